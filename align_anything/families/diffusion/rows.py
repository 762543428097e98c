"""What the pipeline media's data readers share: a data file (or folder of them) as an Arrow
table with its row names, a caption cell's text, and bad rows collected over a whole source
into one `DataError` naming the file and each row. Used by the video and audio readers
(`families/text_to_video/videos.py`, `families/text_to_audio/audio.py`); the image reader
(`families/text_to_image/images.py`) takes `RowProblems` and keeps its own table reader and
caption check (JSON columns of mixed types kept as text, a caption of the wrong type named)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from align_anything.errors import DataError

MAX_SHOWN = 5  # bad rows named in one message (the rest are counted)


class RowProblems:
    """Bad rows of one source, collected so that one error names them all."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.found: list[str] = []

    def add(self, row: str, problem: str) -> None:
        self.found.append(f"{row}: {problem}")

    def raise_any(self, hint: str) -> None:
        """One `DataError` naming the first rows found and counting the rest; nothing when no
        row was bad."""
        if not self.found:
            return
        shown = "\n  ".join(self.found[:MAX_SHOWN])
        more = (f"\n  ... and {len(self.found) - MAX_SHOWN} more"
                if len(self.found) > MAX_SHOWN else "")  # fmt: skip
        raise DataError(
            f"{len(self.found)} row(s) of {self.where} cannot be used (numbered from 1 as in "
            f"the file):\n  {shown}{more}\n{hint}"
        )


def caption_text(value: Any) -> str | None:
    """A caption cell's text, stripped; None when missing or blank."""
    return value.strip() if isinstance(value, str) and value.strip() else None


def read_table(path: str) -> tuple[Any, Any, list[Path], Path]:
    """(Arrow table, row names, files, base folder for relative paths) of a data file or
    folder of data files, through `data.sources.load_dataset`."""
    from align_anything.data.builtin import builtin_path
    from align_anything.data.sources import JSON_LINE, columns_of, load_dataset, row_dicts

    dataset, _, names, files = load_dataset(path, "train")
    local = builtin_path(path) or Path(path).expanduser()  # a built-in set: its shipped file
    base = local.resolve() if local.is_dir() else local.resolve().parent
    if JSON_LINE in dataset.column_names:
        import pyarrow as pa

        table = pa.Table.from_pylist(row_dicts(dataset[:], columns_of(dataset)))
        return table, names, files, base
    return dataset.data, names, files, base


def where(path: str, files: list[Path]) -> str:
    """How a message names a source: its one data file, or the path given."""
    return f"data file {files[0]}" if len(files) == 1 else f"data {path}"
