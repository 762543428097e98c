"""Each task as an object, on the tiny model in this process: a task is given its parts (the
policy, a reference, ...) as fields, so its collate, item count and loss are checked here with a
plain transformers model, against numbers worked out by hand from that model's log-probs. No
run is launched; the end-to-end recipe tests hold the same tasks to frozen losses."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from align_anything.families import zoo
from align_anything.families.language import loading
from align_anything.families.language.batches import Rows, SharedPrefix
from align_anything.families.language.forward import completion_logps
from align_anything.tasks.dpo import DPO, PairBatch
from align_anything.tasks.kto import KTO
from align_anything.tasks.online.common import OnlineRL
from align_anything.tasks.online.grpo import GRPO
from align_anything.tasks.rm import RM
from align_anything.tasks.sft import SFT
from align_anything.training.task import LossOutput, Task

PATH = zoo.resolve_model_path("tiny-random-llama")


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return loading.load_model(PATH, reward=False, dtype=torch.float32).eval()


def logps_of(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> float:
    """log π(completion | prompt), summed, from one plain forward of the row alone."""
    ids = torch.tensor([prompt + completion])
    labels = torch.tensor([[-100] * len(prompt) + completion])
    with torch.no_grad():
        return float(completion_logps(model(input_ids=ids).logits, labels)[0][0])


SFT_ROWS = [
    {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
    {"input_ids": [9, 10, 11], "labels": [-100, 10, 11]},
]
PAIRS = [
    {"prompt_ids": [5, 6], "chosen_ids": [7, 8], "rejected_ids": [9]},
    {"prompt_ids": [10, 11, 12], "chosen_ids": [13], "rejected_ids": [14, 15, 16]},
]


def sft_task(model: torch.nn.Module, *, share_prefix: bool = False) -> SFT:
    return SFT(policy=model, pad_id=0, media=None, completion_only=True,
               share_prefix=share_prefix, flatten_packed=False, mask_dtype=None)  # fmt: skip


@pytest.mark.parametrize("cls", [SFT, DPO, RM, KTO, OnlineRL])
def test_every_task_has_what_the_loop_calls(cls: type) -> None:
    """Each task class offers every member of the `Task` protocol (no base class to inherit
    a missing one from)."""
    members = [name for name in dir(Task) if not name.startswith("_")]
    fields = getattr(cls, "__dataclass_fields__", {})
    missing = [name for name in members if not hasattr(cls, name) and name not in fields]
    assert missing == []


def test_sft_loss_is_the_token_mean_of_the_scored_targets(model: torch.nn.Module) -> None:
    task = sft_task(model)
    batch = task.collate(SFT_ROWS)
    assert isinstance(batch, Rows) and task.count_items(batch) == 4  # targets 7, 8 and 10, 11
    assert task.count_tokens(batch) == 7
    out = task.loss(batch, normalizer=2.0, training=True)
    assert isinstance(out, LossOutput) and set(out.losses) == {"policy"}
    nll = -(logps_of(model, [5, 6], [7, 8]) + logps_of(model, [9], [10, 11]))
    assert float(out.metrics["loss"]) == pytest.approx(nll, rel=1e-5)
    assert float(out.losses["policy"]) == pytest.approx(nll / 2.0, rel=1e-5)
    assert task.finalize_metrics({"loss": 1.5})["perplexity"] == pytest.approx(math.exp(1.5))


def test_sft_shared_prefix_gives_the_plain_loss(model: torch.nn.Module) -> None:
    rows = [{"input_ids": [1, 2, 3, 4, 5, 6, 7], "labels": [-100] * 4 + [5, 6, 7]},
            {"input_ids": [1, 2, 3, 4, 8, 9], "labels": [-100] * 4 + [8, 9]}]  # fmt: skip
    plain, shared = sft_task(model), sft_task(model, share_prefix=True)
    batch = shared.collate(rows)
    assert isinstance(batch, SharedPrefix)
    assert shared.count_items(batch) == plain.count_items(plain.collate(rows)) == 5
    got = shared.loss(batch, normalizer=1.0, training=True).metrics["loss"]
    want = plain.loss(plain.collate(rows), normalizer=1.0, training=True).metrics["loss"]
    assert float(got) == pytest.approx(float(want), rel=1e-5)


def dpo_section(**changes) -> SimpleNamespace:
    values = dict(beta=0.1, label_smoothing=0.0, simpo_gamma=0.5, orpo_lambda=0.1,
                  discopop_tau=0.05, loss_type="sigmoid", loss_weights=None, rpo_alpha=0.0)  # fmt: skip
    values.update(changes)
    return SimpleNamespace(**values, loss_terms=lambda: ([values["loss_type"]], [1.0]))


def test_dpo_with_the_policy_as_reference_is_ln2_per_pair(model: torch.nn.Module) -> None:
    task = DPO(cfg=dpo_section(), policy=model, reference=model, pad_id=0, media=None,
               completion_only=True, share_prompt=False, mask_dtype=None,
               check_generation=lambda: {})  # fmt: skip
    batch = task.collate(PAIRS)
    assert isinstance(batch, PairBatch) and task.count_items(batch) == 2
    out = task.loss(batch, normalizer=1.0, training=True)
    assert float(out.metrics["loss"]) == pytest.approx(2 * math.log(2), rel=1e-6)
    chosen = logps_of(model, [5, 6], [7, 8]) + logps_of(model, [10, 11, 12], [13])
    assert float(out.metrics["logps/chosen"]) == pytest.approx(chosen, rel=1e-5)
    assert float(out.metrics["rewards/margins"]) == pytest.approx(0.0, abs=1e-6)


def test_dpo_reads_precomputed_reference_logps_from_the_rows(model: torch.nn.Module) -> None:
    """Rows carrying the reference's log-probs need no reference model; with a reference 1 nat
    below the policy on chosen and 1 above on rejected, z = β·(1 + 1) for each pair."""
    task = DPO(cfg=dpo_section(), policy=model, reference=None, pad_id=0, media=None,
               completion_only=False, share_prompt=False, mask_dtype=None,
               check_generation=lambda: {})  # fmt: skip
    rows = []
    for pair in PAIRS:
        chosen = logps_of(model, pair["prompt_ids"], pair["chosen_ids"])
        rejected = logps_of(model, pair["prompt_ids"], pair["rejected_ids"])
        rows.append(
            {**pair, "ref_chosen_logps": chosen - 1.0, "ref_rejected_logps": rejected + 1.0}
        )
    out = task.loss(task.collate(rows), normalizer=1.0, training=False)
    per_pair = -math.log(1 / (1 + math.exp(-0.1 * 2.0)))
    assert float(out.metrics["loss"]) == pytest.approx(2 * per_pair, rel=1e-5)
    assert float(out.metrics["rewards/accuracies"]) == 2.0


def test_rm_loss_is_the_pairwise_loss_of_the_scores() -> None:
    scorer = loading.load_model(PATH, reward=True, dtype=torch.float32).eval()
    scorer.config.pad_token_id = 0
    task = RM(policy=scorer, pad_id=0, center_coef=0.0, media=None)
    batch = task.collate(PAIRS)
    assert task.count_items(batch) == 2 and batch.margin is None
    out = task.loss(batch, normalizer=1.0, training=False)

    def score(ids: list[int]) -> float:
        with torch.no_grad():
            return float(scorer(input_ids=torch.tensor([ids])).logits.squeeze())

    diffs = [score(p["prompt_ids"] + p["chosen_ids"]) - score(p["prompt_ids"] + p["rejected_ids"])
             for p in PAIRS]  # fmt: skip
    want = sum(-math.log(1 / (1 + math.exp(-d))) for d in diffs)
    assert float(out.metrics["loss"]) == pytest.approx(want, rel=1e-4)
    assert float(out.metrics["accuracy"]) == sum(d > 0 for d in diffs)


def test_kto_reference_point_then_loss(model: torch.nn.Module) -> None:
    """With the policy as its own reference every implied reward and z₀ are 0, so each row's
    loss is its weight × (1 − σ(0)) = weight / 2."""
    rows = [
        {"prompt_ids": [5, 6], "completion_ids": [7, 8], "kl_ids": [9], "label": True},
        {"prompt_ids": [10, 11], "completion_ids": [9], "kl_ids": [7, 8], "label": False},
    ]
    section = SimpleNamespace(beta=0.1, desirable_weight=1.0, undesirable_weight=3.0)
    task = KTO(cfg=section, policy=model, reference=model, train_rows=rows, eval_rows=2,
               pad_id=0, max_length=64, global_batch=2, world_size=1, grad_accum=1, seed=0,
               steps_per_epoch=1, completion_only=True, share_prefix=False, mask_dtype=None,
               check_generation=lambda: {})  # fmt: skip
    batch = task.collate(rows)
    task.before_losses([batch], [True])
    assert float(task.kl) == 0.0
    # The loop's normaliser for a global batch of 2 rows on 1 rank without accumulation.
    out = task.loss(batch, normalizer=2.0, training=True)
    assert float(out.metrics["loss"]) == pytest.approx(1.0 * 0.5 + 3.0 * 0.5, rel=1e-6)
    assert float(out.losses["policy"]) == pytest.approx((1.0 * 0.5 + 3.0 * 0.5) / 2, rel=1e-6)
    assert float(out.metrics["count/chosen"]) == 2.0  # one row × the 2 rows it averages over


def test_grpo_on_policy_loss_is_minus_the_token_mean_advantage(model: torch.nn.Module) -> None:
    """On-policy (ratio 1, β = 0) the dapo loss is −Σ_t A_b over the counted tokens; the task
    collates prompt + completion with a loss mask over the completion."""
    rl = SimpleNamespace(loss_type="dapo", max_completion_length=4, beta=0.0,
                         mask_truncated_completions=True,
                         clip_range=lambda: (0.2, 0.2))  # fmt: skip
    tokenizer = SimpleNamespace(pad_token_id=0)
    task = OnlineRL(algorithm=GRPO(rl), rl=rl, policy=model, generator=None, rewards=None,
                    tokenizer=tokenizer, media=None, eval_rows=[], eval_path=None,
                    completion_only=True, share_prefix=False, mask_dtype=None, rank=0,
                    world=1)  # fmt: skip
    rows = [
        {"prompt_ids": [5, 6], "completion_ids": [7, 8, 9], "truncated": False, "row": 0},
        {"prompt_ids": [5, 6], "completion_ids": [7, 2, 3, 4], "truncated": True, "row": 0},
    ]
    batch = task.collate(rows)
    assert batch.loss_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]  # the truncated one masked
    assert task.count_items(batch) == 3
    batch.advantages = torch.tensor([0.5, -2.0])
    out = task.loss(batch, normalizer=1.0, training=True)
    assert float(out.metrics["loss"]) == pytest.approx(-3 * 0.5, rel=1e-6)
    metrics = task.finalize_metrics({"count/tokens": 3.0, "tokens/clip_ratio/low_mean": 0.0})
    assert metrics == {"clip_ratio/low_mean": 0.0}
