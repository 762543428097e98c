"""Project rules that keep the pieces in sync (DESIGN §3, STYLE 4 and 6).

- Only `align_anything/engine.py` imports `deepspeed` or `torch.distributed`.
- The trainer registry, the task config files and the task sections of the config schema name
  the same tasks.
- Every shipped DeepSpeed preset is a JSON object without duplicate keys, named ds_<name>_config.json.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

import align_anything
from align_anything import config as config_module

PACKAGE_DIR = Path(align_anything.__file__).parent
ENGINE_FILE = PACKAGE_DIR / "engine.py"
TASK_FILES = sorted((PACKAGE_DIR / "configs" / "task").glob("*.yaml"))
PRESET_FILES = sorted((PACKAGE_DIR / "configs" / "deepspeed").glob("*.json"))

BACKEND_MODULES = ("deepspeed", "torch.distributed")


def _is_backend(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in BACKEND_MODULES)


def backend_imports(source: str) -> list[str]:
    """Every import of deepspeed / torch.distributed in `source`, in any spelling:
    `import deepspeed.comm`, `import torch.distributed as dist`, `from torch import distributed`,
    `from deepspeed.ops import adam`, `importlib.import_module("deepspeed")`, `__import__(...)`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _is_backend(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _is_backend(node.module):
                found.append(node.module)
            else:
                found += [
                    f"{node.module}.{alias.name}"
                    for alias in node.names
                    if _is_backend(f"{node.module}.{alias.name}")
                ]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and _is_backend(first.value)
            ):
                found.append(first.value)
    return found


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import deepspeed", ["deepspeed"]),
        ("import deepspeed.comm as dc", ["deepspeed.comm"]),
        ("import torch.distributed as dist", ["torch.distributed"]),
        ("from torch import distributed", ["torch.distributed"]),
        ("from torch import nn, distributed as d", ["torch.distributed"]),
        ("from torch.distributed import all_reduce", ["torch.distributed"]),
        ("from deepspeed.ops.adam import FusedAdam", ["deepspeed.ops.adam"]),
        ("def f():\n    import deepspeed\n", ["deepspeed"]),
        ("import importlib\nimportlib.import_module('torch.distributed')", ["torch.distributed"]),
        ("import torch\nfrom torch import Tensor, nn\nimport deepspeedish", []),
    ],
)
def test_backend_import_detector(source: str, expected: list[str]) -> None:
    # The layout rule below is only as good as this detector.
    assert backend_imports(source) == expected


def test_only_engine_imports_deepspeed_and_torch_distributed() -> None:
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert ENGINE_FILE in files
    offenders = {
        str(path.relative_to(PACKAGE_DIR.parent)): imports
        for path in files
        if path != ENGINE_FILE and (imports := backend_imports(path.read_text()))
    }
    assert offenders == {}, f"only align_anything/engine.py may import these: {offenders}"
    # The scan does look at the owner: engine.py imports both.
    engine_imports = set(backend_imports(ENGINE_FILE.read_text()))
    assert {"deepspeed", "torch.distributed"} <= engine_imports


def test_trainer_registry_matches_task_files() -> None:
    from align_anything.trainers import REGISTRY

    task_names = {path.stem for path in TASK_FILES}
    assert task_names, "no task config files found"
    assert set(REGISTRY) == task_names
    assert set(config_module.TASK_SECTIONS) == task_names
    assert set(config_module.available_tasks()) == task_names


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    assert not duplicates, f"duplicate keys {duplicates}"
    return dict(pairs)


def test_presets_are_named_and_listed() -> None:
    assert PRESET_FILES, "no presets shipped"
    for path in PRESET_FILES:
        assert path.name.startswith("ds_") and path.name.endswith("_config.json"), path.name
    listed = {config_module.preset_path(name) for name in config_module.available_presets()}
    assert listed == set(PRESET_FILES)
    # DESIGN §2 names these four; more may follow.
    assert {"z0", "z2", "z3", "z3_offload"} <= set(config_module.available_presets())


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.name)
def test_preset_is_json_object_without_duplicate_keys(path: Path) -> None:
    data = json.loads(path.read_text(), object_pairs_hook=_object_without_duplicates)
    assert isinstance(data, dict)
    assert isinstance(data["zero_optimization"]["stage"], int)
