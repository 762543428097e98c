"""Encode once: the VAE latents and text-encoder outputs of a diffusion pipeline's data source
(captioned media, or preference pairs of media), computed once into the data cache and
memory-mapped by every rank. Shared by the pipeline families; what a medium is (an image, a
clip) and how it becomes pixels is the family's (`ensure_latent_cache`'s `refs` and `prepare`).

The VAE is what costs in such training data (a forward pass through the encoder per item per
step, when the media are encoded online); the latents and the caption embeddings of a data
source do not change while the VAE and text encoders are frozen, so they are computed once, in
batches, and read back as numpy memory maps.

- **Key**: everything the arrays depend on, collected by the family (for images:
  `families.text_to_image.media.latent_key_parts`: the source's kind, path and columns, each
  data and image file's size and xxh3-128 digest, the resolution and crop, the identity of the
  VAE and text encoders, `LATENT_ENCODER_VERSION`). The entry is `<cache root>/latents-<key>`.
- **Built like every cache entry** (`data.cache.build_entry`: a temporary sibling, the
  manifest last with every file's size and digest, published atomically; an entry that does
  not match its manifest is rebuilt, never read). Local rank 0 of each node builds it while
  the other ranks wait, as for the text data (`trainers/base._ensure_cache`), then every rank
  opens it (`open_latent_cache`).
- **Content**: unique media (by the digest of their bytes) and unique captions each encoded
  once: `latents.npy` [media, C, ...latent shape], `prompt_embeds.npy` [captions, L, D],
  `pooled_prompt_embeds.npy` [captions, P] (kinds with pooled embeddings),
  `geometry.npy` [media, 4] (original height, width, crop top, left: SDXL's conditioning),
  `rows.npy`: per training row (caption, image) or (caption, chosen, rejected) indices, and
  `captions.json`: the caption texts (sample prompts are drawn from the held-out ones). A
  source of prompts (online RL: kind "prompts", no media) has rows of a caption index alone and
  `fields.json`, each row's other columns (what its reward functions are given).
  Arrays keep the encoders' dtype (bfloat16 stored as its 16-bit pattern: numpy has no bf16).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import xxhash

from align_anything import atomic
from align_anything.data import cache
from align_anything.data.formats import DataReport
from align_anything.data.media import MediaUnreadable
from align_anything.errors import DataError

# Raise when the same inputs would encode to other arrays (it is part of every key).
# 2: captions.json; 3: the manifest counts "media"; 4: images as displayed (EXIF orientation,
# 16-bit grayscale scaled, transparency on white: `data.media.to_rgb`).
LATENT_ENCODER_VERSION = 4
SHOWN = 5  # undecodable media named in one message (the rest are counted)
ARRAYS = ("latents", "prompt_embeds", "pooled_prompt_embeds", "geometry", "rows")

# pixels [B, ...] in [-1, 1] -> scaled latents (`FrozenParts.encode_images`).
MediaEncoder = Callable[[torch.Tensor], torch.Tensor]
# captions -> `prompt_embeds` (and `pooled_prompt_embeds`) (`FrozenParts.encode_prompts`).
PromptEncoder = Callable[[Sequence[str]], dict[str, torch.Tensor]]


class MediaRef(Protocol):
    """One medium a source refers to: its bytes (digested, so each distinct one is encoded
    once)."""

    def read(self) -> bytes: ...


class Prepared(Protocol):
    """A medium made ready for the VAE: `pixels` (numpy, [-1, 1]) and `geometry`: original
    height and width, crop top and left."""

    pixels: np.ndarray
    geometry: tuple[int, int, int, int]


class MediaSource(Protocol):
    """A checked data source: its `kind` ("captioned", "pairs" or "prompts"), `path`, `items`
    (each with a `caption` and the `row` it came from; prompts also their `fields`) and
    `report` (kept and dropped rows)."""

    kind: str
    path: str
    items: Sequence[Any]
    report: DataReport


def files_digest(files: Sequence[Path]) -> str:
    """One digest over the files' paths, sizes and contents (xxh3-128 each), so the key stays
    small for a source of a million images."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(
            f"{path.resolve()}\0{path.stat().st_size}\0"
            f"{atomic.file_digest(path, xxhash.xxh3_128)}\n".encode()
        )
    return digest.hexdigest()


def latent_cache_folder(root: Path, parts: dict[str, Any]) -> Path:
    return Path(root) / f"latents-{cache.key_hash(parts)}"


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy()
    return tensor.numpy()


class _ArrayWriter:
    """A .npy file filled batch by batch (its shape known from the first batch), so no array of
    the whole source is ever in memory."""

    def __init__(self, path: Path, count: int) -> None:
        self.path, self.count, self.array, self.filled = path, count, None, 0
        self.dtype = ""

    def write(self, tensor: torch.Tensor) -> None:
        if self.array is None:
            self.dtype = str(tensor.dtype).removeprefix("torch.")
            values = _to_numpy(tensor)
            self.array = np.lib.format.open_memmap(
                self.path, mode="w+", dtype=values.dtype, shape=(self.count, *values.shape[1:])
            )
        values = _to_numpy(tensor)
        self.array[self.filled : self.filled + len(values)] = values
        self.filled += len(values)

    def close(self) -> None:
        if self.array is not None:
            self.array.flush()
            del self.array


def _unique_media(refs: Sequence[Sequence[MediaRef]]) -> tuple[list[MediaRef], list[list[int]]]:
    """Each distinct medium once (by the digest of its bytes), and per row its media's
    indices into that list."""
    index: dict[str, int] = {}
    unique: list[MediaRef] = []
    rows = []
    for refs_of_row in refs:
        row = []
        for ref in refs_of_row:
            key = xxhash.xxh3_128_hexdigest(ref.read())
            if key not in index:
                index[key] = len(unique)
                unique.append(ref)
            row.append(index[key])
        rows.append(row)
    return unique, rows


def _name_undecodable(source: MediaSource, media: list[MediaRef], media_rows: list[list[int]],
                      start: int, prepare: Callable[[MediaRef], Prepared]) -> None:  # fmt: skip
    """A medium of the batch from `start` could not be decoded (its header passed the data
    check, its data are damaged): decode the rest of the source, without encoding, and raise
    one `DataError` naming each such medium with the first row that uses it."""
    first_row: dict[int, str] = {}
    for item, ids in zip(source.items, media_rows, strict=True):
        for index in ids:
            first_row.setdefault(index, item.row)
    problems = []
    for index in range(start, len(media)):
        try:
            prepare(media[index])
        except MediaUnreadable as err:
            problems.append(f"{first_row[index]}: {err}")
    shown = "\n  ".join(problems[:SHOWN])
    more = f"\n  ... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    raise DataError(
        f"{len(problems)} item(s) of {source.path} cannot be decoded although their headers "
        f"read (damaged data; rows numbered from 1 as in the file):\n  {shown}{more}\n"
        "Replace or remove those rows."
    )


def _encode(source: MediaSource, tmp: Path, *, refs: Sequence[Sequence[MediaRef]],
            prepare: Callable[[MediaRef], Prepared], encode_media: MediaEncoder,
            encode_prompts: PromptEncoder, batch_size: int,
            on_start: Callable[[int, int], None] | None) -> dict[str, Any]:  # fmt: skip
    images, image_rows = _unique_media(refs)
    captions: dict[str, int] = {}
    for item in source.items:
        captions.setdefault(item.caption, len(captions))
    if on_start is not None:
        on_start(len(images), len(captions))
    rows = np.array(
        [
            [captions[item.caption], *ids]
            for item, ids in zip(source.items, image_rows, strict=True)
        ],
        dtype=np.int64,
    )
    np.save(tmp / "rows.npy", rows)
    latents = _ArrayWriter(tmp / "latents.npy", len(images))
    geometry = np.zeros((len(images), 4), dtype=np.int32)
    for start in range(0, len(images), batch_size):
        try:
            ready = [prepare(ref) for ref in images[start : start + batch_size]]
        except MediaUnreadable:
            _name_undecodable(source, images, image_rows, start, prepare)
            raise
        pixels = torch.from_numpy(np.stack([r.pixels for r in ready]))
        latents.write(encode_media(pixels))
        for k, r in enumerate(ready):
            geometry[start + k] = list(r.geometry)
    latents.close()
    np.save(tmp / "geometry.npy", geometry)
    writers: dict[str, _ArrayWriter] = {}
    texts = list(captions)
    (tmp / "captions.json").write_text(json.dumps(texts))
    if source.kind == "prompts":
        (tmp / "fields.json").write_text(json.dumps([item.fields for item in source.items]))
    for start in range(0, len(texts), batch_size):
        for name, tensor in encode_prompts(texts[start : start + batch_size]).items():
            if name not in writers:
                writers[name] = _ArrayWriter(tmp / f"{name}.npy", len(texts))
            writers[name].write(tensor)
    for writer in writers.values():
        writer.close()
    dtypes = {"latents": latents.dtype, **{n: w.dtype for n, w in writers.items()}}
    return {"media": len(images), "captions": len(texts), "dtypes": dtypes}


def ensure_latent_cache(
    source: MediaSource, parts: dict[str, Any], *, root: Path, resolution: int,
    refs: Sequence[Sequence[MediaRef]], prepare: Callable[[MediaRef], Prepared],
    encode_media: MediaEncoder, encode_prompts: PromptEncoder, unit: str = "images",
    batch_size: int = 16, on_start: Callable[[int, int], None] | None = None,
) -> str:  # fmt: skip
    """Make sure the latent cache entry of `source` (key `parts`) exists and is complete,
    encoding it when it is missing or damaged; returns the start-up summary's note. `refs[i]`
    are item i's media (one, or chosen and rejected), `prepare(ref)` makes one ready for the
    VAE (the family's crop and resize), `encode_media(pixels)` returns scaled latents,
    `encode_prompts(captions)` returns `prompt_embeds` (and `pooled_prompt_embeds`)
    (`FrozenParts.encode_images` / `encode_prompts`); both run in batches of `batch_size`.
    `on_start(media, captions)` is called just before the encoders run; `unit` names the
    media in the note ("images"). Call on local rank 0 of each node only."""
    if not source.items:
        raise DataError(f"no usable rows in {source.path}:\n{source.report.summary()}")
    folder = latent_cache_folder(root, parts)

    def build(tmp: Path, work: Path) -> dict[str, Any]:
        start = time.perf_counter()
        encoded = _encode(
            source, tmp, refs=refs, prepare=prepare, encode_media=encode_media,
            encode_prompts=encode_prompts, batch_size=batch_size, on_start=on_start,
        )  # fmt: skip
        return {
            "parts": parts, "kind": source.kind, "resolution": resolution,
            "row_count": len(source.items), "rows_from": [item.row for item in source.items],
            "report": source.report.__dict__, "seconds": time.perf_counter() - start, **encoded,
        }  # fmt: skip

    manifest, problem = cache.build_entry(folder, build)
    if problem is None:
        return (
            f"cache hit {folder} ({manifest['media']} {unit}, {manifest['captions']} captions "
            f"encoded in {manifest['seconds']:.1f} s when built; no encoding now)"
        )
    rebuilt = "" if problem == "not built yet" else f"; rebuilt: {problem}"
    return (
        f"encoded {manifest['media']} {unit} and {manifest['captions']} captions in "
        f"{manifest['seconds']:.1f} s (cached at {folder}{rebuilt})"
    )


def _load(folder: Path, name: str) -> np.ndarray | None:
    path = folder / f"{name}.npy"
    return np.load(path, mmap_mode="r") if path.is_file() else None


def _tensor(values: np.ndarray, dtype: str) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(values))
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


@dataclass
class EncodedMedia:
    """A latent cache entry, memory-mapped: `len()` training rows (captioned images or
    preference pairs, in file order), `batch(indices)` their tensors, `note` and `report` for
    the start-up summary, `rows_from[i]` where row i came from in the source."""

    folder: Path
    kind: str
    resolution: int
    rows: np.ndarray
    latents: np.ndarray
    geometry: np.ndarray
    prompt_embeds: np.ndarray
    pooled_prompt_embeds: np.ndarray | None
    dtypes: dict[str, str]
    rows_from: list[str]
    report: DataReport
    note: str

    def __len__(self) -> int:
        return len(self.rows)

    @functools.cached_property
    def captions(self) -> list[str]:
        """The caption texts, by caption index (`rows[:, 0]`)."""
        return json.loads((self.folder / "captions.json").read_text())

    @functools.cached_property
    def row_fields(self) -> list[dict[str, Any]]:
        """A source of prompts: each row's other columns (empty dicts for other kinds)."""
        path = self.folder / "fields.json"
        return json.loads(path.read_text()) if path.is_file() else [{}] * len(self.rows)

    def _media(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        order = np.argsort(ids, kind="stable")  # memory maps read fastest in file order
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        latents = _tensor(self.latents[ids[order]][back], self.dtypes["latents"])
        geometry = torch.from_numpy(np.asarray(self.geometry[ids], dtype=np.float32))
        target = torch.full((len(ids), 2), float(self.resolution))
        return {"latents": latents, "add_time_ids": torch.cat([geometry, target], dim=1)}

    def _captions(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        out = {"prompt_embeds": _tensor(self.prompt_embeds[ids], self.dtypes["prompt_embeds"])}
        if self.pooled_prompt_embeds is not None:
            out["pooled_prompt_embeds"] = _tensor(
                self.pooled_prompt_embeds[ids], self.dtypes["pooled_prompt_embeds"]
            )
        return out

    def batch(self, indices: Sequence[int]) -> Any:
        """The tensors of rows `indices` (CPU): for captioned images one batch dict
        (`latents`, `prompt_embeds`, `pooled_prompt_embeds` where the kind has them,
        `add_time_ids`: original height and width, crop top and left, target height and
        width), for pairs a (chosen, rejected) pair of such dicts with the same captions, for
        prompts the text tensors and `add_time_ids` of an image generated at the resolution."""
        picked = self.rows[np.asarray(indices, dtype=np.int64)]
        text = self._captions(picked[:, 0])
        if self.kind == "prompts":  # generated images: SDXL's size and crop of a fresh image
            size = float(self.resolution)
            ids = torch.tensor([[size, size, 0.0, 0.0, size, size]]).repeat(len(picked), 1)
            return {**text, "add_time_ids": ids}
        if self.kind == "captioned":
            return {**self._media(picked[:, 1]), **text}
        return {**self._media(picked[:, 1]), **text}, {**self._media(picked[:, 2]), **text}


def open_latent_cache(folder: Path, *, note: str = "") -> EncodedMedia:
    """The complete latent cache entry in `folder` (`ensure_latent_cache` ran), memory-mapped."""
    manifest = json.loads((Path(folder) / cache.MANIFEST).read_text())
    dtypes = manifest["dtypes"]
    rows = np.load(folder / "rows.npy")
    if len(rows) != manifest["row_count"]:
        raise RuntimeError(
            f"{folder / 'rows.npy'} holds {len(rows)} rows, its manifest says "
            f"{manifest['row_count']}: delete {folder} and start again"
        )
    return EncodedMedia(
        folder=Path(folder), kind=manifest["kind"], resolution=manifest["resolution"], rows=rows,
        latents=_load(folder, "latents"),
        geometry=np.load(folder / "geometry.npy", mmap_mode="r"),
        prompt_embeds=_load(folder, "prompt_embeds"),
        pooled_prompt_embeds=_load(folder, "pooled_prompt_embeds"), dtypes=dtypes,
        rows_from=manifest["rows_from"], report=DataReport(**manifest["report"]), note=note,
    )  # fmt: skip


@dataclass(frozen=True)
class LatentRow:
    """One row of a split of a latent cache entry: its `position` in the split (the row index
    the noise draws are seeded by: `forward_diffusion.draw_seed`), the entry's row it reads
    (`source`) in `entry`, and the optimizer step that draws it (None: a held-out row, whose
    draws are the same at every evaluation)."""

    position: int
    source: int
    entry: EncodedMedia = field(repr=False, compare=False)
    step: int | None = None

    def at(self, step: int) -> LatentRow:
        """This row as drawn by optimizer step `step`."""
        return LatentRow(self.position, self.source, self.entry, step)


def row_tensors(rows: Sequence[LatentRow]) -> Any:
    """The CPU tensors of `rows` (of one latent cache entry; see `EncodedMedia.batch`)."""
    entry = rows[0].entry
    if any(row.entry is not entry for row in rows):
        raise ValueError("rows of different latent cache entries in one batch")
    return entry.batch([row.source for row in rows])


class LatentRows(Sequence[LatentRow]):
    """A split of a latent cache entry: rows `indices` of `entry` (the held-out split, the
    training rest, or all of an entry), read as `LatentRow`s (`row_tensors` gives a batch of
    them). A view: nothing is copied."""

    def __init__(self, entry: EncodedMedia, indices: Sequence[int]) -> None:
        self.entry = entry
        self.indices = np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> LatentRow:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        index %= len(self)
        return LatentRow(index, int(self.indices[index]), self.entry)
