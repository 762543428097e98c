"""`python -m align_anything <command>`: the one table of commands dispatches to each tool."""

from __future__ import annotations

import importlib
import subprocess
import sys

from conftest import REPO_ROOT

from align_anything.__main__ import COMMANDS, main


def test_every_command_names_a_module_with_main() -> None:
    for name, (module, _) in COMMANDS.items():
        assert callable(importlib.import_module(module).main), name


def test_help_lists_every_command(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"\n  {name} " in out


def test_unknown_command_is_one_error_with_a_suggestion(capsys) -> None:
    assert main(["exprot", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown command 'exprot' (did you mean 'export'?)")


def test_a_command_runs_its_tool_with_the_rest_of_the_arguments() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "align_anything", "presets", "show", "z0"],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    shipped = REPO_ROOT / "align_anything" / "configs" / "deepspeed" / "ds_z0_config.json"
    assert result.stdout == shipped.read_text()
