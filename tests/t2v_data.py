"""Small video data sets for the text-to-video tests, written in every format the family reads:
mp4 (H.264), webm (VP9) and GIF files, folders of PNG frames, `metadata.jsonl` folders, and
preference pairs in align-anything's (SafeSora) and the generic format. Clips are drawn from
the moving-shapes world (`families/text_to_video/motion.py`), so the check applies to them."""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import numpy as np

from align_anything.families.text_to_video import motion

FRAMES = 8  # the clips these tests write (the built-in sets' are motion.FRAMES = 9)

CODECS = {".mp4": ("libx264", "yuv420p"), ".webm": ("libvpx-vp9", "yuv420p")}


def write_video(path: Path, frames: np.ndarray, *, fps: float = 8,
                times: list[float] | None = None) -> Path:  # fmt: skip
    """Write frames [F, H, W, 3] uint8 as `path` (mp4, webm or gif, by its suffix) at `fps`, or
    with each frame shown at `times` (seconds: a variable frame rate) where given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gif":
        from PIL import Image

        ends = [*times[1:], times[-1] + 1 / fps] if times is not None else []
        durations = ([round(1000 / fps)] * len(frames) if times is None else
                     [round(1000 * (b - a)) for a, b in zip(times, ends, strict=True)])  # fmt: skip
        images = [Image.fromarray(f) for f in frames]
        images[0].save(path, save_all=True, append_images=images[1:], duration=durations, loop=0)
        return path
    import av

    codec, pixel_format = CODECS[path.suffix]
    base = Fraction(1, 1000)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = pixel_format
        stream.time_base = base
        stream.codec_context.time_base = base  # pts in milliseconds, whatever the rate
        if codec == "libx264":
            stream.options = {"crf": "0"}  # lossless-ish: the check must still pass
        for k, frame in enumerate(frames):
            video_frame = av.VideoFrame.from_ndarray(frame, format="rgb24")
            seconds = k / fps if times is None else times[k]
            video_frame.pts = round(seconds / base)
            video_frame.time_base = base
            for packet in stream.encode(video_frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def clip(seed: int, combo: tuple[str, str, str] = ("red", "circle", "right"),
         frames: int = FRAMES) -> np.ndarray:  # fmt: skip
    colour, shape, direction = combo
    layout = motion.random_motion(random.Random(seed), direction)
    return motion.draw_video(shape, colour, direction, frames=frames, **layout)


def captioned_folder(root: Path, count: int = 6, *, frames: int = FRAMES) -> Path:
    """A folder with metadata.jsonl: clips as mp4, webm, gif and a folder of PNG frames."""
    from PIL import Image

    rows = []
    suffixes = [".mp4", ".webm", ".gif", "frames"]
    for k in range(count):
        combo = motion.TRAIN_COMBOS[(7 * k) % len(motion.TRAIN_COMBOS)]
        video = clip(k, combo, frames)
        suffix = suffixes[k % len(suffixes)]
        name = f"clip{k}{'' if suffix == 'frames' else suffix}"
        if suffix == "frames":
            for f, frame in enumerate(video):
                (root / name).mkdir(parents=True, exist_ok=True)
                Image.fromarray(frame).save(root / name / f"{f:03d}.png")
        else:
            write_video(root / name, video)
        rows.append({"file_name": name, "text": motion.caption(*combo)})
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def pair_files(root: Path, count: int = 6, *, frames: int = FRAMES) -> tuple[Path, Path]:
    """The same pairs in the generic format (pairs.jsonl: prompt, chosen, rejected) and in
    align-anything's (safesora.jsonl: prompt_text, video_0/1 {video_path}, helpfulness),
    where the preferred clip is video_1 half the time; gif files beside them."""
    generic, safesora = [], []
    for k in range(count):
        combo = motion.TRAIN_COMBOS[(5 * k + 1) % len(motion.TRAIN_COMBOS)]
        video = clip(100 + k, combo, frames)
        good = write_video(root / f"good{k}.gif", video).name
        bad = write_video(root / f"bad{k}.gif", video[::-1]).name
        text = motion.caption(*combo)
        generic.append({"prompt": text, "chosen": good, "rejected": bad})
        first, second = (good, bad) if k % 2 == 0 else (bad, good)
        safesora.append({"prompt_text": text, "video_0": {"video_path": first},
                         "video_1": {"video_path": second},
                         "helpfulness": "video_0" if k % 2 == 0 else "video_1"})  # fmt: skip
    paths = root / "pairs.jsonl", root / "safesora.jsonl"
    for path, rows in zip(paths, (generic, safesora), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths
