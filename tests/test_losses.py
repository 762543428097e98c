"""Loss functions against hand-derived numbers and invariants.

Constants used below, derived by hand:
    logσ(1)  = −ln(1 + e^−1) = −0.31326168751822286
    logσ(−1) = logσ(1) − 1   = −1.31326168751822286   (logσ(−z) = logσ(z) − z)
    ln 2 = 0.6931471805599453, ln 4 = 1.3862943611198906, ln(3/4) = −0.2876820724517809
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from align_anything.data import IGNORE_INDEX
from align_anything.forward import completion_logps, token_logps
from align_anything.losses import DPO_LOSS_TYPES, dpo_loss, reward_loss
from align_anything.models.reward_head import last_real_index

LN2 = 0.6931471805599453
LN4 = 1.3862943611198906
NEG_LOGSIG_1 = 0.31326168751822286  # −logσ(1)


def approx(value: float, rel: float = 1e-6, abs: float = 1e-6):  # noqa: A002
    return pytest.approx(value, rel=rel, abs=abs)


def naive_token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The obvious reference: full log_softmax, shift, gather, mask."""
    logp = logits[:, :-1].float().log_softmax(-1)
    targets = labels[:, 1:]
    scored = targets != IGNORE_INDEX
    gathered = logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return gathered * scored


# ------------------------------------------------------------------------------------------
# completion_logps / token_logps
# ------------------------------------------------------------------------------------------


def test_uniform_logits_give_minus_log_vocab_per_token():
    # Equal logits over V = 4 ⇒ every token has p = 1/4, log p = −ln 4.
    logits = torch.zeros(2, 5, 4)
    labels = torch.tensor([[IGNORE_INDEX, 1, 2, 3, 0], [IGNORE_INDEX, IGNORE_INDEX, 3, 3, 1]])
    logps, counts = completion_logps(logits, labels)
    assert counts.tolist() == [4, 3]
    assert logps.tolist() == [approx(-4 * LN4), approx(-3 * LN4)]


def test_two_token_vocabulary_by_hand():
    # logits (0, ln 3): softmax = (1/(1+3), 3/(1+3)) = (1/4, 3/4).
    row = torch.tensor([0.0, math.log(3.0)])
    logits = row.expand(1, 3, 2).clone()
    labels = torch.tensor([[IGNORE_INDEX, 0, 1]])  # targets: token 0 then token 1
    per_token = token_logps(logits, labels)
    assert per_token.shape == (1, 2)
    assert per_token[0].tolist() == [approx(-LN4), approx(-0.2876820724517809)]
    logps, counts = completion_logps(logits, labels)
    assert counts.item() == 2
    assert logps.item() == approx(-LN4 - 0.2876820724517809)


def test_shift_uses_logits_at_t_for_label_at_t_plus_1():
    # Position 0 is certain of token 1, position 1 certain of token 0; the last position's
    # logits predict nothing and must not matter.
    big = 50.0
    logits = torch.tensor([[[0.0, big], [big, 0.0], [123.0, -7.0]]])
    labels = torch.tensor([[IGNORE_INDEX, 1, 0]])
    logps, counts = completion_logps(logits, labels)
    assert counts.item() == 2
    assert logps.item() == approx(0.0, abs=1e-12)  # log(1 − e^−50) ≈ −2e−22 each


def test_masked_positions_contribute_nothing_and_get_no_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 7, requires_grad=True)
    labels = torch.randint(0, 7, (2, 6))
    labels[0, 2:4] = IGNORE_INDEX
    labels[1, :3] = IGNORE_INDEX
    per_token = token_logps(logits, labels)
    assert (per_token[0, 1:3] == 0).all()
    assert (per_token[1, :2] == 0).all()
    per_token.sum().backward()
    # logits[:, t] predicts labels[:, t+1]: masked targets at t+1 ⇒ zero gradient at t.
    assert (logits.grad[0, 1:3] == 0).all()
    assert (logits.grad[1, :2] == 0).all()
    assert (logits.grad[:, -1] == 0).all()
    # Changing logits at those positions leaves the result unchanged.
    perturbed = logits.detach().clone()
    perturbed[0, 1:3] += 10 * torch.randn(2, 7)
    perturbed[:, -1] = 99.0
    assert torch.equal(completion_logps(perturbed, labels)[0], completion_logps(logits, labels)[0])


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 64])
def test_chunked_matches_naive_values_and_gradients(chunk_size):
    torch.manual_seed(chunk_size)
    batch, seq, vocab = 3, 11, 13
    logits = (3 * torch.randn(batch, seq, vocab)).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq))
    labels[:, 0] = IGNORE_INDEX
    labels[1, 5:] = IGNORE_INDEX  # right padding
    labels[2, :4] = IGNORE_INDEX  # left padding / prompt
    weights = torch.randn(batch, seq - 1)  # a non-uniform upstream gradient

    chunked = token_logps(logits, labels, chunk_size=chunk_size)
    (chunked * weights).sum().backward()
    chunked_grad = logits.grad.clone()
    logits.grad = None

    naive = naive_token_logps(logits, labels)
    (naive * weights).sum().backward()

    torch.testing.assert_close(chunked, naive, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked_grad, logits.grad, rtol=1e-5, atol=1e-6)
    sums, counts = completion_logps(logits.detach(), labels, chunk_size=chunk_size)
    torch.testing.assert_close(sums, naive.detach().sum(-1), rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [10, 4, 7]  # targets are labels[:, 1:]


def test_backward_passes_gradcheck_in_float64():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[IGNORE_INDEX, 1, 2, IGNORE_INDEX, 0], [IGNORE_INDEX, 3, 3, 1, 2]])
    assert torch.autograd.gradcheck(lambda x: token_logps(x, labels, chunk_size=2), (logits,))


def test_half_precision_logits_are_scored_in_fp32():
    torch.manual_seed(2)
    logits = torch.randn(2, 9, 50).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 50, (2, 9))
    logps, _ = completion_logps(logits, labels, chunk_size=4)
    assert logps.dtype == torch.float32
    # Same numbers as the naive computation on the upcast logits.
    expected = naive_token_logps(logits.detach().float(), labels).sum(-1)
    torch.testing.assert_close(logps, expected, rtol=1e-6, atol=1e-5)
    logps.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_autograd_keeps_no_fp32_copy_of_the_logits():
    # The reason for the hand-written backward: log_softmax on upcast bf16 logits would save
    # a [B, T, V] fp32 tensor for backward. Here only the bf16 logits themselves (already alive
    # in the caller) and [B, T-1]-sized tensors are saved.
    batch, seq, vocab = 2, 16, 300
    logits = torch.randn(batch, seq, vocab).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq))
    saved: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        completion_logps(logits, labels, chunk_size=4)[0].sum()
    large = [s for s in saved if s.numel() > batch * seq]
    assert large, "the logits themselves should be saved for the recomputing backward"
    assert all(s.dtype == torch.bfloat16 and s.data_ptr() == logits.data_ptr() for s in large)

    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        naive_token_logps(logits, labels)
    assert any(s.dtype == torch.float32 and s.numel() >= batch * (seq - 1) * vocab for s in saved)


def test_token_logps_rejects_misaligned_labels():
    with pytest.raises(ValueError, match="shape of input_ids"):
        token_logps(torch.zeros(1, 4, 3), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        token_logps(torch.zeros(1, 4, 3), torch.zeros(1, 4, dtype=torch.long), chunk_size=0)


# ------------------------------------------------------------------------------------------
# SFT: the loss is the negative sum of the scored tokens' log-probs over their count
# ------------------------------------------------------------------------------------------


def test_sft_loss_uniform_logits_is_log_vocab():
    logits = torch.zeros(2, 4, 4)
    labels = torch.tensor([[IGNORE_INDEX, 1, 2, 3], [IGNORE_INDEX, IGNORE_INDEX, 0, IGNORE_INDEX]])
    sums, counts = completion_logps(logits, labels)
    # 4 scored tokens, each with NLL ln 4: sum 4·ln 4 (3·ln 4 + 1·ln 4 by row), mean ln 4.
    assert counts.tolist() == [3, 1]
    assert (-sums).tolist() == [approx(3 * LN4), approx(LN4)]
    assert (-sums.sum() / counts.sum()).item() == approx(LN4)


def test_sft_loss_without_targets_is_zero_not_nan():
    logits = torch.randn(1, 3, 4, requires_grad=True)
    labels = torch.full((1, 3), IGNORE_INDEX)
    sums, counts = completion_logps(logits, labels)
    assert sums.item() == 0.0 and counts.item() == 0
    (-sums.sum()).backward()
    assert (logits.grad == 0).all()


# ------------------------------------------------------------------------------------------
# dpo_loss
# ------------------------------------------------------------------------------------------


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_sigmoid_at_policy_equal_reference_is_ln2():
    logps = t(-12.0, -3.5, -40.0)
    out = dpo_loss(logps, logps - 1, logps, logps - 1, beta=0.1)
    assert out.losses.tolist() == [approx(LN2)] * 3
    assert out.chosen_rewards.tolist() == [0.0] * 3
    assert out.rejected_rewards.tolist() == [0.0] * 3


def z_equals_one_inputs():
    # β = 0.1, (π_c − ref_c) = −10 − (−15) = 5, (π_r − ref_r) = −12 − (−7) = −5
    # ⇒ h = 10, z = 1; chosen reward 0.5, rejected reward −0.5.
    return t(-10.0), t(-12.0), t(-15.0), t(-7.0)


def test_sigmoid_and_cdpo_at_z_equal_one():
    out = dpo_loss(*z_equals_one_inputs(), beta=0.1)
    assert out.losses.item() == approx(NEG_LOGSIG_1)
    assert out.chosen_rewards.item() == approx(0.5)
    assert out.rejected_rewards.item() == approx(-0.5)
    # cDPO, ε = 0.1: −0.9·logσ(1) − 0.1·logσ(−1) = 0.9·0.3132617 + 0.1·1.3132617
    #              = 0.2819355 + 0.1313262 = 0.4132617 (= −logσ(1) + ε·z).
    out = dpo_loss(*z_equals_one_inputs(), beta=0.1, label_smoothing=0.1)
    assert out.losses.item() == approx(0.41326168751822286)


def test_sigmoid_symmetries():
    z = t(-3.0, -0.5, 0.0, 0.7, 4.0)
    zero = torch.zeros_like(z)
    # With ref = 0 and rejected = 0, β = 1: the loss is a function of z alone.
    loss_pos = dpo_loss(z, zero, zero, zero, beta=1.0).losses
    loss_neg = dpo_loss(-z, zero, zero, zero, beta=1.0).losses
    # −logσ(z) − (−logσ(−z)) = −z, since logσ(z) − logσ(−z) = z.
    torch.testing.assert_close(loss_pos - loss_neg, -z)
    # cDPO at ε = 0.5 cannot tell chosen from rejected: swapping them changes nothing.
    swapped = dpo_loss(zero, z, zero, zero, beta=1.0, label_smoothing=0.5).losses
    straight = dpo_loss(z, zero, zero, zero, beta=1.0, label_smoothing=0.5).losses
    torch.testing.assert_close(swapped, straight)


def test_hinge_values():
    zero = t(0.0, 0.0, 0.0)
    # β = 1 and h = (0, 2, 0.25) ⇒ relu(1 − z) = (1, 0, 0.75).
    out = dpo_loss(t(0.0, 2.0, 0.25), zero, zero, zero, beta=1.0, loss_type="hinge")
    assert out.losses.tolist() == [approx(1.0), approx(0.0), approx(0.75)]


def test_ipo_at_zero_and_with_token_averaging():
    beta = 0.25
    logps = t(-6.0)
    ones = torch.ones(1)
    out = dpo_loss(
        logps,
        logps,
        logps,
        logps,
        beta=beta,
        loss_type="ipo",
        chosen_token_counts=ones,
        rejected_token_counts=ones,
    )
    # h = 0 ⇒ (0 − 1/(2β))² = 1/(4β²) = 1/(4·0.0625) = 4.
    assert out.losses.item() == approx(4.0)
    # Averaged per token: chosen −6/3 − (−3/3) = −1, rejected −8/4 − (−12/4) = 1 ⇒ h = −2.
    # β = 0.5 ⇒ (−2 − 1)² = 9. Chosen reward 0.5·(−1) = −0.5, rejected 0.5·1 = 0.5.
    out = dpo_loss(
        t(-6.0),
        t(-8.0),
        t(-3.0),
        t(-12.0),
        beta=0.5,
        loss_type="ipo",
        chosen_token_counts=torch.tensor([3]),
        rejected_token_counts=torch.tensor([4]),
    )
    assert out.losses.item() == approx(9.0)
    assert out.chosen_rewards.item() == approx(-0.5)
    assert out.rejected_rewards.item() == approx(0.5)


def test_robust_equals_sigmoid_without_noise_and_is_unbiased():
    inputs = z_equals_one_inputs()
    robust = dpo_loss(*inputs, beta=0.1, loss_type="robust").losses
    sigmoid = dpo_loss(*inputs, beta=0.1).losses
    torch.testing.assert_close(robust, sigmoid)
    # ε = 0.1, z = 1: (0.9·0.3132617 − 0.1·1.3132617)/0.8 = −logσ(1) − ε·z/(1 − 2ε)
    #               = 0.3132617 − 0.125 = 0.1882617.
    out = dpo_loss(*inputs, beta=0.1, loss_type="robust", label_smoothing=0.1)
    assert out.losses.item() == approx(0.18826168751822286)
    # Unbiased: with labels flipped at rate ε the expected robust loss is the clean loss.
    z = t(-2.0, 0.3, 1.5)
    zero = torch.zeros_like(z)
    eps = 0.2
    forward = dpo_loss(z, zero, zero, zero, beta=1.0, loss_type="robust", label_smoothing=eps)
    flipped = dpo_loss(zero, z, zero, zero, beta=1.0, loss_type="robust", label_smoothing=eps)
    expected = (1 - eps) * forward.losses + eps * flipped.losses
    torch.testing.assert_close(expected, -F.logsigmoid(z))


def test_simpo_is_reference_free_and_length_normalised():
    # avg_c = −4/2 = −2, avg_r = −9/3 = −3; β = 2, γ = 1 ⇒ 2·(−2 + 3) − 1 = 1 ⇒ −logσ(1).
    out = dpo_loss(
        t(-4.0),
        t(-9.0),
        beta=2.0,
        loss_type="simpo",
        simpo_gamma=1.0,
        chosen_token_counts=torch.tensor([2]),
        rejected_token_counts=torch.tensor([3]),
    )
    assert out.losses.item() == approx(NEG_LOGSIG_1)
    assert out.chosen_rewards.item() == approx(-4.0)  # β·avg_c
    assert out.rejected_rewards.item() == approx(-6.0)


def test_orpo_by_hand():
    # Chosen: 2 tokens, avg log p = ln(1/2) ⇒ odds (1/2)/(1/2) = 1, log-odds 0.
    # Rejected: 3 tokens, avg log p = ln(1/4) ⇒ odds (1/4)/(3/4) = 1/3, log-odds −ln 3.
    # Loss = −avg_c − λ·logσ(0 + ln 3) = ln 2 − λ·ln(3/4)   [σ(ln 3) = 3/(3+1)]
    #      = 0.6931472 + 0.1·0.2876821 = 0.7219154.
    out = dpo_loss(
        t(2 * math.log(0.5)),
        t(3 * math.log(0.25)),
        beta=0.1,
        loss_type="orpo",
        orpo_lambda=0.1,
        chosen_token_counts=torch.tensor([2]),
        rejected_token_counts=torch.tensor([3]),
    )
    assert out.losses.item() == approx(LN2 + 0.1 * 0.2876820724517809)


def test_orpo_is_finite_at_extreme_log_probs():
    chosen = torch.tensor([0.0, -1e-9, -1e-3, -200.0], requires_grad=True)
    rejected = torch.tensor([-300.0, -0.5, -1e-8, 0.0], requires_grad=True)
    ones = torch.ones(4)
    out = dpo_loss(
        chosen,
        rejected,
        beta=0.1,
        loss_type="orpo",
        chosen_token_counts=ones,
        rejected_token_counts=ones,
    )
    out.losses.sum().backward()
    assert torch.isfinite(out.losses).all()
    assert torch.isfinite(chosen.grad).all() and torch.isfinite(rejected.grad).all()


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_gradients_push_chosen_up_and_rejected_down(loss_type):
    # Start from policy = reference with equal lengths; one step of gradient descent
    # must raise the chosen log-prob and lower the rejected one.
    policy_chosen = torch.tensor([-20.0, -35.0], requires_grad=True)
    policy_rejected = torch.tensor([-22.0, -30.0], requires_grad=True)
    counts = torch.tensor([10, 10])
    out = dpo_loss(
        policy_chosen,
        policy_rejected,
        policy_chosen.detach().clone(),
        policy_rejected.detach().clone(),
        beta=0.1,
        loss_type=loss_type,
        chosen_token_counts=counts,
        rejected_token_counts=counts,
    )
    out.losses.mean().backward()
    assert (policy_chosen.grad < 0).all(), policy_chosen.grad
    assert (policy_rejected.grad > 0).all(), policy_rejected.grad
    assert not out.chosen_rewards.requires_grad
    assert not out.rejected_rewards.requires_grad


def test_dpo_loss_errors_name_the_problem():
    x = t(-1.0)
    with pytest.raises(ValueError) as info:
        dpo_loss(x, x, x, x, beta=0.1, loss_type="sigmod")
    for name in DPO_LOSS_TYPES:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="ref_rejected_logps"):
        dpo_loss(x, x, x, None, beta=0.1)
    with pytest.raises(ValueError, match="chosen_token_counts"):
        dpo_loss(x, x, beta=0.1, loss_type="simpo")
    with pytest.raises(ValueError, match="chosen_token_counts"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="ipo")
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="no effect"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="one shape"):
        dpo_loss(x, t(-1.0, -2.0), x, x, beta=0.1)
    with pytest.raises(ValueError, match="positive"):
        ones, zeros = torch.ones(1), torch.zeros(1)
        dpo_loss(
            x, x, beta=0.1, loss_type="orpo", chosen_token_counts=ones, rejected_token_counts=zeros
        )


def test_dpo_from_completion_logps_end_to_end():
    # Uniform logits over V = 4: every sequence log-prob is −n·ln 4; policy = reference ⇒ ln 2.
    logits = torch.zeros(2, 4, 4, requires_grad=True)
    labels = torch.tensor([[IGNORE_INDEX, 1, 2, 3], [IGNORE_INDEX, IGNORE_INDEX, 0, 1]])
    logps, counts = completion_logps(logits, labels)
    ref = logps.detach()
    out = dpo_loss(logps[:1], logps[1:], ref[:1], ref[1:], beta=0.1)
    assert out.losses.item() == approx(LN2)
    out.losses.mean().backward()
    assert logits.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------
# reward_loss
# ------------------------------------------------------------------------------------------


def test_reward_loss_by_hand():
    chosen = torch.tensor([2.0, 0.0, 1.0], requires_grad=True)
    rejected = torch.tensor([1.0, 1.0, 1.0], requires_grad=True)
    loss, metrics = reward_loss(chosen, rejected)
    # Differences (1, −1, 0): loss = (−logσ(1) − logσ(−1) + ln 2)/3
    #                              = (0.3132617 + 1.3132617 + 0.6931472)/3 = 0.7732235.
    assert loss.item() == approx(0.7732235185321303)
    assert metrics["accuracy"].item() == approx(1 / 3)  # the tie counts as wrong
    assert metrics["margin"].item() == approx(0.0)
    # Rewards (2, 0, 1, 1, 1, 1): mean 1, deviations (1, −1, 0, 0, 0, 0) ⇒ std √(2/6).
    assert metrics["reward_mean"].item() == approx(1.0)
    assert metrics["reward_std"].item() == approx(math.sqrt(1 / 3))
    loss.backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()


def test_reward_loss_margin_and_centring():
    chosen = torch.tensor([2.0, 0.0, 1.0])
    rejected = torch.tensor([1.0, 1.0, 1.0])
    # A margin of (1, −1, 0) cancels each difference: every pair scores −logσ(0) = ln 2.
    loss, metrics = reward_loss(chosen, rejected, margin=torch.tensor([1.0, -1.0, 0.0]))
    assert loss.item() == approx(LN2)
    assert metrics["margin"].item() == approx(0.0)  # the metric is the raw r+ − r−
    # Centring: mean((r+ + r−)²) = (9 + 1 + 4)/3 = 14/3; with coefficient 0.03 adds 0.14.
    loss_c, _ = reward_loss(chosen, rejected, center_coef=0.03)
    assert loss_c.item() == approx(0.7732235185321303 + 0.14)


def test_centring_gradient_pulls_rewards_towards_zero():
    # Equal rewards: the pairwise term's gradient is equal and opposite, so the sum of the
    # two gradients comes from the centring term alone: 2·coef·2·(r+ + r−)/B.
    chosen = torch.tensor([3.0, 3.0], requires_grad=True)
    rejected = torch.tensor([3.0, 3.0], requires_grad=True)
    loss, _ = reward_loss(chosen, rejected, center_coef=0.5)
    loss.backward()
    torch.testing.assert_close(chosen.grad + rejected.grad, torch.tensor([6.0, 6.0]))


# ------------------------------------------------------------------------------------------
# last_real_index (where a reward head reads its score)
# ------------------------------------------------------------------------------------------


def test_last_real_index_right_and_left_padding():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert last_real_index(right).tolist() == [2, 4, 0]
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert last_real_index(left).tolist() == [4, 4, 4]
    assert last_real_index(right.bool()).dtype == torch.long
