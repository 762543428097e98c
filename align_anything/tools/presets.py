"""The shipped DeepSpeed presets, from the command line.

    python -m align_anything presets list              # each preset with when to use it
    python -m align_anything presets show z3           # print the JSON as shipped
    python -m align_anything presets export z3 DIR     # copy ds_z3_config.json into DIR, unchanged
    python -m align_anything presets export z3 DIR --overwrite  # replace a copy already there

The files are standalone DeepSpeed JSON with "auto" where a value depends on the run, following
the HF Trainer's and accelerate's conventions, so an exported preset works there as it is
(`TrainingArguments(deepspeed="ds_z3_config.json")`, `accelerate launch` with a DeepSpeed
config file, or `deepspeed.initialize(config=...)`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from align_anything.config import available_presets, preset_path
from align_anything.errors import ConfigError, UserError, did_you_mean, report

# One line per shipped preset: when to pick it. A test keeps this in step with the folder.
WHEN_TO_USE: dict[str, str] = {
    "z0": "one device, or plain data parallel when the model and Adam states fit on every device",
    "z2": "optimizer states and gradients partitioned: most multi-GPU fine-tuning",
    "z3": "parameters partitioned too: models that do not fit whole on one device",
    "z3_offload": "ZeRO-3 with optimizer states and parameters in CPU memory: the largest "
    "models on few GPUs, slower per step",
}


def shipped_file(name: str) -> Path:
    """The shipped file of preset `name`; a wrong name lists the right ones."""
    if name not in available_presets():
        raise ConfigError(
            f"unknown preset {name!r}{did_you_mean(name, available_presets())}. "
            f"Shipped presets: {', '.join(available_presets())}."
        )
    return preset_path(name)


def list_presets() -> str:
    """A table of preset name, file and when to use it."""
    names = available_presets()
    width = max(len(n) for n in names)
    return "\n".join(
        f"{name:{width}}  {preset_path(name).name:26}  {WHEN_TO_USE.get(name, '')}"
        for name in names
    )


def export_preset(name: str, directory: Path, *, overwrite: bool = False) -> Path:
    """Copy the shipped file of `name` into `directory` (created if missing), byte for byte.
    A file of that name already there (perhaps edited) is replaced only with `overwrite`."""
    source = shipped_file(name)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{directory} exists and is not a folder")
    target = directory / source.name
    if target.exists() and not overwrite:
        same = target.is_file() and target.read_bytes() == source.read_bytes()
        state = "the shipped preset, unchanged" if same else "not the shipped preset (edited?)"
        raise ConfigError(
            f"{target} already exists ({state}); nothing was written. Add --overwrite to replace "
            "it with the shipped file, or export into another folder."
        )
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m align_anything presets", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the presets with when to use each")
    show = commands.add_parser("show", help="print a preset's JSON as shipped")
    show.add_argument("name")
    export = commands.add_parser("export", help="copy a preset's file into a folder")
    export.add_argument("name")
    export.add_argument("directory", type=Path)
    export.add_argument(
        "--overwrite", action="store_true", help="replace a file of that name in the folder"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            print(list_presets())
        elif args.command == "show":
            sys.stdout.write(shipped_file(args.name).read_text())
        else:
            print(f"wrote {export_preset(args.name, args.directory, overwrite=args.overwrite)}")
    except UserError as err:
        return report(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
