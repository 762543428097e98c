"""`dpo.loss_type` as one name or a weighted list: the config's rules, the trainer's use of them,
and the batch-sorting types (aot, aot_unpaired) under data parallelism.

The loss formulas themselves are tested against hand-derived numbers in test_losses.py; here the
config accepts exactly what `dpo_loss` accepts, `rpo_alpha` stays the `sft` term it always was,
and the end-to-end runs (marked slow) check the step-1 loss of every new type through the real
entry point, where policy = reference makes each a known constant.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import DPO_ARGS, RunResult, launch, run_inline

from align_anything import config as config_module
from align_anything.backend.ds_config import BatchPlan
from align_anything.config import load_config
from align_anything.errors import ConfigError
from align_anything.losses import dpo_loss
from align_anything.losses.rules import DPO_LOSS_TYPES
from align_anything.training.batching import rank_step_rows

LN2 = math.log(2.0)
BETA = 0.1  # the task default, which the runs below keep
EXO_EPSILON = 1e-3


def dpo_config(*overrides: str) -> config_module.DPOSection:
    section = load_config(["task=dpo", *overrides]).dpo
    assert section is not None
    return section


def config_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(["task=dpo", *overrides])
    return str(info.value)


# ------------------------------------------------------------------------------------------
# The config and the loss apply one set of rules (losses/rules.py)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss_type", "weights", "smoothing"),
    [
        (["sigmoid"], None, 0.0), (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], 0.0),
        (["sigmoid", "sigmoid"], None, 0.0), (["sft"], None, 0.0), (["orpo", "sigmoid"], None, 0.0),
        (["simpo", "sft"], None, 0.1), (["sigmoid", "hinge"], [1.0], 0.0),
        (["hinge"], [0.0], 0.0), (["hinge"], None, 0.1), (["exo_pair"], None, 0.0),
        (["exo_pair"], None, 1e-3), (["robust"], None, 0.4),
    ],
)  # fmt: skip
def test_config_refuses_exactly_what_the_loss_refuses(
    loss_type: list[str], weights: list[float] | None, smoothing: float
) -> None:
    """One rule set: a combination the config accepts is one `dpo_loss` computes, and a
    combination it refuses `dpo_loss` refuses too (neither keeps a copy of the rules)."""
    import torch

    from align_anything import losses

    overrides = [f"dpo.loss_type=[{','.join(loss_type)}]", "dpo.rpo_alpha=0",
                 f"dpo.label_smoothing={smoothing}"]  # fmt: skip
    if weights is not None:
        overrides.append(f"dpo.loss_weights=[{','.join(map(str, weights))}]")
    try:
        load_config(["task=dpo", *overrides])
        config_ok = True
    except ConfigError:
        config_ok = False
    logps = torch.tensor([-3.0, -4.0])
    try:
        losses.dpo_loss(
            logps, logps - 1, logps, logps - 1, beta=0.1, loss_type=loss_type,
            loss_weights=weights, label_smoothing=smoothing,
            chosen_token_counts=torch.tensor([2, 3]), rejected_token_counts=torch.tensor([2, 2]),
        )  # fmt: skip
        loss_ok = True
    except ValueError:
        loss_ok = False
    assert config_ok == loss_ok


@pytest.mark.parametrize(
    "overrides",
    [[f"dpo.loss_type={name}"] for name in DPO_LOSS_TYPES if name != "sft"]
    + [
        [
            "dpo.loss_type=[sigmoid,bco_pair,sft]",
            "dpo.loss_weights=[0.8,0.2,1.0]",
            "dpo.rpo_alpha=0",
        ],
        ["dpo.loss_type=[simpo,sft]", "dpo.rpo_alpha=0"],
        ["dpo.loss_type=[aot,exo_pair]", "dpo.label_smoothing=0.001"],
        ["dpo.loss_type=[hinge,sigmoid]", "dpo.label_smoothing=0.1"],
    ],
    ids=lambda overrides: " ".join(o.removeprefix("dpo.") for o in overrides),
)
def test_what_the_config_accepts_dpo_loss_computes(overrides: list[str]) -> None:
    if overrides == ["dpo.loss_type=exo_pair"]:
        overrides = [*overrides, f"dpo.label_smoothing={EXO_EPSILON}"]
    cfg = dpo_config(*overrides)
    names, weights = cfg.loss_terms()
    logps, counts = torch.tensor([-6.0, -9.0]), torch.tensor([3, 4])
    out = dpo_loss(
        logps, logps - 1, logps, logps - 1, beta=cfg.beta, loss_type=names, loss_weights=weights,
        label_smoothing=cfg.label_smoothing, chosen_token_counts=counts,
        rejected_token_counts=counts, simpo_gamma=cfg.simpo_gamma, orpo_lambda=cfg.orpo_lambda,
        discopop_tau=cfg.discopop_tau,
    )  # fmt: skip
    assert set(out.terms) == set(names) and torch.isfinite(out.losses).all()


# ------------------------------------------------------------------------------------------
# loss_terms: the list, its weights, and rpo_alpha as the sft term
# ------------------------------------------------------------------------------------------


def test_the_main_jobs_rpo_alpha_is_the_sft_term() -> None:
    cfg = dpo_config()  # the shipped task file: sigmoid with rpo_alpha 1.0
    assert cfg.loss_type == "sigmoid" and cfg.loss_weights is None
    assert cfg.loss_terms() == (["sigmoid", "sft"], [1.0, 1.0])
    assert dpo_config("dpo.rpo_alpha=0").loss_terms() == (["sigmoid"], [1.0])
    assert dpo_config("dpo.loss_type=ipo", "dpo.rpo_alpha=0.5").loss_terms() == (
        ["ipo", "sft"],
        [1.0, 0.5],
    )


def test_a_list_with_weights_and_rpo_alpha_appended() -> None:
    cfg = dpo_config(
        "dpo.loss_type=[sigmoid,bco_pair,sft]", "dpo.loss_weights=[0.8,0.2,1]", "dpo.rpo_alpha=0"
    )
    assert cfg.loss_terms() == (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0])
    cfg = dpo_config("dpo.loss_type=[sigmoid,bco_pair]", "dpo.rpo_alpha=0.25")
    assert cfg.loss_terms() == (["sigmoid", "bco_pair", "sft"], [1.0, 1.0, 0.25])
    # A single name may carry a one-entry weight list.
    assert dpo_config("dpo.loss_weights=[2]", "dpo.rpo_alpha=0").loss_terms() == (
        ["sigmoid"],
        [2.0],
    )


# Each bad value: one problem, naming the key, the value and what is allowed.
BAD_VALUES = [
    (["dpo.loss_type=[sigmoid,bco_par]"], "dpo.loss_type: Input should be 'sigmoid', 'ipo'",
     ["'sigmoid_norm', 'sft' or a list of them", "unknown: 'bco_par'", "(did you mean 'bco_pair'?)",
      "(given: ['sigmoid', 'bco_par'])"]),
    (["dpo.loss_type=[sigmoid,bco_pair,sft]"], "dpo.rpo_alpha: dpo.loss_type lists sft",
     ["set dpo.rpo_alpha=0 and weight sft in dpo.loss_weights", "(given: 1.0)"]),
    (["dpo.loss_type=[sigmoid,bco_pair]", "dpo.loss_weights=[1,2,3]"],
     "dpo.loss_weights: 3 weights for 2 loss types (sigmoid, bco_pair)", ["(given: [1, 2, 3])"]),
    (["dpo.loss_type=[sigmoid,bco_pair]", "dpo.loss_weights=[1,-0.5]"],
     "dpo.loss_weights: weights must be finite and >= 0, got -0.5", []),
    (["dpo.loss_weights=[0]"], "dpo.loss_weights: at least one weight must be > 0", []),
    (["dpo.loss_type=[sigmoid,sigmoid]"], "dpo.loss_type: sigmoid listed more than once", []),
    (["dpo.loss_type=[sft]", "dpo.rpo_alpha=0"], "dpo.loss_type: sft alone is no preference loss",
     []),
    (["dpo.loss_type=[orpo,sppo_hard]"],
     "dpo.loss_type: the reference-free orpo cannot be combined with types that need a "
     "reference model (here sppo_hard)", []),
    (["dpo.loss_type=[]"], "dpo.loss_type: the list is empty", []),
    (["dpo.loss_type=exo_pair"], "dpo.label_smoothing: exo_pair needs label_smoothing > 0",
     ["(given: 0.0)"]),
    (["dpo.loss_type=[hinge,apo_zero]", "dpo.label_smoothing=0.1"],
     "dpo.label_smoothing: has no effect with loss_type hinge, apo_zero", ["(given: 0.1)"]),
    (["dpo.discopop_tau=0"], "dpo.discopop_tau: Input should be greater than 0", []),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "first", "more"), BAD_VALUES, ids=lambda v: str(v)[:60])
def test_bad_values_give_one_clear_problem(overrides: list[str], first: str, more: list[str]):
    message = config_error(*overrides)
    assert message.startswith("1 problem in the configuration:"), message
    for part in [first, *more]:
        assert part in message, message


def test_problems_are_reported_together() -> None:
    message = config_error("dpo.loss_type=[sigmoid,bco_pair,sft]", "dpo.loss_weights=[0.8,0.2]")
    assert message.startswith("2 problems"), message
    assert "dpo.loss_weights: 2 weights for 3 loss types" in message
    assert "dpo.rpo_alpha: dpo.loss_type lists sft" in message


# ------------------------------------------------------------------------------------------
# aot / aot_unpaired under data parallelism
# ------------------------------------------------------------------------------------------


def _sort_groups(world: int, micro: int, accum: int, lengths: list[int] | None) -> list[list[int]]:
    """The row groups one optimizer step sorts: every rank's micro-batches (aot sorts each)."""
    plan = BatchPlan(micro, accum, world, micro * accum * world)
    return sorted(
        sorted(rows)
        for rank in range(world)
        for rows in rank_step_rows(
            0,
            32,
            plan,
            rank=rank,
            seed=42,
            steps_per_epoch=32 // plan.global_batch,
            lengths=lengths,
        )  # fmt: skip
    )


def test_aot_sorts_the_same_rows_only_where_the_micro_batches_are_the_same() -> None:
    """aot's loss is a function of its sort groups, a rank's micro-batch, so splits agree exactly
    when they cut a step into the same micro-batches: the same micro-batch size, and (with
    speed.group_by_length, which orders a step's rows only with gradient accumulation > 1)
    accumulation on both sides or on neither."""
    lengths = [(7 * i) % 11 for i in range(32)]  # a step's rows of different lengths
    # 2 ranks × micro 2 × accum 2 = 1 rank × micro 2 × accum 4: the same groups.
    assert _sort_groups(2, 2, 2, lengths) == _sort_groups(1, 2, 4, lengths)
    # 2 ranks × micro 2 (no accumulation: rows in seeded order) against 1 rank × micro 2 × accum
    # 2 (longest first): different groups; the same again without group_by_length.
    assert _sort_groups(2, 2, 1, lengths) != _sort_groups(1, 2, 2, lengths)
    assert _sort_groups(2, 2, 1, None) == _sort_groups(1, 2, 2, None)
    # A larger micro-batch sorts more rows together: 1 rank × micro 4 differs from 2 × 2.
    assert _sort_groups(1, 4, 1, None) != _sort_groups(2, 2, 1, None)


# ------------------------------------------------------------------------------------------
# End to end (slow): the real entry point on the tiny model
# ------------------------------------------------------------------------------------------

# At step 1 policy = reference, so every log-ratio is 0 and each new type's loss is a constant:
# apo_zero 1 − ½ + ½; apo_down ½ + 1 − ½; bco_pair and nca_pair 2·ln 2; exo_pair
# −ln 2 − ½·ln(ε(1 − ε)); sppo_hard 2·(1/(2β))² = 50; aot, aot_unpaired, sigmoid_norm ln 2;
# discopop ½·ln 2 + ½.
STEP1_LOSSES = {
    "apo_zero": 1.0,
    "apo_down": 1.0,
    "bco_pair": 2 * LN2,
    "exo_pair": -LN2 - 0.5 * math.log(EXO_EPSILON * (1 - EXO_EPSILON)),
    "nca_pair": 2 * LN2,
    "sppo_hard": 2 * (1 / (2 * BETA)) ** 2,
    "aot": LN2,
    "aot_unpaired": LN2,
    "discopop": 0.5 * LN2 + 0.5,
    "sigmoid_norm": LN2,
}
# The recipe runs' arguments (plain sigmoid, rpo_alpha 0, no generation check), shorter.
SHORT = [*DPO_ARGS, "deepspeed=z0", "data.max_eval_samples=4"]


def _same_metrics(run: RunResult, other: RunResult) -> None:
    """Every logged figure but the clock's is the same, bit for bit."""
    timing = ("elapsed_seconds", "tokens_per_second", "samples_per_second")

    def strip(metrics: list[dict]) -> list[dict]:
        return [{k: v for k, v in m.items() if k not in timing} for m in metrics]

    assert strip(run.metrics) == strip(other.metrics)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", sorted(STEP1_LOSSES))
def test_new_loss_types_at_step_one(loss_type: str, runs_dir: Path) -> None:
    smoothing = [f"dpo.label_smoothing={EXO_EPSILON}"] if loss_type == "exo_pair" else []
    run = run_inline(
        [*SHORT, "train.per_device_batch_size=4", "train.max_steps=1",
         f"dpo.loss_type={loss_type}", *smoothing],
        runs_dir / f"dpo-new-{loss_type}",
    ).check()  # fmt: skip
    expected = STEP1_LOSSES[loss_type]
    # The precomputed reference batches training rows differently from the step (~1e-7 in the
    # log-ratios); eval rows are batched alike, so eval before training is exact.
    assert run.losses()[0] == pytest.approx(expected, rel=1e-5)
    before = run.eval("before")
    assert before["eval/loss"] == pytest.approx(expected, rel=1e-6)
    assert before["eval/rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert math.isfinite(run.eval("after")["eval/loss"])


@pytest.mark.slow
def test_mpo_step_one_is_the_weighted_sum(runs_dir: Path) -> None:
    run = run_inline(
        [*SHORT, "train.per_device_batch_size=4", "train.max_steps=2",
         "dpo.loss_type=[sigmoid,bco_pair,sft]", "dpo.loss_weights=[0.8,0.2,1.0]"],
        runs_dir / "dpo-mpo",
    ).check()  # fmt: skip
    first = run.train_steps()[0]
    # 0.8·ln 2 + 0.2·2·ln 2 + 1.0·NLL, with the NLL (token mean per pair) logged beside it.
    assert first["loss"] == pytest.approx(1.2 * LN2 + first["nll_loss"], rel=1e-6)
    assert first["nll_loss"] > 1.0  # a random model's NLL (≈ ln 49152 ≈ 10.8), not 0
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
def test_rpo_alpha_and_sft_in_the_list_are_the_same_run(runs_dir: Path) -> None:
    """The main job's rpo_alpha: 1.0 and `loss_type=[sigmoid,sft]` give the same numbers."""
    common = [*SHORT, "train.per_device_batch_size=4", "train.max_steps=2"]
    rpo = run_inline([*common, "dpo.rpo_alpha=1.0"], runs_dir / "dpo-rpo1").check()
    listed = run_inline(
        [*common, "dpo.loss_type=[sigmoid,sft]", "dpo.rpo_alpha=0"], runs_dir / "dpo-list-sft"
    ).check()
    assert "nll_loss" in rpo.train_steps()[0]
    _same_metrics(rpo, listed)


@pytest.mark.slow
def test_aot_two_ranks_match_one_rank_with_the_same_micro_batches(runs_dir: Path) -> None:
    """2 ranks × micro 2 × accum 2 cut each step into the micro-batches of 1 rank × micro 2 ×
    accum 4 (see the grouping test above), so aot sorts the same rows and the losses agree."""
    common = [*SHORT, "dpo.loss_type=aot", "train.per_device_batch_size=2", "train.max_steps=2"]
    two = launch(
        [*common, "train.gradient_accumulation_steps=2"], runs_dir / "dpo-aot-2rank",
        launcher="deepspeed", nproc=2,
    ).check()  # fmt: skip
    one = run_inline(
        [*common, "train.gradient_accumulation_steps=4"], runs_dir / "dpo-aot-1rank"
    ).check()
    assert two.losses() == pytest.approx(one.losses(), abs=1e-5)
    # Held-out batches are not the same rows on both (rank r evaluates every world-th row), so
    # eval/loss after training differs between them; before it, every log-ratio is 0 on both.
    for run in (two, one):
        assert run.eval("before")["eval/loss"] == pytest.approx(LN2, rel=1e-6)


# ------------------------------------------------------------------------------------------
# The TRL agreement benchmark asks both sides for the same losses
# ------------------------------------------------------------------------------------------


def test_loss_agreement_cases_configure_both_sides_alike() -> None:
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(benchmarks))
    try:
        import dpo_loss_types_vs_trl as bench
    finally:
        sys.path.remove(str(benchmarks))
    # Every new type has a case; each case's overrides give the run TRL's settings.
    assert set(STEP1_LOSSES) <= set(bench.CASES)
    for name, case in bench.CASES.items():
        cfg = dpo_config(*bench.ours_overrides(case), "dpo.rpo_alpha=0")
        weights = case.get("loss_weights") or [1.0] * len(case["loss_type"])
        assert cfg.loss_terms() == (case["loss_type"], weights), name
        assert cfg.label_smoothing == case.get("label_smoothing", 0.0), name
        assert cfg.discopop_tau == 0.05  # TRL's default, which the TRL child passes
