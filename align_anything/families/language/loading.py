"""Loading a model, its tokenizer or processor, and the one choice of model class for a task.

`model_class` is the only place that decides which class a run's model is: a causal LM
(`AutoModelForCausalLM`), an image-text or audio-text generation model
(`AutoModelForMultimodalLM`), or a reward model (`AutoModelForSequenceClassification` with one
output, or for a multimodal model the family's base model plus a score head, see
`reward_head`). `load_model` loads weights into it (inside `backend.zero_init.model_init_context`
ZeRO-3 loads them partitioned); `empty_model` builds it from a config (on the meta device for
the planner, on CPU for export).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from align_anything.errors import ConfigError, ModelError, did_you_mean
from align_anything.families.zoo import BUILTIN_MODELS, resolve_model_path


def modalities_of(config: Any) -> tuple[str, ...]:
    """The media a model config takes: ("image",), ("audio",), both, or () for a text model."""
    found = []
    if getattr(config, "vision_config", None) is not None:
        found.append("image")
    if getattr(config, "audio_config", None) is not None:
        found.append("audio")
    return tuple(found)


def _not_found(name_or_path: str, err: Exception, key: str = "model.name_or_path") -> ModelError:
    first_line = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    if Path(name_or_path).expanduser().is_dir():
        config = _local_config(name_or_path) or {}
        model_type = config.get("model_type")
        if "does not recognize this architecture" in str(err) and model_type:
            import transformers

            return ModelError(
                f"{key}={name_or_path!r} is a local folder whose config.json has "
                f"model_type {model_type!r}, which transformers {transformers.__version__} does "
                "not know: upgrade transformers, or, where the folder ships the model's own "
                "Python code (named in config.json's auto_map), set model.trust_remote_code=true "
                "to run that code"
            )
        return ModelError(
            f"{key}={name_or_path!r} is a local folder that transformers could not "
            f"load ({first_line})"
        )
    hint = did_you_mean(name_or_path, BUILTIN_MODELS)
    return ModelError(
        f"{key}={name_or_path!r} could not be loaded: it is not a built-in name"
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


def refuse_pipeline(name_or_path: str, path: str, key: str = "model.name_or_path") -> None:
    """A `ModelError` for a diffusers text-to-image pipeline given to a language-model task
    (transformers would only say it finds no config.json), naming the config `key` that gave
    it: the policy's (`model.name_or_path`, which a diffusion task could train) or another
    model's (`ppo.critic_model`, `reward.model`), which must be a transformers folder."""
    if (Path(path) / "model_index.json").is_file() and not (Path(path) / "config.json").is_file():
        fix = (
            "train it with a diffusion task (task=diffusion_sft or task=diffusion_dpo), or give "
            "this task a transformers model folder"
            if key == "model.name_or_path"
            else f"{key} takes a transformers model folder (e.g. the final/ folder of a task=rm "
            "run)"
        )
        raise ModelError(
            f"{key}={name_or_path!r} is a diffusers text-to-image pipeline (model_index.json), "
            f"not a language model: {fix}"
        )


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer, with a pad token (EOS when the tokenizer has none)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    refuse_pipeline(name_or_path, path)
    refuse_remote_code(path, trust_remote_code=trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _not_found(name_or_path, err) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(
    name_or_path: str, *, trust_remote_code: bool = False, key: str = "model.name_or_path"
) -> Any:
    """The model's transformers config (cheap: no weights). `key`: the config key that named
    the model, for messages (`reward.model` for a reward model)."""
    from transformers import AutoConfig

    path = resolve_model_path(name_or_path, key=key)
    refuse_pipeline(name_or_path, path, key)
    refuse_remote_code(path, trust_remote_code=trust_remote_code)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _not_found(name_or_path, err, key) from None


def text_hidden_size(config: Any) -> int:
    """Hidden size of the language model (the text part of multimodal configs)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.hidden_size)


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


def model_class(config: Any, *, reward: bool) -> type:
    """The class of a run's model: reward model or generation model, text or multimodal."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForMultimodalLM,
        AutoModelForSequenceClassification,
    )

    multimodal = bool(modalities_of(config))
    if reward:
        if multimodal:
            from align_anything.families.language.reward_head import reward_model_class

            return reward_model_class(type(config))
        return AutoModelForSequenceClassification
    return AutoModelForMultimodalLM if multimodal else AutoModelForCausalLM


# model.attn_implementation -> the class flag transformers sets for a model that supports it.
_KERNEL_SUPPORT = {
    "sdpa": "_supports_sdpa",
    "flash_attention_2": "_supports_flash_attn",
    "flex_attention": "_supports_flex_attn",
}


def _concrete_class(config: Any, *, reward: bool) -> type | None:
    """The transformers class `model_class` resolves to for this config (None when the
    auto class does not know it, e.g. remote code: transformers then checks by itself)."""
    cls = model_class(config, reward=reward)
    mapping = getattr(cls, "_model_mapping", None)
    if mapping is None:
        return cls
    try:
        return mapping[type(config)]
    except KeyError:
        return None


def check_attention(
    requested: str, config: Any, *, reward: bool, device_type: str, precision: str
) -> str | None:
    """The `attn_implementation` to pass to `from_pretrained` for `model.attn_implementation`
    (None for `auto`: transformers picks sdpa where the model supports it, else eager), or a
    `ConfigError` before any weights load: a kernel that is not installed, that this device or
    precision cannot train with, or that the model class does not implement. Errors rather than
    falling back: a kernel named explicitly is a choice a silent substitute would undo."""
    if requested == "auto":
        return None
    key = f"model.attn_implementation={requested}"
    if requested == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError(
                f"{key} needs the flash-attn package, which is not installed: install it on a "
                "CUDA machine (pip install flash-attn --no-build-isolation), or use "
                "model.attn_implementation=sdpa"
            )
        if device_type != "cuda" or not is_flash_attn_2_available():
            raise ConfigError(
                f"{key} runs only on a CUDA GPU with a matching flash-attn build (this run is on "
                f"{device_type}); use model.attn_implementation=sdpa"
            )
        if precision == "fp32":
            raise ConfigError(
                f"{key} computes in bf16 or fp16 only, and train.precision=fp32: use "
                "train.precision=auto (bf16 or fp16 on a GPU) or model.attn_implementation=sdpa"
            )
    if requested == "flex_attention":
        from transformers.utils import is_torch_flex_attn_available

        if not is_torch_flex_attn_available():
            raise ConfigError(f"{key} needs torch >= 2.5 with flex attention; use sdpa")
        if device_type == "cpu":
            raise ConfigError(
                f"{key}: torch's FlexAttention has no backward pass on CPU, so it cannot train "
                "here; use model.attn_implementation=sdpa (or eager), or a GPU"
            )
    cls = _concrete_class(config, reward=reward)
    flag = _KERNEL_SUPPORT.get(requested)
    if cls is not None and flag is not None and not getattr(cls, flag, False):
        raise ConfigError(
            f"{key}: {cls.__name__} does not implement {requested} in this transformers "
            "version; use model.attn_implementation=auto"
        )
    return requested


def load_model(
    name_or_path: str, *, reward: bool, dtype: Any, trust_remote_code: bool = False,
    attn_implementation: str | None = None,
) -> Any:  # fmt: skip
    """The model of a built-in name, folder or hub name, weights loaded (a reward model gets a
    new one-output score head when the checkpoint has none), with the attention kernel
    `attn_implementation` (see `check_attention`; None: transformers' choice). Call inside
    `backend.zero_init.model_init_context` so ZeRO-3 loads partitioned weights."""
    from transformers.utils import logging as hf_logging

    path = resolve_model_path(name_or_path)
    config = load_config(path, trust_remote_code=trust_remote_code)
    cls = model_class(config, reward=reward)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if not (reward and modalities_of(config)):  # our own reward classes run no remote code
        kwargs["trust_remote_code"] = trust_remote_code
    if reward and not modalities_of(config):
        kwargs["num_labels"] = 1
    verbosity = hf_logging.get_verbosity()
    if reward:  # "score.weight newly initialized" / "lm_head unused" are expected
        hf_logging.set_verbosity_error()
    try:
        model = cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        raise _not_found(name_or_path, err) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return keep_architecture_frozen(model)


def empty_model(config: Any, *, reward: bool, dtype: Any = None) -> Any:
    """The run's model class built from `config` with fresh weights (call under
    `torch.device("meta")` for sizes only)."""
    cls = model_class(config, reward=reward)
    if reward and not modalities_of(config):
        config.num_labels = 1
    if hasattr(cls, "from_config"):
        return cls.from_config(config, dtype=dtype) if dtype else cls.from_config(config)
    return cls(config)


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


def enable_gradient_checkpointing(model: Any, name: str) -> None:
    """transformers' activation checkpointing, non-reentrant (works with frozen inputs, so with
    LoRA and frozen parts, and under ZeRO-3); a clear error for a model without support."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"speed.gradient_checkpointing=true: {type(model).__name__} ({name}) does not "
            "support gradient checkpointing in transformers; set "
            "speed.gradient_checkpointing=false (and lower train.per_device_batch_size or "
            "data.max_length if memory is short)"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_text_side(path: str, *, trust_remote_code: bool) -> tuple[Any, Any, Any]:
    """(config, tokenizer, processor) of a model folder: for an image-text or audio-text model
    the tokenizer is its processor's; for a text model the processor is None."""
    config = load_config(path, trust_remote_code=trust_remote_code)
    if modalities_of(config):
        processor = load_processor(path, trust_remote_code=trust_remote_code)
        return config, processor.tokenizer, processor
    return config, load_tokenizer(path, trust_remote_code=trust_remote_code), None
