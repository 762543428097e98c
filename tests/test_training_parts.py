"""Unit tests of the pieces the loop is built from, each called with typed arguments, none
launching a run: the report's texts, the "fail together" rule, the row step source, the frozen
reference, the held-out generation check and the online reward model.

The tests that need DeepSpeed engines build them in this process (`one_process_group`: a
one-process gloo group, as a plain `python -m align_anything.train` makes), on the tiny model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import DIST_ENV_VARS

from align_anything.backend import distributed as comm
from align_anything.backend.ds_config import BatchPlan
from align_anything.data.formats import DataReport
from align_anything.errors import ConfigError, DataError, UserError
from align_anything.families.language import collate_sft
from align_anything.training import report
from align_anything.training.batching import rank_step_rows
from align_anything.training.sources import RowBatches

# ---------------------------------------------------------------------------- report


def facts(**changes) -> report.StartupFacts:
    base = dict(
        task="dpo", model="tiny-random-llama", model_type="llama", trainable=3_200_000,
        frozen=0, parts=None, world="2 (gloo on cpu)", batch="8 = micro 2 × grad_accum 2 × world 2",
        total_steps=12, steps_per_epoch=30, train_rows=243, train_unit="rows", eval_rows=8,
        zero_stage=3, offload=["optimizer", "parameters"], preset_file="ds_z3_offload_config.json",
        precision="fp32", attention="sdpa (model.attn_implementation=auto)", ds_config="{}",
        memory_plan="≈ 0.24 GiB per device", lines=["  reference       frozen copy"],
        data_reports=["arith-pref (built-in): kept 256 of 256 rows"],
        logging_notes=["tensorboard: out/tensorboard"], output_dir="out",
    )  # fmt: skip
    return report.StartupFacts(**{**base, **changes})


def test_startup_summary_shows_what_a_user_checks_first() -> None:
    text = report.startup_summary(facts())
    lines = text.splitlines()
    assert lines[0] == "align_anything dpo"
    assert (
        "  model           tiny-random-llama (llama): 3.2M trainable, 0 frozen parameters" in lines
    )
    assert "  effective batch 8 = micro 2 × grad_accum 2 × world 2" in lines
    assert "  steps           12 (30 per epoch, 243 train rows, 8 eval rows)" in lines
    assert (
        "  deepspeed       ZeRO stage 3, offload optimizer + parameters "
        "(ds_z3_offload_config.json)" in lines
    )
    assert "  reference       frozen copy" in lines
    assert "  data            arith-pref (built-in): kept 256 of 256 rows" in lines
    assert "  logging         tensorboard: out/tensorboard" in lines
    assert "resumed" not in text and "parts" not in text
    resumed = report.startup_summary(
        facts(resumed=("out/checkpoints/step-4", 4), universal="ZeRO 2 -> 3", parts="lm 3.2M")
    )
    assert "  resumed         from out/checkpoints/step-4 at step 4" in resumed
    assert "via a universal checkpoint: ZeRO 2 -> 3" in resumed
    assert "  parts           lm 3.2M" in resumed


def test_final_summary_and_summary_json_read_the_history() -> None:
    history = [
        {"step": 0, "phase": "before", "eval/loss": 0.69},
        {"step": 1, "loss": 0.6},
        {"step": 2, "phase": "after", "eval/loss": 0.5},
    ]
    peaks = [(1 << 30, 3 << 30)]
    text = report.final_summary(task="dpo", steps=2, history=history, train_seconds=9.6,
                                peaks=peaks, no_eval_reason="unused")  # fmt: skip
    assert text.splitlines()[0] == "finished dpo: 2 steps in 10 s"
    assert "3.00 GiB" in text
    assert any(
        line.split()[:4] == ["eval/loss", "0.6900", "→", "0.5000"] for line in text.splitlines()
    )
    data = report.summary_data(run_id="r1", task="dpo", steps=2, history=history,
                               train_seconds=9.6, peaks=peaks,
                               extra={"reference_seconds": 1.5})  # fmt: skip
    assert data["evaluations"]["after"]["eval/loss"] == 0.5
    assert data["peak_memory_gib_per_rank"] == [3.0]
    assert data["memory_before_model_gib_per_rank"] == [1.0]
    assert data["reference_seconds"] == 1.5
    json.dumps(data)  # summary.json is plain JSON
    lonely = report.final_summary(task="sft", steps=2, history=history[1:2], train_seconds=1.0,
                                  peaks=[], no_eval_reason="because")  # fmt: skip
    assert "  no held-out metrics: because" in lonely


def test_why_no_eval_names_the_cause_and_the_key() -> None:
    assert "data.eval_fraction=0 and no data.eval_path" in report.why_no_eval(
        eval_records=0, reports=[], max_length=64
    )
    dropped = DataReport("eval split, encode_sft(max_length=64)", kept=0)
    dropped.drop("too long", "line 3")
    reason = report.why_no_eval(eval_records=5, reports=[dropped], max_length=64)
    assert "every one of the 5 eval rows was dropped" in reason
    assert "raise data.max_length (now 64)" in reason and "too long" in reason


def test_nonfinite_names_the_step_and_its_rows() -> None:
    plan = BatchPlan(micro_batch=2, grad_accum=1, world_size=1, global_batch=2)
    text = report.nonfinite(["loss"], [float("nan")], step=3, rows=10, batch=plan, seed=1,
                            steps_per_epoch=5, good=None)  # fmt: skip
    assert "non-finite training metric at step 4" in text and "loss=nan" in text
    assert "its update was not applied" in text and "no checkpoint was written" in text


# ---------------------------------------------------------------------------- fail together


def test_fail_together_keeps_the_error_class_and_message() -> None:
    def bad_data() -> None:
        raise DataError("rows.jsonl line 3: no prompt")

    with pytest.raises(DataError, match="rows.jsonl line 3: no prompt"):
        comm.fail_together(bad_data, what="data preparation")
    assert comm.fail_together(lambda: 7, what="x") == 7
    assert comm.fail_together(None, what="x") is None  # a rank with nothing to do only waits


def test_fail_together_raises_a_crash_on_its_own_rank() -> None:
    def crash() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        comm.fail_together(crash, what="data preparation")


def test_decide_on_main_gives_the_value_or_the_users_error() -> None:
    assert comm.decide_on_main(lambda: ("run-1", None)) == ("run-1", None)

    def refuse() -> None:
        raise ConfigError("output_dir holds a run")

    with pytest.raises(ConfigError, match="output_dir holds a run"):
        comm.decide_on_main(refuse)
    assert issubclass(ConfigError, UserError)


# ---------------------------------------------------------------------------- row batches


ROWS = [{"input_ids": [1] * (i % 5 + 2), "labels": [1] * (i % 5 + 2), "n": i} for i in range(12)]


def test_row_batches_give_each_rank_its_share_of_the_seeded_step() -> None:
    """The step's rows are `batching.rank_step_rows`' for the rank; the ranks' micro-batches
    together are the one-rank step's rows."""
    one = BatchPlan(micro_batch=4, grad_accum=1, world_size=1, global_batch=4)
    two = BatchPlan(micro_batch=2, grad_accum=1, world_size=2, global_batch=4)
    ids = []  # the rows each micro-batch got, through a collate that records them

    def collate(rows: list[dict]):
        ids.append([r["n"] for r in rows])
        return collate_sft(rows, pad_id=0)

    single = RowBatches(ROWS, one, rank=0, seed=3, steps_per_epoch=3, collate=collate)
    out = single.step(4)  # epoch 1, step 1
    assert len(out.batches) == 1 and out.batches[0].input_ids.shape[0] == 4
    assert ids[-1] == rank_step_rows(4, 12, one, rank=0, seed=3, steps_per_epoch=3)[0]
    whole = set(ids[-1])
    for rank in (0, 1):
        RowBatches(ROWS, two, rank=rank, seed=3, steps_per_epoch=3, collate=collate).step(4)
    assert set(ids[-2]) | set(ids[-1]) == whole and not set(ids[-2]) & set(ids[-1])
    assert out.metrics == {} and out.seconds == 0.0 and out.table == []


def test_row_batches_pass_the_step_to_rows_of_step() -> None:
    """A task that adds step-dependent fields (KTO's KL partner) gets (step, indices)."""
    seen = []

    def rows_of_step(step: int, indices: list[int]) -> list[dict]:
        seen.append((step, list(indices)))
        return [ROWS[i] for i in indices]

    plan = BatchPlan(micro_batch=2, grad_accum=2, world_size=1, global_batch=4)
    source = RowBatches(ROWS, plan, rank=0, seed=0, steps_per_epoch=3,
                        collate=lambda rows: collate_sft(rows, pad_id=0),
                        rows_of_step=rows_of_step)  # fmt: skip
    assert len(source.step(2).batches) == 2
    assert [s for s, _ in seen] == [2, 2]
    assert [i for _, idx in seen for i in idx] == [
        i for chunk in rank_step_rows(2, 12, plan, rank=0, seed=0, steps_per_epoch=3) for i in chunk
    ]


# ---------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def one_process_group() -> Iterator[comm.DistInfo]:
    """A one-process gloo group in this process (what a plain `python -m` run sets up)."""
    saved = {k: os.environ.pop(k) for k in DIST_ENV_VARS if k in os.environ}
    info = comm.setup_distributed()
    yield info
    comm.teardown_distributed()
    os.environ.update(saved)


Z0 = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
      "bf16": {"enabled": False}, "fp16": {"enabled": False},
      "steps_per_print": 1_000_000}  # fmt: skip


def tiny(reward: bool = False) -> torch.nn.Module:
    from align_anything.families import zoo
    from align_anything.families.language import loading

    return loading.load_model(
        zoo.resolve_model_path("tiny-random-llama"), reward=reward, dtype=torch.float32
    )


def policy_engine() -> object:
    from align_anything.backend import ds_config as dsc
    from align_anything.backend.engine import Engine

    return Engine(tiny(), dict(Z0), adam=dsc.AdamSettings(1e-3, (0.9, 0.999), 1e-8, 0.0),
                  schedule="constant", total_steps=1, warmup_steps=0)  # fmt: skip


@pytest.mark.slow
def test_reference_is_the_loaded_model_frozen_or_the_adapter_disabled_policy(
    one_process_group: comm.DistInfo,
) -> None:
    from align_anything.backend.engine import InferenceEngine
    from align_anything.families.language import lora, reference

    policy = policy_engine()
    loaded = []

    def load() -> torch.nn.Module:
        loaded.append(1)
        return tiny()

    with_lora = reference.build(policy=policy, lora_enabled=True, load_model=load, ds_config=Z0)
    assert isinstance(with_lora, lora.AdapterDisabledReference) and not loaded
    frozen = reference.build(policy=policy, lora_enabled=False, load_model=load,
                             ds_config={**Z0, "train_batch_size": 2})  # fmt: skip
    assert isinstance(frozen, InferenceEngine) and loaded == [1]
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(
            frozen(input_ids=ids).logits, policy.module(input_ids=ids).logits
        )
    assert "frozen copy" in reference.describe(frozen, lora_enabled=False, offload=False,
                                               precomputed_s=None)  # fmt: skip
    assert "4.0 s" in reference.describe(frozen, lora_enabled=False, offload=False,
                                         precomputed_s=4.0)  # fmt: skip
    found = reference.precompute([3, 1, 2], lambda keys: [k * 10 for k in keys], chunk=2,
                                 rank=0, world=1)  # fmt: skip
    assert found == {3: 30, 1: 10, 2: 20}


@pytest.mark.slow
def test_plain_gradients_are_clipped_once_by_the_logged_norm(
    one_process_group: comm.DistInfo,
) -> None:
    """ZeRO-0 in fp32: the wrapper measures the gradient norm once, logs it and clips with it;
    DeepSpeed does not clip again. The first AdamW step with a large eps moves each weight by
    lr·g/(|g| + eps), so the scale the gradients were clipped to shows in the weights (a
    second clip at this max_norm would scale them by max_norm / (max_norm + 1e-6), 1% less)."""
    from align_anything.backend import ds_config as dsc
    from align_anything.backend.engine import Engine

    lr, eps, clip = 1000.0, 10.0, 1e-4
    engine = Engine(tiny(), {**Z0, "gradient_clipping": clip},
                    adam=dsc.AdamSettings(lr, (0.9, 0.999), eps, 0.0), schedule="constant",
                    total_steps=1, warmup_steps=0)  # fmt: skip
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    params = [p for p in engine.module.parameters() if p.grad is not None]
    before = [p.detach().clone() for p in params]
    grads = [p.grad.detach().clone() for p in params]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert norm > 10 * clip  # the clipping acts
    engine.step()
    assert engine.grad_norm() == pytest.approx(float(norm), rel=1e-5)
    factor = clip / (float(norm) + 1e-6)
    for param, old, grad in zip(params, before, grads, strict=True):
        clipped = grad * factor
        moved = lr * clipped / (clipped.abs() + eps)  # ~1e-3: well above the weights' ulp
        torch.testing.assert_close(old - param.detach(), moved, rtol=1e-3, atol=2e-7)


@pytest.mark.slow
def test_generation_check_counts_greedy_answers_with_the_property(
    one_process_group: comm.DistInfo,
) -> None:
    from align_anything.families import zoo
    from align_anything.families.language import evaluation as generation
    from align_anything.families.language import loading

    policy = policy_engine()
    tokenizer = loading.load_tokenizer(zoo.resolve_model_path("tiny-random-llama"))
    records = [{"prompt": [{"role": "user", "content": f"What is {n}?"}], "n": n} for n in range(5)]
    answers = {}

    def check(record: dict, text: str) -> bool:
        answers[record["n"]] = text
        return record["n"] % 2 == 0  # the property: a pure function of the record here

    share = generation.generation_check(policy, tokenizer, records, check, max_new_tokens=3,
                                        rank=0, world=1)  # fmt: skip
    assert share == pytest.approx(3 / 5) and sorted(answers) == [0, 1, 2, 3, 4]
    assert policy.module.training  # left in training mode
    # Data without a check, or no samples: no figure at all.
    assert generation.held_out_check(policy=policy, tokenizer=tokenizer, data_path="mine.jsonl",
                                     records=records, samples=5, max_new_tokens=3, rank=0,
                                     world=1) == {}  # fmt: skip
    assert generation.held_out_check(policy=policy, tokenizer=tokenizer, data_path="arith-pref",
                                     records=records, samples=0, max_new_tokens=3, rank=0,
                                     world=1) == {}  # fmt: skip


@pytest.mark.slow
def test_reward_model_scores_rendered_text_as_the_model_alone(
    one_process_group: comm.DistInfo, tmp_path: Path
) -> None:
    """The online reward model re-renders prompt + completion through its chat template and
    reads the score at the last token: the scores a plain forward of that text gives."""
    from align_anything.families import zoo
    from align_anything.families.language import loading
    from align_anything.rewards.model import RewardModel

    path = zoo.resolve_model_path("tiny-random-llama")
    tokenizer = loading.load_tokenizer(path)
    scorer = tiny(reward=True)
    scorer.config.pad_token_id = tokenizer.pad_token_id
    scorer.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    model = RewardModel(str(tmp_path / "rm"), policy_tokenizer=tokenizer, precision="fp32",
                        model_init_config=Z0, ds_config=Z0, device=torch.device("cpu"))  # fmt: skip
    assert model.same_tokenizer and "frozen copy" in model.describe()
    prompts = [[{"role": "user", "content": "What is 1+1?"}]] * 2
    completions = ["Answer: 2", "It is two, I think"]
    got = model.score(prompts, completions)
    for prompt, completion, score in zip(prompts, completions, got, strict=True):
        text = tokenizer.apply_chat_template(
            [*prompt, {"role": "assistant", "content": completion}], tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            alone = scorer(input_ids=torch.tensor([ids])).logits.squeeze().item()
        assert score == pytest.approx(alone, rel=1e-5, abs=1e-6)
    with pytest.raises(ConfigError, match="is not a reward model"):
        policy_dir = tmp_path / "policy"
        tiny().save_pretrained(policy_dir)
        tokenizer.save_pretrained(policy_dir)
        RewardModel(str(policy_dir), policy_tokenizer=tokenizer, precision="fp32",
                    model_init_config=Z0, ds_config=Z0, device=torch.device("cpu"))  # fmt: skip


@pytest.mark.parametrize("launched", [False, True])
def test_a_stop_request_counts_the_launchers_forward_as_the_same_signal(launched: bool) -> None:
    """Plain: the first SIGTERM is recorded, the second stops at once. Under a launcher a
    process-group SIGTERM arrives twice (directly and forwarded), so the third stops at once."""
    import signal

    from align_anything.errors import Preempted
    from align_anything.training.preemption import StopRequest

    with StopRequest(announce=False, launched=launched) as stop:
        signal.raise_signal(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        if launched:
            signal.raise_signal(signal.SIGTERM)  # the launcher's forward: still one request
            assert stop.signum == signal.SIGTERM
        with pytest.raises(Preempted, match=r"second stop signal \(SIGINT after SIGTERM\)"):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) != stop._handle  # the previous handler is back


def test_only_a_launchers_environment_counts_as_launched(monkeypatch) -> None:
    """Set-up gives a plain `python -m` run LOCAL_RANK too, so that is not the sign; the
    deepspeed launcher's LOCAL_SIZE and torchrun's TORCHELASTIC_RUN_ID are."""
    from align_anything.training.preemption import launched_by_launcher

    for name in ("LOCAL_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not launched_by_launcher()
    monkeypatch.setenv("LOCAL_SIZE", "2")
    assert launched_by_launcher()
    monkeypatch.delenv("LOCAL_SIZE")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert launched_by_launcher()


@pytest.mark.slow
def test_a_released_zero3_reference_is_freed(one_process_group: comm.DistInfo) -> None:
    """A precomputed reference is released before training. Under ZeRO-3, DeepSpeed 0.19.8 keeps
    a destroyed engine's module alive (a module-level list and a class-level cache hold it), so
    its weights stayed resident through training until `release` dropped those references: the
    model and its parameters are garbage once released, and still usable before."""
    import gc
    import weakref

    from align_anything.backend import ds_config as dsc
    from align_anything.backend.engine import InferenceEngine
    from align_anything.backend.zero_init import forget, model_init_context

    z3 = {**Z0, "zero_optimization": {"stage": 3}}
    with model_init_context(z3):
        model = tiny()
    frozen = InferenceEngine(model, dsc.inference_config(z3, offload=False))
    assert frozen.stage == 3
    module, param = weakref.ref(model), weakref.ref(next(model.parameters()))
    del model
    ids = torch.tensor([[5, 6, 7, 8]])
    for _ in range(3):  # a complete trace: DeepSpeed caches which parameters to release
        frozen(input_ids=ids)
    frozen.release()
    gc.collect()
    forget()
    assert module() is None and param() is None
