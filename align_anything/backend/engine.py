"""Trained and frozen models under DeepSpeed: `Engine` (optimizer, schedule, backward, step,
checkpoints, full weights) and `InferenceEngine` (a reference model without gradients)."""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from align_anything.backend.distributed import dist_info
from align_anything.backend.ds_config import (
    AdamSettings,
    offloads_optimizer,
    offloads_params,
    precision_of,
    torch_dtype,
    zero_stage_of,
)
from align_anything.backend.universal import universal_tag, unshare_step_counts
from align_anything.errors import ConfigError


def _build_optimizer(
    model: torch.nn.Module,
    ds_config: dict[str, Any],
    *,
    adam: AdamSettings,
) -> torch.optim.Optimizer | None:
    """DeepSpeed's CPU Adam when the optimizer is offloaded (it steps on the host), else torch's
    fused AdamW on every device. None when the preset has its own `optimizer` block (DeepSpeed
    builds it)."""
    if "optimizer" in ds_config:
        return None
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # Under ZeRO-3 a parameter's data is an empty partition; its real shape is `ds_shape`.
        ndim = len(getattr(param, "ds_shape", param.shape))
        (no_decay if ndim < 2 or "norm" in name.lower() else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": adam.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    kwargs = dict(lr=adam.learning_rate, betas=adam.betas, eps=adam.eps)
    if offloads_optimizer(ds_config):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        refuse_a_stale_build_lock("cpu_adam")
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    # torch's fused kernel: the same AdamW update in one multi-tensor kernel. On CPU about 3x
    # faster than the default per-tensor loop on a 135M-parameter model (0.20 s against 0.59 s
    # per step here); on CUDA the counterpart of DeepSpeed's FusedAdam (and what HF Trainer
    # defaults to), without DeepSpeed's compile on first use, which needs the CUDA toolkit.
    return torch.optim.AdamW(groups, fused=True, **kwargs)


# A build of DeepSpeed's CPU Adam takes a minute or two; a lock much older than that was left by
# a build that was killed.
STALE_BUILD_LOCK_S = 15 * 60


def refuse_a_stale_build_lock(op: str, *, now: float | None = None) -> None:
    """Refuse to start when the JIT build folder of DeepSpeed's op `op` holds a stale lock.

    torch's extension loader (`torch.utils.cpp_extension`, through DeepSpeed's op builder)
    guards each build with a lock file, `<TORCH_EXTENSIONS_DIR>/<op>/lock`, created on start and
    deleted on success. A build killed in between leaves it behind, and every later load waits
    for it to go away, silently and forever (`torch.utils.file_baton.FileBaton.wait`). The lock
    records no owner, so its age is the sign: older than `STALE_BUILD_LOCK_S` is an error naming
    the file; a younger one is another process's build in progress, which the load waits for."""
    # The folder exactly as the loader names it (TORCH_EXTENSIONS_DIR, or torch's default with
    # its Python and accelerator tag); it creates the folder, as the build would.
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(op, verbose=False)) / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_BUILD_LOCK_S:
        raise ConfigError(
            f"the build of DeepSpeed's {op} op (the offload presets' CPU optimizer) is locked by "
            f"{lock}, left {age / 60:.0f} minutes ago by a build that was stopped; every run "
            "would wait for it forever. If no other run is compiling it right now, delete that "
            "file and start again"
        )


def lr_lambda(schedule: str, *, total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak learning rate after `step` optimizer steps."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


# Elements per gradient all-reduce under ZeRO-0 (100 MB in fp32; torch DDP's buckets are 25 MB).
STAGE0_ALLREDUCE_BUCKET = 25_000_000


def _plain_gradients(engine: Any) -> bool:
    """True when gradients are the parameters' own `.grad`, read only after the backward pass:
    ZeRO stage 0 with the torch optimizer in fp32. ZeRO-1/2/3 and the fp16/bf16 optimizers
    hook every parameter's gradient accumulation instead."""
    return engine.zero_optimization_stage() == 0 and not (
        engine.fp16_enabled() or engine.bfloat16_enabled()
    )


class Engine:
    """A trainable model under DeepSpeed: forward, backward, step, checkpoints, export."""

    def __init__(
        self,
        model: torch.nn.Module,
        ds_config: dict[str, Any],
        *,
        adam: AdamSettings,
        schedule: str,
        total_steps: int,
        warmup_steps: int,
    ) -> None:
        """`ds_config` is complete (see `align_anything.training.deepspeed_plan.resolve_deepspeed`), including
        DeepSpeed's `checkpoint.load_universal` flag when the checkpoint to resume from is a
        universal one (see `universal.convert_to_universal`)."""
        self.load_universal = bool(ds_config.get("checkpoint", {}).get("load_universal"))
        optimizer = _build_optimizer(
            model,
            ds_config,
            adam=adam,
        )
        factor = lr_lambda(schedule, total_steps=total_steps, warmup_steps=warmup_steps)
        self._factor = factor

        def scheduler_fn(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
            return torch.optim.lr_scheduler.LambdaLR(opt, factor)

        self.ds_config = ds_config
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=None
            if optimizer
            else [p for p in model.parameters() if p.requires_grad],
            lr_scheduler=scheduler_fn,
            config=ds_config,
        )
        # This run's peak rates (the preset's optimizer block may set its own): a resumed run
        # keeps them rather than the checkpoint's.
        self._peak_lrs = list(self.scheduler.base_lrs)
        plain = _plain_gradients(self.engine)
        # DeepSpeed's stage-0 all-reduce flattens the gradients into buckets of 500M elements,
        # so for any model below that it copies every gradient into one buffer (540 MB for a
        # 135M fp32 model, at the peak) and back. With one data-parallel rank that is all it
        # does: skip it. With more, the wrapper reduces in buckets of STAGE0_ALLREDUCE_BUCKET
        # itself (the same sums, element by element).
        self._reduce_in_buckets = plain and self.engine.dp_world_size > 1
        if plain:
            self.engine.enable_backward_allreduce = False
        # Gradients are the parameters' own `.grad` tensors (what tied_embeddings can use).
        self.plain_gradients = plain
        self._grad_norm: float | None = None
        # DeepSpeed clips plain gradients with a loop of per-parameter norms and an all-reduce of
        # their total (the same on every rank: the gradients are reduced already), then drops
        # the norm, which the logs need. The wrapper measures it once instead (torch's
        # multi-tensor norm, no collective) and clips with it: the same max_norm / (norm + 1e-6)
        # factor, applied where it is < 1.
        self._clip = 0.0
        if plain:
            self._clip = float(self.engine.gradient_clipping())
            self.engine._config.gradient_clipping = 0.0

    # The wrapped module (for generation and config access).
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage DeepSpeed actually runs (not the one asked for)."""
        return int(self.engine.zero_optimization_stage())

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        if self._reduce_in_buckets:
            # Reduces only at the accumulation boundary (DeepSpeed checks), as its own call would.
            self.engine.allreduce_gradients(bucket_size=STAGE0_ALLREDUCE_BUCKET)

    def step(self) -> None:
        """Optimizer step at the accumulation boundary (DeepSpeed counts micro-steps)."""
        if self.engine.is_gradient_accumulation_boundary():
            self._grad_norm = self._clip_plain_gradients()
        self.engine.step()

    def _clip_plain_gradients(self) -> float | None:
        """The global norm of plain gradients (already all-reduced), and their clipping (see
        __init__). ZeRO and the mixed-precision optimizers record the norm themselves (read
        after the step): None."""
        if not self.plain_gradients:
            return None
        params = [p for p in self.engine.module.parameters() if p.grad is not None]
        if not params:
            return None
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if self._clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self._clip, norm)
        return float(norm)

    def grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step (before clipping)."""
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = self._grad_norm
        if isinstance(norm, torch.Tensor):
            norm = float(norm)
        return norm

    def learning_rate(self) -> float:
        return float(self.engine.get_lr()[0])

    def skipped_steps(self) -> int:
        return int(getattr(self.engine, "skipped_steps", 0))

    def save_checkpoint(
        self, directory: Path, client_state: dict[str, Any], *, tag: str = "deepspeed"
    ) -> None:
        """DeepSpeed checkpoint (model, optimizer, scheduler, partitioned on every rank) in
        `directory/tag`."""
        self.engine.save_checkpoint(str(directory), tag=tag, client_state=client_state)

    def load_checkpoint(self, directory: Path, *, tag: str = "deepspeed") -> dict[str, Any]:
        """Load `directory/tag`, or its universal conversion (`universal_tag(tag)`) when the
        engine was built with `load_universal` (a checkpoint of another ZeRO stage or world
        size)."""
        tag = universal_tag(tag) if self.load_universal else tag
        # DeepSpeed's ZeRO-3 universal load copies the first group's hyperparameters onto every
        # group (the no-decay group would get the decay group's weight_decay); they come from
        # this run's config anyway, so put them back. The learning rate is the scheduler's.
        groups = self.optimizer.param_groups
        kept = [{k: g[k] for k in ("weight_decay", "betas", "eps") if k in g} for g in groups]
        load_path, client_state = self.engine.load_checkpoint(
            str(directory), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True,
        )  # fmt: skip
        if self.load_universal:
            for group, values in zip(self.optimizer.param_groups, kept, strict=True):
                group.update(values)
            # ZeRO-3's universal load shares one Adam step tensor among the groups (advanced
            # once per group per step): see `unshare_step_counts`.
            unshare_step_counts(self.optimizer)
        if load_path is None:
            raise ConfigError(f"no DeepSpeed checkpoint could be loaded from {directory / tag}")
        self._follow_this_runs_schedule()
        return client_state or {}

    def _follow_this_runs_schedule(self) -> None:
        """After a load, the schedule is this run's: the loaded scheduler keeps its step count
        but not its peak rate (the checkpoint's `base_lrs`), and the optimizer's rate for the
        next step is recomputed from this run's schedule (a longer run, a new peak rate)."""
        scheduler = self.scheduler
        scheduler.base_lrs = list(self._peak_lrs)
        factor = self._factor(scheduler.last_epoch)
        for group, peak in zip(scheduler.optimizer.param_groups, self._peak_lrs, strict=True):
            group["initial_lr"], group["lr"] = peak, peak * factor
        scheduler._last_lr = [peak * factor for peak in self._peak_lrs]

    @contextlib.contextmanager
    def gathered_for_generation(self) -> Iterator[torch.nn.Module]:
        """The plain module, for `generate`. Under ZeRO-3 every parameter is gathered ONCE for
        the whole round (one all-gather per parameter, the full weights held on every rank while
        the context is open) and DeepSpeed's per-module fetch/release hooks are taken off, so
        the token loop runs locally: no collective per token, and a rank whose sequences finish
        early does not keep the others waiting (no `synced_gpus`). The hooks are put back, and
        the parameter coordinator's recorded trace invalidated, on the way out (TRL's
        `unwrap_model_for_generation` does the same). Collective under ZeRO-3: every rank
        enters and leaves together; other stages hold whole parameters already."""
        module = self.engine.module
        if self.zero_stage != 3:
            yield module
            return
        offload = self.engine.optimizer.parameter_offload
        # Parameters prefetched by the last forward may still be in flight (once DeepSpeed has
        # recorded the module trace): GatheredParameters skips them and they would stay
        # partitioned inside the block (measured: a diffusers UNet's Linear then sees its 1-D
        # partition after a few training steps on 2 ranks). Release them first.
        self.engine.empty_partition_cache()
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            for param in module.parameters():
                param.ds_active_sub_modules.clear()
            # The root's start-of-forward hook too: it checks the recorded trace against the
            # other ranks (a collective per forward, i.e. per token, and a mismatch where ranks
            # generate different numbers of tokens).
            for hook in [offload.fwd_pre_hook, *offload.forward_hooks, *offload.backward_hooks]:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield module
            finally:
                coordinator = offload.get_param_coordinator()
                if not coordinator.is_invalid_trace():
                    coordinator._invalidate_trace()
                # What `setup_zero_stage3_hooks` registers: the step reset first, then the
                # per-module fetch / release hooks.
                offload.fwd_pre_hook = offload.module.register_forward_pre_hook(
                    lambda *_: offload.get_param_coordinator().reset_step(), prepend=True
                )
                offload._register_deepspeed_module(offload.module)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Gather full weights (rank 0 gets them, other ranks None). Every rank must call."""
        if self.zero_stage == 3:
            # Prefetched parameters may still be in flight after the last forward; release them
            # first, then let DeepSpeed consolidate one layer at a time.
            self.engine.empty_partition_cache()
            state = self.engine._zero3_consolidated_16bit_state_dict()
            return state if dist_info().is_main else None
        return gather_state_dict(self.engine.module, self.zero_stage)


def gather_state_dict(module: torch.nn.Module, stage: int) -> dict[str, torch.Tensor] | None:
    """Full-precision copy of a module's weights on rank 0 (ZeRO-3 gathers one parameter at a
    time so peak memory stays one layer above the partition). Collective: call on every rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if stage != 3:
        if rank != 0:
            return None
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if rank == 0:
                state[name] = param.detach().cpu().clone()
    for name, buffer in module.named_buffers():
        if rank == 0 and buffer is not None:
            state[name] = buffer.detach().cpu().clone()
    return state if rank == 0 else None


@contextlib.contextmanager
def gathered(params: list[torch.nn.Parameter], stage: int) -> Iterator[None]:
    """Make ZeRO-3 partitioned parameters whole on every rank for the duration (read-only).
    Collective under ZeRO-3; a no-op for other stages, whose parameters are whole already."""
    if stage != 3:
        yield
        return
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


class InferenceEngine:
    """A frozen model (e.g. the DPO reference) without gradients or optimizer state.

    Under ZeRO-3 it is a DeepSpeed stage-3 engine, so the reference is partitioned like the
    policy; under stages 0-2 it is the plain module on the device (a full copy per rank but no
    optimizer or gradients), optionally kept on CPU between uses.
    """

    def __init__(self, model: torch.nn.Module, ds_config: dict[str, Any]) -> None:
        """`ds_config`: the frozen model's own config (`ds_config.inference_config`)."""
        model.eval()
        model.requires_grad_(False)
        self.stage = zero_stage_of(ds_config)
        self._offload = offloads_params(ds_config)
        if self.stage == 3:
            self.engine, *_ = deepspeed.initialize(model=model, config=ds_config)
            self.module = self.engine.module
        else:
            self.device = dist_info().device
            self.module = model.to(dtype=torch_dtype(precision_of(ds_config)))
            self.module.to("cpu" if self._offload else self.device)
            self.engine = None

    @torch.no_grad()
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is not None:
            return self.engine(*args, **kwargs)
        if self._offload:
            self.module.to(self.device)
        try:
            return self.module(*args, **kwargs)
        finally:
            if self._offload:
                self.module.to("cpu")

    def release(self) -> None:
        """Free the model (after precomputing what was needed from it)."""
        if self.engine is not None:
            module = self.engine.module
            self.engine.destroy()
            forget_zero3_module(module)
        self.engine = None
        self.module = None  # type: ignore[assignment]
        get_accelerator().empty_cache()


def forget_zero3_module(module: torch.nn.Module) -> None:
    """Let a destroyed ZeRO-3 engine's module be freed. DeepSpeed 0.19.8 keeps it alive for the
    rest of the process: `parameter_offload.FWD_MODULE_STACK` (a module-level list) holds every
    module a stage-3 engine wrapped, and the parameter coordinator's class-level `lru_cache` of
    `__params_to_release` holds its sub-modules in its keys. Measured on the 135M-parameter main
    job: the precomputed DPO reference's 0.5 GiB of weights stayed resident through training.
    The cache is recomputed on demand (once per trace) for the engines still alive."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import (
        PartitionedParameterCoordinator,
    )

    stack = parameter_offload.FWD_MODULE_STACK
    stack[:] = [kept for kept in stack if kept is not module]
    # The cached function sits inside DeepSpeed's NVTX wrapper (a closure without `__wrapped__`).
    wrapper = PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
    for cell in getattr(wrapper, "__closure__", None) or ():
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()
    gc.collect()  # the module and its hooks refer to each other
