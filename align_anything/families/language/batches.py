"""The layouts a batch of token sequences can take on its way into a model, one small dataclass
each; `forward.py` dispatches on the type (never on which keys a dict happens to hold).

- `Rows`: one right-padded row per sequence (`collate_sft`, `collate_preference`, ...), with
  the decoded media of a multimodal batch and how many rows are real (a multimodal batch may
  end with a dummy row, see `MediaSupport.attach`).
- `Packed`: several rows concatenated into one, position ids restarting at each (`sft.packing`).
- `SharedPrefix`: sequences that start alike as one row, the prefix once (`data.layouts`).

A layout reads like a tokenizer's `BatchEncoding` too (`batch["input_ids"]`), and `to(device)`
moves every tensor it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import Tensor

T = TypeVar("T")


class _ReadByKey:
    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def __contains__(self, key: str) -> bool:
        return hasattr(self, key)

    @property
    def tokens(self) -> int:
        """Real tokens the layout puts through the model (padding excluded)."""
        return int(self.attention_mask.sum())  # type: ignore[attr-defined]


@dataclass
class Rows(_ReadByKey):
    """One row per sequence, right-padded: `input_ids`, `attention_mask`, `labels` [B, T]
    (labels `IGNORE_INDEX` where not scored). `media`: the model's media inputs
    (`pixel_values`, `input_features`, ...); `real_rows`: rows before a dummy media row."""

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    media: dict[str, Tensor] = field(default_factory=dict)
    real_rows: int | None = None

    @property
    def num_real(self) -> int:
        return self.input_ids.shape[0] if self.real_rows is None else self.real_rows

    def __getitem__(self, key: str) -> Any:
        if key in self.media:
            return self.media[key]
        return super().__getitem__(key)


@dataclass
class Packed(_ReadByKey):
    """Packed rows (`sft.packing`): `input_ids`, `labels`, `position_ids` [B, L] or, flattened
    for flash-attention, [1, N]; `attention_mask` marks real tokens for counting only: the
    model gets the position ids and no mask."""

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    attention_mask: Tensor


@dataclass
class SharedPrefix(_ReadByKey):
    """Sequences that share a prefix as one row each group (`data.layouts.collate_shared_prefix`):
    `input_ids`, `attention_mask` (real tokens, for counting), `position_ids` [G, L], the 4D
    `shared_prefix_mask`, and the scored tokens flat: `score_positions`, `score_targets`,
    `score_sequences` (whose each is), `num_sequences`; `sequence_ends`: the flat position of
    each sequence's last token (a reward model's score is read there); `media`: the media
    inputs of the prefixes' placeholders."""

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    shared_prefix_mask: Tensor
    score_positions: Tensor
    score_targets: Tensor
    score_sequences: Tensor
    num_sequences: int
    sequence_ends: Tensor
    # An image-text batch's media inputs (`pixel_values`, ...), one item per row's prefix
    # (`MediaSupport.features`; online RL with `layouts.supports_shared_media_prompt`).
    media: dict[str, Tensor] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        if key in self.media:
            return self.media[key]
        return super().__getitem__(key)


Layout = Rows | Packed | SharedPrefix
