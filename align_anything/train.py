"""Entry point: `python -m align_anything.train task=dpo deepspeed=z3 key=value ...`.

Works as a plain process, under torchrun, and under the deepspeed launcher (which appends
`--local_rank=N`; the rank is read from the environment instead).

A run, top to bottom (`run`): the config is validated (every mistake at once, before torch is
imported) → `training.setup.setup` makes the `Run` (process group, output folder, model side,
data, DeepSpeed plan, engines, resume) → the task's `build` makes the task and its step source
→ logging starts (the start-up summary) → `training.loop.train` → `training.finish`: the
exported model, the closing summary.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

USAGE = """usage: python -m align_anything.train [task=sft|dpo|rm|kto|grpo|rloo|diffusion_sft|diffusion_dpo] [deepspeed=z0|z2|z3|z3_offload|PATH.json] [key=value ...]

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
    """Validate the config, then set up, build the task, train, export."""
    from align_anything.config import load_config

    # Every config mistake surfaces here, before the heavy imports below (torch, deepspeed).
    cfg = load_config(overrides)
    from contextlib import ExitStack

    from align_anything.tasks import TASKS
    from align_anything.training import finish, loop, setup
    from align_anything.training.preemption import StopRequest

    spec = TASKS[cfg.task]
    # Each set-up step registers its own clean-up here (process group, lock, run.json status,
    # metrics sinks): whatever was reached is undone in reverse order, also after an error.
    with ExitStack() as stack:
        run_ = setup.setup(cfg, spec, stack)
        task, source = spec.build(run_)
        setup.start_logging(run_, spec.family, stack, task=cfg.task)
        # SIGTERM/SIGINT during the step loop: finish the step, write a checkpoint, stop.
        with StopRequest(announce=run_.dist.is_main) as stop:
            loop.train(run_, task, source, stop)
        finish.save_final(run_, spec.family)
        finish.report_finished(run_, task)


def main(argv: Sequence[str] | None = None) -> int:
    args = strip_launcher_args(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "help") for a in args):
        print(USAGE)
        return 0
    # `~key` (Hydra's deletion) has no "="; the config parser explains that it is not supported.
    bad = [a for a in args if "=" not in a and not a.startswith("~")]
    from align_anything.errors import AlreadyFinished, Preempted, UserError

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
        return _stopped(2)
    except AlreadyFinished as done:
        if os.environ.get("RANK", "0") == "0":
            print(f"note: {done}", flush=True)
        return _stopped(0)
    except Preempted as stop:
        if os.environ.get("RANK", "0") == "0":
            print(str(stop), file=sys.stderr, flush=True)
        return _stopped(128 + stop.signum)
    return _stopped(0)


def _stopped(code: int) -> int:
    """`code`, or, in a rank of a multi-process launch, the process ended with it at once.

    By now the run's clean-up has run (`run`'s ExitStack: process group, lock, run.json,
    metrics, the final model) and any message is printed. What is left is the interpreter's own
    shutdown, in which a C++ thread of the distributed backend can still be joinable and abort
    the process ("terminate called without an active exception", SIGABRT), turning the exit
    code into the launcher's 250: seen in 2-rank runs stopped by a data error, and at the end
    of a finished 2-rank ZeRO-3 LoRA run (its results all written). A one-process caller (the
    tests call `main` in-process) gets the code back."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
