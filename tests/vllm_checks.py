"""Measurements of a vLLM generation backend against the real SmolLM2 in transformers, for
tests/test_rollout_vllm.py: the same function measures the colocated backend (run as a script
in the vLLM environment: `python tests/vllm_checks.py`, which prints the measurements as JSON)
and the server backend (called in the test process, the trainer's environment, against a
serve-rollout server). It measures and returns numbers and flags; the tests assert on them.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MODEL = "smollm2-135m-instruct"
PROMPTS = ["Name three colours.", "What is 12 + 30? Answer with the number."]


class Policy:
    """What `rollout_vllm.policy_weights` reads of the trained engine: the module and its ZeRO
    stage (the test trains a plain transformers model, stage 0)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.zero_stage = 0


def load() -> tuple[Any, Any, list[dict]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from align_anything.families.zoo import resolve_model_path

    path = resolve_model_path(MODEL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [
        {
            "prompt_ids": tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        }  # fmt: skip
        for text in PROMPTS
    ]
    return model, tokenizer, rows


@torch.no_grad()
def hf_logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([[*prompt, *completion]])
    logps = model(ids).logits[0].float().log_softmax(-1)
    return [float(logps[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], max_new: int, stop: list[int]) -> list[int]:
    from align_anything.generation.rollout import cut_at_stop

    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=stop,
        pad_token_id=stop[0],
    )  # fmt: skip
    return cut_at_stop(out[0, len(prompt) :].tolist(), set(stop))[0]


def measure(
    backend: Any, model: Any, rows: list[dict], step: Callable[[], None],
    engine_logprobs: Callable[[list[tuple[list[int], list[int]]]], list[list[float]]],
) -> dict[str, Any]:  # fmt: skip
    """Generate with `backend` (its `stop` list is the model's EOS) under several sampling
    settings, compare with transformers, take one optimizer step (`step`, which moves the
    version the backend syncs by) and compare the engine's log-probs of a fixed completion with
    the updated model's."""
    from align_anything.generation.rollout import Sampling

    out: dict[str, Any] = {}
    stop = list(backend.stop)
    sample = Sampling(24, temperature=1.0)
    a = backend.generate(rows, 4, sample, [7, 8])
    b = backend.generate(rows, 4, sample, [7, 8])
    c = backend.generate(rows, 4, sample, [9, 10])
    out["same_seed_same_ids"] = a.ids == b.ids
    out["same_seed_same_logprobs"] = a.logprobs == b.logprobs
    out["distinct_in_group"] = [len({tuple(x) for x in a.ids[i * 4 : i * 4 + 4]}) for i in (0, 1)]
    out["other_seed_rows_differing"] = sum(x != y for x, y in zip(a.ids, c.ids, strict=True))
    # Sampling settings that must reduce to the argmax.
    greedy = backend.generate(rows, 1, Sampling(24, greedy=True), [0, 0])
    top_k1 = backend.generate(rows, 2, Sampling(24, temperature=1.0, top_k=1), [1, 2])
    top_p0 = backend.generate(rows, 2, Sampling(24, temperature=1.0, top_p=1e-6), [3, 4])
    cold = backend.generate(rows, 2, Sampling(24, temperature=1e-4), [5, 6])
    expect = [ids for ids in greedy.ids for _ in range(2)]
    out["top_k1_is_greedy"] = top_k1.ids == expect
    out["top_p_tiny_is_greedy"] = top_p0.ids == expect
    out["cold_is_greedy"] = cold.ids == expect
    out["greedy_is_hf_greedy"] = [
        ids == hf_greedy(model, row["prompt_ids"], 24, stop)
        for ids, row in zip(greedy.ids, rows, strict=True)
    ]
    # Every completion: cut at the first stop token, flagged truncated iff it has none.
    every = list(itertools.chain(a.ids, c.ids, greedy.ids))
    flags = list(itertools.chain(a.truncated, c.truncated, greedy.truncated))
    out["stop_rule_held"] = all(
        (not cut) == (ids[-1] in stop) and not any(t in stop for t in ids[:-1])
        for ids, cut in zip(every, flags, strict=True)
    )
    out["some_ended"] = sum(not f for f in flags)
    out["some_truncated"] = sum(flags)
    short = backend.generate(rows, 2, Sampling(3, temperature=1.0), [11, 12])
    out["short"] = [[len(ids), cut] for ids, cut in zip(short.ids, short.truncated, strict=True)]
    # A stop token of our choosing: the greedy answer's third token ends it there.
    chosen = greedy.ids[0][2]
    backend.stop = [*stop, chosen]
    cut_short = backend.generate(rows[:1], 1, Sampling(24, greedy=True), [0])
    backend.stop = stop
    out["custom_stop"] = [cut_short.ids[0] == greedy.ids[0][:3], cut_short.truncated[0]]
    # The engine's log-probs of its sampled tokens against the trainer's recomputed ones.
    diffs = [
        abs(e - t)
        for ids, logps, row in zip(
            a.ids, a.logprobs, [r for r in rows for _ in range(4)], strict=True
        )  # fmt: skip
        for e, t in zip(logps, hf_logprobs(model, row["prompt_ids"], ids), strict=True)
    ]
    out["sampled_logprob_max_diff"] = max(diffs)
    out["sampled_logprob_tokens"] = len(diffs)
    # One optimizer step on the model, then the engine's log-probs of a fixed completion.
    fixed = [(rows[0]["prompt_ids"], a.ids[0]), (rows[1]["prompt_ids"], a.ids[4])]
    before = [hf_logprobs(model, p, c) for p, c in fixed]
    step()
    after = [hf_logprobs(model, p, c) for p, c in fixed]
    backend.generate(rows[:1], 1, Sampling(2, greedy=True), [0])  # a round: syncs the weights
    engine = engine_logprobs(fixed)
    flat = lambda xs: [v for x in xs for v in x]  # noqa: E731
    out["step_moved_logprobs"] = max(abs(x - y) for x, y in zip(flat(before), flat(after),
                                                                strict=True))  # fmt: skip
    out["synced_logprob_max_diff"] = max(abs(x - y) for x, y in zip(flat(engine), flat(after),
                                                                    strict=True))  # fmt: skip
    return out


def sgd_step(model: Any, rows: list[dict], version: list[int]) -> Callable[[], None]:
    """One real optimizer step: SGD on the NLL of a fixed answer to the first prompt; the step
    counter (what the backend syncs by) moves with it."""

    def step() -> None:
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        prompt = rows[0]["prompt_ids"]
        answer = [28, 29, 30, 31, 32, 33]
        ids = torch.tensor([[*prompt, *answer]])
        logps = model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        loss = -logps[torch.arange(len(answer)), torch.tensor(answer)].mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        version[0] += 1

    return step


def colocated() -> dict[str, Any]:
    """The colocated backend in this process, the way a one-rank run builds it."""
    import os

    import torch.distributed as dist

    from align_anything.families.zoo import resolve_model_path
    from align_anything.generation import vllm as rollout_vllm
    from align_anything.generation.rollout import stop_token_ids
    from align_anything.generation.vllm_engine import EngineSettings, LocalEngine

    os.environ.setdefault("MASTER_PORT", sys.argv[1] if len(sys.argv) > 1 else "29555")
    rollout_vllm.colocated_env(0, 0, 1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    model, tokenizer, rows = load()
    threads = torch.get_num_threads()
    engine = LocalEngine(
        EngineSettings(
            model=resolve_model_path(MODEL),
            dtype="float32",
            max_model_len=256,
            kv_cache_gib=0.5,
            load_format="dummy",
            executor="external_launcher",
        )  # fmt: skip
    )
    version = [0]
    backend = rollout_vllm.VLLMColocate(
        engine, weights=rollout_vllm.policy_weights(Policy(model)), version=lambda: version[0],
        stop=stop_token_ids(model, tokenizer),
    )  # fmt: skip
    out = measure(backend, model, rows, sgd_step(model, rows, version), engine.prompt_logprobs)
    out["torch_threads_kept"] = torch.get_num_threads() == threads
    out["start_seconds"] = engine.start_seconds
    engine.close()
    dist.destroy_process_group() if dist.is_initialized() else None
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print("MEASURED " + json.dumps(colocated()), flush=True)
