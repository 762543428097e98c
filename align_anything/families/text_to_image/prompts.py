"""Prompts for online RL of a text-to-image pipeline (`flow_grpo`, `dance_grpo`,
`diffusion_nft`): a caption column and, for the rewards, any other columns.

A source is a `.jsonl` / `.json` / `.parquet` / `.csv` file, a folder of them, or a built-in
name (e.g. `t2i-shapes`: its captions; its images are not read). The prompt is the first of the
columns `prompt`, `text`, `caption` the file has (`data.columns.caption` names another); every
other column whose values are plain data (strings, numbers, booleans, lists and objects of them)
goes to the reward functions as a keyword of that name, one value per image (GenEval's
metadata, an answer, a tag). Columns of bytes (images) are left out. A missing or empty prompt
is an error naming every such row, before any compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from align_anything.data.formats import DataReport, pick_column
from align_anything.families.text_to_image.images import (
    ImageSource,
    _caption,
    _Problems,
    _table,
    _values,
)

# The prompt column's names tried in a file, in order.
PROMPT_COLUMNS = ("prompt", "text", "caption")


@dataclass(frozen=True)
class PromptRow:
    """One prompt: its `caption` (the name the latent cache knows a text by), the `row` it came
    from (for messages) and its other columns (`fields`)."""

    caption: str
    row: str
    fields: dict[str, Any] = field(default_factory=dict)


def _plain(value: Any) -> bool:
    """Whether `value` is JSON-able plain data (what a field may hold)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _is_bytes_column(table: Any, column: str) -> bool:
    import pyarrow as pa

    kind = table.schema.field(column).type
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return True
    return pa.types.is_struct(kind) and "bytes" in kind.names  # `datasets`' Image feature


def read_prompts(path: str, *, columns: Mapping[str, str] | None = None) -> ImageSource:
    """The prompts of `path` (see the module docstring) as an `ImageSource` of kind "prompts"
    whose items are `PromptRow`s (no images); a `DataError` naming each bad row."""
    table, names, files, _ = _table(path)
    where = f"data file {files[0]}" if len(files) == 1 else f"data {path}"
    prompt_column = pick_column(
        table.column_names, "caption", PROMPT_COLUMNS, dict(columns or {}), where
    )
    kept = [
        name for name in table.column_names
        if name != prompt_column and not _is_bytes_column(table, name)
    ]  # fmt: skip
    captions = _values(table, prompt_column)
    values = {name: _values(table, name) for name in kept}
    problems, items = _Problems(where), []
    for index, caption in enumerate(captions):
        row = names(index)
        text = _caption(caption, row, prompt_column, problems)
        if text is None:
            continue
        fields = {name: values[name][index] for name in kept}
        odd = [name for name, value in fields.items() if not _plain(value)]
        if odd:
            problems.add(row, f"column(s) {', '.join(odd)} hold values that are not plain data")
            continue
        items.append(PromptRow(text, row, fields))
    problems.raise_any("Fix or remove those rows (or leave those columns out of the file).")
    report = DataReport(source=path, total=len(captions))
    report.kept = len(items)
    return ImageSource(path, "prompts", items, report, list(files), [])
