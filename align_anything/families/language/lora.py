"""LoRA adapters through PEFT, under every ZeRO stage.

PEFT does the modelling (adapter layers, saving, merging); this module adds what a DeepSpeed
run needs around it:

- the default targets: every linear layer of the *language model* except its output head
  (PEFT's `"all-linear"` would also adapt a vision or audio encoder), as one regular expression;
- adapters are added after the base model is built (under ZeRO-3 the base is already
  partitioned; DeepSpeed partitions the new adapter parameters when the engine is created);
- saving gathers the adapter weights first (PEFT's own `save_pretrained` on a ZeRO-3 model would
  write the empty local partitions), so the saved adapter has the trained numbers;
- the DPO reference is the policy with adapters disabled (no second model in memory);
- merging an adapter into a plain Hugging Face folder (`python -m align_anything export`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from align_anything import atomic
from align_anything.errors import ConfigError, did_you_mean

# Module-name parts that belong to a multimodal model's encoders or projector, which the default
# targets leave alone (the issue of LoRA on a VLM is the language model).
NON_LANGUAGE_PARTS = ("vision", "visual", "audio", "projector", "image_newline")
# Output heads: the vocabulary projection and the reward model's score head.
HEAD_NAMES = ("lm_head", "score", "classifier")


def default_target_regex(model: torch.nn.Module) -> str:
    """A regex (PEFT full-matches it against module names) for every `nn.Linear` of the
    language model, excluding output heads and multimodal encoder/projector parts."""
    suffixes: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        parts = name.split(".")
        if parts[-1] in HEAD_NAMES or any(p in name for p in NON_LANGUAGE_PARTS):
            continue
        suffixes.add(parts[-1])
    if not suffixes:
        raise ConfigError(
            "model.lora.enabled=true but the model has no linear layers to adapt; set "
            "model.lora.target_modules to the module names to adapt"
        )
    excluded = "|".join(NON_LANGUAGE_PARTS)
    return rf"^(?!.*({excluded})).*\.({'|'.join(sorted(suffixes))})$"


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Every name in `targets` must name a module of `model` the way PEFT matches a list (the
    full module name, or its last dotted parts); PEFT itself accepts names that match no module
    as long as one name does. The error lists the names the model has."""
    names = [name for name, _ in model.named_modules() if name]
    missing = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in names)]
    if not missing:
        return
    linear = sorted(
        {name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )
    hint = did_you_mean(missing[0], [*linear, "all-linear"])
    example = [n for n in ("q_proj", "v_proj") if n in linear] or [
        n for n in linear if n not in HEAD_NAMES
    ][:2]
    verb = "names no module" if len(missing) == 1 else "name no modules"
    raise ConfigError(
        f"model.lora.target_modules: {', '.join(repr(t) for t in missing)} {verb} of "
        f"{type(model).__name__}{hint}. Its linear layers are named: {', '.join(linear)}; e.g. "
        f"model.lora.target_modules=[{','.join(example)}], or all-linear for every linear "
        "layer of the language model"
    )


def add_adapters(
    model: torch.nn.Module,
    *,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: list[str] | str,
    sequence_classification: bool,
) -> Any:
    """Wrap `model` in a PEFT LoRA model; the base weights are frozen. For a reward model
    (`sequence_classification`) the score head is trained fully (PEFT's modules_to_save)."""
    from peft import LoraConfig, TaskType, get_peft_model

    if target_modules in ("all-linear", "default"):  # a language model's default: all-linear
        targets: list[str] | str = default_target_regex(model)
    else:
        targets = list(target_modules)
        check_targets(model, targets)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        task_type=TaskType.SEQ_CLS if sequence_classification else TaskType.CAUSAL_LM,
    )
    try:
        return get_peft_model(model, config)
    except ValueError as err:  # e.g. target modules not found
        raise ConfigError(
            f"model.lora.target_modules={target_modules!r}: {str(err).splitlines()[0]}"
        ) from None


def is_peft_model(module: Any) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "disable_adapter")


def adapter_summary(module: Any) -> str:
    """One line for the start-up summary: rank, alpha and which modules carry adapters."""
    config = module.peft_config["default"]
    adapted = sorted(
        {name.split(".")[-1] for name, sub in module.named_modules() if hasattr(sub, "lora_A")}
    )
    count = sum(1 for _, sub in module.named_modules() if hasattr(sub, "lora_A"))
    saved = sorted(config.modules_to_save or [])
    return (
        f"LoRA r={config.r} alpha={config.lora_alpha} dropout={config.lora_dropout} on "
        f"{count} modules ({', '.join(adapted)})"
        + (f"; trained fully: {', '.join(saved)}" if saved else "")
    )


class AdapterDisabledReference:
    """The DPO reference of a LoRA run: the policy engine itself, in eval mode, with adapters
    disabled. Called like a model; no second copy of the weights exists."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @torch.no_grad()
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        was_training = self.engine.module.training
        self.engine.eval()
        try:
            with self.engine.module.disable_adapter():  # PEFT: the base model's behaviour
                return self.engine(*args, **kwargs)
        finally:
            if was_training:
                self.engine.train()

    def release(self) -> None:
        """Nothing to free: the weights are the policy's."""


def save_adapter(module: Any, state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    """Write the adapter (adapter_config.json + adapter_model.safetensors) from a *full*
    gathered state dict of the PEFT model, so ZeRO-3 partitions never reach the file."""
    module.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)


def load_adapter_model(adapter_dir: Path, base_path: str, *, task: str) -> tuple[Any, Any]:
    """(the base model on CPU in fp32 with the adapter from `adapter_dir` applied, the run's
    tokenizer). For a reward model (`task` "rm") the config's pad id is the tokenizer's, where
    the score is read."""
    from peft import PeftModel

    from align_anything.families.language.loading import load_model, load_tokenizer

    base = load_model(base_path, reward=task == "rm", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    if (Path(adapter_dir) / "tokenizer_config.json").exists():  # the run's tokenizer (RM: its pad)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    else:
        tokenizer = load_tokenizer(base_path)
    if task == "rm":
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def merge_adapter_folder(
    adapter_dir: Path, base_path: str, out: Path, *, task: str, export_record: dict | None = None
) -> Path:
    """Load the base model on CPU in fp32, apply the adapter from `adapter_dir`, merge it into
    the weights and write a plain Hugging Face folder (safetensors) with the tokenizer
    (`export_record`: see `write_hf_folder`)."""
    from align_anything.families.language.loading import load_processor, modalities_of

    model, tokenizer = load_adapter_model(adapter_dir, base_path, task=task)
    merged = model.merge_and_unload()
    if task == "rm":
        merged.config.pad_token_id = tokenizer.pad_token_id
    if modalities_of(merged.config):
        # An image-text / audio-text folder needs the processor: the run's (final/ holds it
        # beside the adapter), else the base model's.
        saved = any((Path(adapter_dir) / name).exists() for name in PROCESSOR_FILES)
        tokenizer = load_processor(str(adapter_dir) if saved else base_path)
    return write_hf_folder(merged, tokenizer, out, export_record=export_record)


# Written into every folder `python -m align_anything export` makes: only such a folder may be
# replaced by a later export (--overwrite).
EXPORT_RECORD = "align_anything_export.json"


# What a saved processor writes beside the tokenizer (transformers 5).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def write_hf_folder(
    model: Any, tokenizer: Any, out: Path, *, export_record: dict | None = None
) -> Path:
    """`save_pretrained` model + tokenizer (or a multimodal model's processor) into `out`,
    atomically (align_anything/atomic.py); with `export_record`, also EXPORT_RECORD holding
    it."""
    out = Path(out)
    with atomic.folder(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if export_record is not None:
            (tmp / EXPORT_RECORD).write_text(json.dumps(export_record, indent=2) + "\n")
    return out


def is_adapter_folder(path: Path) -> bool:
    return (Path(path) / "adapter_config.json").exists()
