"""The image medium of the pipeline families (`IMAGES`, a `families.diffusion.family.Medium`):
how images are read and checked (`images`), made ready for the VAE (resized and centre-cropped,
SDXL's size and crop conditioning kept), drawn by a text-to-image pipeline, written as a
labelled grid, and checked on built-in data (the shapes world's colour rule, `shapes`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from align_anything.families.diffusion import sampling
from align_anything.families.diffusion.family import Medium, OutputCheck
from align_anything.families.diffusion.latents import LATENT_ENCODER_VERSION, files_digest
from align_anything.families.text_to_image.images import (
    ImageRef,
    ImageSource,
    center_crop,
    read_image_source,
)


def latent_key_parts(
    source: ImageSource, *, resolution: int, encoder: str, columns: dict[str, str] | None = None
) -> dict[str, Any]:
    """Everything an image source's latents depend on: its kind, path and columns, each data
    file's and each image file's size and digest, the resolution and crop, the encoders'
    identity (`diffusion.encoder_identity`) and the cache's version."""
    return {
        "version": LATENT_ENCODER_VERSION,
        "kind": source.kind,
        "path": source.path,
        "columns": dict(sorted((columns or {}).items())),
        "data_files": files_digest(source.data_files),
        "image_files": files_digest(source.image_files),
        "resolution": resolution,
        "crop": "center",
        "encoder": encoder,
    }


def image_refs(source: ImageSource) -> list[list[ImageRef]]:
    """Per row, its images: the captioned image, the chosen and the rejected one, or none (a
    prompt for online RL)."""
    if source.kind == "prompts":
        return [[] for _ in source.items]
    if source.kind == "captioned":
        return [[item.image] for item in source.items]
    return [[item.chosen, item.rejected] for item in source.items]


@dataclass(frozen=True)
class _Ready:
    pixels: np.ndarray
    geometry: tuple[int, int, int, int]


def cropper(resolution: int) -> Any:
    """A function making one image ready for the VAE: resized so its shorter side is
    `resolution`, centre-cropped square, [-1, 1]; its geometry is SDXL's conditioning."""

    def prepare(ref: ImageRef) -> _Ready:
        cropped = center_crop(ref.read(), resolution, name=ref.describe())
        return _Ready(cropped.pixels, (*cropped.original_size, *cropped.crop_top_left))

    return prepare


def sample(parts: Any, prompts: Sequence[str], seeds: Sequence[int], **kwargs: Any) -> list:
    """RGB arrays [H, W, 3] for each (prompt, seed), through the pipeline class
    (`sampling.sample_images`)."""
    images = sampling.sample_images(parts, prompts, seeds, **kwargs)
    return [np.asarray(image.convert("RGB")) for image in images]


def save_grid(
    rows: list[list[np.ndarray]], path: Path, row_labels: list[str], column_labels: list[str]
) -> Path:
    """The samples as one labelled PNG grid, `path` + ".png"."""
    from PIL import Image

    pictures = [[Image.fromarray(image) for image in row] for row in rows]
    return sampling.save_grid(
        pictures, path.with_name(path.name + ".png"), row_labels=row_labels,
        column_labels=column_labels,
    )  # fmt: skip


def colour_check(data_path: Any) -> OutputCheck | None:
    """The image check of built-in data (the shapes sets: the dominant colour of each image
    drawn for a held-out caption is the colour it names), or None for other data."""
    from align_anything.families.text_to_image import shapes

    if not isinstance(data_path, str) or data_path not in shapes.SHAPE_DATASETS:
        return None
    from align_anything.data.builtin import builtin_path

    rows = shapes.read_parquet(builtin_path("t2i-shapes-eval"))
    return OutputCheck(
        name="colour", captions=[r["text"] for r in rows], seeds=[int(r["seed"]) for r in rows],
        rule=shapes.colour_match_rate,
    )  # fmt: skip


def read_source(
    path: str, kind: str, columns: dict[str, str], max_pixels: int | None
) -> ImageSource:
    """The data source of a pipeline task: captioned images, preference pairs, or prompts (no
    images: `max_pixels` does not apply)."""
    if kind == "prompts":
        from align_anything.families.text_to_image.prompts import read_prompts

        return read_prompts(path, columns=columns)
    return read_image_source(path, kind, columns=columns, max_pixels=max_pixels)


def describe(resolution: int, latent_shape: tuple[int, ...]) -> str:
    return (
        f"{resolution} px, centre-cropped; latents {'x'.join(str(d) for d in latent_shape)} "
        "(data.resolution)"
    )


IMAGES = Medium(
    name="image", unit="images",
    read_source=read_source,
    key_parts=lambda source, resolution, encoder, columns: latent_key_parts(
        source, resolution=resolution, encoder=encoder, columns=columns
    ),
    refs=image_refs, prepare=cropper, sample=sample, save_samples=save_grid, check=colour_check,
    describe=describe,
)  # fmt: skip
