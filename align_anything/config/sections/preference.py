"""The sections of the offline tasks on text: `sft`, `dpo` (its loss types and their weights,
checked against `losses.rules`), `rm` and `kto`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from align_anything.config.sections.base import _Section
from align_anything.errors import did_you_mean
from align_anything.losses import rules as loss_rules


class SFTSection(_Section):
    assistant_only_loss: bool = Field(
        description="Train on assistant tokens only; false trains on every non-padding token (prompt and template included).",
    )
    packing: bool = Field(
        description="Pack training rows into sequences of up to `data.max_length` tokens (best-fit decreasing, once over the training set); position ids restart at each row and no token attends across rows, so the loss is that of the unpacked rows. `train.per_device_batch_size` then counts packed sequences, as TRL's packing does. Text models only; evaluation rows stay unpacked.",
    )


def _names(loss_type: str | list[str]) -> list[str]:
    return [loss_type] if isinstance(loss_type, str) else list(loss_type)


class _AgainstReference(_Section):
    """What DPO and KTO share: the frozen reference model and the held-out generation check."""

    # model: a frozen reference model beside the policy (ZeRO-3: a partitioned inference engine);
    # precompute: one no-grad pass over the rows the run will use, then the reference is freed.
    reference: Literal["model", "precompute"] = Field(
        description="precompute: one no-grad pass over the rows the run will use (KTO: and its KL pairs), before training, then the reference is freed; model: keep a frozen reference model.",
    )
    reference_offload: bool = Field(
        description="With `reference=model`: keep the reference model in CPU memory."
    )
    # Greedy generations on held-out prompts before and after training, checked for the
    # preferred property where the dataset defines one (built-in datasets do).
    generation_check_samples: int = Field(
        ge=0,
        description="Greedy answers to this many held-out prompts before and after training, checked where the dataset defines a check (built-in data does).",
    )
    generation_max_new_tokens: int = Field(
        ge=1, description="Token limit of each generation-check answer."
    )


class DPOSection(_AgainstReference):
    beta: float = Field(
        gt=0, description="Strength of the pull towards the reference model (the beta of DPO)."
    )
    loss_type: str | list[str] = Field(
        description="One loss type or a list whose weighted sum is the loss (`[sigmoid,bco_pair,sft]`: MPO): sigmoid (DPO; with label_smoothing: cDPO), ipo, hinge, robust, the reference-free simpo / orpo, apo_zero, apo_down, bco_pair, exo_pair, nca_pair, sppo_hard, aot, aot_unpaired, discopop, sigmoid_norm, and sft (the chosen completion's NLL, token mean per pair; not alone). simpo / orpo do not mix with types that need a reference. rewards/* are those of the first type other than sft.",
    )
    loss_weights: list[float] | None = Field(
        description="One weight >= 0 per `loss_type` entry, in order (MPO: `[0.8,0.2,1.0]`); null: all 1.0.",
    )
    label_smoothing: float = Field(
        ge=0.0,
        lt=0.5,
        description="The probability a preference label is wrong: cDPO's epsilon for sigmoid, simpo, aot and aot_unpaired; the noise rate for robust; EXO's epsilon for exo_pair (> 0 there; the paper suggests 1e-3).",
    )
    simpo_gamma: float = Field(description="SimPO's target reward margin gamma.")
    orpo_lambda: float = Field(ge=0.0, description="Weight of ORPO's odds-ratio term.")
    discopop_tau: float = Field(
        gt=0.0, description="DiscoPOP's temperature tau (the paper's 0.05)."
    )
    # Weight of a negative log-likelihood term on the chosen completion (token mean), added to
    # the preference loss: RPO (Pang et al. 2024), older TRL's `rpo_alpha` (TRL 1.16 has only the
    # `sft` loss type). It appends ("sft", rpo_alpha) to the loss terms; 0 disables it.
    rpo_alpha: float = Field(
        ge=0.0,
        description="Weight of an NLL term on the chosen completion (RPO): the same as appending `sft` to loss_type with this weight; listing sft yourself needs rpo_alpha=0. 0: plain DPO.",
    )

    @field_validator("loss_type", mode="before")
    @classmethod
    def _known_loss_types(cls, value: Any) -> Any:
        names = [value] if isinstance(value, str) else value
        allowed = ", ".join(repr(name) for name in loss_rules.DPO_LOSS_TYPES)
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise ValueError(f"Input should be {allowed} or a list of them")
        unknown = [name for name in names if name not in loss_rules.DPO_LOSS_TYPES]
        if unknown:
            hints = "".join(did_you_mean(name, loss_rules.DPO_LOSS_TYPES) for name in unknown)
            listed = "" if isinstance(value, str) else f"; unknown: {', '.join(map(repr, unknown))}"
            raise ValueError(f"Input should be {allowed} or a list of them{listed}{hints}")
        problems = loss_rules.combination_problems(names)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("loss_weights")
    @classmethod
    def _one_weight_per_type(
        cls, value: list[float] | None, info: ValidationInfo
    ) -> list[float] | None:
        if value is None:
            return value
        # Without a valid loss_type (its own error) the count cannot be checked.
        names = _names(info.data["loss_type"]) if "loss_type" in info.data else None
        problems = loss_rules.weight_problems(names, value)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("label_smoothing")
    @classmethod
    def _smoothing_applies(cls, value: float, info: ValidationInfo) -> float:
        if "loss_type" not in info.data:
            return value
        problems = loss_rules.smoothing_problems(_names(info.data["loss_type"]), value)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("rpo_alpha")
    @classmethod
    def _sft_once(cls, value: float, info: ValidationInfo) -> float:
        if value and "sft" in _names(info.data.get("loss_type", [])):
            raise ValueError(
                f"dpo.loss_type lists sft and rpo_alpha={value} would add it a second time: set "
                "dpo.rpo_alpha=0 and weight sft in dpo.loss_weights, or drop sft from the list"
            )
        return value

    def loss_terms(self) -> tuple[list[str], list[float]]:
        """The loss types a run sums and their weights: loss_type with loss_weights (null: all
        1.0), then sft with weight rpo_alpha when rpo_alpha > 0 (RPO as a term of the sum)."""
        names = _names(self.loss_type)
        weights = list(self.loss_weights) if self.loss_weights else [1.0] * len(names)
        if self.rpo_alpha:
            names.append("sft")
            weights.append(self.rpo_alpha)
        return names, weights


class RMSection(_Section):
    margin_column: str | None = Field(
        description="A column holding a per-pair margin subtracted inside the loss (null: none).",
    )
    center_coef: float = Field(
        ge=0.0, description="Weight of the mean-squared reward term that centres rewards at 0."
    )


class KTOSection(_AgainstReference):
    beta: float = Field(
        gt=0, description="Strength of the pull towards the reference model (the beta of KTO)."
    )
    desirable_weight: float = Field(
        gt=0, description="lambda_D: weight of the loss of desirable (thumbs-up) rows."
    )
    undesirable_weight: float = Field(
        gt=0, description="lambda_U: weight of the loss of undesirable (thumbs-down) rows."
    )
