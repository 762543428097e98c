"""Loss functions against hand-derived numbers and invariants.

Constants used below, derived by hand:
    logσ(1)  = −ln(1 + e^−1) = −0.31326168751822286
    logσ(−1) = logσ(1) − 1   = −1.31326168751822286   (logσ(−z) = logσ(z) − z)
    logσ(3)  = −ln(1 + e^−3) = −0.04858735157374206,  logσ(−3) = logσ(3) − 3
    σ(ln 3) = 3/(3 + 1) = 3/4,  σ(−ln 3) = 1/4,  σ(0) = 1/2
    ln 2 = 0.6931471805599453, ln 4 = 1.3862943611198906, ln(3/4) = −0.2876820724517809
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from align_anything.families.language import IGNORE_INDEX
from align_anything.families.language.forward import completion_logps, token_logps
from align_anything.families.language.reward_head import last_real_index
from align_anything.losses import (
    DPO_LOSS_TYPES,
    aot_loss,
    aot_unpaired_loss,
    apo_down_loss,
    apo_zero_loss,
    bco_pair_loss,
    discopop_loss,
    dpo_loss,
    exo_pair_loss,
    nca_pair_loss,
    reward_loss,
    sft_loss,
    sigmoid_norm_loss,
    sppo_hard_loss,
)

LN2 = 0.6931471805599453
LN4 = 1.3862943611198906
NEG_LOGSIG_1 = 0.31326168751822286  # −logσ(1)
NEG_LOGSIG_3 = 0.04858735157374206  # −logσ(3)
LN3 = math.log(3.0)


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


# Not here, each with its own test below: apo_down lowers both log-probs (at policy = reference
# its chosen gradient is exactly 0), discopop's slope at z = 0 is positive for τ < 0.41, and sft
# has no rejected term (and is no loss alone).
PUSHING_TYPES = [t for t in DPO_LOSS_TYPES if t not in ("apo_down", "discopop", "sft")]


@pytest.mark.parametrize("loss_type", PUSHING_TYPES)
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
        # EXO takes log ε; at z = 0 its slope is ¼·ln(ε/(1−ε)) < 0 for ε < 1/2.
        label_smoothing=1e-3 if loss_type == "exo_pair" else 0.0,
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
# The types added for TRL parity (each a function of its own; dpo_loss dispatches to them)
# ------------------------------------------------------------------------------------------


def test_apo_zero_by_hand():
    # β·r_c = ln 3, β·r_r = −ln 3: 1 − σ(ln 3) + σ(−ln 3) = 1 − 3/4 + 1/4 = 1/2; at 0: 1 − ½ + ½.
    assert apo_zero_loss(t(LN3, 0.0), t(-LN3, 0.0), beta=1.0).tolist() == [
        approx(0.5),
        approx(1.0),
    ]
    # Through dpo_loss: ref = 0, so the log-ratios are the policy log-probs; β = 1/2 doubles them.
    zero = t(0.0)
    out = dpo_loss(t(2 * LN3), t(-2 * LN3), zero, zero, beta=0.5, loss_type="apo_zero")
    assert out.losses.item() == approx(0.5)
    assert out.chosen_rewards.item() == approx(LN3)  # β·r_c, as TRL logs it
    assert out.rejected_rewards.item() == approx(-LN3)


def test_apo_down_by_hand_and_lowers_both_log_probs():
    # σ(β·r_c) + 1 − σ(β·(r_c − r_r)): r_c = ln 3, r_r = 0 ⇒ 3/4 + 1 − 3/4 = 1;
    # r_c = 0, r_r = ln 3 ⇒ 1/2 + 1 − σ(−ln 3) = 1/2 + 1 − 1/4 = 5/4.
    assert apo_down_loss(t(LN3, 0.0), t(0.0, LN3), beta=1.0).tolist() == [
        approx(1.0),
        approx(1.25),
    ]
    # At policy = reference: ∂/∂r_c = β·σ'(0) − β·σ'(0) = 0 and ∂/∂r_r = β·σ'(0) = β/4.
    chosen = torch.tensor([-20.0, -35.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([-22.0, -30.0], dtype=torch.float64, requires_grad=True)
    out = dpo_loss(
        chosen, rejected, chosen.detach(), rejected.detach(), beta=0.1, loss_type="apo_down"
    )
    out.losses.mean().backward()
    assert chosen.grad.tolist() == [0.0, 0.0]
    assert rejected.grad.tolist() == [approx(0.1 / 4 / 2)] * 2  # mean over 2 pairs


def test_bco_pair_by_hand():
    # −logσ(β·r_c) − logσ(−β·r_r): (1, −1) ⇒ 2·(−logσ(1)); at 0: 2·ln 2.
    assert bco_pair_loss(t(1.0, 0.0), t(-1.0, 0.0), beta=1.0).tolist() == [
        approx(2 * NEG_LOGSIG_1),
        approx(2 * LN2),
    ]
    # The reward δ of the BCO paper is 0 (TRL 1.16): the loss is not symmetric in r_c and r_r.
    assert bco_pair_loss(t(0.0), t(3.0), beta=1.0).item() == approx(LN2 + 3 + NEG_LOGSIG_3)


def test_exo_pair_is_a_kl_divergence():
    # At z = 0, q = (½, ½): KL = −ln 2 − ½·ln(ε(1 − ε)). ε = ½: 0; ε = 0.1: −ln 2 − ln 0.3 = ln(1/0.6).
    zero = t(0.0)
    assert exo_pair_loss(zero, zero, beta=1.0, epsilon=0.5).item() == approx(0.0)
    assert exo_pair_loss(zero, zero, beta=1.0, epsilon=0.1).item() == approx(math.log(1 / 0.6))
    # q = p where σ(z) = 1 − ε: z = 1 and ε = σ(−1) give KL = 0, a minimum (zero gradient).
    chosen = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    eps = 1 - 1 / (1 + math.exp(-1.0))
    loss = exo_pair_loss(chosen, zero, beta=1.0, epsilon=eps)
    loss.backward()
    assert loss.item() == approx(0.0, abs=1e-12)
    assert chosen.grad.item() == approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="epsilon"):
        exo_pair_loss(zero, zero, beta=1.0, epsilon=0.0)


def test_nca_pair_by_hand():
    # −logσ(β·r_c) − ½·logσ(−β·r_c) − ½·logσ(−β·r_r): at 0, ln 2 + ½ ln 2 + ½ ln 2 = 2 ln 2;
    # (1, −1): 0.3132617 + ½·1.3132617 + ½·0.3132617 = 1.1265234.
    assert nca_pair_loss(t(0.0, 1.0), t(0.0, -1.0), beta=1.0).tolist() == [
        approx(2 * LN2),
        approx(NEG_LOGSIG_1 + 0.5 * (NEG_LOGSIG_1 + 1) + 0.5 * NEG_LOGSIG_1),
    ]


def test_sppo_hard_targets_plus_minus_half_over_beta():
    # β = 0.1: targets ±5 on the unscaled log-ratios. (5, −5) ⇒ 0; (0, 0) ⇒ 25 + 25;
    # (7, −4) ⇒ 2² + 1² = 5.
    assert sppo_hard_loss(t(5.0, 0.0, 7.0), t(-5.0, 0.0, -4.0), beta=0.1).tolist() == [
        approx(0.0),
        approx(50.0),
        approx(5.0),
    ]


def test_aot_sorts_margins_before_comparing():
    # Policy margins (3, −1), reference margins (0, 2): sorted (−1, 3) and (0, 2) ⇒ δ = (−1, 1)
    # ⇒ (−logσ(−1), −logσ(1)). Paired DPO would see h = (3, −3) instead.
    policy, reference = t(3.0, -1.0), t(0.0, 2.0)
    assert aot_loss(policy, reference, beta=1.0).tolist() == [
        approx(NEG_LOGSIG_1 + 1),
        approx(NEG_LOGSIG_1),
    ]
    # Distributional: which pair a margin came from does not matter.
    torch.testing.assert_close(
        aot_loss(policy.flip(0), reference, beta=1.0), aot_loss(policy, reference, beta=1.0)
    )
    # The batch is the sample: split into two batches of one, δ = (3, −3) and the summed loss is
    # −logσ(3) − logσ(−3) = 3 + 2·0.0485874, not 1 + 2·0.3132617.
    halves = aot_loss(policy[:1], reference[:1], beta=1.0) + aot_loss(
        policy[1:], reference[1:], beta=1.0
    )
    assert halves.item() == approx(3 + 2 * NEG_LOGSIG_3)
    # cDPO smoothing at δ = 1, ε = 0.1: −logσ(1) + ε·1 (as in the sigmoid test above).
    smoothed = aot_loss(t(1.0), t(0.0), beta=1.0, label_smoothing=0.1)
    assert smoothed.item() == approx(0.41326168751822286)
    # Through dpo_loss: margins are policy_c − policy_r and ref_c − ref_r.
    zero2 = t(0.0, 0.0)
    out = dpo_loss(policy, zero2, reference, zero2, beta=1.0, loss_type="aot")
    assert out.losses.sum().item() == approx(1 + 2 * NEG_LOGSIG_1)


def test_aot_unpaired_sorts_chosen_and_rejected_separately():
    # r_c = (2, −1), r_r = (0, 1): sorted (−1, 2) and (0, 1) ⇒ δ = (−1, 1). Paired: h = (2, −2).
    assert aot_unpaired_loss(t(2.0, -1.0), t(0.0, 1.0), beta=1.0).tolist() == [
        approx(NEG_LOGSIG_1 + 1),
        approx(NEG_LOGSIG_1),
    ]
    zero2 = t(0.0, 0.0)
    out = dpo_loss(t(2.0, -1.0), t(0.0, 1.0), zero2, zero2, beta=1.0, loss_type="aot_unpaired")
    assert out.losses.sum().item() == approx(1 + 2 * NEG_LOGSIG_1)


def test_discopop_value_slope_and_limits():
    tau = 0.05
    # z = 0: m = σ(0) = ½ ⇒ ½·ln 2 + ½·e⁰.
    zero = t(0.0)
    assert discopop_loss(zero, zero, beta=1.0, tau=tau).item() == approx(0.5 * LN2 + 0.5)
    # Slope at 0: −m'·ln 2 + (1 − m)·(−½) + m'·1 + m·(−1) with m' = 1/(4τ)
    #           = (1 − ln 2)/(4τ) − 3/4 = 1.5342641 − 0.75 = 0.7842641 (positive: not convex).
    chosen = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    discopop_loss(chosen, zero, beta=1.0, tau=tau).backward()
    assert chosen.grad.item() == approx((1 - LN2) / (4 * tau) - 0.75)
    # Far from 0 the blend is one of its parts: z = 2 ⇒ e^−2 (σ(40) = 1 − 4e−18);
    # z = −3 ⇒ −logσ(−3) = 3 + 0.0485874 (σ(−60)·e³ ≈ 2e−25).
    assert discopop_loss(t(2.0), zero, beta=1.0, tau=tau).item() == approx(math.exp(-2.0))
    assert discopop_loss(t(-3.0), zero, beta=1.0, tau=tau).item() == approx(3 + NEG_LOGSIG_3)


def test_discopop_is_finite_where_exp_of_minus_z_overflows():
    # z = −1000 in float32: e^1000 overflows, and σ(z/τ)·e^−z would be 0·inf = nan.
    chosen = torch.tensor([-1000.0, 0.0, 500.0], requires_grad=True)
    zero = torch.zeros(3)
    loss = discopop_loss(chosen, zero, beta=1.0)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(chosen.grad).all()
    assert loss[0].item() == pytest.approx(1000.0)  # −logσ(−1000)


def test_sigmoid_norm_uses_per_token_log_ratios():
    # Chosen: (−6 − (−12))/3 = 2; rejected: (−8 − (−4))/4 = −1 ⇒ h̄ = 3; β = 1/3 ⇒ −logσ(1).
    out = dpo_loss(
        t(-6.0),
        t(-8.0),
        t(-12.0),
        t(-4.0),
        beta=1 / 3,
        loss_type="sigmoid_norm",
        chosen_token_counts=torch.tensor([3]),
        rejected_token_counts=torch.tensor([4]),
    )
    assert out.losses.item() == approx(NEG_LOGSIG_1)
    assert out.chosen_rewards.item() == approx(2 / 3)  # β·r̄, as for ipo
    assert out.rejected_rewards.item() == approx(-1 / 3)
    assert sigmoid_norm_loss(t(2.0), t(-1.0), beta=1 / 3).item() == approx(NEG_LOGSIG_1)


def test_sft_is_the_token_mean_nll_per_pair():
    # −log π / |y|: −6 over 3 tokens ⇒ 2, −3 over 1 token ⇒ 3. The batch's loss is the mean
    # over pairs, 2.5 (TRL 1.16 averages over all 4 chosen tokens instead: 9/4).
    logps = torch.tensor([-6.0, -3.0], dtype=torch.float64, requires_grad=True)
    losses = sft_loss(logps, torch.tensor([3, 1]))
    assert losses.tolist() == [approx(2.0), approx(3.0)]
    losses.mean().backward()
    assert logps.grad.tolist() == [approx(-1 / 6), approx(-1 / 2)]  # −1/(|y|·B)


def test_mpo_weighted_sum_by_hand():
    # MPO at policy = reference: 0.8·ln 2 (sigmoid) + 0.2·2 ln 2 (bco_pair) + 1.0·2 (sft: −6 over
    # 3 tokens) = 1.2·ln 2 + 2.
    logps, counts = t(-6.0), torch.tensor([3])
    kwargs = dict(beta=0.1, chosen_token_counts=counts, rejected_token_counts=counts)
    out = dpo_loss(
        logps, logps, logps, logps, loss_type=["sigmoid", "bco_pair", "sft"],
        loss_weights=[0.8, 0.2, 1.0], **kwargs,
    )  # fmt: skip
    assert out.losses.item() == approx(1.2 * LN2 + 2.0)
    assert {k: v.item() for k, v in out.terms.items()} == {
        "sigmoid": approx(LN2),
        "bco_pair": approx(2 * LN2),
        "sft": approx(2.0),
    }
    unweighted = dpo_loss(
        logps, logps, logps, logps, loss_type=["sigmoid", "bco_pair", "sft"], **kwargs
    )
    assert unweighted.losses.item() == approx(3 * LN2 + 2.0)


def test_sft_term_weighted_alpha_is_the_rpo_term():
    # What rpo_alpha = α adds (the trainer appends ("sft", α)): bit for bit the per-pair
    # sigmoid loss plus α·(−log π_c / |y_c|), as the trainer computed it before the list.
    torch.manual_seed(3)
    chosen, rejected, ref_c, ref_r = (-20 * torch.rand(4) for _ in range(4))
    counts = torch.tensor([3, 5, 1, 7])
    kwargs = dict(beta=0.1, chosen_token_counts=counts, rejected_token_counts=counts)
    combined = dpo_loss(
        chosen, rejected, ref_c, ref_r, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.7],
        **kwargs,
    )  # fmt: skip
    alone = dpo_loss(chosen, rejected, ref_c, ref_r, loss_type="sigmoid", **kwargs)
    assert torch.equal(combined.losses, alone.losses + 0.7 * (-chosen / counts.clamp(min=1)))
    assert torch.equal(combined.chosen_rewards, alone.chosen_rewards)


def test_rewards_are_the_first_preference_types():
    # ipo's example: per token chosen −6/3 − (−3/3) = −1, rejected −8/4 − (−12/4) = 1;
    # summed −3 and 4. β = 0.5.
    args = (t(-6.0), t(-8.0), t(-3.0), t(-12.0))
    kwargs = dict(
        beta=0.5, chosen_token_counts=torch.tensor([3]), rejected_token_counts=torch.tensor([4])
    )
    ipo_first = dpo_loss(*args, loss_type=["sft", "ipo", "sigmoid"], **kwargs)
    assert (ipo_first.chosen_rewards.item(), ipo_first.rejected_rewards.item()) == (
        approx(-0.5),
        approx(0.5),
    )
    sigmoid_first = dpo_loss(*args, loss_type=["sigmoid", "ipo"], **kwargs)
    assert (sigmoid_first.chosen_rewards.item(), sigmoid_first.rejected_rewards.item()) == (
        approx(-1.5),
        approx(2.0),
    )
    # Reference-free: simpo with the sft term needs no reference log-probs.
    free = dpo_loss(t(-4.0), t(-9.0), loss_type=["simpo", "sft"], **kwargs)
    assert free.chosen_rewards.item() == approx(0.5 * -4 / 3)


def test_combinations_that_are_refused():
    x, ones = t(-1.0), torch.ones(1)
    counts = dict(chosen_token_counts=ones, rejected_token_counts=ones)
    cases = [
        (dict(loss_type=["sigmoid", "sigmoid"]), "more than once"),
        (dict(loss_type=["sft"]), "no preference loss"),
        (dict(loss_type=["simpo", "bco_pair"]), "the reference-free simpo cannot be combined"),
        (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0]), "1 weights for 2 loss types"),
        (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, -0.5]), ">= 0"),
        (
            dict(loss_type=["sigmoid", "sft"], loss_weights=[0.0, 0.0]),
            "at least one weight must be > 0",
        ),
        (dict(loss_type="exo_pair"), "exo_pair needs label_smoothing > 0"),
        (dict(loss_type=["exo_pair", "robust"], label_smoothing=0.5), r"\(0, 0.5\)"),
        (dict(loss_type="discopop", discopop_tau=0.0), "discopop_tau"),
        (dict(loss_type=["hinge", "apo_zero"], label_smoothing=0.1), "no effect"),
        (dict(loss_type=[]), "the list is empty"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            dpo_loss(x, x, x, x, beta=0.1, **counts, **kwargs)
    # label_smoothing applies to each listed type that reads it; hinge beside sigmoid is fine.
    dpo_loss(x, x, x, x, beta=0.1, loss_type=["hinge", "sigmoid"], label_smoothing=0.1)


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
