"""Export an align_anything checkpoint to a plain Hugging Face folder.

    python -m align_anything.export outputs/sft/checkpoints/step-200 --out exported/

Works for checkpoints of any ZeRO stage and world size, on one CPU process: the partitions are
merged by DeepSpeed's own `zero_to_fp32`, the architecture and tokenizer come from the run's
`model.name_or_path` (recorded in the checkpoint's run_config.json), and the result is written
as safetensors with the tokenizer, loadable by `from_pretrained`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from align_anything.errors import ConfigError, UserError


def export_checkpoint(checkpoint: str, out: str) -> Path:
    """Write the HF folder for `checkpoint` to `out` (atomically: temporary folder, then rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from align_anything import models
    from align_anything.engine import checkpoint_state_dict

    folder = Path(checkpoint)
    config_file = folder / "run_config.json"
    if not config_file.exists():
        raise ConfigError(
            f"{checkpoint}: no run_config.json; expected an align_anything checkpoint "
            "(output_dir/checkpoints/step-N)"
        )
    run = json.loads(config_file.read_text())
    model_path = models.resolve_model_path(run["model"]["name_or_path"])
    trust = bool(run["model"].get("trust_remote_code", False))
    config = models.load_config(model_path, trust_remote_code=trust)
    tokenizer = models.load_tokenizer(model_path, trust_remote_code=trust)
    if run["task"] == "rm":
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = checkpoint_state_dict(folder)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ConfigError(
            f"{checkpoint}: weights do not match {run['model']['name_or_path']}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    target = Path(out)
    tmp = target.with_name(f".tmp-{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m align_anything.export", description=__doc__.split("\n")[0]
    )
    parser.add_argument("checkpoint", help="a checkpoint folder (output_dir/checkpoints/step-N)")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    args = parser.parse_args(argv)
    try:
        target = export_checkpoint(args.checkpoint, args.out)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
