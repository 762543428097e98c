"""Project rules that keep the pieces in sync (DESIGN §3, STYLE 4 and 6).

- Only `align_anything/backend/` imports `deepspeed` or `torch.distributed`.
- Imports point one way, down the layers of DESIGN.md's reading order, with no cycle.
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
BACKEND_DIR = PACKAGE_DIR / "backend"
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


def test_only_the_backend_imports_deepspeed_and_torch_distributed() -> None:
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    owners = [path for path in files if BACKEND_DIR in path.parents]
    offenders = {
        str(path.relative_to(PACKAGE_DIR.parent)): imports
        for path in files
        if path not in owners and (imports := backend_imports(path.read_text()))
    }
    assert offenders == {}, f"only align_anything/backend/ may import these: {offenders}"
    # The scan does look at the owners: the backend imports both.
    found = {name for path in owners for name in backend_imports(path.read_text())}
    assert {"deepspeed", "torch.distributed"} <= found


# The layers, lowest first (DESIGN.md, "Layout"). A module may import modules of its own group
# and of lower layers only; groups in one layer may not import each other (the model families
# are rooms side by side: language models never import text-to-image code, nor the reverse).
# A module belongs to the group of the longest prefix that names it.
LAYERS: list[dict[str, tuple[str, ...]]] = [
    {"base": ("errors", "atomic", "http_json")},
    {"losses": ("losses",)},
    {"config": ("config",)},
    {"backend": ("backend",), "data": ("data",)},
    {"training": ("training",)},
    {"zoo": ("families", "families.zoo")},
    {"diffusion": ("families.diffusion",)},
    {
        "language": ("families.language",),
        "text_to_image": ("families.text_to_image",),
        "text_to_video": ("families.text_to_video",),
        "text_to_audio": ("families.text_to_audio",),
    },
    {"pipelines": ("families.pipelines",)},
    {"generation": ("generation",), "rewards": ("rewards",)},
    {"tasks": ("tasks",)},
    {"entry": ("train", "tools", "__main__")},
]


def _group_of(module: str) -> tuple[int, str]:
    """(layer, group) of `align_anything.X…`: the group of the longest prefix of X… listed."""
    rest = module.split(".", 1)[1] if "." in module else ""
    best: tuple[int, int, str] | None = None
    for rank, groups in enumerate(LAYERS):
        for group, heads in groups.items():
            for head in heads:
                if rest == head or rest.startswith(head + "."):
                    if best is None or len(head) > best[0]:
                        best = (len(head), rank, group)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS and DESIGN.md")
    return best[1], best[2]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports() -> dict[str, set[str]]:
    """Module -> the align_anything modules it imports (at any depth of the file: a function's
    lazy import counts too)."""
    modules = {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        # Every import counts, those under `if TYPE_CHECKING:` too: a module that needs another's
        # names even for annotations depends on it.
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import submodule` imports the submodule (and runs the package's
                # __init__, which the package's own modules may import from: not a cycle).
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in modules] or [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target not in (name, "align_anything"):
                    found.add(target)
        graph[name] = found
    return graph


def test_imports_point_down_the_layers() -> None:
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in package_imports().items()
        if module != "align_anything"
        for target in targets
        if (a := _group_of(module)) != (b := _group_of(target)) and a[0] <= b[0]
    )
    assert upward == [], "imports up (or across) the layers:\n" + "\n".join(upward)


def test_no_import_cycle() -> None:
    graph = package_imports()
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [({"a": {"b"}, "b": {"a"}}, 1), ({"a": {"b"}, "b": set()}, 0)],
    ids=["cycle", "chain"],
)
def test_cycle_detector(graph: dict[str, set[str]], expected: int, monkeypatch) -> None:
    # The rule above is only as good as its search: it must see a two-module cycle.
    monkeypatch.setattr(f"{__name__}.package_imports", lambda: graph)
    if expected:
        with pytest.raises(AssertionError):
            test_no_import_cycle()
    else:
        test_no_import_cycle()


def test_task_registry_matches_task_files() -> None:
    from align_anything.tasks import TASKS

    task_names = {path.stem for path in TASK_FILES}
    assert task_names, "no task config files found"
    assert set(TASKS) == task_names
    assert all(spec.name == name for name, spec in TASKS.items())
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
