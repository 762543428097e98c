"""Media in the data pipeline, for image-text and audio-text models.

`MediaSupport` writes each item's placeholder into the prompt text already expanded to as many
placeholder tokens as the processor gives an item of that size (so the text encoders,
truncation and prefix checks of `data.encode` work unchanged), checks media cheaply at data
preparation, decodes them per batch in the collate step, and adds a dummy row to a batch
without media (see `MediaSupport.attach`). `media_inputs` picks a batch's media tensors for the
model's forward.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from align_anything.data.formats import DataReport, row_label
from align_anything.data.media import (
    MAX_IMAGE_PIXELS,
    MEDIA_KEYS,
    MediaUnreadable,
    as_list,
    load_audio,
    load_image,
    probe_audio,
    probe_image,
    target_samples,
)
from align_anything.errors import DataError
from align_anything.families.language.batches import Rows
from align_anything.families.language.encode import CUT_MEDIA, IGNORE_INDEX, cuts_media

# Batch keys a multimodal model's forward takes besides input_ids / attention_mask.
MEDIA_MODEL_INPUTS = (
    "pixel_values", "image_sizes", "image_grid_thw", "input_features", "feature_attention_mask",
)  # fmt: skip

# Markers a record may put in its text to place its media: k-th marker = k-th item.
MARKERS = {"image": "<image>", "audio": "<audio>"}
# The keywords online RL's reward functions get a row's own media under (`prompt_media`):
# the media of the prompt, not what the model made (text-to-image rewards get `images=`).
PROMPT_MEDIA_KEYS = {"image": "prompt_images", "audio": "prompt_audio"}


@dataclass
class MediaSupport:
    """Everything the data path needs for a model's media: placeholders, checks, batches."""

    processor: Any
    modalities: tuple[str, ...]
    max_image_pixels: int | None = MAX_IMAGE_PIXELS  # data.max_image_pixels
    # The language model's context (its `max_position_embeddings`; None: unknown): a row whose
    # media alone need more tokens holds more images or clips than the model takes.
    context: int | None = None
    _token_counts: dict[tuple, int] = field(default_factory=dict)

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def sampling_rate(self) -> int:
        return int(self.processor.feature_extractor.sampling_rate)

    def token(self, modality: str) -> str:
        """The placeholder token repeated once per media feature."""
        return self.processor.image_token if modality == "image" else self.processor.audio_token

    def token_id(self, modality: str) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(self.token(modality)))

    def _wrap(self, modality: str) -> tuple[str, str]:
        # Qwen-style processors expect the repeated token between begin/end markers.
        if modality == "audio":
            return (getattr(self.processor, "audio_bos_token", "") or "",
                    getattr(self.processor, "audio_eos_token", "") or "")  # fmt: skip
        if self.token("image") == "<|image_pad|>":
            return "<|vision_start|>", "<|vision_end|>"
        return "", ""

    def placeholder(self, modality: str, count: int | None = None) -> str:
        """The text of one media item: begin marker, the token (`count` times), end marker."""
        begin, end = self._wrap(modality)
        return begin + self.token(modality) * (1 if count is None else count) + end

    # ------------------------------------------------------------ token counts

    def _dummy(self, modality: str, size: Any) -> Any:
        if modality == "image":
            from PIL import Image

            return Image.new("RGB", size)
        return np.zeros(size, dtype=np.float32)

    def token_count(self, modality: str, size: Any) -> int:
        """How many placeholder tokens the processor gives a media item of this size (image:
        (width, height); audio: samples at the feature extractor's rate). Asked of the processor
        itself on a blank item of that size, so every architecture's own rule applies."""
        key = (modality, size)
        if key not in self._token_counts:
            media = {"images" if modality == "image" else "audio": [self._dummy(modality, size)]}
            if modality == "audio":
                media["sampling_rate"] = self.sampling_rate
            out = self.processor(text=[self.placeholder(modality)], return_tensors="pt", **media)
            self._token_counts[key] = int((out["input_ids"] == self.token_id(modality)).sum())
        return self._token_counts[key]

    def _probe(self, modality: str, ref: Any, base_dir: Path | None) -> Any:
        if modality == "image":
            return probe_image(ref, base_dir, max_pixels=self.max_image_pixels)
        samples, rate = probe_audio(ref, base_dir)
        return target_samples(samples, rate, self.sampling_rate)

    # ------------------------------------------------------------ records

    def prepare(self, records: list[dict], *, data_path: str) -> list[dict]:
        """Check every record's media (existence and header, nothing decoded) and write the
        expanded placeholders into its prompt text. Relative paths are resolved against the
        dataset file's folder and stored absolute. Raises one `DataError` listing unreadable
        media with their row numbers."""
        base_dir = media_base_dir(data_path)
        problems: list[str] = []
        prepared = []
        for index, record in enumerate(records):
            try:
                prepared.append(self.prepare_record(record, base_dir))
            except MediaUnreadable as reason:
                problems.append(f"{row_label(record, index)}: {reason}")
        if problems:
            shown = "\n  ".join(problems[:5]) + ("\n  ..." if len(problems) > 5 else "")
            where = f" (relative paths are read from {base_dir})" if base_dir else ""
            raise DataError(
                f"{len(problems)} row(s) of {data_path} have missing, unreadable or too many "
                f"media{where} "
                f"(numbered from 1 as in the file):\n  {shown}\nFix or remove those rows."
            )
        return prepared

    def prepare_record(self, record: dict, base_dir: Path | None) -> dict:
        """One record of `prepare` (raises `MediaUnreadable`); `base_dir`:
        `media_base_dir` of its data path."""
        record = dict(record)
        expanded: dict[str, list[str]] = {}
        total = 0
        for key, modality in MEDIA_KEYS.items():
            refs = as_list(record.get(key))
            if not refs:
                continue
            if modality not in self.modalities:
                raise MediaUnreadable(
                    f"has {key}, but the model takes only {', '.join(self.modalities)}"
                )
            counts = [self.token_count(modality, self._probe(modality, r, base_dir)) for r in refs]
            total += sum(counts)
            if self.context is not None and total > self.context:
                noun = "image" if modality == "image" else "audio clip"
                raise MediaUnreadable(
                    f"has {len(refs)} {noun}s ({sum(counts)} placeholder tokens, "
                    f"{max(counts)} for the largest), more than the model takes: their tokens "
                    f"alone exceed its context of {self.context} tokens "
                    "(max_position_embeddings). Give that row fewer or smaller media"
                )
            expanded[modality] = [self.placeholder(modality, n) for n in counts]
            record[key] = [_absolute(r, base_dir) for r in refs]
        if expanded:
            turns_key = "messages" if "messages" in record else "prompt"
            record[turns_key] = _insert_placeholders(record[turns_key], expanded)
        record["media_tokens"] = total
        return record

    def drop_cut_rows(self, rows: list[dict], report: DataReport) -> list[dict]:
        """Drop encoded rows whose placeholder tokens truncation cut (the model needs one token
        per media feature)."""
        ids = {self.token_id(m) for m in self.modalities}
        kept = []
        for index, row in enumerate(rows):
            if not cuts_media(row, ids):
                kept.append(row)
            else:
                # Encoded rows do not carry their record's source label.
                report.drop(CUT_MEDIA, f"encoded row {index + 1}")
        report.kept -= len(rows) - len(kept)
        return kept

    # ------------------------------------------------------------ batches

    def attach(self, batch: Rows, rows: list[dict], *, copies: int) -> Rows:
        """Decode this batch's media and add the model inputs; mask placeholder tokens out of
        `labels`.

        Sequence s of the batch belongs to row s % len(rows) (`copies`=2 for preference batches:
        chosen rows, then rejected rows, both with the prompt's media). A batch without media of a
        modality the model has gets one extra dummy row (placeholder tokens only, media of zeros,
        no labels; `real_rows` says how many rows are real): every rank then runs every encoder
        in every forward, in the same module order. Under ZeRO-3 a rank whose batch skipped the
        vision or audio tower would not take part in gathering its parameters while the other
        ranks wait for it (a hang); with z0/z2 the tower's gradients would be missing on that
        rank. The dummy row's outputs are cut off before any loss, so it adds exactly zero.
        """
        sequences = [rows[s % len(rows)] for s in range(len(rows) * copies)]
        for modality in self.modalities:
            key = next(k for k, m in MEDIA_KEYS.items() if m == modality)
            refs = [ref for row in sequences for ref in as_list(row.get(key))]
            if not refs:
                refs = [self._add_dummy_row(batch, modality)]
                media = [self._dummy(modality, self._dummy_size(modality))]
            else:
                media = [self._decode(modality, ref) for ref in refs]
            batch.media.update(self._features(modality, media))
        placeholder = torch.zeros_like(batch.input_ids, dtype=torch.bool)
        for modality in self.modalities:
            placeholder |= batch.input_ids == self.token_id(modality)
        batch.labels = batch.labels.masked_fill(placeholder, IGNORE_INDEX)
        return batch

    def has_all_media(self, rows: Sequence[Mapping[str, Any]]) -> bool:
        """Whether every row has media of every modality the model takes (so a batch of them
        runs every encoder without a dummy row)."""
        keys = [k for k, m in MEDIA_KEYS.items() if m in self.modalities]
        return bool(rows) and all(as_list(row.get(k)) for row in rows for k in keys)

    def features(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """The model inputs of the rows' media, decoded, in row order (no dummy row: see
        `has_all_media`)."""
        out: dict[str, torch.Tensor] = {}
        for modality in self.modalities:
            key = next(k for k, m in MEDIA_KEYS.items() if m == modality)
            media = [self._decode(modality, ref) for row in rows for ref in as_list(row.get(key))]
            out.update(self._features(modality, media))
        return out

    def prompt_media(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, list[list[Any]]]:
        """What online RL's reward functions get of each row's own media, one list per row
        (in the row's order; [] for a row without): `prompt_images` (PIL images, RGB, as
        displayed: what the model was shown, before its processor resized them) for a model
        that takes images, `prompt_audio` (float32 numpy arrays, mono, at the feature
        extractor's sampling rate) for one that takes audio. A row repeated for its G
        completions is decoded once; its entries are the same objects."""
        out: dict[str, list[list[Any]]] = {}
        for modality in self.modalities:
            key = next(k for k, m in MEDIA_KEYS.items() if m == modality)
            decoded: dict[Any, Any] = {}
            per_row = []
            for row in rows:
                items = []
                for ref in as_list(row.get(key)):
                    name = _ref_key(ref)
                    if name not in decoded:
                        decoded[name] = self._decode(modality, ref)
                    items.append(decoded[name])
                per_row.append(items)
            out[PROMPT_MEDIA_KEYS[modality]] = per_row
        return out

    def _decode(self, modality: str, ref: Any) -> Any:
        try:
            if modality == "image":
                return load_image(ref, None, max_pixels=self.max_image_pixels)
            return load_audio(ref, None, self.sampling_rate)
        except MediaUnreadable as err:  # changed since the data check, or damaged past its reach
            raise DataError(
                f"{err} (the check at start-up reads its header and, for PNG and JPEG, whether "
                "the file is whole: it changed since, or its data is damaged in a way only "
                "decoding shows)"
            ) from None

    def _dummy_size(self, modality: str) -> Any:
        if modality == "image":
            crop = getattr(self.processor.image_processor, "crop_size", None) or {}
            side = int(crop.get("height", 0) or 32)
            return (side, side)
        return self.sampling_rate  # one second

    def _add_dummy_row(self, batch: Rows, modality: str) -> None:
        text = self.placeholder(modality, self.token_count(modality, self._dummy_size(modality)))
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        rows, width = batch.input_ids.shape
        if batch.real_rows is None:
            batch.real_rows = rows
        new_width = max(width, len(ids))
        pad_id = self.tokenizer.pad_token_id
        fills = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE_INDEX}
        for key, fill in fills.items():
            old = getattr(batch, key)
            grown = torch.full((rows + 1, new_width), fill, dtype=old.dtype)
            grown[:rows, :width] = old
            setattr(batch, key, grown)
        batch.input_ids[rows, : len(ids)] = torch.tensor(ids)
        batch.attention_mask[rows, : len(ids)] = 1

    def _features(self, modality: str, media: list[Any]) -> dict[str, torch.Tensor]:
        if modality == "image":
            out = self.processor.image_processor(images=media, return_tensors="pt")
            return {k: v for k, v in out.items() if k in MEDIA_MODEL_INPUTS}
        out = self.processor.feature_extractor(
            media, sampling_rate=self.sampling_rate, return_attention_mask=True,
            padding="max_length", return_tensors="pt",
        )  # fmt: skip
        return {"input_features": out["input_features"],
                "feature_attention_mask": out["attention_mask"]}  # fmt: skip


def media_inputs(batch: Rows | Mapping[str, Any]) -> dict[str, Any]:
    """The media inputs of a batch, to pass to the model's forward beside the text."""
    source = batch.media if isinstance(batch, Rows) else batch
    return {k: source[k] for k in MEDIA_MODEL_INPUTS if k in source}


def has_media(records: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any record carries media."""
    return any(as_list(r.get(key)) for r in records for key in MEDIA_KEYS)


def media_base_dir(data_path: str) -> Path | None:
    """The folder relative media paths of `data_path` are read from (None: not local)."""
    path = Path(data_path).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.is_file():
        return path.resolve().parent
    return None


def _ref_key(ref: Any) -> Any:
    """A hashable name of a media reference (a path, embedded bytes, or the dict holding
    them), so that rows sharing a reference decode it once."""
    if isinstance(ref, Mapping):
        array = ref.get("array")
        return ("dict", ref.get("path"), ref.get("bytes"),
                id(array) if array is not None else None)  # fmt: skip
    if isinstance(ref, (bytes, bytearray)):
        return bytes(ref)
    return ref if isinstance(ref, str) else id(ref)


def _absolute(ref: Any, base_dir: Path | None) -> Any:
    def resolve(value: str) -> str:
        path = Path(value).expanduser()
        return str(path if path.is_absolute() or base_dir is None else base_dir / path)

    if isinstance(ref, str):
        return resolve(ref)
    if isinstance(ref, Mapping) and isinstance(ref.get("path"), str) and ref.get("bytes") is None:
        return {**ref, "path": resolve(ref["path"])}
    return ref


def _insert_placeholders(messages: list[dict], expanded: dict[str, list[str]]) -> list[dict]:
    """Replace the k-th `<image>`/`<audio>` marker in user turns with the k-th item's
    placeholder; without markers, put every placeholder at the start of the first user turn."""
    messages = copy.deepcopy(messages)
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise MediaUnreadable("has media but no user turn to place them in")
    pattern = re.compile("|".join(re.escape(MARKERS[m]) for m in expanded))
    found = sum(len(pattern.findall(m["content"])) for m in users)
    if found == 0:
        head = "".join(text for texts in expanded.values() for text in texts)
        users[0]["content"] = head + "\n" + users[0]["content"]
        return messages
    wanted = sum(len(texts) for texts in expanded.values())
    if found != wanted:
        raise MediaUnreadable(f"has {wanted} media item(s) but {found} marker(s) in its text")
    queues = {m: list(texts) for m, texts in expanded.items()}
    marker_to_modality = {MARKERS[m]: m for m in expanded}
    for message in users:
        message["content"] = pattern.sub(
            lambda match: queues[marker_to_modality[match.group(0)]].pop(0), message["content"]
        )
    return messages
