"""A vLLM engine in this process (`LocalEngine`): built by the colocated rollout backend
(`generation.vllm`, one engine per training rank, its weights replaced in memory after each
optimizer step) and by `serve-rollout` (`generation.server`, the engine behind the HTTP
protocol). Also the identity of a model's architecture, by which an engine or a server is
checked against the policy before any weights are sent.

vLLM is imported only when an engine is built: the default environment needs none of it.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from align_anything.errors import ConfigError

# Config keys that make two models the same architecture: a server whose model differs in any
# of these cannot take the policy's weights.
ARCHITECTURE_KEYS = (
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings",
)  # fmt: skip


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
