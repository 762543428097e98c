"""vLLM generation backends for online RL (`rollout.backend=vllm`): the engine colocated in the
training process, or a server (`python -m align_anything serve-rollout`) in its own process and
environment. Both implement `rollout.GenerationBackend.generate` with the HF backend's meaning:

- **Sampling**: the same `Sampling` (temperature, top-k, then top-p, max tokens; greedy for
  evaluation) and the same stop tokens (`rollout.stop_token_ids`: vLLM's own EOS handling is off,
  `ignore_eos`, and the trainer's stop list is passed as `stop_token_ids`), one request per
  completion with its own seed (`rollout.completion_seed`, vLLM's per-request
  `SamplingParams(seed=...)`), so a completion depends on its seed and the weights only, not on
  the batch it was drawn in. The two backends do not draw the same tokens for a seed (different
  random streams); each gives one run per seed.
- **Completions**: token ids up to and including the first stop token, truncated when none came
  within max tokens (`rollout.cut_at_stop`, as HF's), and the engine's log-prob of each kept
  token (`Completions.logprobs`). They are the raw model's log-probs (vLLM's default
  `logprobs_mode="raw_logprobs"`: before temperature and top-k/p), which is what the trainer
  recomputes, so their difference is the engine/trainer mismatch alone. The loss always uses the
  trainer's log-probs; the online task logs the mismatch and, when asked, weighs the loss by the
  truncated importance ratio (`losses.truncated_importance_weights`).
- **Weights**: the engine gets the policy's weights before a round whenever an optimizer step
  changed them (`version`), in memory: colocated, one parameter at a time into vLLM's
  `reload_weights` (under ZeRO-3 each parameter gathered on its own and released, as TRL's
  `_move_model_to_vllm`); to a server, in safetensors chunks over HTTP. The first round always
  sends them, so a resumed run or a server started on other weights generates from the trained
  ones. A colocated engine so never reads weights from disk (`load_format="dummy"`).

The engine itself, which serve-rollout builds too, is `generation.vllm_engine`'s; this module
holds the trainer's side of both modes: requests and completions, the policy's weights, the
colocated backend, the server's client, and `build_backend`.

vLLM is imported only when an engine is built: the default environment needs none of it.
vLLM pins transformers below the project's version, so it lives in its own environment
(`make vllm` makes `.venv-vllm`): the trainer runs there for colocate, or only the server does.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from align_anything.errors import ConfigError, UserError
from align_anything.generation.rollout import Completions, Sampling, completion_seed, cut_at_stop
from align_anything.generation.vllm_engine import (
    ARCHITECTURE_KEYS,
    EngineSettings,
    LocalEngine,
    architecture,
    describe_architecture,
)

Weights = Callable[[], Iterator[tuple[str, torch.Tensor]]]
# Largest weight upload in one HTTP request (a model goes in several).
CHUNK_BYTES = 64 * 1024 * 1024


def sampling_params(sampling: Sampling, seed: int, stop: Sequence[int]) -> dict[str, Any]:
    """vLLM `SamplingParams` keyword arguments of one completion (plain data: a server gets
    them as JSON). Greedy is temperature 0 (vLLM's argmax)."""
    return {
        "n": 1,
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "top_p": 1.0 if sampling.greedy else sampling.top_p,
        "top_k": 0 if sampling.greedy else sampling.top_k,
        "max_tokens": sampling.max_new_tokens,
        "seed": seed,
        # The trainer's stop tokens, and only those (HF's generate stops at the same list).
        "ignore_eos": True,
        "stop_token_ids": list(stop),
        "logprobs": 0,  # the sampled token's log-prob
        "detokenize": False,
    }


def requests_for(
    prompts: Sequence[dict], n: int, sampling: Sampling, seeds: Sequence[int], stop: Sequence[int]
) -> list[tuple[list[int], dict[str, Any]]]:
    """One request per completion, prompt i's n completions at rows i·n … i·n+n−1."""
    return [
        (list(p["prompt_ids"]), sampling_params(sampling, completion_seed(seeds[i], j), stop))
        for i, p in enumerate(prompts)
        for j in range(n)
    ]


def to_completions(
    outputs: Sequence[tuple[list[int], list[float]]], stop: Sequence[int], seconds: float
) -> Completions:
    """(token ids, their log-probs) per request -> `Completions` cut at the first stop token."""
    ids, truncated, logprobs = [], [], []
    stops = set(stop)
    for tokens, logps in outputs:
        kept, cut = cut_at_stop(list(tokens), stops)
        ids.append(kept)
        truncated.append(cut)
        logprobs.append(list(logps[: len(kept)]))
    return Completions(ids, truncated, seconds, sum(map(len, ids)), logprobs)


# ---------------------------------------------------------------------------- weights


def policy_weights(policy: Any) -> Weights:
    """The policy's weights under the names the model's own folder uses, one parameter at a
    time: under ZeRO-3 each is gathered, read and released before the next (collective: every
    rank iterates to the end). With LoRA, a target layer's weight is given merged (base +
    B·A·scale, computed aside, so the trained weights are never touched)."""
    from align_anything.backend.engine import gathered
    from align_anything.families.language.lora import is_peft_model

    module, stage = policy.module, policy.zero_stage

    def plain() -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in module.named_parameters():
            with gathered([param], stage):
                yield name, param.data

    def merged() -> Iterator[tuple[str, torch.Tensor]]:
        from peft.tuners.lora import LoraLayer

        layers = {n: m for n, m in module.named_modules() if isinstance(m, LoraLayer)}
        for name, param in module.named_parameters():
            if ".lora_" in name or ".original_module." in name:
                continue
            clean = name.removeprefix("base_model.model.").replace(".base_layer", "")
            clean = clean.replace(".modules_to_save.default", "")
            owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
            layer = layers.get(owner) if owner else None
            if layer is None or not name.endswith(".base_layer.weight"):
                with gathered([param], stage):
                    yield clean, param.data
                continue
            with gathered(list(layer.parameters()), stage):
                delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters)
                yield clean, param.data + delta.to(param.dtype)

    return merged if is_peft_model(module) else plain


class VLLMColocate:
    """The engine in this training process (one per rank, each generating its rank's prompts;
    TRL's `vllm_mode="colocate"`)."""

    def __init__(
        self, engine: LocalEngine, *, weights: Weights, version: Callable[[], int],
        stop: Sequence[int],
    ) -> None:  # fmt: skip
        self.engine = engine
        self.weights = weights
        self.version = version
        self.stop = list(stop)
        self.synced: int | None = None
        self.sync_seconds = 0.0

    def sync(self) -> None:
        """Send the weights when an optimizer step changed them (always the first time)."""
        if self.synced == self.version() and not self.engine.sleeping:
            return
        start = time.perf_counter()
        self.engine.load_weights(self.weights())
        self.synced = self.version()
        self.sync_seconds = time.perf_counter() - start

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[dict], n: int, sampling: Sampling, seeds: Sequence[int]
    ) -> Completions:
        start = time.perf_counter()  # the weight sync counts: it is part of the round's cost
        self.sync()
        outputs = self.engine.generate(requests_for(prompts, n, sampling, seeds, self.stop))
        self.engine.sleep()
        return to_completions(outputs, self.stop, time.perf_counter() - start)

    def describe(self) -> str:
        sleep = (
            "asleep while training" if self.engine.sleeps
            else f"sleep not supported on {self.engine.platform}"
        )  # fmt: skip
        return (
            f"vLLM colocated ({self.engine.describe()}), weights synced in memory after each "
            f"optimizer step, {sleep}"
        )


# ---------------------------------------------------------------------------- the server


class RolloutServerError(UserError):
    """The rollout server cannot be reached, failed, or serves another model."""


class RolloutClient:
    """The protocol of `serve-rollout` (`tools/serve_rollout.py`), from the trainer's side:

    GET  /info           -> {"architecture": {...}, "model": str, "vllm": str, ...}
    POST /weights/begin  -> start a weight update (drops any unfinished one)
    POST /weights        body: safetensors bytes of some tensors (Hugging Face names)
    POST /weights/end    -> the engine takes every tensor sent since begin: {"tensors": n}
    POST /generate       {"requests": [[prompt ids, sampling params], ...]}
                         -> {"outputs": [[token ids, log-probs], ...], "seconds": s}
    POST /logprobs       {"sequences": [[prompt ids, completion ids], ...]} -> {"logprobs": [...]}

    Every failure (refused, reset, timed out, an HTTP error, an answer that is not what the
    protocol says) is one `RolloutServerError` naming the URL."""

    def __init__(self, url: str, *, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, path: str, body: bytes | None, content_type: str, what: str) -> dict:
        request = urllib.request.Request(
            self.url + path, data=body, method="GET" if body is None else "POST",
            headers={"Content-Type": content_type} if body is not None else {},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                payload = answer.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode(errors="replace")
            raise RolloutServerError(
                f"the rollout server at {self.url} answered {what} with HTTP {err.code}: {detail}"
            ) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise RolloutServerError(
                f"the rollout server at {self.url} cannot be reached ({what}: {reason}); start "
                "it with `python -m align_anything serve-rollout MODEL --port PORT` (in the "
                "environment `make vllm` makes) or set rollout.vllm.server_url"
            ) from None
        try:
            data = json.loads(payload)
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = None
        if not isinstance(data, dict):
            raise RolloutServerError(
                f"the rollout server at {self.url} answered {what} with something that is not "
                "a JSON object: is it a serve-rollout server?"
            )
        return data

    def _json(self, path: str, payload: dict[str, Any], what: str) -> dict:
        return self._call(path, json.dumps(payload).encode(), "application/json", what)

    def info(self) -> dict[str, Any]:
        data = self._call("/info", None, "", "GET /info")
        if not isinstance(data.get("architecture"), dict):
            raise RolloutServerError(
                f"the server at {self.url} is not a serve-rollout server (GET /info has no "
                "architecture)"
            )
        return data

    def check_model(self, arch: dict[str, Any], policy_name: str) -> dict[str, Any]:
        """The server's /info, after checking it serves the policy's architecture."""
        info = self.info()
        served = info["architecture"]
        differ = [k for k in ARCHITECTURE_KEYS if served.get(k) != arch.get(k)]
        if differ:
            shown = ", ".join(f"{k} {served.get(k)!r} vs {arch.get(k)!r}" for k in differ)
            raise RolloutServerError(
                f"the rollout server at {self.url} serves another model: "
                f"{info.get('model')} is {describe_architecture(served)}, but the policy "
                f"{policy_name} is {describe_architecture(arch)} ({shown}). Start serve-rollout "
                "with the policy's model (the weights need not match: the trainer sends them)"
            )
        return info

    def push_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        from safetensors.torch import save

        self._json("/weights/begin", {}, "POST /weights/begin")
        chunk: dict[str, torch.Tensor] = {}
        size = count = 0
        for name, tensor in weights:
            chunk[name] = tensor.detach().to("cpu", copy=True).contiguous()
            size += tensor.numel() * tensor.element_size()
            count += 1
            if size >= CHUNK_BYTES:
                self._call("/weights", save(chunk), "application/octet-stream", "POST /weights")
                chunk, size = {}, 0
        if chunk:
            self._call("/weights", save(chunk), "application/octet-stream", "POST /weights")
        answer = self._json("/weights/end", {}, "POST /weights/end")
        if answer.get("tensors") != count:
            raise RolloutServerError(
                f"the rollout server at {self.url} took {answer.get('tensors')} of the {count} "
                "weight tensors sent"
            )
        return count

    def generate(
        self, requests: list[tuple[list[int], dict[str, Any]]]
    ) -> list[tuple[list[int], list[float]]]:
        answer = self._json("/generate", {"requests": requests}, "POST /generate")
        outputs = answer.get("outputs")
        if not isinstance(outputs, list) or len(outputs) != len(requests):
            raise RolloutServerError(
                f"the rollout server at {self.url} answered {len(requests)} requests with "
                f"{len(outputs) if isinstance(outputs, list) else 'no'} outputs"
            )
        return [(list(ids), list(logps)) for ids, logps in outputs]

    def prompt_logprobs(
        self, sequences: Sequence[tuple[list[int], list[int]]]
    ) -> list[list[float]]:
        answer = self._json(
            "/logprobs", {"sequences": [[list(p), list(c)] for p, c in sequences]},
            "POST /logprobs",
        )  # fmt: skip
        return answer["logprobs"]


class VLLMServer:
    """Generation on a serve-rollout server: rank 0 sends the weights when they changed (every
    rank takes part in the ZeRO-3 gathers), then each rank sends its own prompts. A failure on
    any rank stops every rank (`fail_together`) before the step's update."""

    def __init__(
        self, client: RolloutClient, *, weights: Weights, version: Callable[[], int],
        stop: Sequence[int], is_main: bool, agree: Callable[[Callable[[], Any] | None, str], Any],
        info: dict[str, Any],
    ) -> None:  # fmt: skip
        self.client = client
        self.weights = weights
        self.version = version
        self.stop = list(stop)
        self.is_main = is_main
        self.agree = agree  # comm.fail_together, or a plain call in one process
        self.info = info
        self.synced: int | None = None
        self.sync_seconds = 0.0

    def sync(self) -> None:
        if self.synced == self.version():
            return
        start = time.perf_counter()
        failure: RolloutServerError | None = None
        weights = self.weights()
        if self.is_main:
            try:
                self.client.push_weights(weights)
            except RolloutServerError as err:
                failure = err
        for _ in weights:  # the gathers are collective under ZeRO-3: every rank goes to the end
            pass

        def outcome() -> None:
            if failure is not None:
                raise failure

        self.agree(outcome, "rollout weight upload")
        self.synced = self.version()
        self.sync_seconds = time.perf_counter() - start

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[dict], n: int, sampling: Sampling, seeds: Sequence[int]
    ) -> Completions:
        start = time.perf_counter()  # the weight upload counts: it is part of the round's cost
        self.sync()
        requests = requests_for(prompts, n, sampling, seeds, self.stop)
        outputs = self.agree(
            (lambda: self.client.generate(requests)) if requests else (lambda: []),
            "rollout generation",
        )  # fmt: skip
        return to_completions(outputs, self.stop, time.perf_counter() - start)

    def describe(self) -> str:
        return (
            f"vLLM server {self.client.url} ({self.info.get('model')}, vLLM "
            f"{self.info.get('vllm')} on {self.info.get('platform')}), weights sent over HTTP "
            "after each optimizer step"
        )


# ---------------------------------------------------------------------------- build


def engine_dtype(precision: str) -> str:
    return {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")


def colocated_env(rank: int, local_rank: int, world_size: int) -> None:
    """What vLLM's external launcher reads (the process group itself is already up)."""
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


def build_backend(run: Any, stop: Sequence[int]) -> VLLMColocate | VLLMServer:
    """The run's vLLM backend (rollout.vllm); a ConfigError / RolloutServerError before any
    training when it cannot work."""
    from align_anything.backend import distributed as comm

    cfg, policy = run.cfg, run.policy
    settings = cfg.rollout.vllm
    if run.model.media is not None:
        raise ConfigError(
            "rollout.backend=vllm generates from text prompts only here; the policy takes "
            "images or audio: use rollout.backend=hf"
        )
    weights = policy_weights(policy)
    version = lambda: run.state.step  # noqa: E731 - the optimizer steps taken so far
    arch = architecture(policy.module.config)
    if settings.mode == "server":
        client = RolloutClient(settings.server_url, timeout_s=settings.server_timeout_s)
        info = comm.fail_together(
            lambda: client.check_model(arch, cfg.model.name_or_path), what="rollout server check"
        )
        return VLLMServer(
            client, weights=weights, version=version, stop=stop, is_main=run.dist.is_main,
            agree=lambda work, what: comm.fail_together(work, what=what), info=info,
        )  # fmt: skip
    colocated_env(run.dist.rank, run.dist.local_rank, run.dist.world_size)
    engine = LocalEngine(
        EngineSettings(
            model=run.model.path,
            dtype=engine_dtype(run.ds_plan.precision),
            max_model_len=cfg.data.max_length,
            seed=cfg.train.seed,
            kv_cache_gib=settings.kv_cache_gib,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enforce_eager=settings.enforce_eager,
            sleep=settings.sleep,
            load_format="dummy",
            executor="external_launcher",
        )  # fmt: skip
    )
    if run.cleanup is not None:
        run.cleanup.callback(engine.close)
    if engine.arch != arch:
        raise ConfigError(
            f"the vLLM engine built from {cfg.model.name_or_path} is "
            f"{describe_architecture(engine.arch)}, not the policy's "
            f"{describe_architecture(arch)}"
        )
    return VLLMColocate(engine, weights=weights, version=version, stop=stop)
