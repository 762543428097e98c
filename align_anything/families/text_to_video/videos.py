"""Text-to-video data: captioned videos and preference pairs of videos, read and checked
before any model loads, and clips sampled to the training frames.

Sources (`read_video_source`):

- **captioned videos** (denoising fine-tuning):
  - a folder with `metadata.jsonl` (one row per clip: `file_name`, a video file or a folder of
    frames relative to the folder, and its caption in `text`), as the image folders;
  - a folder without one: every video file (`VIDEO_SUFFIXES`, in subfolders too) with its
    caption in a `.txt` file of the same name beside it;
  - a `.jsonl` / `.json` / `.parquet` file (or folder of them): a video column (`video`,
    `file_name` or `video_path`: a path relative to the file, or a video file's embedded
    bytes) and a caption column (`text`, `caption` or `prompt`);
- **preference pairs** (Diffusion-DPO), either
  - align-anything's text-to-video preference format (its SafeSora template): `prompt_text`,
    `video_0` and `video_1` (each `{"video_path": ...}` or a path), and `helpfulness`, the
    preferred one ("video_0" or "video_1"; "equal" is a tie: dropped and counted), or
  - the generic one: `prompt`, `chosen`, `rejected` (paths or embedded bytes).

`columns` maps these names to a file's own (`{"caption": "description"}`).

Decoding is PyAV's (FFmpeg's libraries in-process, in the wheel): mp4, webm, mkv, mov, avi and
GIF alike, each frame with its presentation time, so clips are sampled by time, a variable
frame rate included (imageio-ffmpeg would pipe raw frames from an ffmpeg subprocess, without
per-frame times). A folder of frames (`.png`, `.jpg`, ...; sorted by name) has no times: its
frames are taken as consecutive frames at `data.fps`.

Sampling (`sample_times`): `data.num_frames` frames from the clip's start, one every 1/fps
seconds (`data.fps`; null: consecutive frames at the clip's own rate); each is the frame shown
at that time. Every sampled time must have a frame of its own: where the clip's rate (at any
point) is below `data.fps`, a frame would repeat, and the row is refused, as is a clip shorter
than `num_frames / fps`. Frames are resized (shorter side to `data.resolution`, bilinear) and
centre-cropped square, as images are.

Every row is checked before any compute (each clip decoded once for its frame times): a missing
or unreadable video, an empty one, too few frames, a rate it cannot sample, and a missing
caption are collected over the whole source and reported in one `DataError` naming the file
and each row ("line 3" of a JSON-lines file, "row 3" otherwise, the file's path in a folder).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from align_anything.data.formats import DataReport, pick_column
from align_anything.errors import DataError
from align_anything.families.diffusion.rows import RowProblems as _Problems
from align_anything.families.diffusion.rows import caption_text as _caption
from align_anything.families.diffusion.rows import read_table as _table
from align_anything.families.diffusion.rows import where as _where

VIDEO_SUFFIXES = (".mp4", ".webm", ".gif", ".mkv", ".mov", ".avi", ".m4v")
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
METADATA = "metadata.jsonl"
KINDS = ("captioned", "pairs")
CAPTIONED_COLUMNS = {"video": ("video", "file_name", "video_path"),
                     "caption": ("text", "caption", "prompt")}  # fmt: skip
SAFESORA_COLUMNS = {"caption": ("prompt_text",), "video_0": ("video_0",), "video_1": ("video_1",),
                    "preferred": ("helpfulness",)}  # fmt: skip
GENERIC_PAIR_COLUMNS = {"caption": ("prompt",), "chosen": ("chosen",), "rejected": ("rejected",)}
TIES = ("equal", "tie", "same")
TIE = "tie (neither video preferred)"
# Seconds a frame's time may lie after a sampled time and still be the frame shown then:
# container times are rounded to their time base (a GIF's to 10 ms).
TIME_SLACK = 0.002


class VideoUnreadable(Exception):
    """A video (or folder of frames) that cannot be decoded, with the reason."""


@dataclass(frozen=True)
class VideoRef:
    """A clip: a video file, a folder of frames, or a video file's bytes embedded in row `row`
    of column `column` of an Arrow table (read when needed)."""

    path: Path | None = None
    table: Any = field(default=None, repr=False, compare=False)
    row: int = -1
    column: str = ""

    @property
    def is_frames(self) -> bool:
        return self.path is not None and self.path.is_dir()

    def frame_files(self) -> list[Path]:
        assert self.path is not None
        return sorted(p for p in self.path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)

    def read(self) -> bytes:
        """The clip's bytes (a folder of frames: each frame file's name and bytes in order),
        for the cache's content digest."""
        if self.path is None:
            value = self.table.column(self.column)[self.row].as_py()
            return bytes(value["bytes"] if isinstance(value, Mapping) else value)
        if self.is_frames:
            return b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in self.frame_files())
        return self.path.read_bytes()

    def describe(self) -> str:
        if self.path is None:
            return f"embedded video in {self.column}"
        return f"{self.path}{'/ (frames)' if self.is_frames else ''}"

    def files(self) -> list[Path]:
        """The files the clip's content comes from (for the cache key)."""
        if self.path is None:
            return []
        return self.frame_files() if self.is_frames else [self.path]


@dataclass(frozen=True)
class Clip:
    """A decoded clip: frames [N, H, W, 3] uint8 and each one's time in seconds (None for a
    folder of frames, which has none)."""

    frames: np.ndarray
    times: np.ndarray | None


def _decode_file(source: Any, *, keep_frames: bool) -> tuple[list[np.ndarray], list[float]]:
    import av

    frames, times = [], []
    try:
        with av.open(source) as container:
            if not container.streams.video:
                raise VideoUnreadable("no video stream")
            stream = container.streams.video[0]
            for frame in container.decode(stream):
                if frame.time is None:
                    raise VideoUnreadable("a frame without a presentation time")
                times.append(float(frame.time))
                if keep_frames:
                    frames.append(frame.to_ndarray(format="rgb24"))
    except VideoUnreadable:
        raise
    except (av.FFmpegError, OSError, ValueError) as err:
        raise VideoUnreadable(f"cannot be decoded ({type(err).__name__}: {err})") from None
    if not times:
        raise VideoUnreadable("no frames (an empty video)")
    order = np.argsort(times, kind="stable")  # decode order may differ from display order
    times = [times[i] for i in order]
    if keep_frames:
        frames = [frames[i] for i in order]
    return frames, times


def decode(ref: VideoRef, *, keep_frames: bool = True) -> Clip:
    """The clip's frames (RGB) and their times; `keep_frames=False` reads only the times (and
    the number of frames), for the checks. A `VideoUnreadable` saying why otherwise."""
    if ref.is_frames:
        files = ref.frame_files()
        if not files:
            raise VideoUnreadable(f"a folder with no frames ({', '.join(FRAME_SUFFIXES)})")
        if not keep_frames:
            return Clip(np.zeros((len(files), 0, 0, 3), dtype=np.uint8), None)
        from PIL import Image

        frames = []
        for path in files:
            try:
                with Image.open(path) as image:
                    frames.append(np.asarray(image.convert("RGB")))
            except OSError as err:
                raise VideoUnreadable(f"frame {path.name} cannot be read ({err})") from None
        if len({f.shape for f in frames}) != 1:
            raise VideoUnreadable("its frames are not all the same size")
        return Clip(np.stack(frames), None)
    if ref.path is not None and not ref.path.is_file():
        raise VideoUnreadable("no such file")
    source = str(ref.path) if ref.path is not None else io.BytesIO(ref.read())
    frames, times = _decode_file(source, keep_frames=keep_frames)
    array = np.stack(frames) if keep_frames else np.zeros((len(times), 0, 0, 3), np.uint8)
    return Clip(array, np.asarray(times, dtype=np.float64))


def sample_times(clip: Clip, num_frames: int, fps: float | None) -> list[int]:
    """The indices of `num_frames` frames from the clip's start, one every 1/`fps` seconds
    (None, or a folder of frames: consecutive frames); a `VideoUnreadable` when the clip is
    too short or its rate somewhere below `fps` (a frame would repeat)."""
    count = len(clip.frames)
    if fps is None or clip.times is None:
        if count < num_frames:
            raise VideoUnreadable(f"{count} frames, data.num_frames={num_frames} needed")
        return list(range(num_frames))
    times = clip.times - clip.times[0]
    interval = 1.0 / fps
    span = (num_frames - 1) * interval
    # The clip lasts until its last frame has been shown for a typical frame's time.
    end = times[-1] + (float(np.median(np.diff(times))) if count > 1 else 0.0)
    if count < num_frames or span >= end - TIME_SLACK:
        raise VideoUnreadable(
            f"too few frames: {count} frames over {end:.3f} s; data.num_frames={num_frames} at "
            f"data.fps={fps:g} needs {num_frames} frames over more than {span:.3f} s"
        )
    picked = []
    for k in range(num_frames):
        target = k * interval + TIME_SLACK
        picked.append(int(np.searchsorted(times, target, side="right")) - 1)
    repeated = [k for k in range(1, num_frames) if picked[k] == picked[k - 1]]
    if repeated:
        k = repeated[0]
        gap = times[picked[k] + 1] - times[picked[k]] if picked[k] + 1 < count else float("inf")
        raise VideoUnreadable(
            f"its frame rate cannot be sampled at data.fps={fps:g}: near {k * interval:.3f} s "
            f"consecutive frames are {gap:.3f} s apart (a rate of {1 / gap:.2f} fps, variable "
            f"or below data.fps), so a frame would repeat; lower data.fps or re-encode the video "
            "at a constant rate"
        )
    return picked


def center_crop_frames(frames: np.ndarray, resolution: int) -> np.ndarray:
    """Frames [F, H, W, 3] uint8 -> [3, F, R, R] float32 in [-1, 1]: each resized so its
    shorter side is `resolution` (bilinear) and centre-cropped square (the image medium's
    crop, frame by frame)."""
    from PIL import Image

    out = []
    for frame in frames:
        image = Image.fromarray(frame)
        width, height = image.size
        scale = resolution / min(width, height)
        size = (max(resolution, round(width * scale)), max(resolution, round(height * scale)))
        if size != image.size:
            image = image.resize(size, Image.Resampling.BILINEAR)
        top = max(0, int(round((size[1] - resolution) / 2.0)))
        left = max(0, int(round((size[0] - resolution) / 2.0)))
        out.append(np.asarray(image.crop((left, top, left + resolution, top + resolution))))
    pixels = np.stack(out).astype(np.float32).transpose(3, 0, 1, 2) / 127.5 - 1.0
    return pixels


# ----------------------------------------------------------------- sources


@dataclass(frozen=True)
class CaptionedVideo:
    caption: str
    video: VideoRef
    row: str


@dataclass(frozen=True)
class VideoPair:
    caption: str
    chosen: VideoRef
    rejected: VideoRef
    row: str


@dataclass
class VideoSource:
    """One source read and checked: its items in file order, the report of what was dropped,
    the files its content comes from, and the sampling it was checked for."""

    path: str
    kind: str
    items: list[Any]
    report: DataReport
    data_files: list[Path]
    video_files: list[Path]


@dataclass(frozen=True)
class Sampling:
    """How clips become training frames: `num_frames` at `fps` (None: consecutive)."""

    num_frames: int
    fps: float | None


def check_clip(ref: VideoRef, sampling: Sampling) -> str | None:
    """Why the clip cannot be sampled (unreadable, empty, too short, a rate below data.fps),
    or None."""
    try:
        sample_times(decode(ref, keep_frames=False), sampling.num_frames, sampling.fps)
    except VideoUnreadable as err:
        return f"video {ref.describe()}: {err}"
    return None


def _video_ref(value: Any, *, base: Path, table: Any, row: int, column: str) -> VideoRef | str:
    """The reference a cell holds (a path, `{"video_path": ...}`, or embedded bytes), or why it
    holds none."""
    if isinstance(value, Mapping):
        if value.get("bytes") is not None:
            return VideoRef(table=table, row=row, column=column)
        value = value.get("video_path") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return VideoRef(table=table, row=row, column=column)
    if isinstance(value, str) and value:
        path = Path(value).expanduser()
        return VideoRef(path=path if path.is_absolute() else base / path)
    return f"no video in column '{column}' (a path or embedded bytes)"


def _cell(table: Any, column: str, index: int) -> Any:
    """One cell, without turning embedded bytes into Python objects (only their presence)."""
    import pyarrow as pa

    value = table.column(column)[index]
    if not value.is_valid:
        return None
    if pa.types.is_binary(value.type) or pa.types.is_large_binary(value.type):
        return b""
    if pa.types.is_struct(value.type) and "bytes" in value.type.names:
        return {"bytes": b"" if value["bytes"].is_valid else None,
                "path": value["path"].as_py() if "path" in value.type.names else None}  # fmt: skip
    return value.as_py()


def _source(path: str, kind: str, items: list, total: int, data_files: list[Path],
            report: DataReport | None = None) -> VideoSource:  # fmt: skip
    report = report or DataReport(source=path)
    report.total, report.kept = total, len(items)
    refs = [r for it in items
            for r in ((it.video,) if kind == "captioned" else (it.chosen, it.rejected))]  # fmt: skip
    video_files = sorted({f for r in refs for f in r.files()})
    return VideoSource(path, kind, items, report, list(data_files), video_files)


def _read_table_captioned(path: str, columns: Mapping[str, str], sampling: Sampling,
                          base: Path | None = None) -> VideoSource:  # fmt: skip
    table, names, files, table_base = _table(path)
    base = base or table_base
    where = _where(path, files)
    video_col = pick_column(table.column_names, "video", CAPTIONED_COLUMNS["video"], columns,
                             where)  # fmt: skip
    caption_col = pick_column(table.column_names, "caption", CAPTIONED_COLUMNS["caption"],
                               columns, where)  # fmt: skip
    captions = table.column(caption_col).to_pylist()
    problems, items = _Problems(where), []
    for index, caption in enumerate(captions):
        row = names(index)
        ref = _video_ref(_cell(table, video_col, index), base=base, table=table, row=index,
                         column=video_col)  # fmt: skip
        text = _caption(caption)
        if text is None:
            problems.add(row, f"missing or empty caption in column '{caption_col}'")
        if isinstance(ref, str):
            problems.add(row, ref)
            continue
        problem = check_clip(ref, sampling)
        if problem is not None:
            problems.add(row, problem)
        elif text is not None:
            items.append(CaptionedVideo(text, ref, row))
    problems.raise_any("Fix or remove those rows (or change data.num_frames / data.fps).")
    return _source(path, "captioned", items, len(captions), files)


def _read_folder(folder: Path, columns: Mapping[str, str], sampling: Sampling) -> VideoSource:
    metadata = folder / METADATA
    if metadata.is_file():
        source = _read_table_captioned(str(metadata), {"video": "file_name", **columns},
                                       sampling, base=folder.resolve())  # fmt: skip
        source.path = str(folder)
        source.report.source = str(folder)
        return source
    videos = sorted(
        p for p in folder.rglob("*")
        if p.suffix.lower() in VIDEO_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )  # fmt: skip
    if not videos:
        raise DataError(
            f"video folder {folder} has no {METADATA} and no videos ({', '.join(VIDEO_SUFFIXES)})"
            f": give a folder of videos with a .txt caption beside each, a folder with "
            f"{METADATA} (file_name: a video or a folder of frames, text), or a .jsonl/.parquet "
            "file"
        )
    problems, items, caption_files = _Problems(f"video folder {folder}"), [], []
    for video in videos:
        row = str(video.relative_to(folder))
        text_file = video.with_suffix(".txt")
        try:
            text = _caption(text_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            problems.add(row, f"no caption file {text_file.name} beside it")
            continue
        except (OSError, UnicodeDecodeError) as err:
            problems.add(row, f"caption file {text_file.name} cannot be read as UTF-8 ({err})")
            continue
        if text is None:
            problems.add(row, f"caption file {text_file.name} is empty")
            continue
        ref = VideoRef(path=video)
        problem = check_clip(ref, sampling)
        if problem is not None:
            problems.add(row, problem)
            continue
        items.append(CaptionedVideo(text, ref, row))
        caption_files.append(text_file)
    problems.raise_any("Add a caption (.txt of the same name), fix or remove the video.")
    return _source(str(folder), "captioned", items, len(videos), caption_files)


def _has_data_files(folder: Path) -> bool:
    from align_anything.data.sources import DATA_SUFFIXES

    if (folder / METADATA).is_file():
        return False
    return any(p.name.lower().endswith(tuple(DATA_SUFFIXES)) for p in folder.iterdir())


def read_captioned_videos(path: str, sampling: Sampling, *,
                          columns: Mapping[str, str] | None = None) -> VideoSource:  # fmt: skip
    """The captioned clips of a video folder or a data file (see the module docstring), every
    row checked; a `DataError` naming each bad row otherwise."""
    local = Path(path).expanduser()
    columns = dict(columns or {})
    if local.is_dir() and not _has_data_files(local):
        return _read_folder(local, columns, sampling)
    return _read_table_captioned(path, columns, sampling)


def read_preference_pairs(path: str, sampling: Sampling, *,
                          columns: Mapping[str, str] | None = None) -> VideoSource:  # fmt: skip
    """Preference pairs of clips in align-anything's format (`prompt_text`, `video_0`,
    `video_1`, `helpfulness`) or the generic one (`prompt`, `chosen`, `rejected`), told
    apart by their columns; ties are dropped and counted; a missing clip or caption, a
    clip that cannot be sampled and an unknown preference are one `DataError` naming every
    such row."""
    columns = dict(columns or {})
    table, names, files, base = _table(path)
    where = _where(path, files)
    present = table.column_names
    safesora = "helpfulness" in present or "preferred" in columns
    spec = SAFESORA_COLUMNS if safesora else GENERIC_PAIR_COLUMNS
    if not safesora and not {"prompt", "chosen", "rejected"} <= {*present, *columns}:
        raise DataError(
            f"{where} is neither of the video preference formats: align-anything's "
            "(prompt_text, video_0, video_1, helpfulness) nor the generic one (prompt, chosen, "
            f"rejected); columns found: {', '.join(present)}. Map yours with data.columns"
        )
    picked = {c: pick_column(present, c, tried, columns, where) for c, tried in spec.items()}
    captions = table.column(picked["caption"]).to_pylist()
    report = DataReport(source=path)
    problems, items = _Problems(where), []
    for index, caption in enumerate(captions):
        row = names(index)
        text = _caption(caption)
        if text is None:
            problems.add(row, f"missing or empty caption in column '{picked['caption']}'")
        first, second = ("video_0", "video_1") if safesora else ("chosen", "rejected")
        refs = []
        for name in (first, second):
            column = picked[name]
            ref = _video_ref(_cell(table, column, index), base=base, table=table, row=index,
                             column=column)  # fmt: skip
            if isinstance(ref, str):
                problems.add(row, ref)
                continue
            problem = check_clip(ref, sampling)
            if problem is not None:
                problems.add(row, problem)
                continue
            refs.append(ref)
        preferred = None
        if safesora:
            preferred = table.column(picked["preferred"])[index].as_py()
            if preferred in TIES:
                report.drop(TIE, row)
                continue
            if preferred not in ("video_0", "video_1"):
                problems.add(row, f"{picked['preferred']} {preferred!r} is not 'video_0', "
                                  f"'video_1' or a tie ({', '.join(TIES)})")  # fmt: skip
                continue
        if text is None or len(refs) != 2:
            continue
        chosen, rejected = refs[::-1] if preferred == "video_1" else refs
        items.append(VideoPair(text, chosen, rejected, row))
    problems.raise_any("Fix or remove those rows (or change data.num_frames / data.fps).")
    return _source(path, "pairs", items, len(captions), files, report)


def read_video_source(path: str, kind: str, sampling: Sampling, *,
                      columns: Mapping[str, str] | None = None) -> VideoSource:  # fmt: skip
    """`read_captioned_videos` ("captioned") or `read_preference_pairs` ("pairs")."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}; one of {', '.join(KINDS)}")
    reader = read_captioned_videos if kind == "captioned" else read_preference_pairs
    return reader(path, sampling, columns=columns)
