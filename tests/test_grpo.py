"""Online RL (task=grpo / task=rloo) without a launch: sampling, per-token log-probs, the
config's checks and errors before any compute, and the memory planner. End-to-end runs are in
test_grpo_runs.py; the losses' hand-derived numbers in test_rl_losses.py (the parts branch)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from align_anything.config import load_config
from align_anything.errors import ConfigError
from align_anything.generation.rollout import GumbelSampler, HFGenerate, Sampling, cut_at_stop
from align_anything.train import main

TINY = "model.name_or_path=tiny-random-llama"


# ---------------------------------------------------------------------------- sampling


def test_gumbel_sampler_draws_from_the_tempered_distribution() -> None:
    """Argmax of processed logits + Gumbel noise is a sample of softmax(logits / T): the
    frequencies of 4000 draws (one generator each) match it within 0.03."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    temperature = 2.0
    counts = torch.zeros(4)
    for seed in range(4000):
        sampler = GumbelSampler([seed], temperature=temperature, top_p=1.0)
        counts[int(sampler(torch.zeros(1, 1, dtype=torch.long), logits).argmax())] += 1
    expected = torch.softmax(logits[0] / temperature, dim=-1)
    assert torch.allclose(counts / counts.sum(), expected, atol=0.03), (counts, expected)


def test_top_p_keeps_sampling_inside_the_nucleus() -> None:
    # Probabilities ~0.64, 0.24, 0.09, 0.03: top_p 0.8 keeps the first two tokens only.
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    picked = {
        int(
            GumbelSampler([s], temperature=1.0, top_p=0.8)(
                torch.zeros(1, 1, dtype=torch.long), logits
            ).argmax()
        )  # fmt: skip
        for s in range(500)
    }
    assert picked == {0, 1}


def test_cut_at_stop_keeps_the_stop_token_and_flags_truncation() -> None:
    assert cut_at_stop([5, 6, 2, 0, 0], {2}) == ([5, 6, 2], False)
    assert cut_at_stop([5, 6, 7], {2}) == ([5, 6, 7], True)


class _PlainEngine:
    """The two things `HFGenerate` asks of an engine, for a plain module (what
    `Engine.gathered_for_generation` yields outside ZeRO-3)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.device = torch.device("cpu")

    @contextmanager
    def gathered_for_generation(self):
        yield self.module


@pytest.fixture(scope="module")
def tiny_backend() -> tuple[HFGenerate, object]:
    from align_anything.families import zoo
    from align_anything.families.language import loading

    path = zoo.resolve_model_path("tiny-random-llama")
    model = loading.load_model(path, reward=False, dtype=torch.float32)
    tokenizer = loading.load_tokenizer(path)
    return HFGenerate(_PlainEngine(model), tokenizer, media=None, chunk=64), tokenizer


def test_completions_do_not_depend_on_the_batch_they_are_drawn_in(tiny_backend) -> None:
    """A prompt's completions are the same alone, beside another prompt (other padding) and in
    chunks of one: each completion has its own generator, seeded by (prompt seed, index)."""
    backend, tokenizer = tiny_backend
    short = {"prompt_ids": tokenizer("What is 2+2?")["input_ids"]}
    long = {"prompt_ids": tokenizer("Which is larger, 56 or 20? Think about it.")["input_ids"]}
    sampling = Sampling(8, temperature=1.0, top_p=0.9)
    together = backend.generate([long, short], 3, sampling, [11, 22])
    alone = backend.generate([short], 3, sampling, [22])
    assert together.ids[3:] == alone.ids
    backend.chunk = 1
    try:
        assert backend.generate([long, short], 3, sampling, [11, 22]).ids == together.ids
    finally:
        backend.chunk = 64
    # Different completions of one prompt differ (they are samples, not copies).
    assert len({tuple(ids) for ids in together.ids[:3]}) > 1
    assert all(len(ids) <= 8 for ids in together.ids)
    assert together.truncated == [len(ids) == 8 and ids[-1] != tokenizer.eos_token_id
                                  for ids in together.ids]  # fmt: skip


# ---------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("completion_only", [True, False])
def test_completion_token_logps_are_each_completion_token_left_aligned(
    tiny_backend, completion_only: bool
) -> None:
    from align_anything.families.language.batches import Rows
    from align_anything.families.language.forward import completion_token_logps

    backend, _ = tiny_backend
    model = backend.engine.module
    # Two rows: prompt 3 + completion 4, prompt 5 + completion 2 (then padding).
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 0]])
    labels = torch.full_like(ids, -100)
    labels[0, 3:7] = ids[0, 3:7]
    labels[1, 5:7] = ids[1, 5:7]
    attention = torch.ones_like(ids)
    attention[1, 6] = 0
    labels[1, 6] = -100
    labels[1, 5] = ids[1, 5]
    batch = Rows(ids, attention, labels)
    with torch.no_grad():
        got = completion_token_logps(model, batch, completion_only=completion_only)
        logps = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits, -1)
    expected_0 = [logps[0, t - 1, ids[0, t]] for t in range(3, 7)]
    expected_1 = [logps[1, 4, ids[1, 5]]]
    assert got.shape == (2, 4)
    assert torch.allclose(got[0], torch.stack(expected_0), atol=1e-5)
    assert torch.allclose(got[1, :1], torch.stack(expected_1), atol=1e-5)
    assert (got[1, 1:] == 0).all()


# ---------------------------------------------------------------------------- config


def test_defaults_point_at_the_rl_main_job() -> None:
    cfg = load_config(["task=grpo"])
    assert cfg.model.name_or_path == "smollm2-135m-instruct"
    assert (cfg.data.path, cfg.data.eval_path) == ("arith-prompts", "arith-prompts-eval")
    assert cfg.reward.functions == ["align_anything.rewards:arith_exact"]
    assert cfg.grpo.beta == 0.0 and cfg.grpo.loss_type == "dapo"
    assert cfg.grpo.clip_range() == (0.2, 0.2)
    assert load_config(["task=grpo", "grpo.epsilon_high=0.28"]).grpo.clip_range() == (0.2, 0.28)
    assert load_config(["task=rloo"]).rloo.beta == 0.05  # TRL's RLOO default


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["task=grpo", "reward.weights=[1.0,2.0]"],
         "reward.weights has 2 entries but there are 1 rewards"),
        (["task=grpo", "reward.functions=[]"], "no reward: list reward.functions"),
        (["task=sft", "reward.functions=[a:b]"], "the reward section is for online RL"),
        (["task=grpo", "grpo.loss_type=bnpo"], "grpo.loss_type"),
        (["task=grpo", "grpo.num_generations=1"], "grpo.num_generations"),
        (["task=rloo", "grpo.beta=0.1"], "section 'grpo' is set but task is 'rloo'"),
    ],
)  # fmt: skip
def test_bad_rl_config_is_one_clear_error(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert fragment in str(err.value)


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    import json

    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"What number comes after {n}?", "answer": n + 1} for n in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.usefixtures("in_process_offline")
@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["train.per_device_batch_size=6", "grpo.num_generations=4"],
         "micro-batch x gradient accumulation (6 x 1 = 6 completions per rank) must be a "
         "multiple of 4"),
        (["train.per_device_batch_size=64", "grpo.num_generations=4"],
         "the training set has 12 usable prompts, fewer than one step's 16"),
        (["reward.functions=[align_anything.rewards:arith_exactt]"], "arith_exact"),
        (["reward.functions=[no_such_module_xyz:f]"], "no_such_module_xyz"),
    ],
)  # fmt: skip
def test_bad_rl_input_is_one_error_before_any_compute(
    overrides: list[str], fragment: str, prompt_file: Path, capsys, tmp_path: Path
) -> None:
    status = main(["task=grpo", TINY, f"data.path={prompt_file}", "data.eval_path=null", "data.eval_fraction=0",
                   *overrides, f"output_dir={tmp_path / 'out'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2, err
    assert fragment in err and "Traceback" not in err
    assert err.count("error:") == 1
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------- memory planner


def test_planner_counts_generation_reference_and_reward_model() -> None:
    from align_anything.config import load_preset
    from align_anything.families.language import memory as plan
    from align_anything.families.language.sizes import ModelSizes
    from align_anything.training.memory_plan import Estimate

    sizes = ModelSizes(total=1000, trainable=1000, largest_layer=100, hidden=8, layers=2,
                            vocab=10)  # fmt: skip

    def estimate(preset: str, overrides: list[str]) -> Estimate:
        cfg = load_config(["task=grpo", "train.per_device_batch_size=2", "data.max_length=16",
                           "grpo.generation_batch_size=4", *overrides])  # fmt: skip
        return plan.estimate_preset(
            preset, load_preset(preset)[0], sizes, cfg, world_size=2, gpus_per_node=2,
            precision="fp32",
        )  # fmt: skip

    kv = 2 * 2 * 8 * 16 * 4 * 4 + 4 * 10 * 4  # K and V of 4 sequences of 16 tokens, last logits
    assert estimate("z0", []).generation == kv
    # ZeRO-3 gathers the other ranks' half of the weights for the round.
    assert estimate("z3", []).generation == kv + 4000 / 2
    assert estimate("z0", []).reference == 0  # beta = 0: no reference model
    assert estimate("z0", ["grpo.beta=0.1"]).reference == 4000
    assert estimate("z3", ["grpo.beta=0.1"]).reference == 4000 / 2
    assert estimate("z0", ["grpo.beta=0.1", "model.lora.enabled=true"]).reference == 0
    rm = estimate("z0", ["reward.model=tiny-random-llama"])
    assert rm.reference == plan.reward_model_params("tiny-random-llama") * 4
    e = estimate("z3", [])
    assert math.isclose(e.total, e.model_states + e.reference + max(e.activations, e.generation))


@pytest.mark.parametrize("greedy", [False, True])
def test_the_decode_loop_samples_what_generate_samples(tiny_backend, greedy: bool) -> None:
    """`decode.sample_completions` (each prompt prefilled once, its cache copied, finished
    sequences retired) gives the completions transformers' `generate` gives with the same
    per-completion generators: the prompts' left padding, positions and noise order agree."""
    from align_anything.generation.rollout import completion_seed, stop_token_ids

    backend, tokenizer = tiny_backend
    prompts = [
        {"prompt_ids": tokenizer("What is 2+2?")["input_ids"]},
        {"prompt_ids": tokenizer("Which is larger, 56 or 20? Think about it.")["input_ids"]},
        {"prompt_ids": tokenizer("Hi")["input_ids"]},
    ]
    sampling = Sampling(10, temperature=0.7, top_p=0.9, greedy=greedy)
    seeds = [5, 6, 7]
    module = backend.engine.module.eval()
    stop = stop_token_ids(module, tokenizer) + [
        tokenizer("a")["input_ids"][-1]
    ]  # stops mid-way too
    fast = backend._decode(module, prompts, 3, sampling, seeds, stop)
    rows = [(p, completion_seed(seeds[i], j)) for i, p in enumerate(prompts) for j in range(3)]
    slow = backend._generate(module, [r for r, _ in rows], [s for _, s in rows], sampling, stop)
    assert [cut_at_stop(t, set(stop)) for t in fast] == [cut_at_stop(t, set(stop)) for t in slow]
    assert len(fast) == 9 and any(len(t) < 10 for t in fast) == any(len(t) < 10 for t in slow)
