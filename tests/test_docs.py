"""The README stays true to the code: the configuration reference is generated from the schema,
and the presets table names every shipped preset."""

from __future__ import annotations

import re

from align_anything.config import available_presets, preset_path
from align_anything.tools.docs import (
    README,
    REGENERATE,
    missing_descriptions,
    render,
    type_name,
    updated_readme,
)


def test_every_config_key_has_a_description() -> None:
    missing = missing_descriptions()
    assert not missing, (
        f"add Field(..., description=...) in align_anything/config.py for {missing}, "
        f"then run `{REGENERATE}`"
    )


def test_readme_config_reference_is_current() -> None:
    text = README.read_text()
    assert updated_readme(text, render()) == text, (
        f"README.md's configuration reference is out of date: run `{REGENERATE}`"
    )


def test_reference_lists_every_key_with_its_task_defaults() -> None:
    block = render()
    keys = re.findall(r"^\| `([a-z_.]+)` \|", block, flags=re.MULTILINE)
    assert {"task", "deepspeed", "train.learning_rate", "dpo.beta", "rm.center_coef"} <= set(keys)
    assert len(keys) == len(set(keys))
    (row,) = [line for line in block.splitlines() if line.startswith("| `train.learning_rate`")]
    assert "dpo: `3e-05`" in row and "sft: `2e-05`" in row and "rm: `1e-05`" in row, row
    assert "explicit_keys" not in block and "deepspeed_source" not in block


def test_type_names_are_readable() -> None:
    from typing import Literal

    assert type_name(int | Literal["auto"]) == 'int \\| "auto"'
    assert type_name(list[Literal["a", "b"]]) == 'list["a" \\| "b"]'
    assert type_name(str | None) == "str \\| null"


def test_readme_presets_table_names_every_preset() -> None:
    text = README.read_text()
    for name in available_presets():
        assert f"| `{name}` | `configs/deepspeed/{preset_path(name).name}` |" in text, name
