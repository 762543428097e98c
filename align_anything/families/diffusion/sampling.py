"""Images for fixed prompts and seeds from the current denoiser, and a labelled PNG grid.

Sampling goes through the kind's own diffusers pipeline class, built over the run's modules
(`FrozenParts.pipeline`: references, no second copy of the weights), so what a user sees is
what diffusers would make from the saved folder. Each image has its own generator, seeded by
its seed: the same prompt and seed give the same starting noise whatever the batch, rank or
world size, and so the grids of two runs (or the same run before and after training) compare.

Under ZeRO-3 the denoiser's parameters are partitioned: pass the engine's
`gathered_for_generation` as `gathered` (every rank enters together; the whole denoiser is held
on each rank for the sampling loop, with no collective per denoising step).
"""

from __future__ import annotations

import contextlib
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from align_anything.families.diffusion.parts import FrozenParts


def sample_with_pipeline(
    parts: FrozenParts, prompts: Sequence[str], seeds: Sequence[int], *,
    pipeline_kwargs: Mapping[str, Any], outputs: Callable[[Any], list[Any]], steps: int,
    guidance_scale: float | None, batch_size: int, denoiser: torch.nn.Module | None,
    gathered: Callable[[], AbstractContextManager[torch.nn.Module]] | None,
) -> list[Any]:  # fmt: skip
    """What every medium's sampler shares: one output per (prompt, seed) pair, in `steps`
    steps of the folder's own sampler, at `guidance_scale` (None: the pipeline's default),
    `batch_size` prompts per pipeline call with the medium's `pipeline_kwargs` (its size and
    output type), `outputs` taking the call's result to one item per prompt. Give the
    denoiser either as a plain module (`denoiser`) or as a context that yields it whole
    (`gathered`, e.g. `Engine.gathered_for_generation`: needed under ZeRO-3, collective).
    The denoiser is in eval mode while sampling and back in its former mode afterwards."""
    if (denoiser is None) == (gathered is None):
        raise ValueError("give exactly one of denoiser= and gathered=")
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    context = gathered() if gathered is not None else contextlib.nullcontext(denoiser)
    results: list[Any] = []
    with context as module:
        was_training = module.training
        module.eval()
        try:
            pipe = parts.pipeline(module)
            extra: dict[str, Any] = {**pipeline_kwargs, "num_inference_steps": steps}
            if guidance_scale is not None:
                extra["guidance_scale"] = guidance_scale
            if parts.max_sequence_length is not None:
                extra["max_sequence_length"] = parts.max_sequence_length
            for start in range(0, len(prompts), batch_size):
                generators = [
                    torch.Generator("cpu").manual_seed(int(s))
                    for s in seeds[start : start + batch_size]
                ]
                with torch.no_grad():
                    out = pipe(
                        prompt=list(prompts[start : start + batch_size]), generator=generators,
                        **extra,
                    )  # fmt: skip
                results += outputs(out)
        finally:
            module.train(was_training)
    return results


def sample_images(
    parts: FrozenParts, prompts: Sequence[str], seeds: Sequence[int], *, resolution: int,
    steps: int = 20, guidance_scale: float | None = None, batch_size: int = 8,
    denoiser: torch.nn.Module | None = None,
    gathered: Callable[[], AbstractContextManager[torch.nn.Module]] | None = None,
) -> list[Any]:  # fmt: skip
    """One PIL image per (prompt, seed) pair, `resolution` pixels square (`sample_with_pipeline`
    for the rest)."""
    return sample_with_pipeline(
        parts, prompts, seeds, steps=steps, guidance_scale=guidance_scale,
        batch_size=batch_size, denoiser=denoiser, gathered=gathered,
        pipeline_kwargs={"height": resolution, "width": resolution, "output_type": "pil"},
        outputs=lambda out: list(out.images),
    )  # fmt: skip


LABEL_WIDTH = 160  # pixels of the prompt column
LABEL_HEIGHT = 16  # pixels of the seed row
GAP = 2


def save_grid(
    rows: Sequence[Sequence[Any]], path: Path, *, row_labels: Sequence[str],
    column_labels: Sequence[str] | None = None,
) -> Path:  # fmt: skip
    """A PNG of images in rows (e.g. one row per prompt, one column per seed), each row
    labelled on the left (wrapped) and each column on top; written to a temporary name and
    renamed, so a reader never sees half a file."""
    from PIL import Image, ImageDraw, ImageFont

    if len(rows) != len(row_labels):
        raise ValueError(f"{len(rows)} rows but {len(row_labels)} row labels")
    width = max(image.width for row in rows for image in row)
    height = max(image.height for row in rows for image in row)
    columns = max(len(row) for row in rows)
    top = LABEL_HEIGHT if column_labels else 0
    grid = Image.new(
        "RGB",
        (LABEL_WIDTH + columns * (width + GAP), top + len(rows) * (height + GAP)),
        "white",
    )
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for c, label in enumerate(column_labels or []):
        draw.text((LABEL_WIDTH + c * (width + GAP) + 2, 2), str(label), fill="black", font=font)
    line_height = 11
    for r, (row, label) in enumerate(zip(rows, row_labels, strict=True)):
        y = top + r * (height + GAP)
        lines = textwrap.wrap(str(label), width=26)[: max(1, height // line_height)]
        for k, line in enumerate(lines):
            draw.text((2, y + k * line_height), line, fill="black", font=font)
        for c, image in enumerate(row):
            grid.paste(image.convert("RGB"), (LABEL_WIDTH + c * (width + GAP), y))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    grid.save(tmp, format="PNG")
    os.replace(tmp, path)
    return path
