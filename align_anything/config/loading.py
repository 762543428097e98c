"""Loading the run configuration: Hydra composition, DeepSpeed presets, command-line overrides,
and one validation pass.

Flow: CLI overrides -> Hydra compose (train.yaml + task/<task>.yaml) -> value overrides applied
here -> preset JSON loaded (duplicate keys rejected) with `deepspeed.*` overrides -> pydantic
`RunConfig` (extra="forbid"). Every problem found on the way is collected and reported in one
`ConfigError`, with the full key path, the value given and what is allowed.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from align_anything.config.problems import format_validation_error
from align_anything.config.run import (
    CONFIG_DIR,
    ONLINE_TASKS,
    REWARD_TASKS,
    TASK_SECTIONS,
    RunConfig,
    available_tasks,
)
from align_anything.errors import ConfigError, did_you_mean

PRESET_DIR = CONFIG_DIR / "deepspeed"
# deepspeed=auto: the planner chooses among the shipped presets.
AUTO_PRESET = "auto"


def available_presets() -> list[str]:
    """Preset names shipped in configs/deepspeed/ (ds_<name>_config.json)."""
    return sorted(p.name[3 : -len("_config.json")] for p in PRESET_DIR.glob("ds_*_config.json"))


def preset_path(name: str) -> Path:
    """The shipped file of a preset name."""
    return PRESET_DIR / f"ds_{name}_config.json"


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key '{key}'")
        seen[key] = value
    return seen


def load_preset(spec: str) -> tuple[dict[str, Any], str]:
    """Load a DeepSpeed preset by name (`z3`) or path (`my/ds.json`); returns (dict, source path).

    JSON is parsed with a duplicate-key check: json.load silently keeps the last of two equal
    keys, which hides copy-paste mistakes in hand-edited presets.
    """
    if not spec.strip():
        raise ConfigError(
            f"deepspeed={spec!r}: the value is empty. Give a shipped preset "
            f"({', '.join(available_presets())}), {AUTO_PRESET}, or a path to a DeepSpeed JSON file."
        )
    path = Path(spec).expanduser()
    if spec in available_presets():
        path = preset_path(spec)
    elif not (spec.endswith(".json") or path.exists()):
        raise ConfigError(
            f"deepspeed={spec!r}: unknown preset{did_you_mean(spec, available_presets())}. "
            f"Shipped presets: {', '.join(available_presets())}; {AUTO_PRESET} (the lowest ZeRO "
            "stage that fits memory); or give a path to a JSON file."
        )
    if not path.is_file():
        raise ConfigError(f"deepspeed={spec!r}: file {path} does not exist.")
    try:
        data = json.loads(path.read_text(), object_pairs_hook=_reject_duplicate_keys)
    except (json.JSONDecodeError, ValueError) as err:
        raise ConfigError(f"deepspeed preset {path}: invalid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"deepspeed preset {path}: expected a JSON object at the top level.")
    return data, str(path)


def _parse_overrides(overrides: Sequence[str]) -> tuple[list[tuple[str, Any]], list[str]]:
    """Parse `key=value` overrides with Hydra's grammar (typed values, lists, quoting); returns
    them and a note for each key given more than once."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed: list[tuple[str, Any]] = []
    problems: list[str] = []
    given: dict[str, list[str]] = {}  # key -> the overrides that gave it, in order
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as err:
            problems.append(f"cannot parse override {text!r}: {err}{_quote_hint(text)}")
            continue
        if override.is_delete():
            key = override.get_key_element().lstrip("~")
            problems.append(
                f"override {text!r}: deleting keys is not supported; every key has a default. "
                f"Leave the override out for the default, or set a value: {key}=<value>"
            )
            continue
        if override.is_sweep_override():
            problems.append(
                f"override {text!r}: a comma-separated value is a sweep in Hydra's syntax, and "
                "sweeps are not supported; write a list in brackets (key=[a,b]) or quote the "
                "value (key='a,b')"
            )
            continue
        key = override.get_key_element().lstrip("+")
        # A repeated key keeps its last value, as Hydra does (`a=1 a=2` gives 2), so a wrapper
        # script's defaults followed by the user's own overrides work; the start-up summary
        # says so, since a silent last value can hide a typo or an edit to the wrong copy.
        if key in given:
            given[key].append(text)
        else:
            given[key] = [text]
        parsed.append((key, override.value()))
    if problems:
        raise ConfigError("\n".join(problems))
    notes = [
        f"{key} given {len(texts)} times ({', '.join(texts)}): the last is used"
        for key, texts in given.items() if len(texts) > 1
    ]  # fmt: skip
    return parsed, notes


def _set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    node = target
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def merge_nested(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with `overrides` merged in, key by key at every depth."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_nested(merged[key], value)
        else:
            merged[key] = value
    return merged


def _to_plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _resolved(composed: Any, overrides: Sequence[str]) -> dict[str, Any]:
    """The composed config as plain data with every `${...}` resolved; a reference to a key
    that does not exist is a ConfigError naming the override that holds it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    try:
        return OmegaConf.to_container(composed, resolve=True)  # type: ignore[return-value]
    except InterpolationResolutionError as err:
        key = str(getattr(err, "full_key", "") or "")
        given = next((o for o in overrides if o.lstrip("+").split("=", 1)[0] == key), key)
        reason = str(err).splitlines()[0]
        raise ConfigError(
            f"{given!r}: {reason}. ${{...}} refers to another key of the configuration (e.g. "
            "output_dir=outputs/${task}); to write a literal '${' in a value, escape it as "
            "'\\${'"
        ) from None


def _quote_hint(text: str) -> str:
    """How to write override `text` so that Hydra's grammar takes its value as one string."""
    key, sep, value = text.partition("=")
    if not sep or value[:1] in ("'", '"'):
        return ""
    quote = "'" if "'" not in value else '"'
    inner = value if quote not in value else value.replace(quote, "\\" + quote)
    hydra = f"{key}={quote}{inner}{quote}"
    shell = f'"{hydra}"' if quote == "'" and not set('"$`\\') & set(hydra) else shlex.quote(hydra)
    return (
        f". A value with spaces or characters such as ! # & ( [ ' must be quoted for Hydra: "
        f"{hydra} (on a shell command line, quoted once more: {shell})"
    )


def load_config(overrides: Sequence[str] = ()) -> RunConfig:
    """Compose, override and validate the run configuration.

    Raises one ConfigError listing every problem found.
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    parsed, repeated = _parse_overrides(overrides)
    problems: list[str] = []
    task = next((str(v) for k, v in parsed if k == "task"), "sft")
    task_known = task in available_tasks()
    if not task_known:
        problems.append(
            f"task={task!r}: unknown task{did_you_mean(task, available_tasks())}. "
            f"Available tasks: {', '.join(available_tasks())}."
        )
        task = "sft"  # compose with the default task so the other keys are still checked
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        composed = compose(config_name="train", overrides=[f"task={task}"])
    OmegaConf.set_struct(composed, False)

    preset_overrides: list[tuple[str, Any]] = []
    explicit: set[str] = set()
    for key, value in parsed:
        if key == "task":
            continue
        if key.startswith("deepspeed."):
            preset_overrides.append((key.removeprefix("deepspeed."), _to_plain(value)))
            continue
        OmegaConf.update(composed, key, value, merge=False, force_add=True)
        explicit.add(key)
    raw: dict[str, Any] = _resolved(composed, overrides)
    for name in TASK_SECTIONS:
        if name != task and raw.get(name) is not None:
            if task_known:
                problems.append(
                    f"{name}.*: section '{name}' is set but task is '{task}': remove the "
                    f"{name}.* keys or choose task={name}"
                )
            raw.pop(name)
    if task not in REWARD_TASKS and raw.get("reward") is not None:
        if task_known:
            problems.append(
                f"reward.*: the reward section is for online RL (task={' or task='.join(REWARD_TASKS)}); "
                f"task is '{task}': remove the reward.* keys"
            )
        raw.pop("reward")
    if task not in ONLINE_TASKS and raw.get("rollout") is not None:
        if task_known:
            problems.append(
                f"rollout.*: the rollout section is for online RL (task={' or task='.join(ONLINE_TASKS)}); "
                f"task is '{task}': remove the rollout.* keys"
            )
        raw.pop("rollout")
    preset_spec = str(raw.get("deepspeed", "z0"))
    try:
        # auto: the trainer picks a preset once it knows the model and world size (plan.py);
        # until then the dict holds only the `deepspeed.*` overrides, applied on top later.
        preset, source = (
            ({}, AUTO_PRESET) if preset_spec == AUTO_PRESET else load_preset(preset_spec)
        )
        for key, value in preset_overrides:
            _set_dotted(preset, key, value)
        raw["deepspeed"] = preset
        raw["deepspeed_source"] = source
    except ConfigError as err:
        problems.append(str(err))
        raw["deepspeed"] = {}
        raw["deepspeed_source"] = preset_spec
    raw["explicit_keys"] = frozenset(explicit)
    raw["override_notes"] = tuple(repeated)

    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as err:
        problems.extend(format_validation_error(err, raw))
        config = None
    if problems or config is None:
        count = len(problems)
        header = f"{count} problem{'s' if count != 1 else ''} in the configuration:"
        raise ConfigError("\n".join([header, *(f"  - {p}" for p in problems)]))
    return config
