"""The shape of the training code, measured statically (issue #21's before → after figures).

    python benchmarks/code_shape.py [--package align_anything] [--folders trainers training tasks]

Prints, for the package (the training folders named by --folders):
- the largest class: its methods and the attributes it (and its methods) assign on `self`;
- attributes first assigned outside `__init__` (in every class of the training folders);
- `getattr` / `hasattr` calls in the training folders whose object is `self`, a trainer or a run;
- functions that take a whole trainer (a parameter annotated with a trainer class, or named
  `trainer` / `t`);
- modules of the training folders that a unit test (a test module with at least one test not
  marked `slow`) imports;
- import cycles in the package, counting imports under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path, package_dir: Path) -> str:
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def class_shapes(tree: ast.Module) -> list[tuple[str, int, set[str], set[str]]]:
    """(class, methods, attributes assigned on self, attributes first assigned outside
    __init__) of every class in a module."""
    shapes = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        in_init: set[str] = set()
        everywhere: set[str] = set()
        for method in methods:
            for sub in ast.walk(method):
                targets = []
                if isinstance(sub, ast.Assign):
                    targets = sub.targets
                elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                    targets = [sub.target]
                for target in targets:
                    for t in ast.walk(target):
                        if (
                            isinstance(t, ast.Attribute)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == "self"
                        ):
                            everywhere.add(t.attr)
                            if method.name == "__init__":
                                in_init.add(t.attr)
        # Dataclass-style fields declared in the class body count as set in __init__.
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                in_init.add(item.target.id)
                everywhere.add(item.target.id)
        shapes.append((node.name, len(methods), everywhere, everywhere - in_init))
    return shapes


PROBED = {"self", "t", "trainer", "run"}


def probes(tree: ast.Module) -> int:
    count = 0
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in PROBED
        ):
            count += 1
    return count


def takes_trainer(tree: ast.Module, trainer_classes: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for arg in node.args.args + node.args.kwonlyargs:
            annotation = ast.unparse(arg.annotation) if arg.annotation else ""
            if arg.arg in ("trainer", "t") or any(c in annotation for c in trainer_classes):
                found.append(f"{node.name}({arg.arg})")
                break
    return found


def imports_of(tree: ast.Module, modules: set[str], *, type_checking: bool) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if not type_checking and isinstance(node, ast.If):
            if getattr(node.test, "id", "") == "TYPE_CHECKING":
                node.body = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            targets = [t for t in subs if t in modules] or [node.module]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def unit_tested(tests_dir: Path, modules: set[str]) -> set[str]:
    """Modules imported by a test module that has at least one test not marked slow."""
    tested: set[str] = set()
    for path in sorted(tests_dir.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_slow = any(
            isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
            and "slow" in ast.unparse(n.value)
            for n in tree.body
        )
        fast_tests = 0
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                slow = any("slow" in ast.unparse(d) for d in node.decorator_list)
                fast_tests += not (slow or module_slow)
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                class_slow = any("slow" in ast.unparse(d) for d in node.decorator_list)
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name.startswith("test"):
                        slow = any("slow" in ast.unparse(d) for d in item.decorator_list)
                        fast_tests += not (slow or class_slow or module_slow)
        if fast_tests:
            tested |= imports_of(tree, modules, type_checking=True)
    return tested


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default="align_anything")
    parser.add_argument("--folders", nargs="+", default=["trainers", "training", "tasks"])
    args = parser.parse_args()
    package_dir = ROOT / args.package
    files = {module_name(p, package_dir): p for p in sorted(package_dir.rglob("*.py"))}
    trees = {name: ast.parse(path.read_text()) for name, path in files.items()}
    folders = [f"{args.package}.{f}" for f in args.folders]
    training = {n for n in files if any(n == f or n.startswith(f + ".") for f in folders)}

    shapes = [(m, *s) for m in training for s in class_shapes(trees[m])]
    trainer_classes = {s[1] for s in shapes if s[1].endswith("Trainer")}
    largest = max(shapes, key=lambda s: s[2] + len(s[3]), default=None)
    outside = sum(len(s[4]) for s in shapes)
    probe_count = sum(probes(trees[m]) for m in training)
    whole = [f"{m}.{f}" for m in sorted(files) for f in takes_trainer(trees[m], trainer_classes)]
    tested = unit_tested(ROOT / "tests", set(files)) & training
    graph_tc = {m: imports_of(ast.parse(files[m].read_text()), set(files), type_checking=True)
                - {m} for m in files}  # fmt: skip
    loops = cycles(graph_tc)

    print(
        f"training folders: {', '.join(f for f in folders if any(n.startswith(f) for n in files))}"
    )
    if largest:
        print(f"largest class: {largest[1]} ({largest[0]}): {largest[2]} methods, "
              f"{len(largest[3])} attributes")  # fmt: skip
    print(f"attributes first set outside __init__: {outside} in the training folders' classes"
          + (f" ({len(largest[4])} of them in {largest[1]})" if largest else ""))  # fmt: skip
    print(f"getattr/hasattr probes on self/trainer/run: {probe_count}")
    print(
        f"functions that take a whole trainer: {len(whole)}"
        + (f" ({', '.join(whole)})" if whole else "")
    )
    modules = sorted(m for m in training if not m.endswith("__init__"))
    print(f"training modules with unit tests that launch nothing: {len(tested)} of {len(modules)}")
    untested = sorted(set(modules) - tested)
    if untested:
        print("  without: " + ", ".join(m.removeprefix(args.package + ".") for m in untested))
    print(f"import cycles (TYPE_CHECKING imports counted): {len(loops)}"
          + "".join(f"\n  {' <-> '.join(c)}" for c in loops))  # fmt: skip


if __name__ == "__main__":
    main()
