"""The vLLM generation backends (`rollout.backend=vllm`): the pure parts in any environment, and
both modes on CPU against the real SmolLM2 when the vLLM environment exists (`make vllm`
makes .venv-vllm; ALIGN_ANYTHING_VLLM_PYTHON names another interpreter). Without it those
tests skip and say why.

An engine takes 30-90 s to start on 2 shared cores, so each mode starts few: the server tests
share one serve-rollout process (a module fixture; the last test kills it on purpose), the
colocated checks run in one process of the vLLM environment (`tests/vllm_checks.py`), and each
mode has one GRPO run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import REPO_ROOT, finish, free_port, launch, spawn, tail

from align_anything.config import load_config
from align_anything.errors import ConfigError
from align_anything.generation import vllm as rollout_vllm
from align_anything.generation.rollout import GumbelSampler, Sampling, completion_seed
from align_anything.losses import logp_mismatch, truncated_importance_weights

VLLM_PYTHON = Path(
    os.environ.get("ALIGN_ANYTHING_VLLM_PYTHON") or REPO_ROOT / ".venv-vllm" / "bin" / "python"
)
HAVE_VLLM = VLLM_PYTHON.is_file()
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM,
    reason=f"no vLLM environment at {VLLM_PYTHON} (`make vllm` makes it; "
    "ALIGN_ANYTHING_VLLM_PYTHON names another)",
)
ENGINE_START_S = 600.0  # a loaded 2-core runner has taken minutes
# A test that starts an engine (or first uses a module fixture that does): pytest-timeout's 900 s
# covers fixture set-up too, and the colocated checks alone took 15 min at load average 15-20.
vllm_timeout = pytest.mark.timeout(3600)
SMOL = "smollm2-135m-instruct"
GRPO_VLLM = [
    "task=grpo", f"model.name_or_path={SMOL}", "train.precision=fp32", "train.seed=42",
    "data.path=arith-prompts", "data.eval_path=arith-prompts-eval", "train.learning_rate=1e-5",
    "grpo.num_generations=4", "grpo.max_completion_length=12", "grpo.eval_samples=2",
    "train.per_device_batch_size=8", "checkpoint.save_final=false", "deepspeed=z0",
    "rollout.backend=vllm", "rollout.vllm.kv_cache_gib=0.5",
]  # fmt: skip


# ---------------------------------------------------------------------------- pure parts


def test_truncated_importance_weights_by_hand() -> None:
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
    engine = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token = truncated_importance_weights(trainer, engine, mask, cap=1.5, level="token")
    # exp(0.5) = 1.6487 capped at 1.5; exp(-1) = 0.3679; exp(0) = 1; exp(-2) = 0.1353; masked: 1.
    expected = torch.tensor([[1.5, math.exp(-1.0), 1.0], [math.exp(-2.0), 1.0, 1.0]])
    torch.testing.assert_close(token, expected)
    sequence = truncated_importance_weights(trainer, engine, mask, cap=2.0, level="sequence")
    # Row 0: exp(0.5 - 1 + 0) = exp(-0.5); row 1: exp(-2 + 0) (the masked 9.0 left out).
    torch.testing.assert_close(sequence, torch.tensor([math.exp(-0.5), math.exp(-2.0)]))
    with pytest.raises(ValueError, match="cap must be >= 1"):
        truncated_importance_weights(trainer, engine, mask, cap=0.5, level="token")


def test_logp_mismatch_by_hand() -> None:
    trainer = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    engine = torch.tensor([[-1.5, -2.0], [-1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert logp_mismatch(trainer, engine, mask) == (2.5, 3.0, 2.0)
    assert logp_mismatch(trainer, engine, torch.zeros_like(mask)) == (0.0, 0.0, 0.0)


def test_requests_and_completions_follow_the_hf_backends_rules() -> None:
    sampling = Sampling(5, temperature=0.7, top_p=0.9, top_k=20)
    requests = rollout_vllm.requests_for(
        [{"prompt_ids": [1, 2]}, {"prompt_ids": [3]}], 2, sampling, [11, 12], stop=[0, 9]
    )
    assert [r[0] for r in requests] == [[1, 2], [1, 2], [3], [3]]
    params = [r[1] for r in requests]
    # One seed per completion, the HF backend's (prompt seed, index) -> generator seed.
    assert [p["seed"] for p in params] == [completion_seed(11, 0), completion_seed(11, 1),
                                           completion_seed(12, 0), completion_seed(12, 1)]  # fmt: skip
    assert {(p["temperature"], p["top_p"], p["top_k"], p["max_tokens"]) for p in params} == {
        (0.7, 0.9, 20, 5)
    }
    assert all(p["ignore_eos"] and p["stop_token_ids"] == [0, 9] for p in params)
    greedy = rollout_vllm.sampling_params(Sampling(5, temperature=0.7, greedy=True), 3, [0])
    assert (greedy["temperature"], greedy["top_p"], greedy["top_k"]) == (0.0, 1.0, 0)
    done = rollout_vllm.to_completions(
        [([4, 9, 5], [-0.1, -0.2, -0.3]), ([4, 4, 4], [-1.0, -2.0, -3.0])], [0, 9], 1.0
    )
    assert done.ids == [[4, 9], [4, 4, 4]] and done.truncated == [False, True]
    assert done.logprobs == [[-0.1, -0.2], [-1.0, -2.0, -3.0]]
    assert done.generated_tokens == 5


def test_hf_sampler_top_k_keeps_k_tokens() -> None:
    scores = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    sampler = GumbelSampler([5], temperature=1.0, top_p=1.0, top_k=2)
    out = sampler(torch.zeros((1, 1), dtype=torch.long), scores)
    assert torch.isfinite(out).squeeze(0).tolist() == [False, True, False, True, False]
    # The draws follow the row's generator: 200 draws pick only the top 2, both of them.
    picks = {
        int(GumbelSampler([s], temperature=1.0, top_p=1.0, top_k=2)(None, scores).argmax())
        for s in range(200)
    }  # fmt: skip
    assert picks == {1, 3}


def test_rollout_config() -> None:
    cfg = load_config(["task=grpo"])
    assert cfg.rollout.backend == "hf" and cfg.rollout.vllm.mode == "colocate"
    assert cfg.grpo.top_k == 0
    with pytest.raises(ConfigError, match="rollout.backend=hf samples from the trained weights"):
        load_config(["task=grpo", "rollout.importance_sampling=true"])
    with pytest.raises(ConfigError, match=r"carries credentials") as err:
        load_config(["task=rloo", "rollout.vllm.server_url=http://user:pw@host/x"])
    with pytest.raises(ConfigError, match=r"http://HOST:PORT"):
        load_config(["task=rloo", "rollout.vllm.server_url=http://host/x"])
    assert "pw" not in str(err.value)
    with pytest.raises(ConfigError, match="the rollout section is for online RL"):
        load_config(["task=dpo", "rollout.backend=vllm"])


def test_unreachable_server_is_one_error_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    client = rollout_vllm.RolloutClient(url, timeout_s=5)
    with pytest.raises(rollout_vllm.RolloutServerError, match=re.escape(url)) as err:
        client.info()
    assert "serve-rollout" in str(err.value)


def test_lora_weights_are_sent_merged() -> None:
    """With LoRA the engine gets base + B·A·scale under the base model's names, computed
    aside: equal to peft's own merge, and the trained module unchanged."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from align_anything.families.zoo import resolve_model_path

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-random-llama"))
    names = [n for n, _ in base.named_parameters()]
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # B starts at 0: make the adapter change something
    before = {n: p.clone() for n, p in model.named_parameters()}

    class Policy:
        module, zero_stage = model, 0

    sent = dict(rollout_vllm.policy_weights(Policy())())
    assert list(sent) == names
    expected = {n: p.detach().clone() for n, p in _merged_copy(model).named_parameters()}
    for name in names:
        torch.testing.assert_close(sent[name], expected[name], rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(
        sent[q], before[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"]
    )
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


def _merged_copy(model: Any) -> Any:
    import copy

    return copy.deepcopy(model).merge_and_unload()


# ---------------------------------------------------------------------------- vLLM: server


@pytest.fixture(scope="module")
def server() -> Any:
    """One serve-rollout process of SmolLM2 in the vLLM environment, for this module."""
    if not HAVE_VLLM:
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (`make vllm` makes it)")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"serve-rollout-{port}.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), "-m", "align_anything", "serve-rollout", SMOL, "--port", str(port),
         "--max-model-len", "256", "--kv-cache-gib", "0.5"],
        cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ENGINE_START_S
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"serve-rollout exited {proc.returncode}:\n{tail(log.read())}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            if time.monotonic() > deadline:
                pytest.fail(f"serve-rollout did not answer at {url} in {ENGINE_START_S:.0f} s")
            time.sleep(2)
        yield {"url": url, "proc": proc, "log": log}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


@pytest.fixture(scope="module")
def server_measured(server: dict) -> dict[str, Any]:
    """`vllm_checks.measure` of the server backend, from this (the trainer's) environment."""
    import vllm_checks

    from align_anything.generation.rollout import stop_token_ids

    model, tokenizer, rows = vllm_checks.load()
    client = rollout_vllm.RolloutClient(server["url"], timeout_s=600)
    info = client.check_model(rollout_vllm.architecture(model.config), SMOL)
    version = [0]
    backend = rollout_vllm.VLLMServer(
        client, weights=rollout_vllm.policy_weights(vllm_checks.Policy(model)),
        version=lambda: version[0], stop=stop_token_ids(model, tokenizer), is_main=True,
        agree=lambda work, what: work(), info=info,
    )  # fmt: skip
    return vllm_checks.measure(
        backend, model, rows, vllm_checks.sgd_step(model, rows, version), client.prompt_logprobs
    )


@pytest.fixture(scope="module")
def colocate_measured() -> dict[str, Any]:
    """`vllm_checks.measure` of the colocated backend, in a process of the vLLM environment."""
    if not HAVE_VLLM:
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (`make vllm` makes it)")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", MASTER_PORT=str(free_port()))
    done = subprocess.run(
        [str(VLLM_PYTHON), str(REPO_ROOT / "tests" / "vllm_checks.py")], cwd=REPO_ROOT, env=env,
        capture_output=True, text=True, timeout=ENGINE_START_S + 600,
    )  # fmt: skip
    found = re.findall(r"^MEASURED (.*)$", done.stdout, flags=re.MULTILINE)
    assert done.returncode == 0 and found, (
        f"tests/vllm_checks.py exited {done.returncode}:\n{tail(done.stdout + done.stderr)}"
    )
    return json.loads(found[-1])


@pytest.fixture(params=["colocate", "server"])
def measured(request: pytest.FixtureRequest) -> dict[str, Any]:
    return request.getfixturevalue(f"{request.param}_measured")


@pytest.mark.slow
@needs_vllm
@vllm_timeout
def test_seeds_give_one_sample(measured: dict[str, Any]) -> None:
    assert measured["same_seed_same_ids"] and measured["same_seed_same_logprobs"]
    # Completions of one prompt have their own seeds: 4 distinct samples of 24 tokens each.
    assert measured["distinct_in_group"] == [4, 4]
    assert measured["other_seed_rows_differing"] >= 6  # of 8


@pytest.mark.slow
@needs_vllm
@vllm_timeout
def test_sampling_settings_reduce_to_greedy_as_they_should(measured: dict[str, Any]) -> None:
    assert measured["top_k1_is_greedy"]
    assert measured["top_p_tiny_is_greedy"]
    assert measured["cold_is_greedy"]
    # vLLM's greedy answers are transformers' (fp32 on both sides).
    assert measured["greedy_is_hf_greedy"] == [True, True]


@pytest.mark.slow
@needs_vllm
@vllm_timeout
def test_stop_tokens_and_truncation_flags(measured: dict[str, Any]) -> None:
    assert measured["stop_rule_held"]
    assert measured["some_ended"] > 0 and measured["some_truncated"] > 0
    # max_tokens=3: at most 3 tokens; truncated ones have all 3 (shorter ones ended).
    assert all(length <= 3 and (length == 3 or not cut) for length, cut in measured["short"])
    assert any(cut for _, cut in measured["short"])
    assert measured["custom_stop"] == [True, False]


@pytest.mark.slow
@needs_vllm
@vllm_timeout
def test_engine_logprobs_match_the_trainer_and_follow_a_step(measured: dict[str, Any]) -> None:
    assert measured["sampled_logprob_tokens"] > 50
    assert measured["sampled_logprob_max_diff"] < 2e-3
    # The step moved the fixed completion's log-probs far more than the tolerance, and the
    # engine's, after the round that synced the weights, are the trainer's.
    assert measured["step_moved_logprobs"] > 0.05
    assert measured["synced_logprob_max_diff"] < 2e-3


@pytest.mark.slow
@needs_vllm
@vllm_timeout
def test_colocated_engine_keeps_the_trainers_threads(colocate_measured: dict[str, Any]) -> None:
    assert colocate_measured["torch_threads_kept"]


def _vllm_steps(run: Any) -> list[dict[str, Any]]:
    steps = run.check().train_steps()
    assert len(steps) == 2
    for step in steps:
        assert math.isfinite(step["loss"])
        assert step["sampling/sampling_logp_difference/mean"] < 2e-3
        assert step["sampling/sampling_logp_difference/max"] < 5e-2
    return steps


@pytest.mark.slow
@needs_vllm
@vllm_timeout
def test_grpo_colocated(tmp_path: Path) -> None:
    """Two GRPO steps with the engine in the training process (the trainer runs in the vLLM
    environment), with truncated importance sampling on."""
    run = launch(
        [*GRPO_VLLM, "train.max_steps=2", "rollout.vllm.mode=colocate",
         "rollout.importance_sampling=true"],
        tmp_path / "run", python=str(VLLM_PYTHON), timeout_s=ENGINE_START_S + 600,
    )  # fmt: skip
    steps = _vllm_steps(run)
    assert "vLLM colocated" in run.summary_line("generator")
    for step in steps:
        # The weights: min(exp(trainer - engine), 3): within the mismatch of 1.
        assert abs(step["sampling/importance_sampling_ratio/mean"] - 1.0) < 2e-3
        assert step["sampling/importance_sampling_ratio/max"] <= 3.0


@pytest.mark.slow
@needs_vllm
@vllm_timeout
def test_grpo_on_the_server(server: dict, tmp_path: Path) -> None:
    """Two GRPO steps in this (the default) environment, generating on the server."""
    run = launch(
        [*GRPO_VLLM, "train.max_steps=2", "rollout.vllm.mode=server",
         f"rollout.vllm.server_url={server['url']}"],
        tmp_path / "run", timeout_s=900,
    )  # fmt: skip
    _vllm_steps(run)
    assert f"vLLM server {server['url']}" in run.summary_line("generator")
    assert "sampling/importance_sampling_ratio/mean" not in run.train_steps()[0]


@pytest.mark.slow
@needs_vllm
@vllm_timeout
def test_a_server_of_another_model_is_one_error(server: dict, tmp_path: Path) -> None:
    run = launch(
        ["task=grpo", "model.name_or_path=tiny-random-llama", "train.max_steps=1",
         "rollout.backend=vllm", "rollout.vllm.mode=server",
         f"rollout.vllm.server_url={server['url']}"],
        tmp_path / "run",
    )  # fmt: skip
    assert run.returncode == 2, tail(run.output)
    message = run.output[run.output.index("error:") :]
    assert f"rollout server at {server['url']} serves another model" in message
    assert "hidden 576, 30 layers" in message and "hidden 64, 2 layers" in message
    assert "Traceback" not in run.output


@pytest.mark.slow
def test_an_unreachable_server_stops_the_run_before_training(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    run = launch(
        ["task=grpo", "model.name_or_path=tiny-random-llama", "train.max_steps=1",
         "rollout.backend=vllm", "rollout.vllm.mode=server", f"rollout.vllm.server_url={url}"],
        tmp_path / "run",
    )  # fmt: skip
    assert run.returncode == 2, tail(run.output)
    assert f"error: the rollout server at {url} cannot be reached" in run.output
    assert "Traceback" not in run.output and not run.train_steps()


@pytest.mark.slow
@needs_vllm
@vllm_timeout
def test_a_server_that_dies_mid_run_stops_before_the_update(server: dict, tmp_path: Path) -> None:
    """The server is killed after the run's first checkpoint: the run stops with one error
    naming the URL, before that step's update, and the last checkpoint is intact. Last in this
    module: it kills the module's server."""
    out = tmp_path / "run"
    proc = spawn(
        [*GRPO_VLLM, "train.max_steps=6", "rollout.vllm.mode=server",
         f"rollout.vllm.server_url={server['url']}", "checkpoint.every_steps=1"],
        out,
    )  # fmt: skip
    deadline = time.monotonic() + 900
    while not _complete_checkpoints(out):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(1)
    os.killpg(server["proc"].pid, signal.SIGKILL)
    run = finish(proc, out, timeout_s=900)
    assert run.returncode == 2, tail(run.output)
    message = run.output[run.output.index("error:") :]
    assert re.search(r"generation in step \d+ failed, before that step's optimizer update", message)
    assert server["url"] in message and "is intact (resume=auto)" in message
    assert _complete_checkpoints(out) and len(run.train_steps()) < 6
    assert "Traceback" not in run.output


def _complete_checkpoints(output_dir: Path) -> list[Path]:
    from align_anything.training import checkpoints

    root = output_dir / "checkpoints"
    return [p for p in checkpoints.listed(root) if (p / checkpoints.MANIFEST).is_file()]


def test_importance_weights_scale_the_grpo_and_rloo_losses() -> None:
    """GRPO multiplies each token's loss by its weight, RLOO each completion's (on-policy:
    ratio 1, so the loss is −A·w per token / per sequence, summed over the counted ones)."""
    from align_anything.tasks.online.common import RolloutBatch
    from align_anything.tasks.online.grpo import GRPO
    from align_anything.tasks.online.rloo import RLOO

    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = torch.tensor([2.0, -1.0])

    def batch(weights: Any) -> RolloutBatch:
        return RolloutBatch(
            rows=None, shared=None, loss_mask=mask, truncated=torch.tensor([False, False]),
            advantages=advantages, is_weights=weights,
        )  # fmt: skip

    # The task part the algorithms read: the policy's per-token log-probs of the batch.
    task = SimpleNamespace(policy=None, token_logps=lambda policy, batch: logps)
    grpo = GRPO(load_config(["task=grpo", "grpo.loss_type=dapo"]).grpo)
    token_w = torch.tensor([[0.5, 2.0, 9.0], [1.0, 0.25, 3.0]])
    total = grpo.loss(task, batch(token_w), normalizer=1.0)[0]["policy"]
    # −A·w summed over counted tokens: −2·(0.5 + 2.0) + 1·(1.0 + 0.25 + 3.0) = −5 + 4.25.
    assert float(total) == pytest.approx(-0.75)
    plain = grpo.loss(task, batch(None), normalizer=1.0)[0]["policy"]
    assert float(plain) == pytest.approx(-2.0 * 2 + 1.0 * 3)
    rloo = RLOO(load_config(["task=rloo"]).rloo, global_batch=2)
    total = rloo.loss(task, batch(torch.tensor([0.5, 3.0])), normalizer=1.0)[0]["policy"]
    assert float(total) == pytest.approx(-2.0 * 0.5 + 1.0 * 3.0)
