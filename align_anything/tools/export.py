"""Export an align_anything checkpoint to a plain Hugging Face folder.

    python -m align_anything export outputs/sft/checkpoints/step-200 --out exported/
    python -m align_anything export outputs/sft/final --out merged/     # a LoRA adapter folder

Works for checkpoints of any ZeRO stage and world size, on one CPU process: the partitions are
merged by DeepSpeed's own `zero_to_fp32`, the architecture and tokenizer come from the run's
`model.name_or_path` (recorded in the checkpoint's run_config.json), and the result is written
as safetensors with the tokenizer, loadable by `from_pretrained`. LoRA runs (a checkpoint, or the
adapter folder `final/`) are merged into the base weights, giving a plain model folder. A
text-to-image run's export is a whole diffusers pipeline folder (the trained denoiser, the base
pipeline's frozen parts) that `DiffusionPipeline.from_pretrained` loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from align_anything.config import DIFFUSION_TASKS
from align_anything.errors import ConfigError, UserError, report


def check_target(out: Path, *, overwrite: bool) -> None:
    """Refuse, before any work, an --out that is a file or a non-empty folder; with
    `overwrite`, a non-empty folder only when an earlier export made it."""
    from align_anything.families.language.lora import EXPORT_RECORD

    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder: choose a folder path")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    shown = ", ".join(held[:5]) + (", …" if len(held) > 5 else "")
    if not overwrite:
        raise ConfigError(
            f"--out {out} is not empty (it holds {shown}); nothing was written. Choose a new "
            "folder, or add --overwrite to replace an earlier export there."
        )
    if not (out / EXPORT_RECORD).is_file():
        raise ConfigError(
            f"--out {out} holds {shown} but is not a folder this command exported (no "
            f"{EXPORT_RECORD}): --overwrite replaces only an earlier export. Choose another --out."
        )


def export_checkpoint(checkpoint: str, out: str, *, overwrite: bool = False) -> Path:
    """Write the HF folder for `checkpoint` to `out` (atomically: temporary folder, then rename;
    an existing `out` only when empty, or an earlier export and `overwrite`)."""
    import torch

    from align_anything.backend.universal import checkpoint_state_dict
    from align_anything.families.language import lora
    from align_anything.families.language.loading import empty_model, load_text_side
    from align_anything.families.zoo import resolve_model_path
    from align_anything.training import checkpoints

    folder = Path(checkpoint)
    target = Path(out)
    check_target(target, overwrite=overwrite)
    if target.resolve() == folder.resolve() or folder.resolve() in target.resolve().parents:
        raise ConfigError(
            f"--out {out} is inside the checkpoint {checkpoint}: choose a folder outside it"
        )
    if (folder / "deepspeed").is_dir():
        problem = checkpoints.verify(folder)
        if problem is not None:
            raise ConfigError(f"{checkpoint} is not a complete checkpoint: {problem}")
    record = {"exported_from": str(folder.resolve()), "tool": "python -m align_anything export"}
    config_file = folder / "run_config.json"
    if not config_file.exists():
        raise ConfigError(
            f"{checkpoint}: no run_config.json; expected an align_anything checkpoint "
            "(output_dir/checkpoints/step-N) or the final/ folder of a LoRA run"
        )
    run = json.loads(config_file.read_text())
    if run["task"] in DIFFUSION_TASKS:
        return export_pipeline(folder, run, target, record=record)
    model_path = resolve_model_path(run["model"]["name_or_path"])
    if lora.is_adapter_folder(folder):
        return lora.merge_adapter_folder(
            folder, model_path, target, task=run["task"], export_record=record
        )
    trust = bool(run["model"].get("trust_remote_code", False))
    # An image-text or audio-text model's folder needs its processor (image processor or
    # feature extractor, chat template), not only the tokenizer: AutoProcessor loads it.
    config, tokenizer, processor = load_text_side(model_path, trust_remote_code=trust)
    model = empty_model(config, reward=run["task"] == "rm", dtype=torch.float32)
    adapters = run["model"].get("lora", {})
    if adapters.get("enabled"):
        model = lora.add_adapters(
            model,
            r=adapters["r"],
            alpha=adapters["alpha"],
            dropout=adapters["dropout"],
            target_modules=adapters["target_modules"],
            sequence_classification=run["task"] == "rm",
        )
    state = checkpoint_state_dict(folder)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k.removeprefix("base_model.model.") not in tied]
    if missing or unexpected:
        raise ConfigError(
            f"{checkpoint}: weights do not match {run['model']['name_or_path']}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if adapters.get("enabled"):
        model = model.merge_and_unload()
    return lora.write_hf_folder(model, processor or tokenizer, target, export_record=record)


def export_pipeline(folder: Path, run: dict, target: Path, *, record: dict) -> Path:
    """A text-to-image run's export: a whole diffusers pipeline folder (`DiffusionPipeline.
    from_pretrained` loads it) from a checkpoint of any ZeRO stage (the denoiser's gathered
    weights, a LoRA adapter merged) or from a LoRA run's `final/` adapter (merged through
    diffusers' own `load_lora_weights` and `fuse_lora`); the frozen parts are the base
    pipeline's, in fp32."""
    import torch

    from align_anything import atomic
    from align_anything.backend.universal import checkpoint_state_dict
    from align_anything.families import diffusion
    from align_anything.families.language.lora import EXPORT_RECORD

    info = diffusion.inspect_pipeline(run["model"]["name_or_path"])
    extra = {EXPORT_RECORD: record}
    if (folder / diffusion.LORA_WEIGHTS).is_file():  # final/ of a LoRA run
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(str(info.path), torch_dtype=torch.float32)
        pipe.load_lora_weights(str(folder))
        pipe.fuse_lora()
        pipe.unload_lora_weights()
        with atomic.folder(target) as tmp:
            pipe.save_pretrained(tmp, safe_serialization=True)
            (tmp / EXPORT_RECORD).write_text(atomic.to_json(record))
        return target
    lora = run["model"].get("lora", {})
    adapters = (
        {key: lora[key] for key in ("r", "alpha", "dropout", "target_modules")}
        if lora.get("enabled") else None
    )  # fmt: skip
    try:
        denoiser = diffusion.denoiser_from_state_dict(
            info, checkpoint_state_dict(folder), adapters=adapters
        )
    except RuntimeError as err:  # load_state_dict: missing / unexpected keys
        raise ConfigError(
            f"{folder}: its weights do not match {run['model']['name_or_path']}'s denoiser "
            f"({str(err).splitlines()[0][:300]})"
        ) from None
    parts = diffusion.load_frozen_parts(info, dtype=torch.float32)
    return diffusion.save_pipeline(parts, denoiser, target, configs=extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m align_anything export", description=__doc__.split("\n")[0]
    )
    parser.add_argument("checkpoint", help="a checkpoint folder (output_dir/checkpoints/step-N)")
    parser.add_argument(
        "--out", required=True, help="the Hugging Face folder to write (new, or empty)"
    )
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace --out when it holds an earlier export (never any other folder)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        target = export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
    except UserError as err:
        return report(err)
    print(f"exported {args.checkpoint} -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
