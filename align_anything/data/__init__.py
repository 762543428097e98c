"""Data: files → canonical records → encoded rows in the on-disk Arrow cache → batches.

What training uses is exported here: the batch layouts and the collate functions that make
them, the label convention, the per-split reports. The run's data is built by `pipeline` and
cached by `cache`; the list encoders of `encode` (`encode_sft`, `encode_preference`, ...) and
`formats.load_records` / `split_records` encode a list of records the way a run encodes each
row, for scripts, benchmarks and tests: import them from their modules."""

from align_anything.data.batches import Layout, Packed, Rows, SharedPrefix, to_device
from align_anything.data.collate import (
    collate_margins,
    collate_preference,
    collate_sft,
    collate_unpaired,
    pad_rows,
)
from align_anything.data.encode import IGNORE_INDEX, TRUNCATION_MODES
from align_anything.data.formats import FORMATS, DataReport

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "TRUNCATION_MODES",
    "DataReport",
    "Layout",
    "Packed",
    "Rows",
    "SharedPrefix",
    "collate_margins",
    "collate_preference",
    "collate_sft",
    "collate_unpaired",
    "pad_rows",
    "to_device",
]
