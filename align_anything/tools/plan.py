"""Print the memory plan of a run: per-device memory of every shipped preset, and what
`deepspeed=auto` would choose (see `align_anything.training.memory_plan`).

    python -m align_anything plan task=dpo model.name_or_path=smollm2-135m-instruct
    python -m align_anything plan --world-size 8 task=sft model.name_or_path=Qwen/Qwen2.5-7B
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from align_anything.config import load_config
from align_anything.errors import ConfigError, UserError, report
from align_anything.training.memory_plan import format_table, plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m align_anything plan", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--world-size", type=int, default=None,
                        help="devices in the run (default: WORLD_SIZE, else visible GPUs, else 1)")  # fmt: skip
    parser.add_argument("--gpus-per-node", type=int, default=None)
    parser.add_argument(
        "overrides", nargs="*", help="config overrides, as for align_anything.train"
    )
    args = parser.parse_args(argv)
    world = args.world_size
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", torch.cuda.device_count() or 1))
    try:
        for flag, value in (("--world-size", world), ("--gpus-per-node", args.gpus_per_node)):
            if value is not None and value < 1:
                raise ConfigError(
                    f"{flag} {value}: give a positive number of devices (e.g. {flag} 8)"
                )
        overrides = [o for o in args.overrides if not o.startswith("deepspeed=")]
        cfg = load_config(overrides)
        from align_anything.tasks import TASKS  # after the config: a bad key fails fast

        family = TASKS[cfg.task].family
        figures, budget, source = plan(
            cfg, family.estimate_memory, world_size=world, gpus_per_node=args.gpus_per_node
        )
    except UserError as err:
        return report(err)
    print(format_table(figures, budget, source, cfg=cfg, world_size=world))
    return 0


if __name__ == "__main__":
    sys.exit(main())
