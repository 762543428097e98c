"""Reward functions for tests/test_grpo_runs.py (importable by a launched run through
PYTHONPATH=tests): one that fails on purpose."""

from __future__ import annotations

_calls = 0


def fails_from_fourth_call(prompts: list, completions: list[str], **fields) -> list[float]:
    """-0.001 per character, until the 4th call of the process; from then on it raises."""
    global _calls
    _calls += 1
    if _calls >= 4:
        raise ValueError("this test's reward function fails from its 4th call on")
    return [-0.001 * len(text) for text in completions]


def huge_first(prompts: list, completions: list[str], **fields) -> list[float]:
    """1e39 for the first completion (finite in Python, inf in float32), 0.0 for the rest."""
    return [1e39] + [0.0] * (len(completions) - 1)


def exits(prompts: list, completions: list[str], **fields) -> list[float]:
    """Ends the process with status 0, as a script's `sys.exit(0)` would."""
    raise SystemExit(0)


def hangs(prompts: list, completions: list[str], **fields) -> list[float]:
    """Never returns. Creates the file named by $RL_TEST_MARKER first, so that a test knows when
    the run is inside the call."""
    import os
    import time
    from pathlib import Path

    if os.environ.get("RL_TEST_MARKER"):
        Path(os.environ["RL_TEST_MARKER"]).touch()
    while True:
        time.sleep(3600)


def no_opinion(prompts: list, completions: list[str], **fields) -> list[float | None]:
    """A reward with no opinion on any completion (every value None)."""
    return [None] * len(completions)
