"""The DPO loss types by name and the rules for combining them: the one list and the one rule
set, read both by `losses.dpo_loss` (which checks its arguments) and by the run config (which
checks `dpo.loss_type`, `dpo.loss_weights`, `dpo.label_smoothing` before anything runs).

No torch here: the config imports it before any heavy import."""

from __future__ import annotations

import math
from collections.abc import Sequence

DPO_LOSS_TYPES: tuple[str, ...] = (
    "sigmoid", "ipo", "hinge", "robust", "simpo", "orpo",
    "apo_zero", "apo_down", "bco_pair", "exo_pair", "nca_pair", "sppo_hard",
    "aot", "aot_unpaired", "discopop", "sigmoid_norm", "sft",
)  # fmt: skip
# Types that read no reference log-probs. simpo and orpo are whole preference losses without a
# reference and may not share a list with a type that needs one; sft goes with any type.
REFERENCE_FREE_LOSS_TYPES: tuple[str, ...] = ("simpo", "orpo", "sft")
REFERENCE_FREE_PREFERENCE: tuple[str, ...] = ("simpo", "orpo")
# Types whose formula uses length-normalised log-probs, so token counts are required.
NEEDS_TOKEN_COUNTS: tuple[str, ...] = ("ipo", "simpo", "orpo", "sigmoid_norm", "sft")
# Types whose log-ratios (and so their logged rewards) are per-token averages.
PER_TOKEN_LOGRATIOS: tuple[str, ...] = ("ipo", "sigmoid_norm")
# Types that read label_smoothing: a preference label's flip probability (cDPO, robust, aot), or
# EXO's ε, the weight its target distribution gives the rejected completion.
SMOOTHED_LOSS_TYPES: tuple[str, ...] = (
    "sigmoid", "robust", "simpo", "exo_pair", "aot", "aot_unpaired",
)  # fmt: skip
# Types that sort the batch they are given: their per-pair losses depend on the other pairs of
# that batch (in training: the micro-batch of one rank).
BATCH_SORTED_LOSS_TYPES: tuple[str, ...] = ("aot", "aot_unpaired")


def needs_reference(loss_types: Sequence[str]) -> bool:
    """Whether a combination of loss types reads reference log-probs."""
    return any(name not in REFERENCE_FREE_LOSS_TYPES for name in loss_types)


def combination_problems(names: Sequence[str]) -> list[str]:
    """What is wrong with a list of known loss types as one loss (empty: nothing)."""
    problems = []
    if not names:
        problems.append("the list is empty: give at least one loss type")
    repeated = sorted({name for name in names if list(names).count(name) > 1})
    if repeated:
        problems.append(
            f"{', '.join(repeated)} listed more than once: list each type once and weight it "
            "in loss_weights"
        )
    if names and set(names) == {"sft"}:
        problems.append(
            "sft alone is no preference loss: list it beside one (e.g. [sigmoid,sft]); for "
            "supervised fine-tuning use task=sft"
        )
    free = [name for name in names if name in REFERENCE_FREE_PREFERENCE]
    with_reference = [n for n in names if n not in (*REFERENCE_FREE_PREFERENCE, "sft")]
    if free and with_reference:
        problems.append(
            f"the reference-free {', '.join(free)} cannot be combined with types that need a "
            f"reference model (here {', '.join(with_reference)}); sft goes with both"
        )
    return problems


def weight_problems(names: Sequence[str] | None, weights: Sequence[float]) -> list[str]:
    """What is wrong with `weights` for the loss types `names` (empty: nothing; `names` None:
    the types are not known, only the values are checked)."""
    problems = []
    if names is not None and len(weights) != len(names):
        problems.append(
            f"{len(weights)} weights for {len(names)} loss types ({', '.join(names)}): give "
            "one per loss type, in the same order, or null for all 1.0"
        )
    bad = [w for w in weights if not math.isfinite(w) or w < 0]
    if bad:
        problems.append(f"weights must be finite and >= 0, got {', '.join(map(str, bad))}")
    elif weights and not any(w > 0 for w in weights):
        problems.append("at least one weight must be > 0")
    return problems


def smoothing_problems(names: Sequence[str], label_smoothing: float) -> list[str]:
    """What is wrong with `label_smoothing` for the loss types `names` (empty: nothing)."""
    if "exo_pair" in names and label_smoothing == 0:
        return ["exo_pair needs label_smoothing > 0 (EXO's epsilon; its paper suggests 1e-3)"]
    if label_smoothing and not any(name in SMOOTHED_LOSS_TYPES for name in names):
        return [
            f"has no effect with loss_type {', '.join(names)}: it applies to "
            f"{', '.join(SMOOTHED_LOSS_TYPES)}; leave it at 0.0"
        ]
    # robust divides by 1 - 2ε, so it excludes ε = 0.5; cDPO at ε = 0.5 is merely uninformative.
    # EXO takes log ε, so it needs ε > 0.
    above_min = label_smoothing > 0 if "exo_pair" in names else label_smoothing >= 0
    below_max = label_smoothing < 0.5 if "robust" in names else label_smoothing <= 0.5
    if not (above_min and below_max):
        allowed = ("(0" if "exo_pair" in names else "[0") + (
            ", 0.5)" if "robust" in names else ", 0.5]"
        )
        return [f"must be in {allowed} for loss_type {', '.join(names)}, got {label_smoothing}"]
    return []
