"""Reward functions for online RL (`task=grpo`, `task=rloo`): the built-in ones, loading a
user's by name, and scoring a batch of completions with clear errors.

A reward function is named `module:function` in the config
(`reward.functions=[align_anything.rewards:arith_exact, my_pkg.rewards:length_penalty]`) and is
called with keyword arguments, as TRL 1.16's `GRPOTrainer` calls its reward functions:

    fn(prompts=[...], completions=[...], **fields) -> list[float | None]

- `prompts`: each completion's prompt as the data gave it (a string, or a list of
  `{"role", "content"}` messages), repeated for the G completions of one prompt;
- `completions`: the decoded completions (strings, special tokens removed). TRL passes
  message lists for conversational prompts and also `completion_ids`, `trainer_state`, …;
  here a completion is always its text and nothing else is passed — write `**kwargs` in the
  signature so a function keeps working if a field is added;
- `fields`: every other column of the prompt data (e.g. `answer=[...]`), one list each,
  aligned with `completions`;
- the return: one number per completion, or None for "no opinion" on that one.

`score_completions` turns the returns into tensors: the total is Σ wᵢ·rᵢ over the functions
that gave a number (TRL's `nansum`); a completion for which every function returned None has
total NaN, which TRL calls unscorable: the advantage functions in `losses.rl` leave it out of
their group statistics and give it advantage 0. Anything else unusable (an exception, NaN or
inf, the wrong count, a value that is not a number) raises `RewardError`, whose one message
names the function, the data row and the completion.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from align_anything.data.builtin import ANSWER_RE, has_preferred_property
from align_anything.data.formats import describe_rows
from align_anything.errors import ConfigError, UserError, did_you_mean

RewardFunction = Callable[..., Sequence[float | None]]
# `module.sub:function` (the attribute may be dotted: `module:Class.method`).
_SPEC_RE = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
# Completions are shown up to this many characters in error messages.
_SHOWN_CHARS = 300
# Data rows named in a message about many rows (the rest are counted).
_SHOWN_ROWS = 8


class RewardError(UserError):
    """A reward function failed on a batch: raised, returned NaN/inf, the wrong count or a value
    that is not a number. The message names the function, the data row and the completion."""


class RowsFailed(Exception):
    """Raised by a reward function that knows which of its rows failed (one request of a remote
    reward: `rewards_remote`): `score_completions` names their data rows with the message, and
    does not call the function again row by row to find the failing one."""

    def __init__(self, message: str, indices: Sequence[int]) -> None:
        super().__init__(message)
        self.indices = list(indices)


# --------------------------------------------------------------------------------------------
# Built-in reward functions, for the built-in arithmetic prompts (`arith-prompts`)
# --------------------------------------------------------------------------------------------


def arith_exact(
    prompts: list, completions: list[str], answer: list, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion is exactly `Answer: <the row's answer>` (surrounding whitespace
    aside: the generation check's `has_preferred_property`), else 0.0; None for a row whose
    `answer` is None. Needs the data's `answer` field."""
    return [
        None if right is None else float(has_preferred_property({"answer": right}, completion))
        for completion, right in zip(completions, answer, strict=True)
    ]


def arith_format(prompts: list, completions: list[str], **kwargs: Any) -> list[float]:
    """Credit for the answer format alone, whatever the number, graded so that each step towards
    the exact format pays:

    - 1.0: exactly `Answer: <an integer>` (surrounding whitespace aside);
    - 0.5: begins with `Answer: <an integer>` but goes on (the model must learn to stop);
    - 0.25: contains `Answer: <an integer>` somewhere after other words;
    - 0.0: none of these.

    Used with `arith_exact` (e.g. weights [1.0, 0.5]) so that a group whose completions are all
    wrong in number still has reward differences to learn from."""
    rewards = []
    for completion in completions:
        text = completion.strip()
        if ANSWER_RE.fullmatch(text):
            rewards.append(1.0)
        elif ANSWER_RE.match(text):
            rewards.append(0.5)
        elif ANSWER_RE.search(text):
            rewards.append(0.25)
        else:
            rewards.append(0.0)
    return rewards


def length_penalty(prompts: list, completions: list[str], **kwargs: Any) -> list[float]:
    """An example of a shaping term: −0.001 per character of the completion (−0.1 for 100
    characters). Combine it with a task reward and a small weight."""
    return [-0.001 * len(completion) for completion in completions]


# --------------------------------------------------------------------------------------------
# Loading functions by name
# --------------------------------------------------------------------------------------------


def _load_one(spec: str, where: str) -> RewardFunction:
    match = _SPEC_RE.fullmatch(spec.strip()) if isinstance(spec, str) else None
    if match is None:
        raise ConfigError(
            f"{where}={spec!r} is not 'module:function'; name a function as "
            "'align_anything.rewards:arith_exact' or 'my_pkg.rewards:length_penalty'"
        )
    module_name, attribute = match.groups()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name):
            raise ConfigError(
                f"{where}={spec!r}: no module named {err.name!r}; install the package that "
                "holds it or put its folder on PYTHONPATH (the working directory counts)"
            ) from err
        raise ConfigError(f"{where}={spec!r}: importing {module_name!r} failed: {err}") from err
    except Exception as err:  # noqa: BLE001 (the user's module: any error at import is theirs)
        raise ConfigError(
            f"{where}={spec!r}: importing {module_name!r} failed: {type(err).__name__}: {err}"
        ) from err
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            names = [name for name in dir(value) if not name.startswith("_")]
            raise ConfigError(
                f"{where}={spec!r}: {module_name!r} has no {attribute!r}{did_you_mean(part, names)}"
            )
        value = getattr(value, part)
    if not callable(value):
        raise ConfigError(
            f"{where}={spec!r} is a {type(value).__name__}, not a function; name a callable "
            "fn(prompts, completions, **fields) -> list[float | None]"
        )
    return value


def load_reward_functions(names: Sequence[str]) -> list[tuple[str, RewardFunction]]:
    """Import each `module:function` in `names` (the config's `reward.functions`), in order.

    Returns (name, function) pairs; the name, used in the metric keys `rewards/<name>/mean`, is
    the function's attribute name (`arith_exact`) or, when two specs share one, the whole spec.
    Raises `ConfigError` naming the entry for a malformed spec, a module that is not found or
    fails to import, a missing attribute (with a did-you-mean) or one that is not callable.
    """
    functions = [_load_one(spec, f"reward.functions[{i}]") for i, spec in enumerate(names)]
    short = [spec.strip().rsplit(":", 1)[1] for spec in names]
    return [
        (name if short.count(name) == 1 else spec.strip(), function)
        for name, spec, function in zip(short, names, functions, strict=True)
    ]


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


def _shown(completion: str) -> str:
    if len(completion) > _SHOWN_CHARS:
        completion = completion[:_SHOWN_CHARS] + f"… ({len(completion)} characters)"
    return repr(completion)


def _where(name: str, row_ids: Sequence[int | str], completions: Sequence[str], index: int) -> str:
    row = row_ids[index]
    where = row if isinstance(row, str) else f"data row {row}"
    return f"reward function {name!r} on {where} (completion {_shown(completions[index])})"


def _rows_named(row_ids: Sequence[int | str], indices: Sequence[int]) -> str:
    """The distinct data rows of `indices` ("lines 3, 4"; G completions share their prompt's
    row), at most _SHOWN_ROWS of them, and how many completions."""
    labels = [row if isinstance(row, str) else f"data row {row}" for row in row_ids]
    distinct = list(dict.fromkeys(labels[i] for i in indices))
    shown = describe_rows(distinct[:_SHOWN_ROWS])
    more = f" and {len(distinct) - _SHOWN_ROWS} more" if len(distinct) > _SHOWN_ROWS else ""
    count = len(indices)
    return f"{shown}{more} ({count} completion{'s' if count != 1 else ''})"


def _call(
    function: RewardFunction,
    prompts: Sequence,
    completions: Sequence[str],
    fields: dict[str, Sequence],
    indices: Sequence[int] | None = None,
) -> Any:
    if indices is not None:
        prompts = [prompts[i] for i in indices]
        completions = [completions[i] for i in indices]
        fields = {key: [values[i] for i in indices] for key, values in fields.items()}
    return function(prompts=list(prompts), completions=list(completions), **fields)


def _failing_row(
    function: RewardFunction, prompts: Sequence, completions: Sequence[str], fields: dict
) -> tuple[int, BaseException] | None:
    """The first row on which `function`, called on that row alone, raises (to name the row
    when a call on the whole batch raised); None when every row alone succeeds."""
    for index in range(len(completions)):
        try:
            _call(function, prompts, completions, fields, [index])
        except Exception as err:  # noqa: BLE001 (the user's function)
            return index, err
    return None


def _as_list(returned: Any) -> list | None:
    if isinstance(returned, (list, tuple)):
        return list(returned)
    if hasattr(returned, "tolist") and getattr(returned, "ndim", None) == 1:
        return returned.tolist()  # a 1-D tensor or numpy array
    return None


def _rewards_of(
    name: str,
    function: RewardFunction,
    prompts: Sequence,
    completions: Sequence[str],
    fields: dict[str, Sequence],
    row_ids: Sequence[int | str],
) -> list[float]:
    """One function's rewards as floats (NaN for None), or a RewardError."""
    try:
        returned = _call(function, prompts, completions, fields)
    except RowsFailed as err:
        raise RewardError(
            f"reward {name!r} on {_rows_named(row_ids, err.indices)}: {err}"
        ) from None
    except Exception as err:  # noqa: BLE001 (the user's function)
        found = _failing_row(function, prompts, completions, fields)
        index, cause = found if found is not None else (0, err)
        alone = "" if found is not None else " (on the whole batch; each row alone succeeds)"
        raise RewardError(
            f"{_where(name, row_ids, completions, index)} raised "
            f"{type(cause).__name__}: {cause}{alone}"
        ) from err
    values = _as_list(returned)
    if values is None or len(values) != len(completions):
        got = (
            f"{len(values)} values"
            if values is not None
            else f"a {type(returned).__name__}, not a list"
        )
        raise RewardError(
            f"{_where(name, row_ids, completions, 0)} and the {len(completions) - 1} others of "
            f"the batch: returned {got} for {len(completions)} completions; return one float "
            "(or None) per completion"
        )
    rewards = []
    for index, value in enumerate(values):
        if value is None:
            rewards.append(math.nan)
            continue
        if isinstance(value, (torch.Tensor,)) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise RewardError(
                f"{_where(name, row_ids, completions, index)} returned {value!r} "
                f"({type(value).__name__}); return a float or None"
            )
        if not math.isfinite(float(value)):
            raise RewardError(
                f"{_where(name, row_ids, completions, index)} returned {float(value)}; return a "
                "finite float, or None for no opinion"
            )
        rewards.append(float(value))
    return rewards


def score_completions(
    functions: Sequence[tuple[str, RewardFunction]],
    weights: Sequence[float],
    *,
    prompts: Sequence,
    completions: Sequence[str],
    fields: dict[str, Sequence],
    row_ids: Sequence[int | str],
) -> tuple[Tensor, dict[str, Tensor]]:
    """Score N completions with every reward function.

    Args:
        functions: (name, function) pairs, from `load_reward_functions`.
        weights: one per function (the config's `reward.weights`; all 1.0 when not given).
        prompts, completions: N each, aligned (a prompt repeated for its G completions).
        fields: the prompt data's other columns, each a list of N values.
        row_ids: N data rows for messages: the prompt's row label in the user's file
            (`"line 12"`, the encoded row's `source_row`) or a row number (`data row 12`).
    Returns:
        (total [N] float32: Σ wᵢ·rᵢ over the functions that gave a number, NaN where every
        function returned None; {name: [N] float32 with NaN for None}).
    Raises:
        RewardError: a function raised, returned NaN/inf, the wrong count or a non-number.
        ValueError: arguments that do not line up (a bug of the caller, not the user's).
    """
    count = len(completions)
    if len(weights) != len(functions) or not functions:
        raise ValueError(f"{len(weights)} weights for {len(functions)} reward functions")
    lengths = {len(prompts), len(row_ids), *(len(values) for values in fields.values())}
    if lengths != {count}:
        raise ValueError(f"prompts, row_ids and every field must have {count} entries")
    per_function = {
        name: torch.tensor(
            _rewards_of(name, function, prompts, completions, fields, row_ids),
            dtype=torch.float32,
        )
        for name, function in functions
    }
    stacked = torch.stack(list(per_function.values()), dim=1)  # [N, F]
    weight = torch.tensor(list(weights), dtype=torch.float32)
    total = (stacked * weight).nansum(dim=1)
    total[torch.isnan(stacked).all(dim=1)] = math.nan
    return total, per_function
