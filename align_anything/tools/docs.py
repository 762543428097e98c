"""The configuration reference, docs/configuration.md, generated from the pydantic schema
(`RunConfig`).

    python -m align_anything docs --write     # rewrite the block in docs/configuration.md
    python -m align_anything docs --check     # exit 1 when it is out of date (a test runs this)
    python -m align_anything docs             # print the block

The block sits between `<!-- config-reference:start -->` and `<!-- config-reference:end -->`;
the page's text around it is written by hand. Each section is a heading (so other pages link
to `configuration.md#dpo`), and each key is listed with its type, its default as a run sees it
(train.yaml composed with each task file: where tasks differ, each task's value) and the
field's description.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from omegaconf import OmegaConf
from pydantic import BaseModel

from align_anything.config import (
    CONFIG_DIR,
    TASK_SECTIONS,
    RunConfig,
    available_tasks,
    load_config,
)

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
REGENERATE = "python -m align_anything docs --write"
# Bookkeeping fields the loader fills in; not keys a user sets.
INTERNAL = frozenset({"explicit_keys", "override_notes", "deepspeed_source"})
# The schema holds the loaded preset JSON; on the command line the key takes a name or a path.
SHOWN_TYPES = {"deepspeed": "preset name \\| path"}


def type_name(annotation: Any) -> str:
    """A short, readable rendering of a field's type: `int | "auto"`, `"a" | "b"`, `list[str]`."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model of a section field (`ModelConfig`, `DPOSection | None`, ...)."""
    candidates = typing.get_args(annotation) or (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _lookup(data: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f"`{value}`"
    return f"`{json.dumps(value)}`"


def _default(dotted: str, resolved: dict[str, dict[str, Any]]) -> str:
    """The value each task's composed config gives `dotted`; one value when all agree."""
    values = {task: found for task, cfg in resolved.items() for ok, found in [_lookup(cfg, dotted)]
              if ok}  # fmt: skip
    if not values:
        return ""
    shown = {task: _show(v) for task, v in values.items()}
    if len(set(shown.values())) == 1:
        return next(iter(shown.values()))
    if "." not in dotted:  # a top-level key that follows the task, e.g. outputs/${task}
        return _show(OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "train.yaml"))[dotted])
    return ", ".join(f"{task}: {text}" for task, text in shown.items())


def _rows(
    model: type[BaseModel], prefix: str, resolved: dict[str, dict[str, Any]]
) -> list[tuple[str, list[str]]]:
    """(section title, table rows) for `model` and, recursively, its sub-sections."""
    rows: list[str] = []
    nested: list[tuple[str, list[str]]] = []
    for name, field in model.model_fields.items():
        if name in INTERNAL:
            continue
        key = f"{prefix}{name}"
        sub = TASK_SECTIONS.get(name) if not prefix else None
        sub = sub or _section_model(field.annotation)
        if sub is not None:
            nested.extend(_rows(sub, f"{key}.", resolved))
            continue
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(
            f"| `{key}` | {SHOWN_TYPES.get(key) or type_name(field.annotation)} | {_default(key, resolved)} | {description} |"
        )
    title = prefix.rstrip(".") or "top level"
    return ([(title, rows)] if rows else []) + nested


def missing_descriptions(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Dotted keys whose schema field has no description (the reference needs one for each)."""
    missing = []
    for name, field in model.model_fields.items():
        if name in INTERNAL:
            continue
        sub = (TASK_SECTIONS.get(name) if not prefix else None) or _section_model(field.annotation)
        if sub is not None:
            missing.extend(missing_descriptions(sub, f"{prefix}{name}."))
        elif not field.description:
            missing.append(f"{prefix}{name}")
    return missing


def render() -> str:
    """The configuration reference block (without the start/end markers)."""
    resolved: dict[str, dict[str, Any]] = {}
    for task in available_tasks():
        cfg = load_config([f"task={task}"])
        resolved[task] = cfg.to_dict()
        # The preset's name as train.yaml gives it, not the loaded JSON.
        name = Path(cfg.deepspeed_source).name
        resolved[task]["deepspeed"] = name.removeprefix("ds_").removesuffix("_config.json")
    parts = [
        f"<!-- generated by `{REGENERATE}` from the schema in align_anything/config/; "
        "do not edit by hand -->",
        "",
        "Set any key on the command line as `section.key=value` "
        "(`python -m align_anything.train task=dpo dpo.beta=0.2 train.max_steps=100`). "
        "Defaults live in one place, `configs/train.yaml` composed with "
        "`configs/task/<task>.yaml` (the schema holds types, limits and these descriptions, no "
        "values); where the tasks differ, each task's default is shown.",
    ]
    for title, rows in _rows(RunConfig, "", resolved):
        heading = "## top level" if title == "top level" else f"## `{title}`"
        parts += ["", heading]
        if title == "speed":
            parts += [
                "",
                "Time and memory only: none of these changes a number the run computes (each is "
                "tested equal to the plain path); every other key may.",
            ]
        parts += [
            "",
            "| key | type | default | description |",
            "| --- | --- | --- | --- |",
            *rows,
        ]
    return "\n".join(parts) + "\n"


def updated_reference(text: str, block: str) -> str:
    """`text` (the page) with the block between the markers replaced by `block`."""
    if START not in text or END not in text:
        raise SystemExit(f"error: {REFERENCE} lacks the markers {START} … {END}")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m align_anything docs", description=__doc__.split("\n")[0]
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--write", action="store_true", help="rewrite the block in docs/configuration.md"
    )
    mode.add_argument(
        "--check", action="store_true", help="exit 1 if docs/configuration.md is out of date"
    )
    args = parser.parse_args(argv)
    missing = missing_descriptions()
    if missing:
        print(
            "error: add a description (Field(..., description=...)) in the schema "
            f"(align_anything/config/) for: {', '.join(missing)}",
            file=sys.stderr,
        )
        return 1
    block = render()
    if not (args.write or args.check):
        sys.stdout.write(block)
        return 0
    text = REFERENCE.read_text()
    new = updated_reference(text, block)
    if args.check:
        if new != text:
            print(f"docs/configuration.md is out of date: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(new)
    print(f"updated the configuration reference in {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
