"""PPO and REINFORCE++ losses (align_anything/losses/ppo.py) against hand-derived numbers.

Each expected value is worked out in the comment above it. The layout is the online trainer's:
[B, T] over the completion tokens, left-aligned, with a mask that is 1 on each row's tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from align_anything.losses import (
    discounted_returns,
    explained_variance,
    explained_variance_moments,
    gae,
    group_baseline,
    loss_items,
    loss_sum,
    masked_moments,
    per_token_rewards,
    ppo_policy_loss,
    token_entropy,
    token_kl,
    value_loss,
    whiten,
)

NAN = float("nan")


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _flat(values) -> list:
    if isinstance(values, (list, tuple)):
        return [v for item in values for v in _flat(item)]
    return [values]


def _shape(values) -> list | None:
    return [_shape(v) for v in values] if isinstance(values, (list, tuple)) else None


class approx:  # noqa: N801 (reads like pytest.approx, which takes no nested lists)
    """pytest.approx for nested lists (a [B, T] tensor's `tolist()`), same shape required."""

    def __init__(self, expected, rel: float = 1e-9, abs: float = 1e-9) -> None:  # noqa: A002
        self.expected, self.rel, self.abs = expected, rel, abs

    def __eq__(self, got) -> bool:
        return _shape(got) == _shape(self.expected) and _flat(got) == pytest.approx(
            _flat(self.expected), rel=self.rel, abs=self.abs
        )

    def __repr__(self) -> str:
        return f"approx({self.expected!r})"


# Row 0 has three completion tokens, row 1 two (then padding).
MASK = t([[1, 1, 1], [1, 1, 0]])


# --------------------------------------------------------------------------------------------
# Rewards per token
# --------------------------------------------------------------------------------------------


def test_per_token_rewards_put_the_clipped_score_last_and_the_kl_everywhere() -> None:
    # k1 = old − ref: row 0 [−1 − (−1.5), −2 − (−1), −0.5 − (−0.5)] = [0.5, −1, 0];
    # row 1 [−0.2 − (−0.7), −0.4 − (−0.1), padding] = [0.5, −0.3, 0 (masked: 9 − 3 ignored)].
    old = t([[-1.0, -2.0, -0.5], [-0.2, -0.4, 9.0]])
    ref = t([[-1.5, -1.0, -0.5], [-0.7, -0.1, 3.0]])
    kl = token_kl(old, ref, MASK)
    assert kl.tolist() == approx([[0.5, -1.0, 0.0], [0.5, -0.3, 0.0]])
    # kl_coef 0.1: −0.1·k1 on every token = row 0 [−0.05, 0.1, 0], row 1 [−0.05, 0.03, 0].
    # Scores 2 and −5, clipped to ±3: 2 on row 0's token 2, −3 on row 1's token 1 (its last).
    rewards = per_token_rewards(t([2.0, -5.0]), MASK, kl=kl, kl_coef=0.1, reward_clip=3.0)
    assert rewards.tolist() == approx([[-0.05, 0.1, 2.0], [-0.05, 0.03 - 3.0, 0.0]])
    # Without a clip the score stays −5; without a KL only the scores remain.
    assert per_token_rewards(t([2.0, -5.0]), MASK).tolist() == [[0, 0, 2.0], [0, -5.0, 0]]


def test_per_token_rewards_of_unscorable_and_empty_rows() -> None:
    # A NaN score (no reward had an opinion) adds no score; a row without tokens gets nothing,
    # not even the score (it has no last token to carry it).
    mask = t([[1, 1], [0, 0]])
    kl = t([[0.2, 0.4], [5.0, 5.0]])
    rewards = per_token_rewards(t([NAN, 7.0]), mask, kl=kl, kl_coef=0.5)
    assert rewards.tolist() == approx([[-0.1, -0.2], [0.0, 0.0]])


def test_group_baseline_subtracts_each_prompts_mean_score() -> None:
    # G = 3. Group 0 [1, 2, 6]: mean 3 → [−2, −1, 3]. Group 1 [NaN, 4, 0]: mean of the
    # scorable two 2 → [NaN, 2, −2].
    got = group_baseline(t([1.0, 2.0, 6.0, NAN, 4.0, 0.0]), 3)
    assert math.isnan(got[3])
    assert got[[0, 1, 2, 4, 5]].tolist() == approx([-2.0, -1.0, 3.0, 2.0, -2.0])
    with pytest.raises(ValueError, match="groups of 4"):
        group_baseline(t([1.0, 2.0, 3.0]), 4)


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


def test_gae_against_a_hand_computed_scan() -> None:
    # γ = 0.9, λ = 0.8, γλ = 0.72.
    # Row 0: r = [0, 0, 1], V = [0.5, 0.4, 0.8], V after the last token = 0.
    #   δ2 = 1 + 0.9·0 − 0.8 = 0.2                 A2 = 0.2
    #   δ1 = 0 + 0.9·0.8 − 0.4 = 0.32              A1 = 0.32 + 0.72·0.2 = 0.464
    #   δ0 = 0 + 0.9·0.4 − 0.5 = −0.14             A0 = −0.14 + 0.72·0.464 = 0.19408
    #   R = A + V = [0.69408, 0.864, 1.0]
    # Row 1: r = [0.2, −1], V = [0.1, −0.3]; its padding (r 5, V 7) counts as 0.
    #   δ1 = −1 + 0 − (−0.3) = −0.7                A1 = −0.7
    #   δ0 = 0.2 + 0.9·(−0.3) − 0.1 = −0.17        A0 = −0.17 + 0.72·(−0.7) = −0.674
    #   R = [−0.574, −1.0, 0]
    rewards = t([[0.0, 0.0, 1.0], [0.2, -1.0, 5.0]])
    values = t([[0.5, 0.4, 0.8], [0.1, -0.3, 7.0]])
    advantages, returns = gae(rewards, values, MASK, gamma=0.9, lam=0.8)
    assert advantages.tolist() == approx([[0.19408, 0.464, 0.2], [-0.674, -0.7, 0.0]])
    assert returns.tolist() == approx([[0.69408, 0.864, 1.0], [-0.574, -1.0, 0.0]])


def test_gae_limits() -> None:
    rewards = t([[0.0, 0.0, 1.0], [0.2, -1.0, 0.0]])
    values = t([[0.5, 0.4, 0.8], [0.1, -0.3, 0.0]])
    # λ = 1, γ = 1: Monte Carlo, A_t = (sum of the rewards from t) − V_t; R = the reward-to-go.
    advantages, returns = gae(rewards, values, MASK, gamma=1.0, lam=1.0)
    assert returns.tolist() == approx([[1.0, 1.0, 1.0], [-0.8, -1.0, 0.0]])
    assert advantages.tolist() == approx([[0.5, 0.6, 0.2], [-0.9, -0.7, 0.0]])
    # λ = 0: one-step TD, A_t = r_t + γ V_{t+1} − V_t (γ = 1): row 0 [−0.1, 0.4, 0.2].
    advantages, _ = gae(rewards, values, MASK, gamma=1.0, lam=0.0)
    assert advantages[0].tolist() == approx([-0.1, 0.4, 0.2])
    with pytest.raises(ValueError, match="lam must be in"):
        gae(rewards, values, MASK, gamma=1.0, lam=1.5)


def test_discounted_returns() -> None:
    # γ = 0.5. Row 0 r = [1, 0, 2]: G2 = 2, G1 = 0 + 0.5·2 = 1, G0 = 1 + 0.5·1 = 1.5.
    # Row 1 r = [−1, 4] (padding 9 ignored): G1 = 4, G0 = −1 + 0.5·4 = 1.
    returns = discounted_returns(t([[1.0, 0.0, 2.0], [-1.0, 4.0, 9.0]]), MASK, gamma=0.5)
    assert returns.tolist() == approx([[1.5, 1.0, 2.0], [1.0, 4.0, 0.0]])


def test_whiten_over_the_masked_tokens() -> None:
    # The five tokens 1.5, 1, 2 | 1, 4: mean 9.5 / 5 = 1.9; deviations −0.4, −0.9, 0.1, −0.9,
    # 2.1; squares 0.16 + 0.81 + 0.01 + 0.81 + 4.41 = 6.2; biased variance 6.2 / 5 = 1.24.
    values = t([[1.5, 1.0, 2.0], [1.0, 4.0, 123.0]])
    scale = 1 / math.sqrt(1.24 + 1e-8)
    expected = [[-0.4 * scale, -0.9 * scale, 0.1 * scale], [-0.9 * scale, 2.1 * scale, 0.0]]
    assert whiten(values, MASK).tolist() == approx(expected)
    # shift_mean=False adds the mean back on the counted tokens (TRL's reward whitening).
    shifted = whiten(values, MASK, shift_mean=False)
    assert shifted[0].tolist() == approx([v + 1.9 for v in expected[0]])
    assert shifted[1, 2] == 0.0


def test_whiten_with_summed_moments_does_not_depend_on_the_split() -> None:
    # Two ranks each hold one row; the all-reduced moments give each the whole batch's numbers.
    values = t([[1.5, 1.0, 2.0], [1.0, 4.0, 123.0]])
    moments = masked_moments(values[:1], MASK[:1]) + masked_moments(values[1:], MASK[1:])
    assert moments.tolist() == approx([5.0, 9.5, 1.5**2 + 1 + 4 + 1 + 16])
    whole = whiten(values, MASK)
    assert whiten(values[1:], MASK[1:], moments=moments).tolist() == approx(whole[1:].tolist())


def test_reinforce_plus_plus_advantages_by_hand() -> None:
    # Scores 1 and −1, no KL; row 0 has 2 tokens, row 1 one. Rewards [0, 1] and [−1, pad].
    # γ = 1 returns: [1, 1] and [−1]. Whitened over the 3 tokens: mean 1/3, deviations 2/3,
    # 2/3, −4/3, variance (4/9 + 4/9 + 16/9) / 3 = 8/9, std 2√2/3:
    # A = [1/√2, 1/√2 | −√2].
    mask = t([[1, 1], [1, 0]])
    rewards = per_token_rewards(t([1.0, -1.0]), mask)
    advantages = whiten(discounted_returns(rewards, mask, gamma=1.0), mask)
    r = 1 / math.sqrt(2)
    assert advantages.tolist() == approx([[r, r], [-2 * r, 0.0]], rel=1e-7, abs=1e-7)


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def test_ppo_policy_loss_per_token() -> None:
    # ε = 0.2. Tokens (ratio ρ, advantage A):
    #   (1.5, +1): −min(1.5, 1.2·1) = −1.2, clipped (ρ > 1.2 with A > 0)
    #   (0.5, +1): −min(0.5, 0.8) = −0.5, not clipped (the clip would give more)
    #   (0.5, −2): −min(−1, 0.8·(−2)) = 1.6, clipped (ρ < 0.8 with A < 0)
    #   (5, −1):   −min(−5, −1.2) = 5, not clipped (the unclipped term is the worse one)
    ratios = t([[1.5, 0.5, 0.5, 5.0]])
    advantages = t([[1.0, 1.0, -2.0, -1.0]])
    old = t([[-1.0, -2.0, -0.3, -4.0]])
    logps = (old + ratios.log()).requires_grad_()
    loss, stats = ppo_policy_loss(logps, old, advantages, epsilon_low=0.2, epsilon_high=0.2)
    assert loss.tolist() == approx([[-1.2, -0.5, 1.6, 5.0]])
    assert stats.clipped.tolist() == [[1.0, 0.0, 1.0, 0.0]]
    assert stats.dual_clipped.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    # approx KL ½(log ρ)²: ½ ln²1.5, ½ ln²0.5 (twice), ½ ln²5.
    logs = [math.log(1.5), math.log(0.5), math.log(0.5), math.log(5.0)]
    assert stats.approx_kl.tolist() == approx([[0.5 * v * v for v in logs]])
    # Gradient −ρA where the unclipped term is taken, 0 where the clip is: [0, −0.5, 0, 5].
    loss.sum().backward()
    assert logps.grad.tolist() == approx([[0.0, -0.5, 0.0, 5.0]])


def test_ppo_policy_loss_dual_clip() -> None:
    # c = 3 bounds the loss of a negative advantage by −c·A: the (5, −1) token's 5 becomes 3
    # (and passes no gradient); (0.5, −2) keeps 1.6 < 6; positive advantages are untouched.
    ratios = t([[1.5, 0.5, 0.5, 5.0]])
    advantages = t([[1.0, 1.0, -2.0, -1.0]])
    old = t([[-1.0, -2.0, -0.3, -4.0]])
    logps = (old + ratios.log()).requires_grad_()
    loss, stats = ppo_policy_loss(
        logps, old, advantages, epsilon_low=0.2, epsilon_high=0.2, dual_clip=3.0
    )
    assert loss.tolist() == approx([[-1.2, -0.5, 1.6, 3.0]])
    assert stats.dual_clipped.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    loss.sum().backward()
    assert logps.grad.tolist() == approx([[0.0, -0.5, 0.0, 0.0]])
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_policy_loss(logps, old, advantages, epsilon_low=0.2, epsilon_high=0.2, dual_clip=1.0)


def test_policy_loss_aggregates_as_one_token_mean_over_any_split() -> None:
    # Row 0 (3 tokens) and row 1 (2 tokens) with ρ = 1: ℓ = −A. A = [1, 2, 3 | 4, 5]: the token
    # mean over the batch is −15/5 = −3, whether both rows are one micro-batch or two.
    advantages = t([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    logps = torch.zeros(2, 3, dtype=torch.float64)
    loss, _ = ppo_policy_loss(logps, logps, advantages, epsilon_low=0.2, epsilon_high=0.2)
    whole = loss_sum(loss, MASK, loss_type="dapo", max_completion_length=3)
    assert float(whole) / loss_items(MASK, loss_type="dapo") == approx(-3.0)
    parts = [loss_sum(loss[i : i + 1], MASK[i : i + 1], loss_type="dapo",
                      max_completion_length=3) for i in (0, 1)]  # fmt: skip
    items = sum(loss_items(MASK[i : i + 1], loss_type="dapo") for i in (0, 1))
    assert float(sum(parts)) / items == approx(-3.0)


def test_value_loss_with_clipping() -> None:
    # ε_v = 0.2.
    #   V 1.0, V_old 0.5, R 2.0: (V − R)² = 1; V_clip = 0.5 + 0.2 = 0.7, (0.7 − 2)² = 1.69:
    #       ½·max = 0.845, clipped (and no gradient: V_clip does not move with V)
    #   V 0.0, V_old 0.5, R 1.0: 1; V_clip = 0.3, (0.3 − 1)² = 0.49: ½·1 = 0.5, not clipped;
    #       gradient V − R = −1
    #   V 2.0, V_old 2.0, R 2.5: both 0.25: 0.125, not clipped (equal, not larger)
    values = t([[1.0, 0.0, 2.0]]).requires_grad_()
    old = t([[0.5, 0.5, 2.0]])
    returns = t([[2.0, 1.0, 2.5]])
    loss, clipped = value_loss(values, old, returns, value_clip=0.2)
    assert loss.tolist() == approx([[0.845, 0.5, 0.125]])
    assert clipped.tolist() == [[1.0, 0.0, 0.0]]
    loss.sum().backward()
    assert values.grad.tolist() == approx([[0.0, -1.0, -0.5]])
    # No clip: ½(V − R)² = [0.5, 0.5, 0.125].
    plain, never = value_loss(values.detach(), old, returns, value_clip=None)
    assert plain.tolist() == approx([[0.5, 0.5, 0.125]])
    assert not never.any()


def test_explained_variance() -> None:
    # R = [1, 3, 2], V = [1, 2, 2.5]: R − V = [0, 1, −0.5], mean 1/6, E[x²] = 1.25/3, variance
    # 1.25/3 − 1/36 = 7/18; R's variance: mean 2, deviations −1, 1, 0 → 2/3.
    # 1 − (7/18)/(2/3) = 1 − 7/12 = 5/12.
    mask = t([[1, 1, 1, 0]])
    values, returns = t([[1.0, 2.0, 2.5, 50.0]]), t([[1.0, 3.0, 2.0, -50.0]])
    assert float(explained_variance(values, returns, mask)) == approx(5 / 12)
    assert float(explained_variance(returns, returns, mask)) == approx(1.0)
    # From moments summed over two "ranks" (token 0 | tokens 1, 2): the same number.
    split = torch.zeros_like(mask)
    split[0, 0] = 1
    moments = explained_variance_moments(values, returns, split) + explained_variance_moments(
        values, returns, mask - split
    )
    assert float(explained_variance(values, returns, mask, moments=moments)) == approx(5 / 12)
    # Returns that do not vary: undefined.
    assert math.isnan(explained_variance(values, t([[2.0, 2.0, 2.0, 0.0]]), mask))


def test_token_entropy() -> None:
    # Uniform over 4: ln 4. Logits [ln 3, 0]: p = [3/4, 1/4],
    # H = −(3/4 ln 3/4 + 1/4 ln 1/4) = 0.75·0.2876820724517809 + 0.25·1.3862943611198906.
    assert float(token_entropy(torch.zeros(4))) == approx(math.log(4), rel=1e-6)
    got = token_entropy(torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]]))
    expected = 0.75 * 0.2876820724517809 + 0.25 * 1.3862943611198906
    assert got.tolist() == approx([expected, math.log(2)], rel=1e-6)
    # Chunking changes nothing; the result is fp32 for bf16 logits.
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(token_entropy(logits, chunk_size=1), token_entropy(logits, chunk_size=64))
    assert token_entropy(logits.bfloat16()).dtype == torch.float32
