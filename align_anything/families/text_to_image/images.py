"""Text-to-image data: captioned images and preference pairs of images, read and checked
before any model loads, and images cropped to the training resolution.

Sources (`read_image_source`):

- **captioned images** (denoising fine-tuning):
  - an image folder with `metadata.jsonl` (the `datasets` imagefolder convention: one row per
    image, `file_name` relative to the folder and its caption in `text`);
  - an image folder without one: every image (`.png`, `.jpg`, `.jpeg`, `.webp`, `.bmp`, in
    subfolders too) with its caption in a `.txt` file of the same name beside it;
  - a `.jsonl` / `.json` / `.parquet` file (or folder of them): an `image` column (a path
    relative to the file, or embedded bytes: raw, or `{"bytes": ..., "path": ...}` as
    `datasets` stores images) and a caption column (`text` or `caption`);
- **preference pairs** (Diffusion-DPO) in the Pick-a-Pic shape: `caption`, `jpg_0`, `jpg_1`
  (paths or embedded bytes) and `label_0`: 1 when image 0 is preferred, 0 when image 1 is,
  0.5 for a tie (a number, or a string of one: "1"). Ties say nothing about which image is
  better: they are dropped and counted; so are pairs whose two images are the same file (the
  same path, or files of identical bytes), whose loss cannot move from ln 2.

`columns` maps these names to a file's own (`{"caption": "prompt"}`).

Every row is checked before any compute: a missing or unreadable image (its header is read;
more pixels than `data.max_image_pixels`; floating-point pixels), a missing or empty caption or
one that is not text (a number: a column mapped wrongly, more likely than a caption "42") and a
label outside {0, 0.5, 1} are collected over the whole source and reported in one `DataError`
naming the file and each row ("line 3" of a JSON-lines file, "row 3" otherwise, the image's
path in a folder), as `data.media` reports media of the text tasks. Images are referenced, never
held: embedded bytes are read from the memory-mapped Arrow table when they are encoded; an
image whose pixel data turn out damaged only then (a PNG whose checksums hold but whose
compressed stream does not) is named with its row by the encoding (`data.latents`).

Images are read as they are displayed (`data.media.to_rgb`): the EXIF orientation applied (a
phone's portrait photo is stored sideways), 16-bit grayscale scaled to 8 bits, transparency
laid on white.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from align_anything.data.formats import DataReport, pick_column
from align_anything.data.media import MAX_IMAGE_PIXELS, MediaUnreadable, load_image, probe_image
from align_anything.errors import DataError
from align_anything.families.diffusion.rows import RowProblems as _Problems

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
METADATA = "metadata.jsonl"
KINDS = ("captioned", "pairs")
# Canonical name -> the column names tried in a file, in order.
CAPTIONED_COLUMNS = {"image": ("image", "file_name"), "caption": ("text", "caption")}
PAIR_COLUMNS = {"caption": ("caption",), "jpg_0": ("jpg_0",), "jpg_1": ("jpg_1",),
                "label_0": ("label_0",)}  # fmt: skip
TIE = "tie (label_0 = 0.5: neither image preferred)"
IDENTICAL = "identical images (jpg_0 and jpg_1 are the same file: nothing to prefer)"
# Schema metadata of a JSON-lines table: the columns whose values mix types (kept as JSON text).
_JSON_COLUMNS = b"align_anything.json_columns"


@dataclass(frozen=True)
class ImageRef:
    """An image: a file, or bytes embedded in row `row` of column `column` of an Arrow table
    (read when needed, `read`)."""

    path: Path | None = None
    table: Any = field(default=None, repr=False, compare=False)
    row: int = -1
    column: str = ""

    def read(self) -> bytes:
        """The image file's bytes."""
        if self.path is not None:
            return self.path.read_bytes()
        value = self.table.column(self.column)[self.row].as_py()
        return bytes(value["bytes"] if isinstance(value, Mapping) else value)

    def describe(self) -> str:
        return str(self.path) if self.path is not None else f"embedded image in {self.column}"


@dataclass(frozen=True)
class CaptionedImage:
    caption: str
    image: ImageRef
    row: str  # where it came from, for messages ("line 3", "cats/01.png")


@dataclass(frozen=True)
class PreferencePair:
    caption: str
    chosen: ImageRef
    rejected: ImageRef
    row: str


@dataclass
class ImageSource:
    """One source read and checked: its items in file order, the report of what was dropped,
    and the files its content comes from (data files, and image files referenced by path)."""

    path: str
    kind: str
    items: list[Any]
    report: DataReport
    data_files: list[Path]
    image_files: list[Path]


def _caption(value: Any, row: str, column: str, problems: _Problems) -> str | None:
    """The caption's text, or None with the row's problem added."""
    if isinstance(value, str) and value.strip():
        return value.strip()
    if value is None or isinstance(value, str):
        problems.add(row, f"missing or empty caption in column '{column}'")
    else:
        problems.add(
            row, f"caption {value!r} in column '{column}' is a {type(value).__name__}, not text "
            "(is data.columns.caption the caption column?)",
        )  # fmt: skip
    return None


def _check_image(ref: ImageRef, row: str, problems: _Problems, max_pixels: int | None) -> None:
    try:
        probe_image(
            str(ref.path) if ref.path is not None else ref.read(), None, max_pixels=max_pixels
        )
    except (MediaUnreadable, OSError) as err:
        problems.add(row, f"image {ref.describe()}: {err}")


def _same_image(a: ImageRef, b: ImageRef) -> bool:
    """Whether two references hold the same image file: one path, or identical bytes."""
    if a.path is not None and b.path is not None:
        if a.path.resolve() == b.path.resolve():
            return True
        if a.path.stat().st_size != b.path.stat().st_size:
            return False
    return a.read() == b.read()


def _image_ref(value: Any, *, base: Path, table: Any, row: int, column: str) -> ImageRef | str:
    """The reference a cell holds, or why it holds none."""
    if isinstance(value, Mapping):
        if value.get("bytes") is not None:
            return ImageRef(table=table, row=row, column=column)
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return ImageRef(table=table, row=row, column=column)
    if isinstance(value, str) and value:
        path = Path(value).expanduser()
        return ImageRef(path=path if path.is_absolute() else base / path)
    return f"no image in column '{column}' (a path or embedded bytes)"


def _table(path: str) -> tuple[Any, Any, list[Path], Path]:
    """(Arrow table, row names, files, base folder for relative image paths) of a data file or
    folder of data files, through `sources.load_dataset`."""
    import datasets

    from align_anything.data.sources import JSON_LINE, columns_of, load_dataset, row_dicts

    dataset, _, names, files = load_dataset(path, "train")
    local = Path(path).expanduser()
    base = local.resolve() if local.is_dir() else local.resolve().parent
    if JSON_LINE in dataset.column_names:
        # JSON lines arrive as each line's text (`sources` reads them a line at a time, so an
        # odd value is that row's problem): parse them into a table of the file's own columns.
        return _json_table(row_dicts(dataset[:], columns_of(dataset))), names, files, base
    # Image columns `datasets` would decode into PIL images: keep their stored bytes and paths.
    for name, feature in dataset.features.items():
        if isinstance(feature, datasets.Image) and feature.decode:
            dataset = dataset.cast_column(name, datasets.Image(decode=False))
    return dataset.data, names, files, base


def _json_table(rows: list[dict[str, Any]]) -> Any:
    """The parsed rows of a JSON-lines file as an Arrow table. A column whose values mix types
    (a label "1" among numbers, a caption 42 among strings), which Arrow cannot hold as one
    type, is kept as each value's JSON text and listed in the schema's metadata, so that
    `_values` and `_cell` give back the values as the file wrote them, for the row checks."""
    import pyarrow as pa

    names = list(rows[0]) if rows else []
    arrays, mixed = [], []
    for name in names:
        values = [row[name] for row in rows]
        try:
            arrays.append(pa.array(values))
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            arrays.append(pa.array([None if v is None else json.dumps(v) for v in values]))
            mixed.append(name)
    table = pa.Table.from_arrays(arrays, names=names) if names else pa.table({})
    return table.replace_schema_metadata({_JSON_COLUMNS: json.dumps(mixed)}) if mixed else table


def _json_columns(table: Any) -> list[str]:
    metadata = table.schema.metadata or {}
    return json.loads(metadata.get(_JSON_COLUMNS, b"[]"))


def _values(table: Any, column: str) -> list[Any]:
    """A column's values as Python objects (a mixed JSON-lines column's as the file wrote them)."""
    values = table.column(column).to_pylist()
    if column in _json_columns(table):
        return [None if v is None else json.loads(v) for v in values]
    return values


def _read_table_captioned(path: str, columns: Mapping[str, str], max_pixels: int | None
                          ) -> ImageSource:  # fmt: skip
    table, names, files, base = _table(path)
    where = f"data file {files[0]}" if len(files) == 1 else f"data {path}"
    image_col = pick_column(table.column_names, "image", CAPTIONED_COLUMNS["image"], columns, where)
    caption_col = pick_column(
        table.column_names, "caption", CAPTIONED_COLUMNS["caption"], columns, where
    )
    images = _values(table, image_col) if _is_path_column(table, image_col) else None
    captions = _values(table, caption_col)
    problems, items = _Problems(where), []
    for index, caption in enumerate(captions):
        row = names(index)
        value = images[index] if images is not None else _cell(table, image_col, index)
        ref = _image_ref(value, base=base, table=table, row=index, column=image_col)
        text = _caption(caption, row, caption_col, problems)
        if isinstance(ref, str):
            problems.add(row, ref)
            continue
        _check_image(ref, row, problems, max_pixels)
        if text is not None:
            items.append(CaptionedImage(text, ref, row))
    problems.raise_any("Fix or remove those rows.")
    return _source(path, "captioned", items, len(captions), files)


def _is_path_column(table: Any, column: str) -> bool:
    import pyarrow as pa

    return pa.types.is_string(table.schema.field(column).type) or pa.types.is_large_string(
        table.schema.field(column).type
    )


def _cell(table: Any, column: str, index: int) -> Any:
    """One cell, without turning embedded bytes into Python objects (only their presence)."""
    value = table.column(column)[index]
    if not value.is_valid:
        return None
    if column in _json_columns(table):
        return json.loads(value.as_py())
    import pyarrow as pa

    if pa.types.is_struct(value.type):
        return {"bytes": b"" if value["bytes"].is_valid else None,
                "path": value["path"].as_py() if "path" in value.type.names else None}  # fmt: skip
    if pa.types.is_binary(value.type) or pa.types.is_large_binary(value.type):
        return b""
    return value.as_py()


def _source(path: str, kind: str, items: list, total: int, data_files: list[Path],
            report: DataReport | None = None) -> ImageSource:  # fmt: skip
    report = report or DataReport(source=path, total=total)
    report.total, report.kept = total, len(items)
    refs = [
        r
        for it in items
        for r in ((it.image,) if kind == "captioned" else (it.chosen, it.rejected))
    ]
    image_files = sorted({r.path for r in refs if r.path is not None})
    return ImageSource(path, kind, items, report, list(data_files), image_files)


def _read_folder(folder: Path, columns: Mapping[str, str], max_pixels: int | None
                 ) -> ImageSource:  # fmt: skip
    metadata = folder / METADATA
    if metadata.is_file():
        source = _read_table_captioned(str(metadata), {"image": "file_name", **columns}, max_pixels)
        source.path = str(folder)
        source.report.source = str(folder)
        return source
    images = sorted(
        p for p in folder.rglob("*")
        if p.suffix.lower() in IMAGE_SUFFIXES and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )  # fmt: skip
    if not images:
        raise DataError(
            f"image folder {folder} has no {METADATA} and no images "
            f"({', '.join(IMAGE_SUFFIXES)}): give a folder of images with a .txt caption beside "
            f"each, a folder with {METADATA} (file_name, text), or a .jsonl/.parquet file"
        )
    problems, items, captions = _Problems(f"image folder {folder}"), [], []
    for image in images:
        row = str(image.relative_to(folder))
        text_file = image.with_suffix(".txt")
        try:
            raw = text_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            problems.add(row, f"no caption file {text_file.name} beside it")
            continue
        except (OSError, UnicodeDecodeError) as err:
            problems.add(row, f"caption file {text_file.name} cannot be read as UTF-8 ({err})")
            continue
        if not raw.strip():
            problems.add(row, f"caption file {text_file.name} is empty")
            continue
        ref = ImageRef(path=image)
        _check_image(ref, row, problems, max_pixels)
        items.append(CaptionedImage(raw.strip(), ref, row))
        captions.append(text_file)
    problems.raise_any("Add a caption (.txt of the same name) or remove the image.")
    return _source(str(folder), "captioned", items, len(images), captions)


def read_captioned_images(
    path: str, *, columns: Mapping[str, str] | None = None,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
) -> ImageSource:  # fmt: skip
    """The captioned images of an image folder or a data file (see the module docstring),
    every row checked; a `DataError` naming each bad row otherwise."""
    local = Path(path).expanduser()
    columns = dict(columns or {})
    if local.is_dir() and not _has_data_files(local):
        return _read_folder(local, columns, max_pixels)
    return _read_table_captioned(path, columns, max_pixels)


def _has_data_files(folder: Path) -> bool:
    from align_anything.data.sources import DATA_SUFFIXES

    if (folder / METADATA).is_file():
        return False
    return any(p.name.lower().endswith(tuple(DATA_SUFFIXES)) for p in folder.iterdir())


def _label(value: Any) -> float | None:
    """0, 0.5 or 1 from a number or a string of one ("1", "0.5": a CSV converted to JSON)."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None
    value = float(value)
    return value if value in (0.0, 0.5, 1.0) else None


def read_preference_pairs(
    path: str, *, columns: Mapping[str, str] | None = None,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
) -> ImageSource:  # fmt: skip
    """Pick-a-Pic-shaped preference pairs (see the module docstring): the chosen image is the
    one whose label is 1; ties (0.5) and pairs of one image twice are dropped and counted in
    the report; a missing image or caption and a label outside {0, 0.5, 1} are one `DataError`
    naming every such row."""
    columns = dict(columns or {})
    table, names, files, base = _table(path)
    where = f"data file {files[0]}" if len(files) == 1 else f"data {path}"
    picked = {c: pick_column(table.column_names, c, tried, columns, where)
              for c, tried in PAIR_COLUMNS.items()}  # fmt: skip
    captions = _values(table, picked["caption"])
    labels = _values(table, picked["label_0"])
    report = DataReport(source=path)
    problems, items = _Problems(where), []
    for index, (caption, raw_label) in enumerate(zip(captions, labels, strict=True)):
        row, known = names(index), len(problems.found)
        label = _label(raw_label)
        if label is None:
            problems.add(
                row, f"label {raw_label!r} in column '{picked['label_0']}' is not 0, 0.5 or 1"
            )
        text = _caption(caption, row, picked["caption"], problems)
        refs = []
        for column in (picked["jpg_0"], picked["jpg_1"]):
            ref = _image_ref(
                _cell(table, column, index), base=base, table=table, row=index, column=column
            )
            if isinstance(ref, str):
                problems.add(row, ref)
            else:
                _check_image(ref, row, problems, max_pixels)
                refs.append(ref)
        if len(problems.found) > known:  # this row's problems are reported
            continue
        if label == 0.5:
            report.drop(TIE, row)
            continue
        if _same_image(*refs):
            report.drop(IDENTICAL, row)
            continue
        chosen, rejected = refs if label == 1.0 else refs[::-1]
        items.append(PreferencePair(text, chosen, rejected, row))
    problems.raise_any("Fix or remove those rows.")
    return _source(path, "pairs", items, len(captions), files, report)


def read_image_source(
    path: str, kind: str, *, columns: Mapping[str, str] | None = None,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
) -> ImageSource:  # fmt: skip
    """`read_captioned_images` ("captioned") or `read_preference_pairs` ("pairs"); images of
    more than `max_pixels` pixels (`data.max_image_pixels`; None: any size) are refused."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}; one of {', '.join(KINDS)}")
    reader = read_captioned_images if kind == "captioned" else read_preference_pairs
    return reader(path, columns=columns, max_pixels=max_pixels)


# ----------------------------------------------------------------- images at the resolution


@dataclass(frozen=True)
class Cropped:
    """An image resized so its shorter side is the resolution and centre-cropped square:
    `pixels` [3, R, R] float32 in [-1, 1], the original (height, width) and the crop's
    (top, left) in the resized image (SDXL's size and crop conditioning)."""

    pixels: np.ndarray
    original_size: tuple[int, int]
    crop_top_left: tuple[int, int]


def center_crop(
    data: bytes, resolution: int, *, max_pixels: int | None = None, name: str = "image"
) -> Cropped:
    """The image in `data` (any format PIL reads) as displayed, in 8-bit RGB
    (`data.media.to_rgb`), shorter side resized to `resolution` (bilinear, as diffusers'
    training scripts' `transforms.Resize`), then the centre square (offsets rounded as
    diffusers' SDXL script rounds them). Written with PIL rather than diffusers'
    `VaeImageProcessor`, which does not report the crop offsets SDXL needs. Raises
    `MediaUnreadable` (naming `name`) for an image that cannot be decoded. `max_pixels`: none
    by default, since the data check (`read_image_source`) applied `data.max_image_pixels`."""
    from PIL import Image

    image = load_image({"bytes": data, "path": name}, None, max_pixels=max_pixels)
    width, height = image.size
    scale = resolution / min(width, height)
    size = (max(resolution, round(width * scale)), max(resolution, round(height * scale)))
    resized = image.resize(size, Image.Resampling.BILINEAR)
    top = max(0, int(round((size[1] - resolution) / 2.0)))
    left = max(0, int(round((size[0] - resolution) / 2.0)))
    square = resized.crop((left, top, left + resolution, top + resolution))
    pixels = np.asarray(square, dtype=np.float32).transpose(2, 0, 1) / 127.5 - 1.0
    return Cropped(pixels, (height, width), (top, left))
