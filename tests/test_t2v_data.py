"""Text-to-video data (`families/text_to_video/videos.py`, `motion.py`): every format the
family reads gives the clips it was written from; clips are sampled by frame time; every bad
row is named in one error before any compute; the built-in moving-shapes sets are what
`motion.generate` draws and pass their own check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import t2v_data

from align_anything.data.builtin import builtin_path
from align_anything.errors import DataError
from align_anything.families.text_to_video import motion
from align_anything.families.text_to_video import videos as v

EIGHT = v.Sampling(8, 8.0)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("t2v-data")
    t2v_data.captioned_folder(root / "captioned")
    t2v_data.pair_files(root / "pairs")
    return root


def test_a_metadata_folder_reads_mp4_webm_gif_and_frame_folders(root: Path) -> None:
    source = v.read_video_source(str(root / "captioned"), "captioned", EIGHT)
    assert [item.row for item in source.items] == [f"line {k}" for k in range(1, 7)]
    assert {p.suffix for p in source.video_files} >= {".mp4", ".webm", ".gif", ".png"}
    for item in source.items:
        clip = v.decode(item.video)
        frames = clip.frames[v.sample_times(clip, 8, 8.0)]
        assert frames.shape == (8, 32, 32, 3)
        assert motion.video_matches(frames, item.caption), item.row
        assert not motion.video_matches(frames[::-1], item.caption)


def test_both_pair_formats_give_the_same_chosen_and_rejected_clips(root: Path) -> None:
    generic = v.read_video_source(str(root / "pairs" / "pairs.jsonl"), "pairs", EIGHT)
    safesora = v.read_video_source(str(root / "pairs" / "safesora.jsonl"), "pairs", EIGHT)
    assert len(generic.items) == len(safesora.items) == 6
    for a, b in zip(generic.items, safesora.items, strict=True):
        assert a.caption == b.caption
        assert a.chosen.path == b.chosen.path and a.rejected.path == b.rejected.path
        assert motion.video_matches(v.decode(a.chosen).frames, a.caption)
        assert not motion.video_matches(v.decode(a.rejected).frames, a.caption)


def test_a_safesora_tie_is_dropped_and_counted(tmp_path: Path) -> None:
    t2v_data.pair_files(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "safesora.jsonl").read_text().splitlines()]
    rows[0]["helpfulness"] = "equal"
    (tmp_path / "safesora.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = v.read_video_source(str(tmp_path / "safesora.jsonl"), "pairs", EIGHT)
    assert len(source.items) == 5 and source.report.kept == 5 and source.report.total == 6
    assert v.TIE in source.report.summary()


def test_clips_are_sampled_by_time(tmp_path: Path) -> None:
    video = t2v_data.clip(0, frames=16)
    path = t2v_data.write_video(tmp_path / "fast.mp4", video, fps=16)
    clip = v.decode(v.VideoRef(path=path))
    assert v.sample_times(clip, 8, 8.0) == list(range(0, 16, 2))  # every other frame
    assert v.sample_times(clip, 8, None) == list(range(8))  # consecutive
    # A variable rate that never drops below 8 fps samples fine: each sampled time takes the
    # frame shown then (frames 1, 4, 7, 10, 13 come 10 ms late: at 0.25 s frame 3 still shows).
    times = [k / 16 + (0.01 if k % 3 == 1 else 0.0) for k in range(16)]
    jittered = t2v_data.write_video(tmp_path / "vfr.webm", video, times=times)
    picked = v.sample_times(v.decode(v.VideoRef(path=jittered)), 8, 8.0)
    assert picked == [0, 2, 3, 6, 8, 9, 12, 14]


def test_frames_are_resized_and_centre_cropped() -> None:
    frames = np.zeros((2, 40, 60, 3), dtype=np.uint8)
    frames[:, :, 25:35] = 255  # a white band in the middle columns
    pixels = v.center_crop_frames(frames, 20)
    assert pixels.shape == (3, 2, 20, 20) and pixels.dtype == np.float32
    assert pixels.min() == -1.0 and pixels.max() == 1.0
    # 40x60 -> 20x30, centre crop columns 5..25: the band (12.5..17.5) lands at 7.5..12.5
    assert np.all(pixels[:, :, :, 9:11] == 1.0) and np.all(pixels[:, :, :, :5] == -1.0)


def test_every_bad_row_is_named_in_one_error(tmp_path: Path) -> None:
    video = t2v_data.clip(1)
    t2v_data.write_video(tmp_path / "good.gif", video)
    t2v_data.write_video(tmp_path / "short.gif", video[:4])
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all")
    (tmp_path / "empty.webm").write_bytes(b"")
    gapped = [0.0, 0.125, 0.25, 0.5, 0.625, 0.75, 0.875, 1.0]  # 0.25 s gap: 4 fps there
    t2v_data.write_video(tmp_path / "gap.mp4", video, times=gapped)
    rows = [
        {"file_name": "good.gif", "text": "a red circle moving right"},
        {"file_name": "good.gif", "text": "  "},
        {"file_name": "short.gif", "text": "short"},
        {"file_name": "broken.mp4", "text": "broken"},
        {"file_name": "empty.webm", "text": "empty"},
        {"file_name": "gap.mp4", "text": "gap"},
        {"file_name": "missing.mp4", "text": "missing"},
    ]
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as raised:
        v.read_video_source(str(tmp_path), "captioned", EIGHT)
    message = str(raised.value)
    assert f"6 row(s) of data file {tmp_path / 'metadata.jsonl'} cannot be used" in message
    assert "line 2: missing or empty caption in column 'text'" in message
    assert "line 3: video" in message and "too few frames: 4 frames" in message
    assert "line 4: video" in message and "broken.mp4: cannot be decoded" in message
    assert "line 5: video" in message and "empty.webm" in message
    assert "line 6: video" in message and "and 1 more" in message  # line 7: past five shown
    # The variable rate and the missing file, shown when the others are fixed.
    (tmp_path / "metadata.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [rows[0], rows[5], rows[6]])
    )
    with pytest.raises(DataError) as raised:
        v.read_video_source(str(tmp_path), "captioned", EIGHT)
    message = str(raised.value)
    assert "line 2: video" in message and "cannot be sampled at data.fps=8" in message
    assert "0.250 s apart" in message
    assert "line 3: video" in message and "missing.mp4: no such file" in message
    # At 4 fps the gapped clip samples (its rate never drops below 4 fps); the missing file
    # stays refused.
    (tmp_path / "metadata.jsonl").write_text(json.dumps(rows[5]) + "\n")
    assert len(v.read_video_source(str(tmp_path), "captioned", v.Sampling(4, 4.0)).items) == 1


def test_a_pairs_file_of_neither_format_is_refused(tmp_path: Path) -> None:
    (tmp_path / "odd.jsonl").write_text(json.dumps({"question": "q", "a": "x", "b": "y"}) + "\n")
    with pytest.raises(DataError, match="neither of the video preference formats"):
        v.read_video_source(str(tmp_path / "odd.jsonl"), "pairs", EIGHT)


@pytest.mark.slow  # draws and decodes ~600 clips: ~3 s
def test_builtin_sets_are_generated_and_pass_their_check() -> None:
    generated = motion.generate()
    for name, rows in generated.items():
        shipped = motion.read_parquet(builtin_path(name))
        assert shipped == rows, name
    for row in generated["t2v-shapes"][:16] + generated["t2v-shapes-eval"]:
        assert motion.video_matches(_gif(row["video"]), row["text"]), row["text"]
    for row in generated["t2v-shapes-pref"][:16]:
        assert motion.video_matches(_gif(row["chosen"]), row["prompt"])
        assert not motion.video_matches(_gif(row["rejected"]), row["prompt"])
    held_out = {motion.caption_words(r["text"]) for r in generated["t2v-shapes-eval"]}
    trained = {motion.caption_words(r["text"]) for r in generated["t2v-shapes"]}
    assert held_out and not held_out & trained  # held-out colour x direction never trained


def _gif(data: bytes) -> np.ndarray:
    import pyarrow as pa

    table = pa.table({"video": [data]})
    return v.decode(v.VideoRef(table=table, row=0, column="video")).frames
