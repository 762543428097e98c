"""`python -m align_anything <command> [arguments]`: one entry point for every tool.

python -m align_anything train task=dpo deepspeed=z3     # = python -m align_anything.train …
python -m align_anything export CKPT --out DIR
python -m align_anything --help                          # the table below
"""

from __future__ import annotations

import importlib
import sys

# command -> (module with a `main(argv) -> int`, what it does)
COMMANDS = {
    "train": ("align_anything.train", "train: task=<{tasks}> and key=value overrides"),
    "export": (
        "align_anything.tools.export",
        "a checkpoint or LoRA adapter -> a Hugging Face folder",
    ),
    "score": ("align_anything.tools.score", "score prompt/response rows with a reward model"),
    "serve-reward": (
        "align_anything.rewards.server",
        "serve a reward model over HTTP for reward.remote.urls",
    ),
    "serve-rollout": (
        "align_anything.generation.server",
        "serve a vLLM engine for rollout.backend=vllm, rollout.vllm.mode=server",
    ),
    "plot": ("align_anything.tools.plot", "metrics.jsonl -> metrics.png"),
    "presets": (
        "align_anything.tools.presets",
        "list, show or export the shipped DeepSpeed presets",
    ),
    "plan": (
        "align_anything.tools.plan",
        "per-device memory of every preset; what deepspeed=auto picks",
    ),
    "docs": (
        "align_anything.tools.docs",
        "regenerate or check the configuration reference (docs/configuration.md)",
    ),
    "data": ("align_anything.data.synthetic", "write a small synthetic image/audio dataset"),
}


def usage() -> str:
    from align_anything.config import available_tasks

    tasks = "|".join(available_tasks())
    width = max(map(len, COMMANDS))
    rows = "\n".join(
        f"  {name:<{width}}  {what.format(tasks=tasks)}" for name, (_, what) in COMMANDS.items()
    )
    return (
        "usage: python -m align_anything <command> [arguments]\n\ncommands:\n"
        f"{rows}\n\n`python -m align_anything <command> --help` describes each."
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        from align_anything.errors import did_you_mean

        print(f"error: unknown command {command!r}{did_you_mean(command, COMMANDS)}\n\n{usage()}",
              file=sys.stderr)  # fmt: skip
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
