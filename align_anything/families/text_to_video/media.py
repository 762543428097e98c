"""The video medium of the pipeline families (`VIDEOS`, a `families.diffusion.family.Medium`):
how clips are read and checked (`videos`), sampled to `data.num_frames` at `data.fps` and made
ready for the VAE (every frame resized and centre-cropped), drawn by a text-to-video pipeline,
written as an animated GIF with a PNG contact sheet beside it, and checked on built-in data
(the moving-shapes world's motion and colour rule, `motion`).

The medium's own settings (frames, rate) are bound once at set-up (`configure`), checked
against the kind: Wan's causal VAE takes 4k+1 frames."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from align_anything.errors import ConfigError
from align_anything.families.diffusion import sampling
from align_anything.families.diffusion.family import Medium, OutputCheck
from align_anything.families.diffusion.latents import LATENT_ENCODER_VERSION, files_digest
from align_anything.families.text_to_video.videos import (
    Sampling,
    VideoRef,
    VideoSource,
    center_crop_frames,
    decode,
    read_video_source,
    sample_times,
)

SAMPLE_BATCH = 8  # clips per pipeline call when sampling


def latent_key_parts(source: VideoSource, *, resolution: int, sampling: Sampling, encoder: str,
                     columns: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Everything a video source's latents depend on: its kind, path and columns, each data
    file's and clip file's size and digest, the frames, rate, resolution and crop, the
    encoders' identity and the cache's version."""
    return {
        "version": LATENT_ENCODER_VERSION, "medium": "video", "kind": source.kind,
        "path": source.path, "columns": dict(sorted((columns or {}).items())),
        "data_files": files_digest(source.data_files),
        "video_files": files_digest(source.video_files), "resolution": resolution,
        "num_frames": sampling.num_frames, "fps": sampling.fps, "crop": "center",
        "encoder": encoder,
    }  # fmt: skip


def video_refs(source: VideoSource) -> list[list[VideoRef]]:
    """Per row, its clips: the captioned one, or the chosen and the rejected one."""
    if source.kind == "captioned":
        return [[item.video] for item in source.items]
    return [[item.chosen, item.rejected] for item in source.items]


@dataclass(frozen=True)
class _Ready:
    pixels: np.ndarray  # [3, F, R, R] in [-1, 1]
    geometry: tuple[int, int, int, int]


def frames_ready(sampling: Sampling) -> Callable[[int], Callable[[VideoRef], _Ready]]:
    """`prepare`: a function making one clip ready for the VAE at a resolution: its sampled
    frames, each resized and centre-cropped, [3, F, R, R] in [-1, 1]."""

    def at(resolution: int) -> Callable[[VideoRef], _Ready]:
        def prepare(ref: VideoRef) -> _Ready:
            clip = decode(ref)
            picked = clip.frames[sample_times(clip, sampling.num_frames, sampling.fps)]
            height, width = picked.shape[1:3]
            scale = resolution / min(height, width)
            top = max(0, round((round(height * scale) - resolution) / 2))
            left = max(0, round((round(width * scale) - resolution) / 2))
            return _Ready(center_crop_frames(picked, resolution), (height, width, top, left))

        return prepare

    return at


def sample_videos(
    parts: Any, prompts: Sequence[str], seeds: Sequence[int], *, resolution: int,
    num_frames: int, steps: int = 20, guidance_scale: float | None = None,
    batch_size: int = SAMPLE_BATCH, denoiser: torch.nn.Module | None = None,
    gathered: Callable[[], AbstractContextManager[torch.nn.Module]] | None = None,
) -> list[np.ndarray]:  # fmt: skip
    """One clip [F, H, W, 3] uint8 per (prompt, seed), through the kind's pipeline class over
    the run's modules (`FrozenParts.pipeline`), each from its own seeded CPU generator
    (`families.diffusion.sampling.sample_with_pipeline`: `denoiser` or `gathered`, the
    denoiser in eval mode meanwhile)."""

    def clips(out: Any) -> list[np.ndarray]:
        frames = np.asarray(out.frames, dtype=np.float32)
        return [np.round(np.clip(v, 0, 1) * 255).astype(np.uint8) for v in frames]

    return sampling.sample_with_pipeline(
        parts, prompts, seeds, steps=steps, guidance_scale=guidance_scale,
        batch_size=batch_size, denoiser=denoiser, gathered=gathered,
        pipeline_kwargs={"height": resolution, "width": resolution, "num_frames": num_frames,
                         "output_type": "np"},
        outputs=clips,
    )  # fmt: skip


LABEL_WIDTH = 160
LABEL_HEIGHT = 16
GAP = 2


def _grid_frames(rows: list[list[np.ndarray]], row_labels: list[str],
                 column_labels: list[str]) -> list[Any]:  # fmt: skip
    """One labelled grid image per frame (rows of prompts, columns of seeds)."""
    import textwrap

    from PIL import Image, ImageDraw, ImageFont

    height, width = rows[0][0].shape[1:3]
    frames = max(len(clip) for row in rows for clip in row)
    columns = max(len(row) for row in rows)
    font = ImageFont.load_default()
    size = (LABEL_WIDTH + columns * (width + GAP), LABEL_HEIGHT + len(rows) * (height + GAP))
    background = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(background)
    for c, label in enumerate(column_labels):
        draw.text((LABEL_WIDTH + c * (width + GAP) + 2, 2), label, fill="black", font=font)
    for r, label in enumerate(row_labels):
        y = LABEL_HEIGHT + r * (height + GAP)
        for k, line in enumerate(textwrap.wrap(label, width=26)[: max(1, height // 11)]):
            draw.text((2, y + k * 11), line, fill="black", font=font)
    grids = []
    for f in range(frames):
        grid = background.copy()
        for r, row in enumerate(rows):
            for c, clip in enumerate(row):
                frame = clip[min(f, len(clip) - 1)]
                grid.paste(Image.fromarray(frame), (LABEL_WIDTH + c * (width + GAP),
                                                    LABEL_HEIGHT + r * (height + GAP)))  # fmt: skip
        grids.append(grid)
    return grids


def contact_sheet(rows: list[list[np.ndarray]], row_labels: list[str]) -> Any:
    """A still of the samples: one strip of every frame per clip, a row per (prompt, seed)."""
    import textwrap

    from PIL import Image, ImageDraw, ImageFont

    clips = [(label, clip) for row, label in zip(rows, row_labels, strict=True) for clip in row]
    height, width = clips[0][1].shape[1:3]
    frames = max(len(clip) for _, clip in clips)
    sheet = Image.new("RGB", (LABEL_WIDTH + frames * (width + GAP), len(clips) * (height + GAP)),
                      "white")  # fmt: skip
    draw, font = ImageDraw.Draw(sheet), ImageFont.load_default()
    for k, (label, clip) in enumerate(clips):
        y = k * (height + GAP)
        for j, line in enumerate(textwrap.wrap(label, width=26)[: max(1, height // 11)]):
            draw.text((2, y + j * 11), line, fill="black", font=font)
        for f, frame in enumerate(clip):
            sheet.paste(Image.fromarray(frame), (LABEL_WIDTH + f * (width + GAP), y))
    return sheet


def save_samples(rows: list[list[np.ndarray]], path: Path, row_labels: list[str],
                 column_labels: list[str], *, fps: float = 8.0) -> Path:  # fmt: skip
    """The samples as an animated GIF of the labelled grid (`path` + ".gif") and, beside it,
    a PNG contact sheet of every frame of every clip (`path` + ".png", returned: the still
    that is logged). Each written to a temporary name and renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grids = _grid_frames(rows, row_labels, column_labels)
    gif, png = path.with_name(path.name + ".gif"), path.with_name(path.name + ".png")
    tmp = gif.with_name(f".tmp-{gif.name}")
    grids[0].save(tmp, format="GIF", save_all=True, append_images=grids[1:],
                  duration=round(1000 / fps), loop=0)  # fmt: skip
    os.replace(tmp, gif)
    labels = (
        [f"{r} ({c})" for r in row_labels for c in column_labels] if column_labels else row_labels
    )
    sheet_rows = [[clip] for row in rows for clip in row]
    tmp = png.with_name(f".tmp-{png.name}")
    contact_sheet(sheet_rows, labels[: len(sheet_rows)]).save(tmp, format="PNG")
    os.replace(tmp, png)
    return png


def motion_check(data_path: Any) -> OutputCheck | None:
    """The video check of built-in data (the moving-shapes sets: does each clip drawn for a
    held-out caption show the caption's colour moving in its direction), None otherwise."""
    from align_anything.data.builtin import builtin_path
    from align_anything.families.text_to_video import motion

    if not isinstance(data_path, str) or not data_path.startswith("t2v-shapes"):
        return None
    if builtin_path(data_path) is None:
        return None
    rows = motion.read_parquet(builtin_path("t2v-shapes-eval"))
    return OutputCheck(
        name="motion", captions=[r["text"] for r in rows], seeds=[int(r["seed"]) for r in rows],
        rule=motion.match_rate,
    )  # fmt: skip


def configure(cfg: Any, info: Any) -> Medium:
    """The medium bound to the run's `data.num_frames` and `data.fps`, checked against the
    kind (Wan: 4k+1 frames)."""
    frames = info.frames(cfg.data.num_frames)
    step = info.temporal_scale_factor
    if step > 1 and (frames - 1) % step:
        lower = (frames - 1) // step * step + 1
        raise ConfigError(
            f"data.num_frames={frames}: {info.name}'s VAE keeps the first frame and compresses "
            f"the rest {step}x in time, so clips take {step}k+1 frames; e.g. "
            f"data.num_frames={lower if lower > 1 else lower + step} or {lower + step}"
        )
    sampling = Sampling(frames, cfg.data.fps)
    rate = f"{sampling.fps:g} fps" if sampling.fps else "consecutive frames"
    return replace(
        VIDEOS,
        # data.max_image_pixels guards image files; clips (and frame folders, under Pillow's
        # own limit) are read frame by frame at the size the sampler keeps.
        read_source=lambda path, kind, columns, _max_pixels: read_video_source(
            path, kind, sampling, columns=columns
        ),
        key_parts=lambda source, resolution, encoder, columns: latent_key_parts(
            source, resolution=resolution, sampling=sampling, encoder=encoder, columns=columns
        ),
        prepare=frames_ready(sampling),
        sample=lambda parts, prompts, seeds, **kw: sample_videos(
            parts, prompts, seeds, num_frames=frames, **kw
        ),
        save_samples=lambda rows, path, row_labels, column_labels: save_samples(
            rows, path, row_labels, column_labels, fps=sampling.fps or 8.0
        ),
        describe=lambda resolution, latent_shape: (
            f"{frames} frames ({rate}), {resolution} px, centre-cropped; latents "
            f"{'x'.join(str(d) for d in latent_shape)} (data.num_frames, data.fps, "
            "data.resolution)"
        ),
        configure=None,
    )  # fmt: skip


def _unbound(*_: Any, **__: Any) -> Any:
    raise RuntimeError("the video medium is used through `configure(cfg, info)` (its frames)")


VIDEOS = Medium(
    name="video", unit="clips", read_source=_unbound, key_parts=_unbound, refs=video_refs,
    prepare=_unbound, sample=_unbound, save_samples=_unbound, check=motion_check,
    describe=_unbound, encoder=lambda parts: parts.encode_videos, configure=configure,
)  # fmt: skip
