"""`python -m align_anything presets list | show NAME | export NAME DIR`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from align_anything.config import available_presets, preset_path
from align_anything.tools.presets import WHEN_TO_USE, main

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_every_shipped_preset_says_when_to_use_it() -> None:
    missing = sorted(set(available_presets()) - set(WHEN_TO_USE))
    stale = sorted(set(WHEN_TO_USE) - set(available_presets()))
    assert not missing and not stale, (
        f"align_anything/presets.py WHEN_TO_USE: add a line for {missing}, remove {stale}"
    )


def test_list_names_every_preset_with_its_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "align_anything", "presets", "list"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    lines = out.splitlines()
    assert len(lines) == len(available_presets())
    for name, line in zip(available_presets(), lines, strict=True):
        assert line.split()[:2] == [name, preset_path(name).name], line
        assert line.endswith(WHEN_TO_USE[name]), line


def test_show_prints_the_shipped_json(capsys: pytest.CaptureFixture) -> None:
    assert main(["show", "z3"]) == 0
    out = capsys.readouterr().out
    assert out == preset_path("z3").read_text()
    assert json.loads(out)["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize("name", available_presets())
def test_export_copies_the_file_byte_for_byte(name: str, tmp_path: Path) -> None:
    target_dir = tmp_path / "other_project" / "configs"  # created on the way
    assert main(["export", name, str(target_dir)]) == 0
    copied = target_dir / preset_path(name).name
    assert copied.read_bytes() == preset_path(name).read_bytes()


def test_unknown_preset_lists_the_shipped_ones(capsys: pytest.CaptureFixture) -> None:
    assert main(["show", "z33"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'z33'" in err and "did you mean 'z3'" in err
    assert ", ".join(available_presets()) in err
