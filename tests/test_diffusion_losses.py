"""Text-to-image losses (`losses/diffusion.py`) against numbers derived by hand in the comments:
the per-sample MSE, min-SNR-γ weights, Diffusion-DPO's three types with their metrics and
gradients, and Diffusion-KTO."""

from __future__ import annotations

import math

import pytest
import torch

from align_anything import losses

# Three pairs of per-sample MSEs (θ: policy, ref: reference; w: chosen, l: rejected):
#   pair 1: θ_w 0.2, θ_l 0.5, ref_w 0.3, ref_l 0.4 → logits = (0.3 − 0.4) − (0.2 − 0.5) = 0.2
#   pair 2: θ_w 0.6, θ_l 0.5, ref_w 0.5, ref_l 0.5 → logits = 0 − 0.1 = −0.1
#   pair 3: all 0.3                                 → logits = 0
POLICY_W = torch.tensor([0.2, 0.6, 0.3], dtype=torch.float64)
POLICY_L = torch.tensor([0.5, 0.5, 0.3], dtype=torch.float64)
REF_W = torch.tensor([0.3, 0.5, 0.3], dtype=torch.float64)
REF_L = torch.tensor([0.4, 0.5, 0.3], dtype=torch.float64)
BETA = 5.0  # β·logits = 1.0, −0.5, 0


def _dpo(loss_type: str, policy_w: torch.Tensor = POLICY_W) -> losses.DiffusionDPOOutput:
    return losses.diffusion_dpo_loss(
        policy_w, POLICY_L, REF_W, REF_L, beta=BETA, loss_type=loss_type
    )


def test_per_sample_mse_is_the_mean_square_per_sample() -> None:
    # Sample 0: (1 − 0)² and (2 − 0)² → (1 + 4) / 2 = 2.5; sample 1: (3 − 1)², (4 − 1)² → 6.5.
    prediction = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).reshape(2, 1, 1, 2)
    target = torch.tensor([[0.0, 0.0], [1.0, 1.0]]).reshape(2, 1, 1, 2)
    assert losses.per_sample_mse(prediction, target).tolist() == [2.5, 6.5]
    # 16-bit inputs are compared in fp32 (a bf16 MSE of near-equal predictions loses its
    # digits); fp64 stays fp64.
    assert losses.per_sample_mse(prediction.bfloat16(), target.bfloat16()).dtype == torch.float32
    assert losses.per_sample_mse(prediction.double(), target.double()).dtype == torch.float64
    with pytest.raises(ValueError, match="differ"):
        losses.per_sample_mse(prediction, target[:1])


def test_min_snr_weights_epsilon_and_v() -> None:
    snr = torch.tensor([0.5, 5.0, 20.0])
    # γ = 5. epsilon: min(SNR, γ)/SNR = 0.5/0.5, 5/5, 5/20.
    eps = losses.min_snr_weights(snr, gamma=5.0, prediction="epsilon")
    assert eps.tolist() == pytest.approx([1.0, 1.0, 0.25])
    # v: min(SNR, γ)/(SNR + 1) = 0.5/1.5, 5/6, 5/21.
    v = losses.min_snr_weights(snr, gamma=5.0, prediction="v_prediction")
    assert v.tolist() == pytest.approx([1 / 3, 5 / 6, 5 / 21])


def test_min_snr_at_zero_snr_and_for_flow() -> None:
    zero = torch.tensor([0.0, 1.0])
    # ε at SNR 0: 0/0, weight 1 by convention; at SNR 1 (< γ): 1/1. v at SNR 0: 0/(0+1) = 0.
    assert losses.min_snr_weights(zero, gamma=5.0, prediction="epsilon").tolist() == [1.0, 1.0]
    assert losses.min_snr_weights(zero, gamma=5.0, prediction="v_prediction").tolist() == [
        0.0,
        0.5,
    ]
    with pytest.raises(ValueError, match="epsilon and v_prediction"):
        losses.min_snr_weights(zero, gamma=5.0, prediction="flow")
    with pytest.raises(ValueError, match="gamma"):
        losses.min_snr_weights(zero, gamma=0.0, prediction="epsilon")


def test_denoising_loss_weights_the_mse_without_gradient_through_weights() -> None:
    mse = torch.tensor([2.0, 4.0], requires_grad=True)
    weights = torch.tensor([0.5, 0.25], requires_grad=True)
    loss = losses.denoising_loss(mse, weights=weights)
    assert loss.tolist() == [1.0, 1.0]  # 2·0.5, 4·0.25
    loss.sum().backward()
    assert mse.grad.tolist() == [0.5, 0.25]
    assert weights.grad is None  # the weights are detached
    assert losses.denoising_loss(mse).tolist() == [2.0, 4.0]


def test_diffusion_dpo_sigmoid_values_and_metrics() -> None:
    out = _dpo("sigmoid")
    # −log σ(β·logits): −log σ(1) = log(1 + e^−1); −log σ(−0.5) = log(1 + e^0.5); log 2.
    expected = [math.log(1 + math.exp(-1)), math.log(1 + math.exp(0.5)), math.log(2)]
    assert out.losses.tolist() == pytest.approx(expected, abs=1e-12)
    assert out.losses.tolist() == pytest.approx(
        [0.31326168751822286, 0.9740769841801067, 0.6931471805599453], abs=1e-12
    )
    assert out.logits.tolist() == pytest.approx([0.2, -0.1, 0.0], abs=1e-12)
    m = out.metrics
    # rewards: β·(ref − θ): chosen 5·0.1, 5·(−0.1), 0; rejected 5·(−0.1), 0, 0.
    assert m["rewards/chosen"].tolist() == pytest.approx([0.5, -0.5, 0.0])
    assert m["rewards/rejected"].tolist() == pytest.approx([-0.5, 0.0, 0.0])
    assert m["rewards/margins"].tolist() == pytest.approx([1.0, -0.5, 0.0])
    # the chosen reward is higher in pair 1, lower in pair 2, tied (0.5) in pair 3
    assert m["rewards/accuracies"].tolist() == [1.0, 0.0, 0.5]
    assert m["mse/policy_chosen"].tolist() == POLICY_W.tolist()
    assert m["mse/ref_rejected"].tolist() == REF_L.tolist()


def test_diffusion_dpo_hinge_and_ipo_values() -> None:
    # hinge: relu(1 − β·logits) = relu(0), relu(1.5), relu(1).
    assert _dpo("hinge").losses.tolist() == pytest.approx([0.0, 1.5, 1.0], abs=1e-12)
    # ipo: (logits − 1/(2β))² with 1/(2β) = 0.1: (0.2 − 0.1)², (−0.1 − 0.1)², (0 − 0.1)².
    assert _dpo("ipo").losses.tolist() == pytest.approx([0.01, 0.04, 0.01], abs=1e-12)


def test_diffusion_dpo_gradients_push_the_chosen_error_down() -> None:
    policy_w = POLICY_W.clone().requires_grad_(True)
    _dpo("sigmoid", policy_w).losses[0].backward()
    # d/dθ_w −log σ(β·logits) = β·(1 − σ(β·logits)) with β·logits = 1: 5·(1 − σ(1)).
    assert policy_w.grad[0].item() == pytest.approx(5 * (1 - 1 / (1 + math.exp(-1))))
    assert policy_w.grad[0].item() == pytest.approx(1.3447071068499756)
    assert policy_w.grad[1:].tolist() == [0.0, 0.0]  # other pairs do not enter pair 1's loss
    policy_w = POLICY_W.clone().requires_grad_(True)
    _dpo("ipo", policy_w).losses[0].backward()
    # d/dθ_w (logits − 0.1)² = 2·(0.2 − 0.1)·(−1) = −0.2: IPO pulls back past its target margin.
    assert policy_w.grad[0].item() == pytest.approx(-0.2)


def test_diffusion_dpo_sft_weight_adds_the_chosen_error() -> None:
    policy_w = POLICY_W.clone().requires_grad_(True)
    out = losses.diffusion_dpo_loss(policy_w, POLICY_L, REF_W, REF_L, beta=BETA, sft_weight=2.0)
    # Each pair's loss gains 2·θ_w: −log σ(1) + 0.4, −log σ(−0.5) + 1.2, ln 2 + 0.6.
    plain = [math.log(1 + math.exp(-1.0)), math.log(1 + math.exp(0.5)), math.log(2)]
    assert out.losses.tolist() == pytest.approx([plain[0] + 0.4, plain[1] + 1.2, plain[2] + 0.6])
    # The gradient on θ_w gains the weight: 5·(1 − σ(1)) + 2 (1.3447 + 2).
    out.losses[0].backward()
    assert policy_w.grad[0].item() == pytest.approx(1.3447071068499756 + 2.0)
    # The logits, and so every reward metric, are those of plain Diffusion-DPO.
    assert out.logits.tolist() == pytest.approx(_dpo("sigmoid").logits.tolist())
    with pytest.raises(ValueError, match="sft_weight"):
        losses.diffusion_dpo_loss(POLICY_W, POLICY_L, REF_W, REF_L, beta=1, sft_weight=-1)


def test_diffusion_dpo_reference_gets_no_gradient() -> None:
    ref_w = REF_W.clone().requires_grad_(True)
    out = losses.diffusion_dpo_loss(POLICY_W, POLICY_L, ref_w, REF_L, beta=BETA)
    assert not out.losses.requires_grad  # nothing in it requires a gradient but the reference


def test_diffusion_dpo_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="beta"):
        losses.diffusion_dpo_loss(POLICY_W, POLICY_L, REF_W, REF_L, beta=0)
    with pytest.raises(ValueError, match="sigmoid, hinge, ipo"):
        losses.diffusion_dpo_loss(POLICY_W, POLICY_L, REF_W, REF_L, beta=1, loss_type="cpo")
    with pytest.raises(ValueError, match="one \\[B\\] shape"):
        losses.diffusion_dpo_loss(POLICY_W[:2], POLICY_L, REF_W, REF_L, beta=1)


def test_diffusion_kto_on_mse() -> None:
    policy = torch.tensor([0.2, 0.5])
    ref = torch.tensor([0.3, 0.4])
    desirable = torch.tensor([True, False])
    # r = ref − θ = [0.1, −0.1]. z₀ = 0: desirable 1 − σ(5·0.1) = 1 − σ(0.5);
    # undesirable 1 − σ(5·(0 − (−0.1))) = 1 − σ(0.5).
    out = losses.diffusion_kto_loss(policy, ref, desirable, torch.tensor(0.0), beta=BETA)
    assert out.losses.tolist() == pytest.approx([0.3775406687981454] * 2)
    assert out.rewards.tolist() == pytest.approx([0.5, -0.5])  # β·r
    # z₀ = 0.05: desirable 1 − σ(5·(0.1 − 0.05)) = 1 − σ(0.25); undesirable 1 − σ(5·0.15).
    out = losses.diffusion_kto_loss(policy, ref, desirable, torch.tensor(0.05), beta=BETA)
    assert out.losses.tolist() == pytest.approx([0.43782349911420193, 0.320821300824607])
