"""Image-text and audio-text models through the same trainers as text models.

What differs from a text model is kept here, so the trainers stay shared:

- built-in tiny models (`tiny-random-llava`, `tiny-random-qwen2-audio`): tiny encoders and a tiny
  language model built from config, with a processor made locally from SmolLM2's tokenizer plus
  the placeholder tokens, a PIL-backend image processor and a Whisper feature extractor;
- loading the model (`AutoModelForMultimodalLM`), its processor, and a reward model (the VLM's
  base model plus a one-output score head read at the last real token);
- `model.freeze` by part (vision_tower, audio_tower, projector, language_model) and the
  per-part parameter summary;
- `MediaSupport`: placeholders written into the prompt text with exactly as many placeholder
  tokens as the processor gives the media (so the text encoders, truncation and prefix checks of
  `data.encode` work unchanged), media checked cheaply at data preparation, decoded per batch in
  the collate step, and a dummy row for a batch without media (see `MediaSupport.attach`).
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

from align_anything.data.encode import IGNORE_INDEX
from align_anything.data.formats import DataReport, row_label
from align_anything.data.media import (
    MEDIA_KEYS,
    MediaUnreadable,
    as_list,
    load_audio,
    load_image,
    probe_audio,
    probe_image,
    target_samples,
)
from align_anything.errors import ConfigError, DataError, ModelError
from align_anything.models import full_numel, keep_architecture_frozen

# Batch keys a multimodal model's forward takes besides input_ids / attention_mask.
MEDIA_MODEL_INPUTS = (
    "pixel_values", "image_sizes", "image_grid_thw", "input_features", "feature_attention_mask",
)  # fmt: skip
# Markers a record may put in its text to place its media: k-th marker = k-th item.
MARKERS = {"image": "<image>", "audio": "<audio>"}
# Parts `model.freeze` names, matched against parameter-name components in this order (the
# projector first: Qwen2-VL's merger sits inside `visual`). Anything unmatched is the language
# model, except a reward head.
PARTS = ("vision_tower", "audio_tower", "projector", "language_model")
_PART_COMPONENTS = {
    "projector": ("multi_modal_projector", "merger", "connector", "mm_projector"),
    "vision_tower": ("vision_tower", "visual", "vision_model"),
    "audio_tower": ("audio_tower", "audio_model"),
    "head": ("score", "v_head"),
}
TEXT_SIZE = 64  # hidden size of the tiny language models


# --------------------------------------------------------------------------- detection, loading


def modalities_of(config: Any) -> tuple[str, ...]:
    """The media a model config takes: ("image",), ("audio",), both, or () for a text model."""
    found = []
    if getattr(config, "vision_config", None) is not None:
        found.append("image")
    if getattr(config, "audio_config", None) is not None:
        found.append("audio")
    return tuple(found)


def load_processor(path: str, *, trust_remote_code: bool = False) -> Any:
    """The model's processor (tokenizer + image processor / feature extractor), pad token set."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot load the processor of {path}: {err}") from None
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None:
        raise ModelError(f"the processor of {path} has no tokenizer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return processor


def load_multimodal_lm(path: str, *, dtype: Any, trust_remote_code: bool = False) -> Any:
    """An image-text or audio-text generation model (`AutoModelForMultimodalLM`)."""
    from transformers import AutoModelForMultimodalLM

    model = AutoModelForMultimodalLM.from_pretrained(
        path, dtype=dtype, trust_remote_code=trust_remote_code
    )
    return keep_architecture_frozen(model)


def last_real_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last attended position, whatever the padding side ([B])."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(dim=1)


class RewardHeadMixin:
    """A multimodal base model (no LM head) and a one-output score at the last real token.

    Combined with a model family's PreTrainedModel class by `reward_model_class`, so weight
    init, attention implementations and checkpoint layout follow the family: a generation
    checkpoint's `model.*` weights load into `self.model`, its `lm_head` is unused and `score` is
    new. Registered with `AutoModelForSequenceClassification`, so after `import
    align_anything.multimodal` the exported folder loads with `from_pretrained`.
    """

    def __init__(self, config: Any) -> None:
        from transformers import AutoModel

        super().__init__(config)
        self.model = AutoModel.from_config(config)
        self.score = torch.nn.Linear(config.get_text_config().hidden_size, 1, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **media: Any) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutputWithPast

        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **media)[0]
        last = last_real_index(attention_mask)
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return SequenceClassifierOutputWithPast(logits=self.score(picked))


_REWARD_CLASSES: dict[type, type] = {}


def reward_model_class(config_class: type) -> type:
    """The reward-model class for a multimodal config class (built once, registered with
    `AutoModelForSequenceClassification`)."""
    if config_class in _REWARD_CLASSES:
        return _REWARD_CLASSES[config_class]
    from transformers import AutoModel, AutoModelForSequenceClassification, PreTrainedModel

    base_model = AutoModel._model_mapping[config_class]
    family = next(c for c in base_model.__mro__[1:] if issubclass(c, PreTrainedModel))
    name = base_model.__name__.removesuffix("Model") + "ForRewardModel"
    cls = type(name, (RewardHeadMixin, family), {"config_class": config_class})
    AutoModelForSequenceClassification.register(config_class, cls, exist_ok=True)
    _REWARD_CLASSES[config_class] = cls
    return cls


def load_reward_model(path: str, config: Any, *, dtype: Any) -> Any:
    """A multimodal reward model from a generation checkpoint or an exported reward model."""
    from transformers.utils import logging as hf_logging

    cls = reward_model_class(type(config))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "score.weight newly initialized" / "lm_head unused" expected
    try:
        model = cls.from_pretrained(path, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    return keep_architecture_frozen(model)


def _register_builtin_reward_classes() -> None:
    from transformers import LlavaConfig, Qwen2AudioConfig

    for config_class in (LlavaConfig, Qwen2AudioConfig):
        reward_model_class(config_class)


# --------------------------------------------------------------------------- freezing by part


def part_of(name: str) -> str:
    """The part a parameter belongs to: vision_tower, audio_tower, projector, head or
    language_model."""
    components = name.split(".")
    for part, markers in _PART_COMPONENTS.items():
        if any(marker in components for marker in markers):
            return part
    return "language_model"


def part_counts(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """part -> (trainable, frozen) parameter counts (ZeRO-3 partitions report `ds_numel`)."""
    counts: dict[str, list[int]] = {}
    for name, param in model.named_parameters():
        entry = counts.setdefault(part_of(name), [0, 0])
        entry[0 if param.requires_grad else 1] += full_numel(param)
    return {part: (t, f) for part, (t, f) in counts.items()}


def freeze_parts(model: torch.nn.Module, parts: Sequence[str], *, model_name: str) -> None:
    """Turn off gradients of the named parts; errors name parts the model does not have."""
    if not parts:
        return
    present = part_counts(model)
    missing = [p for p in parts if p not in present]
    if missing:
        raise ConfigError(
            f"model.freeze={list(parts)}: {model_name} has no {', '.join(missing)}; its parts: "
            f"{', '.join(p for p in PARTS if p in present)}"
        )
    for name, param in model.named_parameters():
        if part_of(name) in parts:
            param.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"model.freeze={list(parts)} leaves nothing to train")


def describe_parts(counts: Mapping[str, tuple[int, int]]) -> str:
    """One summary line: each part's trainable and frozen parameters."""
    order = [*PARTS[:3], "language_model", "head"]
    shown = []
    for part in order:
        if part in counts:
            trainable, frozen = counts[part]
            state = "frozen" if not trainable else "trainable" if not frozen else "partly frozen"
            shown.append(f"{part} {(trainable + frozen) / 1e6:.2f}M {state}")
    return ", ".join(shown)


# --------------------------------------------------------------------------- media in data


@dataclass
class MediaSupport:
    """Everything the data path needs for a model's media: placeholders, checks, batches."""

    processor: Any
    modalities: tuple[str, ...]
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
            return probe_image(ref, base_dir)
        samples, rate = probe_audio(ref, base_dir)
        return target_samples(samples, rate, self.sampling_rate)

    # ------------------------------------------------------------ records

    def prepare(self, records: list[dict], *, data_path: str) -> list[dict]:
        """Check every record's media (existence and header, nothing decoded) and write the
        expanded placeholders into its prompt text. Relative paths are resolved against the
        dataset file's folder and stored absolute. Raises one `DataError` listing unreadable
        media with their row numbers."""
        base_dir = _base_dir(data_path)
        problems: list[str] = []
        prepared = []
        for index, record in enumerate(records):
            try:
                prepared.append(self._prepare_record(record, base_dir))
            except MediaUnreadable as reason:
                problems.append(f"{row_label(record, index)}: {reason}")
        if problems:
            shown = "\n  ".join(problems[:5]) + ("\n  ..." if len(problems) > 5 else "")
            where = f" (relative paths are read from {base_dir})" if base_dir else ""
            raise DataError(
                f"{len(problems)} row(s) of {data_path} have missing or unreadable media{where} "
                f"(numbered from 1 as in the file):\n  {shown}\nFix or remove those rows."
            )
        return prepared

    def _prepare_record(self, record: dict, base_dir: Path | None) -> dict:
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
            seq = row.get("input_ids", row.get("prompt_ids", []))
            if sum(1 for t in seq if t in ids) == row.get("media_tokens", 0):
                kept.append(row)
            else:
                # Encoded rows do not carry their record's source label.
                report.drop(
                    "truncation cut into media placeholder tokens", f"encoded row {index + 1}"
                )
        report.kept -= len(rows) - len(kept)
        return kept

    # ------------------------------------------------------------ batches

    def attach(self, batch: dict[str, Any], rows: list[dict], *, copies: int) -> dict[str, Any]:
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
            batch.update(self._features(modality, media))
        placeholder = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        for modality in self.modalities:
            placeholder |= batch["input_ids"] == self.token_id(modality)
        batch["labels"] = batch["labels"].masked_fill(placeholder, IGNORE_INDEX)
        return batch

    def _decode(self, modality: str, ref: Any) -> Any:
        try:
            if modality == "image":
                return load_image(ref, None)
            return load_audio(ref, None, self.sampling_rate)
        except MediaUnreadable as err:  # changed on disk since the data check
            raise DataError(f"{err} (it was readable when the run started)") from None

    def _dummy_size(self, modality: str) -> Any:
        if modality == "image":
            crop = getattr(self.processor.image_processor, "crop_size", None) or {}
            side = int(crop.get("height", 0) or 32)
            return (side, side)
        return self.sampling_rate  # one second

    def _add_dummy_row(self, batch: dict[str, Any], modality: str) -> None:
        text = self.placeholder(modality, self.token_count(modality, self._dummy_size(modality)))
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        rows, width = batch["input_ids"].shape
        batch.setdefault("real_rows", rows)
        new_width = max(width, len(ids))
        pad_id = self.tokenizer.pad_token_id
        fills = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE_INDEX}
        for key, fill in fills.items():
            grown = torch.full((rows + 1, new_width), fill, dtype=batch[key].dtype)
            grown[:rows, :width] = batch[key]
            batch[key] = grown
        batch["input_ids"][rows, : len(ids)] = torch.tensor(ids)
        batch["attention_mask"][rows, : len(ids)] = 1

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


def media_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The media inputs of a batch, to pass to the model's forward beside the text."""
    return {k: batch[k] for k in MEDIA_MODEL_INPUTS if k in batch}


def has_media(records: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any record carries media."""
    return any(as_list(r.get(key)) for r in records for key in MEDIA_KEYS)


def _base_dir(data_path: str) -> Path | None:
    path = Path(data_path).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.is_file():
        return path.resolve().parent
    return None


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


# --------------------------------------------------------------------------- built-in tiny models


def _text_config_kwargs(tokenizer: Any) -> dict[str, Any]:
    return dict(
        vocab_size=len(tokenizer), hidden_size=TEXT_SIZE, intermediate_size=2 * TEXT_SIZE,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip


def build_tiny_llava(target: Path, tokenizer: Any) -> None:
    """A LLaVA-architecture model: 2-layer CLIP vision tower (16x16 images, 4x4 patches: 16
    image tokens), MLP projector, 2-layer Llama; SmolLM2's tokenizer plus `<image>`."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tokenizer.add_tokens(["<image>"], special_tokens=True)
    image_processor = LlavaImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=4,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=16, patch_size=4, projection_dim=32,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision, text_config=LlamaConfig(**_text_config_kwargs(tokenizer)),
        image_token_id=processor.image_token_id, vision_feature_select_strategy="default",
        vision_feature_layer=-1, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(target, safe_serialization=True)
    processor.save_pretrained(target)


def build_tiny_qwen2_audio(target: Path, tokenizer: Any) -> None:
    """A Qwen2-Audio-architecture model: 2-layer Whisper-style encoder on 16 mel bins over 2 s
    windows (a 1 s clip: 25 audio tokens), linear projector, 2-layer Qwen2; SmolLM2's tokenizer
    plus the audio tokens; a Whisper feature extractor at 16 kHz."""
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioEncoderConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        Qwen2Config,
        WhisperFeatureExtractor,
    )

    tokenizer.add_tokens(["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"], special_tokens=True)
    extractor = WhisperFeatureExtractor(
        feature_size=16, sampling_rate=16000, hop_length=160, chunk_length=2, n_fft=400
    )
    processor = Qwen2AudioProcessor(
        feature_extractor=extractor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )
    audio = Qwen2AudioEncoderConfig(
        num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
        d_model=32, max_source_positions=100,
    )  # fmt: skip
    config = Qwen2AudioConfig(
        audio_config=audio, text_config=Qwen2Config(**_text_config_kwargs(tokenizer)),
        audio_token_id=processor.audio_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2AudioForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(target, safe_serialization=True)
    processor.save_pretrained(target)


_register_builtin_reward_classes()
