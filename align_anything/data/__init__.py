"""Data: load files into canonical records, encode them through the chat template, collate."""

from align_anything.data.collate import collate_preference, collate_sft, collate_unpaired
from align_anything.data.encode import (
    IGNORE_INDEX,
    TRUNCATION_MODES,
    encode_preference,
    encode_sft,
    encode_unpaired,
)
from align_anything.data.formats import FORMATS, DataReport, load_records, split_records

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "TRUNCATION_MODES",
    "DataReport",
    "collate_preference",
    "collate_sft",
    "collate_unpaired",
    "encode_preference",
    "encode_sft",
    "encode_unpaired",
    "load_records",
    "split_records",
]
