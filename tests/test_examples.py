"""The bring-your-own-dataset example: the command in its README, run as written except for a
tiny model and one step."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from conftest import REPO_ROOT, TINY_MODEL, run_inline

# End to end: the README's command runs in-process (conftest.run_inline: `align_anything.train.main`
# with its arguments), from the repository root as a user would.
pytestmark = pytest.mark.slow

BYO_README = REPO_ROOT / "examples" / "byo_dataset" / "README.md"


def test_byo_dataset_command_maps_the_columns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (block,) = re.findall(r"```bash\n(.*?)```", BYO_README.read_text(), flags=re.DOTALL)
    command = shlex.split(block.replace("\\\n", " "))
    assert command[:3] == ["python", "-m", "align_anything.train"], command
    monkeypatch.chdir(REPO_ROOT)  # the command's paths are relative to it
    run = run_inline(
        [*command[3:], f"model.name_or_path={TINY_MODEL}", "train.max_steps=1",
         "train.precision=fp32", "checkpoint.save_final=false"],
        tmp_path / "byo",
    ).check()  # fmt: skip
    assert "capitals.jsonl as preference: kept 16 of 16 rows" in run.output
    assert "train split, encode_preference(max_length=128, truncation='drop'): kept 12 of 12" in (
        run.output
    )
    assert [m["step"] for m in run.train_steps()] == [1]
    # Held-out pairs from the same file: before training the policy is its own reference.
    assert abs(run.eval("before")["eval/rewards/margins"]) < 1e-6
