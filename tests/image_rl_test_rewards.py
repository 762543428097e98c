"""Reward functions of images for tests/test_image_rl_runs.py (importable by a launched run
through PYTHONPATH=tests)."""

from __future__ import annotations

from typing import Any

import numpy as np


def red_mean(prompts: list, images: list, tag: list | None = None, **fields: Any) -> list[float]:
    """The mean of the red channel in [0, 1] (a reward with a spread on random pipelines),
    plus a thousandth of the prompt row's `tag` field (so a test sees that fields arrive)."""
    return [float(np.asarray(image)[..., 0].mean()) / 255 + 0.001 * t
            for image, t in zip(images, tag or [0] * len(images), strict=True)]  # fmt: skip


def wrong_count(prompts: list, images: list, **fields: Any) -> list[float]:
    """One reward too few."""
    return [0.0] * (len(images) - 1)
