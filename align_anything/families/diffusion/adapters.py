"""LoRA on a denoiser, through PEFT as diffusers integrates it (`ModelMixin.add_adapter`).

The denoiser stays a diffusers model (not a PEFT wrapper), so the kind's pipeline samples with
it as it is, and the adapter saves in exactly the layout diffusers' `load_lora_weights` reads
(the pipeline class's `save_lora_weights`, with the adapter's config as metadata so a rank and
alpha that differ load back with the right scale). As for language models (`models.lora`):
adapters are added after the base is built (under ZeRO-3 it is already partitioned; DeepSpeed
partitions the new adapter parameters when the engine wraps the model), the adapter is saved
from a gathered full state dict (never ZeRO-3's empty partitions), and the DPO reference is the
same denoiser with its adapters disabled (`adapters_disabled`), not a second copy.

A denoiser without diffusers' PEFT integration (`UNet3DConditionModel`, whose pipeline diffusers
has deprecated) gets the very same LoRA layers from PEFT's `inject_adapter_in_model`, and is
switched, merged and saved through those layers (`_tuner_layers`) in place of the mixin's
methods; its adapter file has the same layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from align_anything import atomic
from align_anything.errors import ConfigError, did_you_mean

# The attention projections of a UNet's transformer blocks (diffusers' LoRA training scripts'
# targets for SD and SDXL).
UNET_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
# An MMDiT's (SD3, Flux) attention: the image stream's projections and the text stream's added
# ones (diffusers' SD3 LoRA script's default targets; Flux's single blocks have no to_out or
# added projections, so there only to_q / to_k / to_v match).
TRANSFORMER_TARGETS = (*UNET_TARGETS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


# The file diffusers' `save_lora_weights` writes and `load_lora_weights` reads.
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


# Wan's attention blocks: self attention (attn1) and cross attention to the text (attn2), each
# to_q, to_k, to_v and to_out.0 (diffusers' Wan LoRA training targets).
WAN_TARGETS = UNET_TARGETS


def default_denoiser_targets(kind: str) -> list[str]:
    """The modules LoRA adapts by default in a denoiser of `kind`."""
    from align_anything.families.diffusion.kinds import UNET_KINDS

    if kind == "wan":
        return list(WAN_TARGETS)
    return list(UNET_TARGETS if kind in UNET_KINDS else TRANSFORMER_TARGETS)


def _short_name(name: str) -> str:
    """A module's name as PEFT targets match it: its last part, or the last two where the
    last is an index (`to_out.0`)."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def _check_targets(denoiser: torch.nn.Module, targets: list[str], kind: str) -> None:
    """Every target must name a module the way PEFT matches it (the full name or its last
    dotted parts); PEFT itself accepts names that match nothing as long as one name matches."""
    names = [name for name, _ in denoiser.named_modules() if name]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if not missing:
        return
    linear = sorted(
        {_short_name(n) for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)}
    )
    verb = "names no module" if len(missing) == 1 else "name no modules"
    raise ConfigError(
        f"model.lora.target_modules: {', '.join(repr(t) for t in missing)} {verb} of "
        f"{type(denoiser).__name__}{did_you_mean(missing[0], linear)}. Its linear layers are "
        f"named: {', '.join(linear)}; the default for {kind} is "
        f"[{','.join(default_denoiser_targets(kind))}] (model.lora.target_modules=default)"
    )


def add_denoiser_adapters(
    denoiser: torch.nn.Module, *, kind: str, r: int, alpha: float, dropout: float,
    target_modules: list[str] | str = "default",
) -> torch.nn.Module:  # fmt: skip
    """Add a LoRA adapter ("default") to `denoiser` in place and freeze its base weights;
    returns it. `target_modules`: "default" (`default_denoiser_targets`) or module names as PEFT
    matches them (a full name or its last dotted parts); a name that matches no module is a
    `ConfigError` listing the names the denoiser has. The adapter's B matrices start at zero,
    so the adapted denoiser starts equal to the base."""
    from peft import LoraConfig

    targets = default_denoiser_targets(kind) if target_modules == "default" else target_modules
    if isinstance(targets, str):
        raise ConfigError(
            f"model.lora.target_modules={targets!r}: a denoiser takes 'default' or a list of "
            f"module names, e.g. [{','.join(default_denoiser_targets(kind))}]"
        )
    _check_targets(denoiser, list(targets), kind)
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
        init_lora_weights=True,
    )  # fmt: skip
    denoiser.requires_grad_(False)
    if hasattr(denoiser, "add_adapter"):
        denoiser.add_adapter(config)  # PEFT marks only the adapter parameters trainable
        return denoiser
    from peft import inject_adapter_in_model

    inject_adapter_in_model(config, denoiser, adapter_name="default")
    denoiser.peft_config = {"default": config}
    denoiser._hf_peft_config_loaded = True  # what diffusers' mixin sets: `has_adapters`
    return denoiser


def has_adapters(denoiser: torch.nn.Module) -> bool:
    return bool(getattr(denoiser, "_hf_peft_config_loaded", False))


def _tuner_layers(denoiser: torch.nn.Module) -> list[tuple[str, Any]]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(n, m) for n, m in denoiser.named_modules() if isinstance(m, BaseTunerLayer)]


def _switch_adapters(denoiser: torch.nn.Module, enabled: bool) -> None:
    if hasattr(denoiser, "enable_adapters"):
        denoiser.enable_adapters() if enabled else denoiser.disable_adapters()
        return
    for _, layer in _tuner_layers(denoiser):
        layer.enable_adapters(enabled)


@contextlib.contextmanager
def adapters_disabled(denoiser: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The base denoiser's behaviour inside the block (the Diffusion-DPO reference of a LoRA
    run): adapters off, back on afterwards, also when the block raises."""
    _switch_adapters(denoiser, False)
    try:
        yield denoiser
    finally:
        _switch_adapters(denoiser, True)


def adapter_state(denoiser: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict:
    """The adapter's weights out of a full (gathered) state dict of the adapted denoiser, keyed
    as PEFT saves them (adapter name removed)."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(denoiser, state_dict=state_dict)


def save_denoiser_adapter(
    denoiser: torch.nn.Module, state_dict: dict[str, torch.Tensor], directory: Path, *,
    kind: str, denoiser_part: str, configs: dict[str, Any] | None = None,
) -> Path:  # fmt: skip
    """Write the adapter of `denoiser` from a full gathered `state_dict` (ZeRO-3: the engine's
    consolidated one) into `directory` (atomically) as the kind's pipeline class writes it:
    `pytorch_lora_weights.safetensors`, which `pipeline.load_lora_weights(directory)` loads,
    with `configs` (file name -> JSON data) beside it. An adapter without weights (an empty
    ZeRO-3 partition) is refused rather than saved."""
    import diffusers

    from align_anything.families.diffusion.kinds import PIPELINE_CLASSES

    layers = adapter_state(denoiser, state_dict)
    empty = [k for k, v in layers.items() if v.numel() == 0]
    if not layers or empty:
        raise RuntimeError(
            "the adapter to save has no weights"
            + (f" ({len(empty)} empty tensors, e.g. {empty[0]})" if empty else "")
            + ": pass the gathered full state dict (ZeRO-3 partitions are empty)"
        )
    from align_anything.families.diffusion.kinds import UNET_KINDS

    if kind in UNET_KINDS:
        from diffusers.utils import convert_state_dict_to_diffusers

        layers = convert_state_dict_to_diffusers(layers)  # as diffusers' UNet LoRA scripts do
    cls = getattr(diffusers, PIPELINE_CLASSES[kind])
    if not hasattr(cls, "save_lora_weights"):  # AudioLDMPipeline: no LoRA mixin; SD's layout
        cls = diffusers.StableDiffusionPipeline  # of a UNet's adapter (`final-merged/` beside)
    config = denoiser.peft_config["default"].to_dict()
    with atomic.folder(Path(directory)) as tmp:
        cls.save_lora_weights(
            tmp, safe_serialization=True, **{f"{denoiser_part}_lora_layers": layers},
            **{f"{denoiser_part}_lora_adapter_metadata": config},
        )  # fmt: skip
        for name, data in (configs or {}).items():
            (tmp / name).write_text(atomic.to_json(data))
    return Path(directory)


def merge_adapters(denoiser: torch.nn.Module) -> torch.nn.Module:
    """Fold the adapter into the base weights and remove the adapter layers (for a plain
    diffusers folder: `final/`); in place, so call it on a copy that no longer trains."""
    if not has_adapters(denoiser):
        return denoiser
    if hasattr(denoiser, "fuse_lora"):
        denoiser.fuse_lora(lora_scale=1.0)
        denoiser.unload_lora()
        return denoiser
    for name, layer in _tuner_layers(denoiser):  # no diffusers mixin: PEFT's layers directly
        layer.merge()
        parent, _, child = name.rpartition(".")
        setattr(denoiser.get_submodule(parent) if parent else denoiser, child,
                layer.get_base_layer())  # fmt: skip
    del denoiser.peft_config
    denoiser._hf_peft_config_loaded = False
    return denoiser


def adapter_summary(denoiser: torch.nn.Module) -> str:
    """One line for the start-up summary: rank, alpha and the adapted module names."""
    config: Any = denoiser.peft_config["default"]
    count = sum(1 for _, m in denoiser.named_modules() if hasattr(m, "lora_A"))
    return (
        f"LoRA r={config.r} alpha={config.lora_alpha} dropout={config.lora_dropout} on "
        f"{count} modules ({', '.join(sorted(config.target_modules))})"
    )
