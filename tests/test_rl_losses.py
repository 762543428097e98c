"""Online-RL losses (align_anything/losses/rl.py) against hand-derived numbers.

Each expected value is worked out in the comment above it; TRL 1.16's definitions are in the
docstrings of the functions under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from align_anything import losses
from align_anything.losses import (
    group_advantages,
    group_reward_std,
    grpo_per_token_loss,
    loss_items,
    loss_sum,
    rloo_advantages,
    rloo_per_sequence_loss,
    rloo_reward_with_kl,
    rloo_sequence_kl,
)

NAN = float("nan")
EPS = 1e-4  # TRL's std epsilon


def approx(values, rel: float = 1e-6, abs: float = 1e-6):  # noqa: A002
    return pytest.approx(values, rel=rel, abs=abs)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# GRPO advantages
# --------------------------------------------------------------------------------------------

# Two prompts, G = 4. Group 0: [1, 0, 0, 0]; group 1: [1, 1, 1, 1] (std 0).
REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]


def test_group_advantages_group_scaling() -> None:
    # Group 0: mean 0.25; deviations 0.75, −0.25 ×3; Σ squares 0.5625 + 3·0.0625 = 0.75;
    # unbiased variance 0.75 / 3 = 0.25, std 0.5 → A = 0.75 / 0.5001, −0.25 / 0.5001.
    # Group 1: every reward equal → deviation 0, std 0 → 0 / 1e-4 = 0 (no NaN).
    got = group_advantages(t(REWARDS), 4, "group")
    a, b = 0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS)
    assert got.tolist() == approx([a, b, b, b, 0.0, 0.0, 0.0, 0.0])
    assert not torch.isnan(got).any()


def test_group_advantages_batch_scaling() -> None:
    # Deviations still from each group's mean; std of all eight rewards (mean 5/8):
    # deviations 3/8 (×5) and −5/8 (×3): Σ squares 5·9/64 + 3·25/64 = 120/64 = 1.875;
    # unbiased 1.875 / 7 = 15/56; std √(15/56).
    std = math.sqrt(15 / 56)
    got = group_advantages(t(REWARDS), 4, "batch")
    a, b = 0.75 / (std + EPS), -0.25 / (std + EPS)
    assert got.tolist() == approx([a, b, b, b, 0.0, 0.0, 0.0, 0.0])


def test_group_advantages_no_scaling() -> None:
    # r − group mean, no division and no epsilon (Dr. GRPO).
    got = group_advantages(t(REWARDS), 4, "none")
    assert got.tolist() == approx([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0])


def test_group_advantages_leave_out_unscorable_rows() -> None:
    # [1, NaN, 0, 0]: mean over the three scorable 1/3; deviations 2/3, −1/3, −1/3;
    # Σ squares 6/9, mean 2/9, × 3/2 (Bessel on 3 values) = 1/3; std 1/√3. The NaN row → 0.
    got = group_advantages(t([1.0, NAN, 0.0, 0.0]), 4, "group")
    std = 1 / math.sqrt(3)
    a, b = (2 / 3) / (std + EPS), (-1 / 3) / (std + EPS)
    assert got.tolist() == approx([a, 0.0, b, b])


def test_group_reward_std_and_zero_std_share() -> None:
    std = group_reward_std(t(REWARDS), 4)
    assert std.tolist() == approx([0.5, 0.0])
    # TRL's frac_reward_zero_std: half of the groups.
    assert (std == 0).double().mean().item() == 0.5
    # G = 1 (TRL's eval with num_generations_eval=1): std taken as 0, advantages 0.
    assert group_reward_std(t([3.0, 4.0]), 1).tolist() == [0.0, 0.0]
    assert group_advantages(t([3.0, 4.0]), 1, "group").tolist() == [0.0, 0.0]


def test_group_advantages_reject_bad_shapes() -> None:
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(t(REWARDS), 3, "group")
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(t(REWARDS), 4, "std")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# RLOO advantages and KL in the reward
# --------------------------------------------------------------------------------------------


def test_rloo_leave_one_out_baseline() -> None:
    # [1, 0, 0, 2], sum 3: baselines (3−1)/3 = 2/3, (3−0)/3 = 1, 1, (3−2)/3 = 1/3
    # → advantages 1/3, −1, −1, 5/3 (= G/(G−1)·(r − mean) = 4/3·(r − 0.75)).
    got = rloo_advantages(t([1.0, 0.0, 0.0, 2.0]), 4)
    assert got.tolist() == approx([1 / 3, -1.0, -1.0, 5 / 3])


def test_rloo_normalize_advantages() -> None:
    # The advantages above have mean 0; Σ squares 1/9 + 1 + 1 + 25/9 = 44/9; unbiased
    # 44/27; std √(44/27). Normalised: A / (std + 1e-4).
    got = rloo_advantages(t([1.0, 0.0, 0.0, 2.0]), 4, normalize_advantages=True)
    std = math.sqrt(44 / 27)
    assert got.tolist() == approx([a / (std + EPS) for a in (1 / 3, -1.0, -1.0, 5 / 3)])


def test_rloo_unscorable_rows_and_equal_groups() -> None:
    # [1, NaN, 3, 2 | NaN, 5 | 4, 4]: group 0 has 3 scorable, sum 6: baselines
    # (6−1)/2 = 2.5, (6−3)/2 = 1.5, (6−2)/2 = 2 → −1.5, 0 (NaN row), 1.5, 0.
    got = rloo_advantages(t([1.0, NAN, 3.0, 2.0]), 4)
    assert got.tolist() == approx([-1.5, 0.0, 1.5, 0.0])
    # A group with one scorable row: baseline (5 − 5)/0 = NaN → 0; equal rewards → 0.
    assert rloo_advantages(t([NAN, 5.0, 4.0, 4.0]), 2).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_rloo_kl_in_the_reward() -> None:
    # k1 per token, summed over counted tokens: (−1 − −1.5) + (−2 − −1) = 0.5 − 1 = −0.5;
    # the third token is masked.
    old = t([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    ref = t([[-1.5, -1.0, -9.0], [-1.0, -1.0, -1.0]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    kl = rloo_sequence_kl(old, ref, mask)
    assert kl.tolist() == approx([-0.5, 1.5])
    # r − β·KL with β = 0.1: 1 − 0.1·(−0.5) = 1.05; 0.5 − 0.1·1.5 = 0.35.
    assert rloo_reward_with_kl(t([1.0, 0.5]), kl, 0.1).tolist() == approx([1.05, 0.35])


def test_rloo_per_sequence_loss_clips_the_sequence_ratio() -> None:
    # ρ = exp(Σ log π − Σ log π_old): 1.5, 0.5, 1.0 with A = +1, −1, +2; ε = 0.2.
    # ρ 1.5, A +1: min(1.5, 1.2) = 1.2 → −1.2, high-clipped.
    # ρ 0.5, A −1: min(−0.5, −0.8) = −0.8 → 0.8, low-clipped.
    # ρ 1.0, A +2: −2 (plain REINFORCE −A).
    old = t([-3.0, -3.0, -3.0])
    logps = old + t([math.log(1.5), math.log(0.5), 0.0])
    loss, stats = rloo_per_sequence_loss(
        logps, old, t([1.0, -1.0, 2.0]), epsilon_low=0.2, epsilon_high=0.2
    )
    assert loss.tolist() == approx([-1.2, 0.8, -2.0])
    assert stats.kl is None
    assert stats.is_high_clipped.tolist() == [1.0, 0.0, 0.0]
    assert stats.is_low_clipped.tolist() == [0.0, 1.0, 0.0]
    assert stats.is_region_clipped.tolist() == [1.0, 1.0, 0.0]


# --------------------------------------------------------------------------------------------
# GRPO per-token loss: the clip and the KL
# --------------------------------------------------------------------------------------------

RATIOS = [0.5, 1.1, 1.5]


def _ratio_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old = t([[-2.0, -1.0, -0.5], [-2.0, -1.0, -0.5]])
    logps = (old + t([RATIOS, RATIOS]).log()).requires_grad_()
    return logps, old, t([1.0, -1.0])


def test_grpo_clip_with_positive_and_negative_advantages() -> None:
    # ε_low 0.2, ε_high 0.28 (DAPO): the clip range is [0.8, 1.28].
    # A = +1: ρ 0.5 → min(0.5, 0.8) = 0.5 → −0.5 (below the range, unclipped: a positive
    #         advantage may raise a low ratio); ρ 1.1 → −1.1; ρ 1.5 → min(1.5, 1.28) → −1.28,
    #         high-clipped.
    # A = −1: ρ 0.5 → min(−0.5, −0.8) = −0.8 → 0.8, low-clipped; ρ 1.1 → 1.1;
    #         ρ 1.5 → min(−1.5, −1.28) = −1.5 → 1.5 (above the range, unclipped).
    logps, old, advantages = _ratio_batch()
    loss, stats = grpo_per_token_loss(logps, old, advantages, epsilon_low=0.2, epsilon_high=0.28)
    assert loss.tolist() == [approx([-0.5, -1.1, -1.28]), approx([0.8, 1.1, 1.5])]
    assert stats.kl is None
    assert stats.is_high_clipped.tolist() == [[0, 0, 1], [0, 0, 0]]
    assert stats.is_low_clipped.tolist() == [[0, 0, 0], [1, 0, 0]]
    assert stats.is_region_clipped.tolist() == [[0, 0, 1], [1, 0, 0]]
    # Gradient: d(−ρ·A)/d log π = −ρ·A where unclipped, 0 where clipped.
    loss.sum().backward()
    assert logps.grad.tolist() == [approx([-0.5, -1.1, 0.0]), approx([0.0, 1.1, 1.5])]


def test_grpo_clip_boundary_is_not_clipped() -> None:
    # ε = 0 on both sides, ρ exactly 1 (log π = log π_old): the clipped and unclipped terms
    # are equal; the indicators are strict (<, >), so nothing counts as clipped; loss −A.
    old = t([[-1.0, -2.0]])
    loss, stats = grpo_per_token_loss(old.clone(), old, t([3.0]), epsilon_low=0.0, epsilon_high=0.0)
    assert loss.tolist() == [[-3.0, -3.0]]
    assert stats.is_region_clipped.sum().item() == 0


def test_grpo_k3_kl() -> None:
    # ρ = 1 and A = 0, so the loss is β·KL alone. δ = ref − log π:
    # δ = 0: e⁰ − 0 − 1 = 0; δ = ln 2: 2 − ln 2 − 1 = 1 − ln 2; δ = −ln 2: ½ + ln 2 − 1 = ln 2 − ½.
    logps = t([[-1.0, -1.0, -1.0]])
    ref = logps + t([[0.0, math.log(2), -math.log(2)]])
    loss, stats = grpo_per_token_loss(
        logps, logps, t([0.0]), epsilon_low=0.2, epsilon_high=0.2, ref_logps=ref, beta=0.1
    )
    kl = [0.0, 1 - math.log(2), math.log(2) - 0.5]
    assert stats.kl.tolist() == [approx(kl)]
    assert loss.tolist() == [approx([0.1 * k for k in kl])]
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_per_token_loss(logps, logps, t([0.0]), epsilon_low=0.2, epsilon_high=0.2, beta=0.1)


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------

PER_TOKEN = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
MASK = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]  # the third completion fully masked (truncated)


@pytest.mark.parametrize(
    ("loss_type", "expected_sum", "expected_items"),
    [
        # grpo: token mean per sequence (1+2)/2 = 1.5, 4/1 = 4, masked row 0/max(0,1) = 0;
        # summed 5.5 over 3 sequences (the masked one counts, as in TRL's .mean()).
        ("grpo", 5.5, 3),
        # dr_grpo, L = 4: (1 + 2 + 4) / 4 = 1.75 over 3 sequences (TRL: 7 / (3·4)).
        ("dr_grpo", 1.75, 3),
        # dapo: 1 + 2 + 4 = 7 over the 3 counted tokens.
        ("dapo", 7.0, 3),
    ],
)
def test_aggregation_modes(loss_type: str, expected_sum: float, expected_items: int) -> None:
    per_token, mask = t(PER_TOKEN), t(MASK)
    got = loss_sum(per_token, mask, loss_type=loss_type, max_completion_length=4)
    assert got.item() == approx(expected_sum)
    assert loss_items(mask, loss_type=loss_type) == expected_items


def test_dapo_counts_tokens_not_sequences() -> None:
    # Same masked sum 7 but 2 sequences of 1 and 2 tokens: grpo 5.5/3 ≠ dapo 7/3.
    per_token, mask = t(PER_TOKEN), t(MASK)
    grpo = loss_sum(per_token, mask, loss_type="grpo", max_completion_length=4) / 3
    dapo = loss_sum(per_token, mask, loss_type="dapo", max_completion_length=4) / 3
    assert (grpo.item(), dapo.item()) == approx((5.5 / 3, 7 / 3))


@pytest.mark.parametrize("loss_type", losses.GRPO_LOSS_TYPES)
def test_split_invariance(loss_type: str) -> None:
    # Two micro-batches of unequal size (2 and 4 rows): Σ loss_sum / Σ loss_items equals the
    # whole batch's, and equals TRL's definition computed directly on the whole batch.
    generator = torch.Generator().manual_seed(0)
    per_token = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([5, 1, 3, 0, 2, 4])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).double()
    kwargs = {"loss_type": loss_type, "max_completion_length": 5}
    parts = [(per_token[:2], mask[:2]), (per_token[2:], mask[2:])]
    split = sum(loss_sum(p, m, **kwargs) for p, m in parts) / sum(
        loss_items(m, loss_type=loss_type) for _, m in parts
    )
    whole = loss_sum(per_token, mask, **kwargs) / loss_items(mask, loss_type=loss_type)
    masked = per_token * mask
    trl = {
        "grpo": (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean(),
        "dr_grpo": masked.sum() / (6 * 5),
        "dapo": masked.sum() / mask.sum(),
    }[loss_type]
    assert split.item() == approx(whole.item(), rel=1e-12)
    assert whole.item() == approx(trl.item(), rel=1e-12)


def test_aggregation_rejects_unknown_types() -> None:
    with pytest.raises(ValueError, match="loss_type"):
        loss_sum(t(PER_TOKEN), t(MASK), loss_type="bnpo", max_completion_length=4)
    with pytest.raises(ValueError, match="loss_type"):
        loss_items(t(MASK), loss_type="bnpo")
