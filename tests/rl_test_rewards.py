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
