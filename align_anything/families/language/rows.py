"""Views of a run's encoded rows and held-out records on memory-mapped Arrow datasets: a row is
read (and becomes Python objects) only when a batch asks for it, so a process holds no more
than its batches beyond the mapped files."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from align_anything.data.jsonrow import loads


class EncodedRows(Sequence):
    """The encoded rows of one split: ``rows[i]`` is the dict the list encoders make (the
    encoded ids, then the record's other keys), plus any in-memory column a trainer set
    (`set_column`: e.g. precomputed reference log-probs, one number per row) and whatever
    `derive` adds from the row and its index (e.g. KTO's KL completion of a held-out row)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._columns: dict[str, np.ndarray] = {}
        self._derive: Callable[[int, dict], dict] | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        index %= len(self)
        row = self.plain(index)
        if self._derive is not None:
            row.update(self._derive(index, row))
        return row

    def plain(self, index: int) -> dict:
        """Row `index` without what `derive` adds."""
        raw = self.dataset[index]
        extras = raw.pop("extras", None)
        row = {**(loads(extras) if extras else {}), **raw}
        for name, values in self._columns.items():
            row[name] = values[index].item()
        return row

    def set_column(self, name: str, values: Any) -> None:
        """Add (or replace) a column held in memory, one value per row."""
        values = np.asarray(values)
        if len(values) != len(self):
            raise ValueError(f"column {name!r} has {len(values)} values for {len(self)} rows")
        self._columns[name] = values

    def derive(self, function: Callable[[int, dict], dict]) -> None:
        """Add `function(index, row)`'s keys to every row as it is read."""
        self._derive = function

    def column(self, name: str) -> np.ndarray:
        """A scalar column as numpy (e.g. KTO's `label`), read from the mapped file."""
        return self.dataset.data.column(name).to_numpy()

    def lengths(self) -> np.ndarray:
        """Tokens each row puts through the model: the summed lengths of its id lists
        (`batching.row_tokens` of every row, from the Arrow list offsets)."""
        import pyarrow.compute as pc

        total = np.zeros(len(self), dtype=np.int64)
        for name in self.dataset.column_names:
            if name.endswith("ids"):
                total += pc.list_value_length(self.dataset.data.column(name)).to_numpy()
        return total

    def last_ids(self, name: str) -> np.ndarray:
        """The last id of list column `name` in every row (-1 where a list is empty)."""
        parts = []
        for chunk in self.dataset.data.column(name).chunks:  # chunk by chunk: no copy of the ids
            offsets = chunk.offsets.to_numpy()  # absolute positions in chunk.values
            values = chunk.values.to_numpy()
            ends = offsets[1:]
            out = np.full(len(ends), -1, dtype=np.int64)
            nonempty = ends > offsets[:-1]
            out[nonempty] = values[ends[nonempty] - 1]
            parts.append(out)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class RecordsView(Sequence):
    """Canonical records stored as JSON text (a `record` column), parsed one at a time."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return loads(self.dataset[int(index)]["record"])

    def __iter__(self) -> Iterator[Any]:
        for batch in self.dataset.iter(batch_size=1000):
            yield from (loads(text) for text in batch["record"])
