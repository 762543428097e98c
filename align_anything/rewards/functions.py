"""Reward functions for online RL (`task=grpo`, `task=rloo`, `task=ppo`, and for images
`task=flow_grpo`, `dance_grpo`, `diffusion_nft`): the built-in ones, loading a user's by name,
and scoring a batch of completions or images with clear errors.

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

The text-to-image tasks call the same functions the same way with `images` in place of
`completions`:

    fn(prompts=[...], images=[...], **fields) -> list[float | None]

- `prompts`: each image's prompt (the caption string), repeated for the G images of one prompt;
- `images`: the generated images, `PIL.Image.Image` in mode "RGB" at the run's resolution
  (`numpy.asarray(image)` is [H, W, 3] uint8), one per prompt entry;
- `fields` and the return as above. Weights, None, timeouts and invalid values are handled by
  the same code as for text (`score_completions(..., images=...)`); a message names the image
  by its size instead of quoting a completion.

An image-text or audio-text policy's functions also get what each row showed the model, so a
rule can check an answer against the picture or the sound (`MediaSupport.prompt_media`):

- `prompt_images`: per completion, the list of its row's images in the row's order, each a
  `PIL.Image.Image` in mode "RGB" as displayed (EXIF orientation applied; the picture as the
  data gave it, before the processor resized it); [] for a row without images. The G
  completions of one prompt share the same objects. (The text-to-image tasks' `images=` are
  something else: the images the model generated, in place of `completions`.)
- `prompt_audio`: the same for audio, each clip a float32 numpy array, mono, at the model's
  sampling rate.

They are passed only when the policy takes that medium (a text-only run's functions never see
them); a remote reward gets them too, images as base64 PNG (`rewards.remote`).

`score_completions` turns the returns into tensors: the total is Σ wᵢ·rᵢ over the functions
that gave a number (TRL's `nansum`); a completion for which every function returned None has
total NaN, which TRL calls unscorable: the advantage functions in `losses.rl` leave it out of
their group statistics and give it advantage 0. Anything else unusable (an exception, NaN or
inf, also a value beyond float32's range, the wrong count, a value that is not a number)
raises `RewardError`, whose one message names the function, the data row and the completion.
A call that does not return within `reward.timeout_seconds` is interrupted and raises
`RewardError` naming the function and the rows of the call.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import Tensor

from align_anything.data.formats import describe_rows
from align_anything.errors import ConfigError, Preempted, UserError, did_you_mean
from align_anything.training import preemption

RewardFunction = Callable[..., Sequence[float | None]]
# `module.sub:function` (the attribute may be dotted: `module:Class.method`).
_SPEC_RE = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
# Completions are shown up to this many characters in error messages.
_SHOWN_CHARS = 300
# Data rows named in a message about many rows (the rest are counted).
_SHOWN_ROWS = 5


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


class ImageOutputs(list):
    """The images of a batch (PIL, RGB): what the reward functions are given as `images=`,
    and what a message names ("image 32x32") instead of quoting a completion."""


def _noun(outputs: Sequence[Any]) -> str:
    return "image" if isinstance(outputs, ImageOutputs) else "completion"


def _shown(completion: Any) -> str:
    if not isinstance(completion, str):
        size = getattr(completion, "size", None)
        return f"{size[0]}x{size[1]}" if size else type(completion).__name__
    if len(completion) > _SHOWN_CHARS:
        completion = completion[:_SHOWN_CHARS] + f"… ({len(completion)} characters)"
    return repr(completion)


def _label(row: int | str) -> str:
    return row if isinstance(row, str) else f"data row {row}"


def _where(name: str, row_ids: Sequence[int | str], completions: Sequence[str], index: int) -> str:
    where = _label(row_ids[index])
    noun = _noun(completions)
    return f"reward function {name!r} on {where} ({noun} {_shown(completions[index])})"


# ---- calling a user's function with a deadline
#
# The function runs in the main thread, as TRL calls it: libraries that bound their own work
# with signal.alarm (math_verify, the HumanEval `time_limit`) only work there. A watchdog thread
# waits for the deadline and then interrupts the call with a signal, whose handler raises
# `_Interrupted` inside the function (a BaseException: a function's own `except Exception` does
# not swallow it). Written by hand: the packages that time out a call (func_timeout, stopit,
# wrapt_timeout_decorator) run it in another thread or cannot interrupt a blocking system call.
_WATCHDOG_SIGNAL = signal.SIGUSR2
# How often the watchdog looks at the deadline (a stop signal may move it earlier).
_WATCH_PERIOD_S = 0.25


class _Interrupted(BaseException):
    """Raised inside a reward function by the watchdog's signal once its deadline passed."""


@dataclass
class RewardCall:
    """The reward-function call in progress in the main thread (see `active_call`)."""

    name: str
    rows: str
    timeout_s: float
    deadline: float  # time.monotonic()
    running: bool = True  # the watchdog's signal interrupts the call only while this holds
    expired: bool = False
    stop_signal: int = 0  # the stop signal that cut the call short (0: its own timeout)

    def cut_short(self, seconds: float, signum: int) -> None:
        """A stop signal came: give the call at most `seconds` more, then abandon it (the run
        stops with `Preempted`). Safe to call from a signal handler."""
        if time.monotonic() + seconds < self.deadline:
            self.deadline = time.monotonic() + seconds
            self.stop_signal = signum

    def error(self) -> BaseException:
        """What the run raises for a call past its deadline."""
        if self.stop_signal:
            name = signal.Signals(self.stop_signal).name
            return Preempted(
                f"stopped by {name}: reward function {self.name!r} was still running on {self.rows} "
                "when the signal came and did not return in the time a scheduler leaves before it "
                "kills the job, so this step was abandoned (no checkpoint of it was written); "
                "resume=auto continues from the newest complete checkpoint",
                self.stop_signal,
            )
        return RewardError(
            f"reward function {self.name!r} did not return within reward.timeout_seconds="
            f"{self.timeout_s:g} on {self.rows}. Make it faster (or bound its own work), or "
            "raise reward.timeout_seconds"
        )


_active: RewardCall | None = None


def active_call() -> RewardCall | None:
    """The reward-function call the main thread is in right now (None: none). A stop-signal
    handler uses it to cut a hung call short instead of waiting for the step to end."""
    return _active


def _interrupt_expired_call(signum: int, frame: FrameType | None) -> None:
    call = _active
    if call is not None and call.running and call.expired:
        call.running = False  # at most once: never again in the caller's own code
        raise _Interrupted


def _watch(call: RewardCall, done: threading.Event, main_thread: int) -> None:
    while not done.wait(min(_WATCH_PERIOD_S, max(0.0, call.deadline - time.monotonic()))):
        if time.monotonic() >= call.deadline:
            call.expired = True
            signal.pthread_kill(main_thread, _WATCHDOG_SIGNAL)
            return


def _rows_text(row_ids: Sequence[int | str]) -> str:
    """The distinct data rows of a call ("lines 3, 4": a prompt's G completions share their
    prompt's row), at most _SHOWN_ROWS of them, and how many completions."""
    labels = list(dict.fromkeys(map(_label, row_ids)))
    shown = describe_rows(labels[:_SHOWN_ROWS])
    more = f" and {len(labels) - _SHOWN_ROWS} more" if len(labels) > _SHOWN_ROWS else ""
    count = len(row_ids)
    return f"{shown}{more} ({count} completion{'s' if count != 1 else ''})"


def _call_with_deadline(
    name: str, function: RewardFunction, kwargs: dict[str, Any], rows: str,
    timeout_s: float | None,
) -> Any:  # fmt: skip
    """`function(**kwargs)`, abandoned after `timeout_s` seconds (None: no limit) or, after a
    stop signal, sooner: `RewardError` or `Preempted` then. Outside the main thread (no signal
    handlers there) the call runs without a limit."""
    global _active
    if threading.current_thread() is not threading.main_thread():
        return function(**kwargs)
    limit = math.inf if timeout_s is None else timeout_s  # a stop signal may still cut it short
    call = RewardCall(name, rows, limit, deadline=time.monotonic() + limit)
    done = threading.Event()
    watchdog = threading.Thread(
        target=_watch, args=(call, done, threading.main_thread().ident), daemon=True,
        name=f"reward-deadline-{name}",
    )  # fmt: skip
    previous = signal.signal(_WATCHDOG_SIGNAL, _interrupt_expired_call)
    _active = call
    preemption.waiting_on(call)
    result = None
    try:
        watchdog.start()
        try:
            result = function(**kwargs)
        finally:
            call.running = False
    except BaseException:
        # Past the deadline, whatever came out (our _Interrupted, or what the function's own
        # handler turned it into) is reported as the timeout below.
        if not call.expired:
            raise
    finally:
        call.running = False
        done.set()
        watchdog.join()  # no watchdog signal arrives after the handler is restored
        _active = None
        preemption.waiting_on(None)
        signal.signal(_WATCHDOG_SIGNAL, previous)
    if call.expired:  # also when the function swallowed the interruption and returned
        raise call.error()
    return result


def _call(
    name: str,
    function: RewardFunction,
    prompts: Sequence,
    completions: Sequence[str],
    fields: dict[str, Sequence],
    row_ids: Sequence[int | str],
    timeout_s: float | None,
    indices: Sequence[int] | None = None,
) -> Any:
    if indices is not None:
        prompts = [prompts[i] for i in indices]
        completions = type(completions)(completions[i] for i in indices)
        fields = {key: [values[i] for i in indices] for key, values in fields.items()}
        row_ids = [row_ids[i] for i in indices]
    key = "images" if isinstance(completions, ImageOutputs) else "completions"
    kwargs = {"prompts": list(prompts), key: list(completions), **fields}
    return _call_with_deadline(name, function, kwargs, _rows_text(row_ids), timeout_s)


# A function that raises SystemExit (sys.exit in a script's code path) fails like any other:
# it must return its values, and the run must not end with exit status 0 as if it succeeded.
_FUNCTION_FAILED = (Exception, SystemExit)


def _raised(cause: BaseException) -> str:
    if isinstance(cause, SystemExit):
        return f"raised SystemExit({cause.code!r}) (it must return its values, not exit)"
    return f"raised {type(cause).__name__}: {cause}"


def _failing_row(
    name: str, function: RewardFunction, prompts: Sequence, completions: Sequence[str],
    fields: dict, row_ids: Sequence[int | str], timeout_s: float | None,
) -> tuple[int, BaseException] | None:  # fmt: skip
    """The first row on which `function`, called on that row alone, raises (to name the row
    when a call on the whole batch raised); None when every row alone succeeds."""
    for index in range(len(completions)):
        try:
            _call(name, function, prompts, completions, fields, row_ids, timeout_s, [index])
        except _FUNCTION_FAILED as err:  # the user's function
            if isinstance(err, RewardError):  # its deadline passed
                raise
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
    timeout_s: float | None,
) -> list[float]:
    """One function's rewards as floats (NaN for None), or a RewardError."""
    call = (name, function, prompts, completions, fields, row_ids, timeout_s)
    try:
        returned = _call(*call)
    except RewardError:  # the deadline passed
        raise
    except RowsFailed as err:  # a reward server named the rows it failed on
        raise RewardError(
            f"reward {name!r} on {_rows_text([row_ids[i] for i in err.indices])}: {err}"
        ) from None
    except _FUNCTION_FAILED as err:  # the user's function
        found = _failing_row(*call)
        index, cause = found if found is not None else (0, err)
        alone = "" if found is not None else " (on the whole batch; each row alone succeeds)"
        raise RewardError(
            f"{_where(name, row_ids, completions, index)} {_raised(cause)}{alone}"
        ) from (None if isinstance(err, SystemExit) else err)
    values = _as_list(returned)
    if values is None or len(values) != len(completions):
        got = (
            f"{len(values)} values"
            if values is not None
            else f"a {type(returned).__name__}, not a list"
        )
        raise RewardError(
            f"{_where(name, row_ids, completions, 0)} and the {len(completions) - 1} others of "
            f"the batch: returned {got} for {len(completions)} {_noun(completions)}s; return "
            f"one float (or None) per {_noun(completions)}"
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
        if not math.isfinite(torch.tensor(float(value), dtype=torch.float32).item()):
            raise RewardError(
                f"{_where(name, row_ids, completions, index)} returned {float(value):g}, beyond "
                f"float32's range (±{torch.finfo(torch.float32).max:.3g}), in which rewards are "
                "computed: it would become inf. Return a finite float of smaller magnitude, or "
                "None for no opinion"
            )
        rewards.append(float(value))
    return rewards


def score_completions(
    functions: Sequence[tuple[str, RewardFunction]],
    weights: Sequence[float],
    *,
    prompts: Sequence,
    completions: Sequence[str] | None = None,
    fields: dict[str, Sequence],
    row_ids: Sequence[int | str],
    timeout_s: float | None = None,
    images: Sequence[Any] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Score N completions (or N images: `images` in place of `completions`) with every reward
    function.

    Args:
        functions: (name, function) pairs, from `load_reward_functions`.
        weights: one per function (the config's `reward.weights`; all 1.0 when not given).
        prompts, completions: N each, aligned (a prompt repeated for its G completions).
        images: N images (PIL, RGB) instead of completions: the functions get `images=`.
        fields: the prompt data's other columns, each a list of N values.
        row_ids: N data rows for messages: the prompt's row label in the user's file
            (`"line 12"`, the encoded row's `source_row`) or a row number (`data row 12`).
        timeout_s: the longest one function's call may take (`reward.timeout_seconds`; None:
            no limit). Enforced in the main thread, where the call is interrupted.
    Returns:
        (total [N] float32: Σ wᵢ·rᵢ over the functions that gave a number, NaN where every
        function returned None; {name: [N] float32 with NaN for None}).
    Raises:
        RewardError: a function raised (SystemExit included), did not return within
            `timeout_s`, returned NaN/inf (also beyond float32's range), the wrong count or a
            non-number, or the weighted total overflowed float32.
        Preempted: a stop signal (SIGTERM/SIGINT) cut a hung call short (`active_call`).
        ValueError: arguments that do not line up (a bug of the caller, not the user's).
    """
    if (completions is None) == (images is None):
        raise ValueError("give exactly one of completions= and images=")
    if images is not None:
        completions = ImageOutputs(images)
    assert completions is not None
    count = len(completions)
    if len(weights) != len(functions) or not functions:
        raise ValueError(f"{len(weights)} weights for {len(functions)} reward functions")
    lengths = {len(prompts), len(row_ids), *(len(values) for values in fields.values())}
    if lengths != {count}:
        raise ValueError(f"prompts, row_ids and every field must have {count} entries")
    per_function = {
        name: torch.tensor(
            _rewards_of(name, function, prompts, completions, fields, row_ids, timeout_s),
            dtype=torch.float32,
        )
        for name, function in functions
    }
    stacked = torch.stack(list(per_function.values()), dim=1)  # [N, F]
    weight = torch.tensor(list(weights), dtype=torch.float32)
    total = (stacked * weight).nansum(dim=1)
    total[torch.isnan(stacked).all(dim=1)] = math.nan
    overflowed = torch.isinf(total).nonzero().flatten().tolist()
    if overflowed:
        index = overflowed[0]
        terms = ", ".join(
            f"{name} {stacked[index, k].item():g} x {w:g}"
            for k, (name, w) in enumerate(zip(per_function, weights, strict=True))
        )
        raise RewardError(
            f"the weighted reward of {_label(row_ids[index])} ({_noun(completions)} "
            f"{_shown(completions[index])}) is inf in "
            f"float32: {terms}. Lower reward.weights or the rewards' magnitude"
        )
    return total, per_function
