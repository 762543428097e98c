"""The documentation stays true to the code: README.md and every page under docs/.

- docs/configuration.md's reference is generated from the schema (`python -m align_anything
  docs`), and the presets table names every shipped preset;
- every command in a ```bash block runs as written, as far as it can without training: a train
  command's overrides compose and validate (`load_config`, the trainer's own first step), a
  launcher's arguments parse with the launcher's own parser, a tool's with the tool's, a launch
  script's printed command (DRY_RUN=1) validates in turn, and every program, module, file, make
  target, extra, pinned version and test it names exists;
- README.md is a front door of at most 200 lines, every relative link (and #anchor) resolves,
  and every repository path named in backticks exists.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest
from conftest import DIST_ENV_VARS, REPO_ROOT

from align_anything.__main__ import COMMANDS
from align_anything.config import available_presets, load_config, preset_path
from align_anything.errors import ConfigError
from align_anything.tools.docs import (
    REFERENCE,
    REGENERATE,
    missing_descriptions,
    render,
    type_name,
    updated_reference,
)

README = REPO_ROOT / "README.md"
# One rendering for the tests that read it (each composes every task's config: ~2 s).
rendered = functools.cache(render)
DOCS = REPO_ROOT / "docs"
README_MAX_LINES = 200


def doc_pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def where(page: Path, line: int) -> str:
    return f"{page.relative_to(REPO_ROOT)}:{line}"


# ------------------------------------------------------------------ the configuration reference


def test_every_config_key_has_a_description() -> None:
    missing = missing_descriptions()
    assert not missing, (
        f"add Field(..., description=...) in align_anything/config/ for {missing}, "
        f"then run `{REGENERATE}`"
    )


def test_config_reference_is_current() -> None:
    text = REFERENCE.read_text()
    assert updated_reference(text, rendered()) == text, (
        f"docs/configuration.md is out of date: run `{REGENERATE}`"
    )


def test_reference_lists_every_key_with_its_task_defaults() -> None:
    block = rendered()
    keys = re.findall(r"^\| `([a-z_.]+)` \|", block, flags=re.MULTILINE)
    assert {"task", "deepspeed", "train.learning_rate", "dpo.beta", "rm.center_coef"} <= set(keys)
    assert len(keys) == len(set(keys))
    (row,) = [line for line in block.splitlines() if line.startswith("| `train.learning_rate`")]
    assert "dpo: `3e-05`" in row and "sft: `2e-05`" in row and "rm: `1e-05`" in row, row
    assert "explicit_keys" not in block and "deepspeed_source" not in block
    # Each section is a heading, so other pages link to configuration.md#dpo.
    assert "\n## `dpo`\n" in block and "\n## `reward.remote`\n" in block


def test_type_names_are_readable() -> None:
    from typing import Literal

    assert type_name(int | Literal["auto"]) == 'int \\| "auto"'
    assert type_name(list[Literal["a", "b"]]) == 'list["a" \\| "b"]'
    assert type_name(str | None) == "str \\| null"


def test_presets_table_names_every_preset() -> None:
    text = (DOCS / "deepspeed.md").read_text()
    for name in available_presets():
        assert f"| `{name}` | `configs/deepspeed/{preset_path(name).name}` |" in text, name


# ------------------------------------------------------------------ the front door and the links


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; at most {README_MAX_LINES}: move the detail into docs/"
    )
    # Its first commands are the two of a fresh machine.
    first_two = [cmd.argv for cmd in documented_commands([README])[:2]]
    assert first_two == [["make", "train"], ["make", "test"]], first_two


FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*$", re.MULTILINE)


def _prose(text: str) -> str:
    """`text` without code blocks, line numbers kept (a block becomes as many empty lines)."""
    return FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def anchors(page: Path) -> set[str]:
    """The #anchors GitHub gives the headings of `page`: lower case, punctuation other than - and
    _ dropped, spaces as hyphens; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(_prose(page.read_text())):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def relative_links(page: Path) -> Iterator[tuple[int, str]]:
    prose = INLINE_CODE.sub("", _prose(page.read_text()))
    for number, line in enumerate(prose.splitlines(), start=1):
        for target in LINK.findall(line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                yield number, target


def test_every_relative_link_resolves() -> None:
    problems = []
    checked = 0
    for page in doc_pages():
        for number, target in relative_links(page):
            checked += 1
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                problems.append(f"{where(page, number)}: {target}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(
                    f"{where(page, number)}: {target}: no heading with the anchor #{anchor} "
                    f"in {resolved.relative_to(REPO_ROOT)}"
                )
    assert checked > 100, f"only {checked} links found: is the link pattern still right?"
    assert not problems, "\n".join(problems)


# Top-level folders and files of the repository, and the package's rooms, as paths are written
# in backticks (`tests/test_losses.py`, `training/loop.py`, `families/zoo.py`).
ROOTS = ("align_anything", "tests", "scripts", "benchmarks", "examples", "configs", "docs",
         "requirements")  # fmt: skip
PACKAGE = REPO_ROOT / "align_anything"
PATH_IN_CODE = re.compile(r"`([\w.*/-]+/[\w.*/-]*(?:::\w+)?|[\w-]+\.(?:md|toml|txt|py|sh))`")


def _named_path(text: str) -> Path | None:
    """The repository path a backticked name means, or None when it is not one: a name under a
    top-level folder or a package room that ends in a file suffix or a slash (`rewards/chosen`
    is a metric, `rewards/` the room)."""
    first = text.split("/", 1)[0]
    if not re.fullmatch(r"\w[\w.-]*", first) or not re.search(r"(\.\w+|/)$", text):
        return None
    if first in ROOTS or (REPO_ROOT / first).is_file():
        return REPO_ROOT / text
    if "/" in text and (PACKAGE / first).is_dir():
        return PACKAGE / text
    return None


def test_every_path_named_in_backticks_exists() -> None:
    problems = []
    checked = 0
    for page in doc_pages():
        prose = _prose(page.read_text())
        for number, line in enumerate(prose.splitlines(), start=1):
            for name in PATH_IN_CODE.findall(line):
                file, _, test = name.partition("::")
                path = _named_path(file)
                if path is None:
                    continue
                checked += 1
                pattern = str(path.relative_to(REPO_ROOT))
                found = sorted(REPO_ROOT.glob(pattern)) if "*" in pattern else [path]
                if not found or not all(p.exists() for p in found):
                    problems.append(f"{where(page, number)}: `{name}`: no such path")
                elif test and not re.search(rf"^def {test}\(", path.read_text(), re.MULTILINE):
                    problems.append(f"{where(page, number)}: `{name}`: no such test")
    assert checked > 50, f"only {checked} paths found: is the pattern still right?"
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ the commands, as written


@dataclass
class Command:
    """One simple command of a ```bash block: its environment assignments and its words."""

    page: Path
    line: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        assignments = [f"{k}={v}" for k, v in self.env.items()]
        return f"{where(self.page, self.line)}: {shlex.join([*assignments, *self.argv])}"


OPERATORS = {"&&", "||", ";", "|", "&"}
REDIRECTIONS = {">", ">>", "<"}
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
BASH_BLOCK = re.compile(r"^```(bash|sh)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def split_commands(line: str, page: Path, number: int) -> list[Command]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    commands: list[Command] = []
    words: list[str] = []
    tokens = iter([*lexer, ";"])
    for token in tokens:
        if token in REDIRECTIONS:
            next(tokens)  # the file it reads or writes: not a word of the command
            continue
        if token not in OPERATORS:
            words.append(token)
            continue
        env = {}
        while words and ASSIGNMENT.match(words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if words:
            commands.append(Command(page, number, words, env))
        words = []
    return commands


def documented_commands(pages: list[Path] | None = None) -> list[Command]:
    out = []
    for page in pages or doc_pages():
        text = page.read_text()
        for block in BASH_BLOCK.finditer(text):
            first = text.count("\n", 0, block.start(2)) + 1
            lines = block.group(2).split("\n")
            i = 0
            while i < len(lines):
                start, line = i, lines[i]
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1] + " " + lines[i]
                i += 1
                out += split_commands(line, page, first + start)
    return out


def test_commands_are_extracted_as_written() -> None:
    (cmd,) = split_commands(
        "NUM_GPUS=2 PRESET=z2 bash scripts/dpo.sh train.max_steps=100   # a comment", README, 1
    )
    assert cmd.env == {"NUM_GPUS": "2", "PRESET": "z2"}
    assert cmd.argv == ["bash", "scripts/dpo.sh", "train.max_steps=100"]
    first, second = split_commands(
        "printf 'a\\n' > pairs.jsonl && python -m x 'k=[a, b]' &", README, 1
    )
    assert first.argv == ["printf", "a\\n"] and second.argv == ["python", "-m", "x", "k=[a, b]"]
    every = documented_commands()
    assert any(c.page == README and c.argv == ["make", "train"] for c in every)
    assert sum(c.argv[:3] == ["python", "-m", "align_anything.train"] for c in every) > 30


class DocProblem(Exception):
    """A documented command that does not run as written; its message names the page and line."""


def require(condition: object, message: object) -> None:
    if not condition:
        raise DocProblem(str(message))


class _Parsed(Exception):
    """Raised by the patched ArgumentParser.parse_args once a tool's arguments have parsed."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def parse_tool_arguments(module_name: str, args: list[str]) -> argparse.Namespace:
    """The tool's own parser's reading of `args`: its `main` runs up to the parse and no further
    (every tool parses its arguments first). A bad argument is argparse's SystemExit."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):  # type: ignore[no-untyped-def]
        raise _Parsed(real(self, argv, namespace))

    module = importlib.import_module(module_name)
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            module.main(args)
        except _Parsed as parsed:
            return parsed.namespace
    raise DocProblem(f"{module_name}.main returned without parsing its arguments")


PYTHONS = {"python", "python3", ".venv/bin/python", ".venv-vllm/bin/python"}
# Other tools' commands: nothing of this project's to check in them.
NOT_OURS = {"printf", "tensorboard", ".", "source", "ds_report", "wandb", "cd"}
TRAIN = "align_anything.train"


@dataclass
class Checks:
    """What the quick checks leave to the slow test (importing torch and deepspeed alone takes
    seconds): the train overrides to validate, the tools' arguments and the launcher commands to
    parse, and the launch scripts to dry-run."""

    overrides: list[tuple[Command, list[str]]] = field(default_factory=list)
    tools: list[tuple[Command, str, list[str]]] = field(default_factory=list)
    launches: list[Command] = field(default_factory=list)
    scripts: list[Command] = field(default_factory=list)


def _makefile_targets() -> set[str]:
    text = (REPO_ROOT / "Makefile").read_text()
    targets = set()
    for names in re.findall(r"^([\w .-]+):(?!=)", text, flags=re.MULTILINE):
        targets.update(names.split())
    return targets


def _constraint(package: str) -> str:
    text = (REPO_ROOT / "constraints.txt").read_text()
    (version,) = re.findall(rf"^{re.escape(package)}==(\S+)$", text, flags=re.MULTILINE)
    return version


def check_python(cmd: Command, argv: list[str], checks: Checks) -> None:
    if argv[0] != "-m":
        script = REPO_ROOT / argv[0]
        require(script.is_file() and script.suffix == ".py", f"{cmd}: no script {argv[0]}")
        return
    module, args = argv[1], argv[2:]
    if module == TRAIN:
        checks.overrides.append((cmd, args))
    elif module == "align_anything":
        tool = args[0]
        if tool in ("--help", "-h", "help"):
            return
        require(tool in COMMANDS, f"{cmd}: no tool {tool!r} (tools: {', '.join(COMMANDS)})")
        if tool == "train":
            checks.overrides.append((cmd, args[1:]))
        else:
            require(importlib.util.find_spec(COMMANDS[tool][0]), f"{cmd}: no module for {tool}")
            checks.tools.append((cmd, COMMANDS[tool][0], args[1:]))
    elif module == "pytest":
        for target in (a for a in args if not a.startswith("-")):
            path, _, test = target.partition("::")
            require((REPO_ROOT / path).exists(), f"{cmd}: no test file {path}")
            if test:
                text = (REPO_ROOT / path).read_text()
                require(re.search(rf"^def {test}\(", text, re.MULTILINE), f"{cmd}: no test {test}")
    elif module.startswith("align_anything."):
        require(importlib.util.find_spec(module), f"{cmd}: no module {module}")
        checks.tools.append((cmd, module, args))
    else:
        require(module in ("venv", "pip"), f"{cmd}: unknown module {module}: add a check for it")


def check_pip(cmd: Command, args: list[str]) -> None:
    require(args[0] == "install", cmd)
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    extras = re.findall(r"^([\w-]+) = \[", section, flags=re.MULTILINE)
    for i, arg in enumerate(args):
        if arg == "-c":
            require(
                (REPO_ROOT / args[i + 1]).is_file(), f"{cmd}: no constraints file {args[i + 1]}"
            )
        if match := re.fullmatch(r"\.\[([\w,]+)\]", arg):
            unknown = set(match.group(1).split(",")) - set(extras)
            require(not unknown, f"{cmd}: no extra {unknown} in pyproject.toml")
        if match := re.fullmatch(r"torch==([\w.]+)(\+cpu)?", arg):
            pinned = _constraint("torch")
            require(match.group(1) == pinned, f"{cmd}: constraints.txt pins torch=={pinned}")


def check(cmd: Command, checks: Checks) -> None:
    """The quick checks of one command; what needs validating goes into `checks`."""
    program, *args = cmd.argv
    if program in PYTHONS:
        check_python(cmd, args, checks)
    elif program == "pip":
        check_pip(cmd, args)
    elif program == "make":
        targets = [a for a in args if not ASSIGNMENT.match(a)]
        missing = set(targets) - _makefile_targets()
        require(targets and not missing, f"{cmd}: no make target {missing or '(none given)'}")
    elif program in ("deepspeed", "torchrun"):
        checks.launches.append(cmd)
    elif program in ("bash", "sbatch"):
        script = REPO_ROOT / args[0]
        require(script.is_file(), f"{cmd}: no script {args[0]}")
        if program == "bash" and args[0].startswith("scripts/"):
            checks.scripts.append(cmd)  # each prints its command with DRY_RUN=1
    else:
        require(program in NOT_OURS, f"{cmd}: unknown program {program}: add a check for it")


def check_launch(cmd: Command, checks: Checks) -> None:
    """A deepspeed or torchrun command, read by the launcher's own parser: it starts
    align_anything.train as a module, whose overrides join `checks`."""
    program, *args = cmd.argv
    if program == "deepspeed":
        from deepspeed.launcher.runner import parse_args

        parsed = parse_args(args)
        require(parsed.module and parsed.user_script == TRAIN, f"{cmd}: not --module {TRAIN}")
        checks.overrides.append((cmd, parsed.user_args))
    else:
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(args)
        require(parsed.module and parsed.training_script == TRAIN, f"{cmd}: not -m {TRAIN}")
        checks.overrides.append((cmd, parsed.training_script_args))


def quick_checks() -> Checks:
    checks = Checks()
    problems = []
    for cmd in documented_commands():
        try:
            check(cmd, checks)
        except DocProblem as err:
            problems.append(str(err))
    assert not problems, "\n".join(problems)
    return checks


def test_every_command_names_what_exists() -> None:
    checks = quick_checks()
    assert len(checks.overrides) > 40 and len(checks.tools) > 10
    assert len(checks.launches) >= 5 and len(checks.scripts) > 10


def validate_overrides(checks: Checks, cwd: Path) -> list[str]:
    """Compose and validate every train command's overrides, in `cwd`: a scratch folder that
    holds the repository's `configs` and the `outputs/...` folders the commands read, which
    earlier documented runs write (e.g. `reward.model=outputs/rm/final` after a task=rm run)."""
    (cwd / "configs").symlink_to(REPO_ROOT / "configs")
    problems = []
    for cmd, overrides in checks.overrides:
        bad = [o for o in overrides if "=" not in o or o.startswith("-")]
        if bad:
            problems.append(f"{cmd}: not key=value overrides: {bad}")
            continue
        for key, _, value in (o.partition("=") for o in overrides):
            if value.startswith("outputs/") and key != "output_dir":
                (cwd / value).mkdir(parents=True, exist_ok=True)
        try:
            load_config(overrides)
        except ConfigError as err:
            problems.append(f"{cmd}: {err}")
    return problems


def dry_run(cmd: Command, cwd: Path) -> list[str]:
    """The command a launch script would run (DRY_RUN=1), with the documented environment."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    for name in ("NUM_GPUS", "PRESET", "TASK", "MODEL", "OUTPUT_DIR", "MASTER_PORT", "HOSTFILE"):
        env.pop(name, None)
    env.update(cmd.env, DRY_RUN="1")
    if "HOSTFILE" in env:
        env["HOSTFILE"] = str(REPO_ROOT / env["HOSTFILE"])
    done = subprocess.run(
        ["bash", str(REPO_ROOT / cmd.argv[1]), *cmd.argv[2:]], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    require(done.returncode == 0, f"{cmd}: exit {done.returncode}\n{done.stderr}")
    return shlex.split(done.stdout)


@pytest.mark.slow  # ~70 config compositions, torch's and deepspeed's imports, 16 dry runs: ~30 s
def test_every_documented_command_validates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = quick_checks()
    monkeypatch.chdir(tmp_path)
    problems = []
    for cmd in checks.scripts:  # the printed deepspeed / torchrun command, at the script's line
        try:
            checks.launches.append(Command(cmd.page, cmd.line, dry_run(cmd, tmp_path)))
        except DocProblem as err:
            problems.append(str(err))
    for cmd in checks.launches:
        try:
            check_launch(cmd, checks)
        except DocProblem as err:
            problems.append(str(err))
        except SystemExit as err:
            problems.append(f"{cmd}: {cmd.argv[0]}'s parser refused it (exit {err.code})")
    for cmd, module, args in checks.tools:
        try:
            namespace = parse_tool_arguments(module, args)
        except DocProblem as err:
            problems.append(f"{cmd}: {err}")
            continue
        except SystemExit as err:
            problems.append(f"{cmd}: {module}'s parser refused it (exit {err.code})")
            continue
        if module == COMMANDS["plan"][0]:
            checks.overrides.append((cmd, namespace.overrides))
    problems += validate_overrides(checks, tmp_path)
    assert not problems, "\n".join(problems)
