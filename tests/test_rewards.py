"""Reward functions (align_anything/rewards.py): the built-ins, loading by name, scoring, and
the error messages (each must name the function, the data row and the completion)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from align_anything.errors import ConfigError, UserError
from align_anything.rewards import arith_exact, arith_format, length_penalty
from align_anything.rewards.functions import (
    RewardError,
    load_reward_functions,
    score_completions,
)

PROMPTS = ["What number comes after 41?"] * 2 + ["Which is larger, 56 or 20?"] * 2
COMPLETIONS = ["Answer: 42", "The number after 41 is 42.", "Answer: 56. Yes.", "Answer: 20"]
FIELDS = {"answer": [42, 42, 56, 56]}
ROW_IDS = [7, 7, 3, 3]


def _score(functions, weights=None, completions=COMPLETIONS, fields=FIELDS):
    return score_completions(
        functions,
        weights or [1.0] * len(functions),
        prompts=PROMPTS,
        completions=completions,
        fields=fields,
        row_ids=ROW_IDS,
    )


# --- built-ins --------------------------------------------------------------------------------


def test_arith_exact() -> None:
    # Only the exact format with the right number scores; None answer → no opinion.
    got = arith_exact(
        PROMPTS, [" Answer: 42\n", "Answer: 43", "56", "Answer: 56"], [42, 42, 56, None]
    )
    assert got == [1.0, 0.0, 0.0, None]


def test_arith_format_grades_the_format() -> None:
    completions = ["Answer: 7", "Answer: 7. I hope this helps!", "So... Answer: 7", "seven"]
    assert arith_format(PROMPTS, completions) == [1.0, 0.5, 0.25, 0.0]


def test_length_penalty() -> None:
    assert length_penalty(PROMPTS, ["abcd", ""]) == pytest.approx([-0.004, 0.0])


# --- loading by name ---------------------------------------------------------------------------


def test_load_builtins_by_name() -> None:
    loaded = load_reward_functions(
        [
            "align_anything.rewards:arith_exact",
            "align_anything.rewards:arith_format",
        ]
    )
    assert loaded == [("arith_exact", arith_exact), ("arith_format", arith_format)]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            import math
            NOT_A_FUNCTION = 3
            def length_penalty(prompts, completions, **kwargs):
                return [-len(c) for c in completions]
            def raises_on_long(prompts, completions, **kwargs):
                return [1.0 / (10 - len(c)) for c in completions]
            def nan_for_wrong(prompts, completions, answer, **kwargs):
                return [1.0 if c == f"Answer: {a}" else math.nan for c, a in zip(completions, answer)]
            def too_few(prompts, completions, **kwargs):
                return [0.0] * (len(completions) - 1)
            def words(prompts, completions, **kwargs):
                return ["good" if "42" in c else 0.0 for c in completions]
            def abstains(prompts, completions, **kwargs):
                return [None if c.startswith("Answer") else 0.5 for c in completions]
            def huge(prompts, completions, **kwargs):
                return [1.0, 1e39, 1.0, 1.0][: len(completions)]
            def large(prompts, completions, **kwargs):
                return [3e38] * len(completions)
            def exits(prompts, completions, **kwargs):
                raise SystemExit(0)
            def sleeps(prompts, completions, **kwargs):
                import time
                time.sleep(3600)
            def spins(prompts, completions, **kwargs):
                while True:
                    pass
            def swallows(prompts, completions, **kwargs):
                import time
                try:
                    time.sleep(3600)
                except BaseException:
                    pass
                return [0.0] * len(completions)
            def converts(prompts, completions, **kwargs):
                import time
                try:
                    time.sleep(3600)
                except BaseException:
                    raise ValueError("interrupted")
            """
        )
    )
    (tmp_path / "broken_rewards.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_duplicate_short_names_use_the_whole_spec(user_module) -> None:
    loaded = load_reward_functions(
        ["my_rewards:length_penalty", "align_anything.rewards:length_penalty"]
    )
    assert [name for name, _ in loaded] == [
        "my_rewards:length_penalty",
        "align_anything.rewards:length_penalty",
    ]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("my_rewards.length_penalty", r"reward.functions\[0\]='my_rewards.length_penalty' is not 'module:function'"),
        ("my_rewards:", r"is not 'module:function'"),
        ("no_such_pkg_abc.rewards:fn", r"no module named 'no_such_pkg_abc'.*PYTHONPATH"),
        ("broken_rewards:fn", r"importing 'broken_rewards' failed: No module named 'not_installed_dependency_xyz'"),
        ("my_rewards:lenght_penalty", r"'my_rewards' has no 'lenght_penalty' \(did you mean 'length_penalty'\?\)"),
        ("my_rewards:NOT_A_FUNCTION", r"is a int, not a function"),
    ],
)  # fmt: skip
def test_load_errors(user_module, spec: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_reward_functions([spec])


# --- scoring -----------------------------------------------------------------------------------


def test_weights_sum_the_functions() -> None:
    # arith_exact: [1, 0, 0, 0]; arith_format: [1, 0, 0.5, 1].
    # total = 1.0·exact + 0.5·format = [1.5, 0, 0.25, 0.5].
    functions = load_reward_functions(
        [
            "align_anything.rewards:arith_exact",
            "align_anything.rewards:arith_format",
        ]
    )
    total, per_function = _score(functions, [1.0, 0.5])
    assert total.tolist() == [1.5, 0.0, 0.25, 0.5]
    assert per_function["arith_exact"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert per_function["arith_format"].tolist() == [1.0, 0.0, 0.5, 1.0]
    assert total.dtype == torch.float32


def test_none_is_no_opinion(user_module) -> None:
    # abstains: [None, 0.5, None, None]; arith_format: [1, 0, 0.5, 1].
    # total ignores the None terms: [1, 0.5, 0.5, 1].
    functions = load_reward_functions(
        ["my_rewards:abstains", "align_anything.rewards:arith_format"]
    )
    total, per_function = _score(functions)
    assert total.tolist() == [1.0, 0.5, 0.5, 1.0]
    assert torch.isnan(per_function["abstains"]).tolist() == [True, False, True, True]
    # Alone, a row where every function says None is unscorable: NaN (TRL's convention).
    total, _ = _score(load_reward_functions(["my_rewards:abstains"]))
    assert torch.isnan(total).tolist() == [True, False, True, True]
    assert total[1].item() == 0.5


def _error_of(spec: str, completions=COMPLETIONS) -> str:
    with pytest.raises(RewardError) as caught:
        _score(load_reward_functions([spec]), completions=completions)
    assert isinstance(caught.value, UserError)
    return str(caught.value)


def test_error_when_a_function_raises(user_module) -> None:
    # 1 / (10 − len): the second completion has 26 characters, fine; a 10-character one fails.
    completions = ["Answer: 4", "0123456789", "Answer: 56", "x"]
    message = _error_of("my_rewards:raises_on_long", completions)
    assert "'raises_on_long'" in message
    assert "data row 7" in message and "'0123456789'" in message
    assert "ZeroDivisionError" in message


def test_error_when_a_function_returns_nan(user_module) -> None:
    message = _error_of("my_rewards:nan_for_wrong")
    # Row 2 (the second completion, data row 7) is the first NaN.
    assert "'nan_for_wrong'" in message and "data row 7" in message
    assert repr(COMPLETIONS[1]) in message and "returned nan" in message


def test_error_when_a_function_returns_the_wrong_count(user_module) -> None:
    message = _error_of("my_rewards:too_few")
    assert "'too_few'" in message and "data row 7" in message
    assert repr(COMPLETIONS[0]) in message and "returned 3 values for 4 completions" in message


def test_error_when_a_function_returns_a_non_number(user_module) -> None:
    message = _error_of("my_rewards:words")
    assert "'words'" in message and "data row 7" in message
    assert repr(COMPLETIONS[0]) in message and "returned 'good' (str)" in message


def test_error_when_a_field_is_missing() -> None:
    # arith_exact needs `answer`: the TypeError is reported with the function and row.
    with pytest.raises(RewardError, match=r"'arith_exact' on data row 7 .*answer"):
        _score(load_reward_functions(["align_anything.rewards:arith_exact"]), fields={})


def test_long_completions_are_shortened_in_messages(user_module) -> None:
    long = "z" * 1000
    message = _error_of("my_rewards:nan_for_wrong", [long] * 4)
    assert "(1000 characters)" in message and len(message) < 600


def test_row_labels_from_the_data_are_named_as_given() -> None:
    # Encoded prompt rows carry their file's label ("line 12"); messages use it as it is.
    with pytest.raises(RewardError, match=r"'arith_exact' on line 12 \(completion 'Answer: 42'\)"):
        score_completions(
            load_reward_functions(["align_anything.rewards:arith_exact"]), [1.0],
            prompts=["q"], completions=["Answer: 42"], fields={}, row_ids=["line 12"],
        )  # fmt: skip


# --- issue 24: values beyond float32, SystemExit, a call that does not return -----------------


def test_a_reward_beyond_float32_is_an_error_naming_function_and_row(user_module) -> None:
    # 1e39 is a finite Python float but inf in float32, where rewards are computed.
    message = _error_of("my_rewards:huge")
    assert "'huge' on data row 7" in message and repr(COMPLETIONS[1]) in message
    assert "returned 1e+39, beyond float32's range (±3.4e+38)" in message


def test_a_weighted_total_beyond_float32_is_an_error(user_module) -> None:
    # 3e38 x 1 + 3e38 x 1 overflows float32.
    functions = load_reward_functions(["my_rewards:large", "align_anything.rewards:arith_format"])
    with pytest.raises(RewardError, match=r"the weighted reward of data row 7 .* is inf in "
                       r"float32: large 3e\+38 x 1, arith_format 1 x 3e\+38"):  # fmt: skip
        _score(functions, [1.0, 3e38])


def test_system_exit_in_a_reward_function_is_a_failure(user_module) -> None:
    message = _error_of("my_rewards:exits")
    assert "'exits' on data row 7" in message
    assert "raised SystemExit(0) (it must return its values, not exit)" in message


def _timed(spec: str, timeout_s: float = 0.5) -> str:
    import time

    start = time.monotonic()
    with pytest.raises(RewardError) as caught:
        score_completions(
            load_reward_functions([spec]), [1.0], prompts=PROMPTS, completions=COMPLETIONS,
            fields=FIELDS, row_ids=ROW_IDS, timeout_s=timeout_s,
        )  # fmt: skip
    assert time.monotonic() - start < timeout_s + 2.0
    return str(caught.value)


@pytest.mark.parametrize("name", ["sleeps", "spins", "swallows", "converts"])
def test_a_call_past_its_deadline_is_an_error_naming_function_and_rows(user_module, name):
    """Blocked in a system call, spinning in Python, swallowing the interruption and returning,
    or turning it into an error of its own: each is reported as the timeout."""
    import signal

    from align_anything.rewards import functions as rewards

    before = signal.getsignal(signal.SIGUSR2)
    message = _timed(f"my_rewards:{name}")
    assert message == (
        f"reward function {name!r} did not return within reward.timeout_seconds=0.5 on data "
        "rows 7, 3 (4 completions). Make it faster (or bound its own work), or raise "
        "reward.timeout_seconds"
    )
    # Nothing left behind: the handler restored, no call active, no watchdog thread.
    import threading

    assert signal.getsignal(signal.SIGUSR2) == before and rewards.active_call() is None
    assert not [t for t in threading.enumerate() if t.name.startswith("reward-deadline")]


def test_a_stop_signal_cuts_a_hung_call_short(user_module) -> None:
    """What the SIGTERM handler does (training/preemption.py): the call gets a grace period,
    then the run stops as preempted, naming the function."""
    import signal
    import threading

    from align_anything.errors import Preempted
    from align_anything.rewards import functions as rewards

    def cut() -> None:
        while rewards.active_call() is None:
            pass
        rewards.active_call().cut_short(0.3, signal.SIGTERM)

    threading.Thread(target=cut, daemon=True).start()
    with pytest.raises(Preempted) as caught:
        score_completions(
            load_reward_functions(["my_rewards:sleeps"]), [1.0], prompts=PROMPTS,
            completions=COMPLETIONS, fields=FIELDS, row_ids=ROW_IDS, timeout_s=60.0,
        )  # fmt: skip
    assert caught.value.signum == signal.SIGTERM
    assert (
        "stopped by SIGTERM: reward function 'sleeps' was still running on data rows 7, 3"
        in str(caught.value)
    )


def test_a_call_within_its_deadline_returns_its_values(user_module) -> None:
    total, _ = score_completions(
        load_reward_functions(["my_rewards:length_penalty"]), [1.0], prompts=PROMPTS,
        completions=COMPLETIONS, fields=FIELDS, row_ids=ROW_IDS, timeout_s=30.0,
    )  # fmt: skip
    assert total.tolist() == [-len(c) for c in COMPLETIONS]
