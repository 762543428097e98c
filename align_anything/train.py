"""Entry point: `python -m align_anything.train task=dpo deepspeed=z3 key=value ...`.

Works as a plain process, under torchrun, and under the deepspeed launcher (which appends
`--local_rank=N`; the rank is read from the environment instead).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

USAGE = """usage: python -m align_anything.train [task=sft|dpo|rm] [deepspeed=z0|z2|z3|z3_offload|PATH.json] [key=value ...]

Examples:
  python -m align_anything.train task=dpo deepspeed=z3
  python -m align_anything.train task=sft model.name_or_path=tiny-random-llama train.max_steps=5
  deepspeed --num_gpus 2 --module align_anything.train task=sft deepspeed=z2
Keys are listed in align_anything/configs/train.yaml and configs/task/<task>.yaml."""


def strip_launcher_args(argv: Sequence[str]) -> list[str]:
    """Drop `--local_rank=N` / `--local_rank N` that the deepspeed launcher appends."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.startswith(("--local_rank=", "--local-rank=")):
            continue
        if arg in ("--local_rank", "--local-rank"):
            skip = True
            continue
        out.append(arg)
    return out


def run(overrides: Sequence[str]) -> None:
    """Validate the config, then set up, train, export and clean up."""
    from align_anything.config import load_config
    from align_anything.trainers.preemption import StopRequest

    cfg = load_config(overrides)  # every config mistake surfaces here, before any import of torch
    from align_anything.errors import Preempted
    from align_anything.trainers import REGISTRY

    trainer = REGISTRY[cfg.task](cfg)
    status = "failed"
    try:
        trainer.setup()
        # SIGTERM/SIGINT during the step loop: finish the step, write a checkpoint, stop.
        with StopRequest(announce=trainer.dist.is_main) as stop:
            trainer.stop_request = stop
            trainer.train()
        trainer.save()
        status = "complete"
    except Preempted:
        status = "stopped"
        raise
    finally:
        trainer.cleanup(status)  # run.json records how the run ended


def main(argv: Sequence[str] | None = None) -> int:
    args = strip_launcher_args(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "help") for a in args):
        print(USAGE)
        return 0
    # `~key` (Hydra's deletion) has no "="; the config parser explains that it is not supported.
    bad = [a for a in args if "=" not in a and not a.startswith("~")]
    from align_anything.errors import Preempted, UserError

    try:
        if bad:
            raise UserError(
                f"expected key=value overrides, got {' '.join(bad)!r}. {USAGE.splitlines()[0]}"
            )
        run(args)
    except UserError as err:
        rank = os.environ.get("RANK", "0")
        prefix = "error" if rank == "0" else f"error (rank {rank})"
        print(f"{prefix}: {err}", file=sys.stderr, flush=True)
        return 2
    except Preempted as stop:
        if os.environ.get("RANK", "0") == "0":
            print(str(stop), file=sys.stderr, flush=True)
        return 128 + stop.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
