"""Loss agreement with TRL 1.16 for every DPO loss type added for TRL parity, and their mixes.

    python benchmarks/dpo_loss_types_vs_trl.py                      # every case, tiny-random-llama
    python benchmarks/dpo_loss_types_vs_trl.py --cases aot,mpo --model smollm2-135m-instruct

For each case align_anything (its real entry point, ZeRO-0, precomputed reference) and TRL's
DPOTrainer (gradient checkpointing off, torch's fused AdamW) train the same model on the same
pairs in the same order (the rows and order of dpo_vs_trl.py), with the same β, batch, AdamW
settings and learning rate, for `--steps` optimizer steps; the table shows each side's logged
loss at step 1 and step 2 and their differences. At step 1 the policy is the reference, every
log-ratio is 0 and most types' loss is a constant of the formula (ln 2, 1, 2·ln 2, 50, …); the
step-2 loss, after one AdamW update on each side, is where the two implementations' gradients
and their losses at non-zero log-ratios meet. Cases with `sft` also depend on the NLL: TRL
averages it over all chosen tokens of the batch, align_anything per pair (then over pairs), so
they agree only on rows whose chosen completions have one length (the `… equal-length` cases).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from common import child_env, child_inputs, preference_rows, run_ours, run_trl
from dpo_vs_trl import build_setup

# name -> TRL's DPOConfig settings (align_anything's `dpo.*` keys of the same names).
CASES: dict[str, dict[str, Any]] = {
    "apo_zero": {"loss_type": ["apo_zero"]},
    "apo_down": {"loss_type": ["apo_down"]},
    "bco_pair": {"loss_type": ["bco_pair"]},
    "exo_pair": {"loss_type": ["exo_pair"], "label_smoothing": 1e-3},  # EXO's suggested ε
    "nca_pair": {"loss_type": ["nca_pair"]},
    "sppo_hard": {"loss_type": ["sppo_hard"]},
    "aot": {"loss_type": ["aot"]},
    "aot_unpaired": {"loss_type": ["aot_unpaired"]},
    "discopop": {"loss_type": ["discopop"]},
    "sigmoid_norm": {"loss_type": ["sigmoid_norm"]},
    "sigmoid+sft": {"loss_type": ["sigmoid", "sft"]},
    "mpo": {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
    "sigmoid+sft equal-length": {"loss_type": ["sigmoid", "sft"]},
    "mpo equal-length": {
        "loss_type": ["sigmoid", "bco_pair", "sft"],
        "loss_weights": [0.8, 0.2, 1.0],
    },
}


def ours_overrides(case: dict[str, Any]) -> list[str]:
    """align_anything's overrides for a case (rpo_alpha is 0 in every benchmark run)."""
    overrides = [f"dpo.loss_type=[{','.join(case['loss_type'])}]"]
    if case.get("loss_weights"):
        overrides.append(f"dpo.loss_weights=[{','.join(map(str, case['loss_weights']))}]")
    if case.get("label_smoothing"):
        overrides.append(f"dpo.label_smoothing={case['label_smoothing']}")
    return overrides


def equal_chosen_length_rows(count: int, *, model: str, max_length: int) -> list[dict]:
    """The first `count` arith-pref pairs whose chosen completion has the most common token
    length (align_anything's encoding), so that per-pair and per-batch token means agree."""
    from align_anything.families.language.encode import encode_preference
    from align_anything.families.language.loading import load_tokenizer
    from align_anything.families.zoo import resolve_model_path

    rows = preference_rows("arith-pref", 96)
    tokenizer = load_tokenizer(resolve_model_path(model))
    encoded, _ = encode_preference(rows, tokenizer, max_length=max_length)
    lengths = [len(e["chosen_ids"]) for e in encoded]
    common_length, available = Counter(lengths).most_common(1)[0]
    if available < count:
        raise SystemExit(f"only {available} pairs share a chosen length; {count} needed")
    return [row for row, n in zip(rows, lengths, strict=True) if n == common_length][:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random-llama", help="a built-in model name")
    parser.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=8, help="pairs per optimizer step")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per run")
    args = parser.parse_args()
    names = [n.strip() for n in args.cases.split(",")] if args.cases else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {list(CASES)}")

    shape = dict(steps=args.steps, batch=args.batch, max_length=args.max_length,
                 learning_rate=args.learning_rate, model=args.model)  # fmt: skip
    equal_rows = None
    if any(n.endswith("equal-length") for n in names):
        equal_rows = equal_chosen_length_rows(
            args.steps * args.batch, model=args.model, max_length=args.max_length
        )
    workdir = Path(tempfile.mkdtemp(prefix="aa-bench-dpo-losses-"))
    env = child_env(args.threads)
    print(f"work folder {workdir}; model {args.model}; {len(names)} cases", flush=True)
    lines = [
        "| case | ours step 1 | TRL step 1 | \\|diff\\| | ours step 2 | TRL step 2 | \\|diff\\| |",
        "|---|---|---|---|---|---|---|",
    ]
    worst: dict[str, float] = {}
    for name in names:
        case = CASES[name]
        rows = equal_rows if name.endswith("equal-length") else None
        setup = build_setup(**shape, rows=rows)
        folder = workdir / name.replace(" ", "-").replace("+", "-")
        folder.mkdir()
        overrides, spec = child_inputs(setup, folder)
        # The case's loss keys replace the DPO setup's (the trainer refuses a key given twice).
        own = ours_overrides(case)
        keys = {o.split("=", 1)[0] for o in own}
        shared = [o for o in overrides if o.split("=", 1)[0] not in keys]
        ours = run_ours("ours", shared + own, workdir=folder, env=env)
        trl = run_trl(
            "TRL", {**spec, **case, "gradient_checkpointing": False, "optim": "adamw_torch_fused"},
            workdir=folder, env=env,
        )  # fmt: skip
        if trl.extra["token_lengths"] != setup.token_lengths:
            raise SystemExit(f"{name}: the trainers tokenised the rows to different lengths")
        figures = []
        for ours_step, trl_step in ((ours.first_step, trl.first_step),
                                    (ours.second_step, trl.second_step)):  # fmt: skip
            a, b = ours_step.get("loss", float("nan")), trl_step.get("loss", float("nan"))
            figures += [f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.1e}"]
            worst[name] = max(worst.get(name, 0.0), abs(a - b))
        line = f"| {name} | " + " | ".join(figures) + " |"
        lines.append(line)
        print(line, flush=True)
    print()
    print(f"load average at the end: {os.getloadavg()}")
    print(f"model {args.model}, {args.steps} steps × {args.batch} pairs, lr {args.learning_rate}")
    print("\n".join(lines))
    agree = [n for n, w in worst.items() if w <= 1e-4]
    print(f"\nwithin 1e-4 at every step: {len(agree)} of {len(worst)} cases")
    for name, value in worst.items():
        if value > 1e-4:
            print(f"  - {name}: largest difference {value:.1e}")


if __name__ == "__main__":
    sys.exit(main())
