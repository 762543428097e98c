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

vLLM is imported only when an engine is built: the default environment needs none of it.
vLLM pins transformers below the project's version, so it lives in its own environment
(`make vllm` makes `.venv-vllm`): the trainer runs there for colocate, or only the server does.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from align_anything.errors import ConfigError, UserError
from align_anything.generation.rollout import Completions, Sampling, completion_seed, cut_at_stop

Weights = Callable[[], Iterator[tuple[str, torch.Tensor]]]
# Config keys that make two models the same architecture: a server whose model differs in any
# of these cannot take the policy's weights.
ARCHITECTURE_KEYS = (
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings",
)  # fmt: skip
# Largest weight upload in one HTTP request (a model goes in several).
CHUNK_BYTES = 64 * 1024 * 1024


def architecture(config: Any) -> dict[str, Any]:
    """What `ARCHITECTURE_KEYS` a (text) model config has: the identity a server is checked by."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    out = {key: data.get(key) for key in ARCHITECTURE_KEYS}
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = out["num_attention_heads"]
    return out


def describe_architecture(arch: dict[str, Any]) -> str:
    names = ",".join(arch.get("architectures") or [str(arch.get("model_type"))])
    return (
        f"{names} (hidden {arch.get('hidden_size')}, {arch.get('num_hidden_layers')} layers, "
        f"vocabulary {arch.get('vocab_size')})"
    )


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


# ---------------------------------------------------------------------------- the engine


@dataclass(frozen=True)
class EngineSettings:
    """How a vLLM engine is built (colocated or in serve-rollout)."""

    model: str  # a model folder (config and tokenizer; the weights too unless load_format=dummy)
    dtype: str  # float32 | bfloat16 | float16
    max_model_len: int
    seed: int = 0
    kv_cache_gib: float | None = 1.0
    gpu_memory_utilization: float = 0.3
    enforce_eager: bool = True
    sleep: bool = False
    load_format: str = "auto"
    # colocate: share the trainer's process group (vLLM's external launcher); serve-rollout: own.
    executor: str = "uni"


@contextlib.contextmanager
def _kept_process_state() -> Iterator[None]:
    """vLLM's CPU worker, built in this process, sets the global seeds, lowers torch's thread
    count to 1 and replaces `torch.set_num_threads` with a no-op (it binds its threads); a
    training process keeps its own of all three."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    rng = (torch.get_rng_state(), random.getstate())
    try:
        import numpy

        numpy_state: Any = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        numpy_state = None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads  # type: ignore[assignment]
        set_threads(threads)
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        if numpy_state is not None:
            import numpy

            numpy.random.set_state(numpy_state)


@contextlib.contextmanager
def _serving_threads() -> Iterator[None]:
    """torch's thread count inside the engine's calls: vLLM serves with one intra-op thread
    unless OMP_NUM_THREADS says otherwise (its workers' OpenMP threads spin-wait after each
    parallel region, which on a shared CPU costs more than the second thread gains); the
    trainer's own count is back for training."""
    threads = torch.get_num_threads()
    wanted = int(os.environ.get("OMP_NUM_THREADS") or 1)
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class LocalEngine:
    """A vLLM `LLM` in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): its model is an
    object here, so weights go into it in memory."""

    def __init__(self, settings: EngineSettings) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # The engine's own one-process group (serve-rollout) listens on loopback, not on the
        # machine's address (vLLM's default); a user's VLLM_HOST_IP wins.
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        try:
            import vllm
        except ImportError as err:
            raise ConfigError(
                f"rollout.backend=vllm needs vLLM in this environment ({err}); `make vllm` "
                "installs it into .venv-vllm (run the trainer there for "
                "rollout.vllm.mode=colocate, or serve-rollout there for mode=server)"
            ) from None
        from vllm.platforms import current_platform

        self.version = vllm.__version__
        self.platform = "cpu" if current_platform.is_cpu() else current_platform.device_name
        self.sleeps = settings.sleep and current_platform.is_sleep_mode_available()
        kwargs: dict[str, Any] = dict(
            model=settings.model, dtype=settings.dtype, max_model_len=settings.max_model_len,
            seed=settings.seed, enforce_eager=settings.enforce_eager,
            load_format=settings.load_format, distributed_executor_backend=settings.executor,
            enable_sleep_mode=self.sleeps, gpu_memory_utilization=settings.gpu_memory_utilization,
            trust_remote_code=False,
        )  # fmt: skip
        if settings.kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_gib * 2**30)
        start = time.perf_counter()
        with _kept_process_state():
            self.llm = vllm.LLM(**kwargs)
        self.start_seconds = time.perf_counter() - start
        self.sleeping = False
        self.arch = architecture(self.llm.llm_engine.model_config.hf_config)

    @property
    def _runner(self) -> Any:
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def generate(
        self, requests: Sequence[tuple[list[int], dict[str, Any]]]
    ) -> list[tuple[list[int], list[float]]]:
        """(token ids, the sampled tokens' log-probs) per (prompt ids, sampling params)."""
        from vllm import SamplingParams

        self.wake()
        with _serving_threads():
            outputs = self.llm.generate(
                [{"prompt_token_ids": ids} for ids, _ in requests],
                [SamplingParams(**params) for _, params in requests], use_tqdm=False,
            )  # fmt: skip
        results = []
        for out in outputs:
            sample = out.outputs[0]
            tokens = list(sample.token_ids)
            logps = [float(step[t].logprob) for t, step in zip(tokens, sample.logprobs or [],
                                                               strict=True)]  # fmt: skip
            results.append((tokens, logps))
        return results

    def prompt_logprobs(
        self, sequences: Sequence[tuple[list[int], list[int]]]
    ) -> list[list[float]]:
        """The engine's log-prob of each completion token of (prompt ids, completion ids)."""
        from vllm import SamplingParams

        self.wake()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        with _serving_threads():
            outputs = self.llm.generate(
                [{"prompt_token_ids": [*p, *c]} for p, c in sequences], params, use_tqdm=False
            )
        return [
            [float(out.prompt_logprobs[len(p) + i][t].logprob) for i, t in enumerate(c)]
            for out, (p, c) in zip(outputs, sequences, strict=True)
        ]

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Replace the engine's weights (Hugging Face names, any order; tensors read once).
        vLLM's in-place reload re-runs each layer's post-load processing (the CPU backend packs
        linear weights into kernel layouts and drops the originals, so a plain `load_weights`
        cannot update them). Returns how many tensors were read."""
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in weights:
                count += 1
                yield name, tensor

        if self.sleeps and self.sleeping:
            self.llm.wake_up(tags=["weights"])
        self._runner.reload_weights(weights_iterator=counted())
        if self.platform == "cpu":
            self._repack_tied_head()
        self.llm.reset_prefix_cache()
        return count

    def _repack_tied_head(self) -> None:
        # vLLM 0.32's CPU backend packs the LM head's weight into its own GEMM handle at load;
        # a tied head is never loaded itself (its weight is the embedding's), so the reload
        # updates the shared tensor but not that handle: pack it again from the new weight.
        model = self._runner.model
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None)
        if weight is None or weight.numel() == 0:
            return
        tied = any(
            m is not head and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.data_ptr() == weight.data_ptr()
            for m in model.modules()
        )  # fmt: skip
        if not tied:
            return
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(head, remove_weight=False)

    def sleep(self) -> None:
        """Free the KV cache and the weights while the trainer computes (level 2: the next
        round sends the weights anyway), where the platform supports it."""
        if self.sleeps and not self.sleeping:
            self.llm.sleep(level=2)
            self.sleeping = True

    def wake(self) -> None:
        if self.sleeps and self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def describe(self) -> str:
        return f"vLLM {self.version} on {self.platform}, started in {self.start_seconds:.0f} s"

    def close(self) -> None:
        """Shut the engine down now, while the process group it shares is still up (its own
        exit hook would run after the run left the group, and fail)."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


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
