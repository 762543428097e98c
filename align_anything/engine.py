"""The one owner of DeepSpeed and torch.distributed.

Everything that touches the process group, ZeRO partitioning, the optimizer, checkpoints or
weight gathering lives here, behind a small surface: `setup_distributed`, `resolve_ds_config`,
`model_init_context`, `Engine` (train), `InferenceEngine` (frozen reference models), the
collective helpers and `export_hf`. Trainers never import deepspeed or torch.distributed.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import math
import os
import socket
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from align_anything import atomic, tied_embeddings
from align_anything.errors import ConfigError

# DeepSpeed prints an INFO line for nearly everything; keep warnings and errors.
logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
    os.environ["DS_ACCELERATOR"] = "cpu"  # say it rather than have DeepSpeed warn that it guessed
# DeepSpeed still calls collectives that torch has renamed; the warning is DeepSpeed's to fix.
warnings.filterwarnings(
    "ignore",
    message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    category=FutureWarning,
)

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
for _name in ("deepspeed", "torch.distributed"):
    logging.getLogger(_name).setLevel(logging.WARNING)

AUTO = "auto"


# --------------------------------------------------------------------------- distributed


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_DIST: DistInfo | None = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def setup_distributed(timeout_s: float = 600.0) -> DistInfo:
    """Join (or create) the process group. Works under the deepspeed launcher, torchrun, and
    plain `python -m`, where it creates a one-process group on loopback."""
    global _DIST
    if _DIST is not None:
        return _DIST
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        )  # fmt: skip
    accelerator = get_accelerator()
    backend = accelerator.communication_backend_name()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accelerator.device_name() == "cuda":
        accelerator.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device(accelerator.device_name())
    if not dist.is_initialized():
        deepspeed.init_distributed(
            dist_backend=backend,
            auto_mpi_discovery=False,
            verbose=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        _unlink_shm_allreduce_buffer()
    _DIST = DistInfo(
        rank=dist.get_rank(),
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        device=device,
        backend=backend,
    )
    return _DIST


def dist_info() -> DistInfo:
    """The current process's rank, world size and device (after `setup_distributed`)."""
    if _DIST is None:
        raise RuntimeError("setup_distributed() has not been called")
    return _DIST


def teardown_distributed() -> None:
    """Destroy the process group (end of run) and forget ZeRO-3 model construction."""
    global _DIST
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    _HF_DS_CONFIGS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
    _DIST = None


def _unlink_shm_allreduce_buffer() -> None:
    """DeepSpeed's CPU shared-memory all-reduce (0.19) creates a 66 MB file per rank in
    /dev/shm and never removes it, so every multi-rank CPU run would leave RAM behind for good
    (even more so a killed one). Every rank has mapped every buffer once `init_distributed`
    returns everywhere, so after one barrier each rank unlinks its own name: the mappings stay
    valid until the processes exit, and the memory is freed then."""
    if get_accelerator().device_name() != "cpu" or dist.get_world_size() == 1:
        return
    name = (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}"
    )
    dist.barrier()
    with contextlib.suppress(OSError):
        (Path("/dev/shm") / name).unlink()


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _all_reduce(tensor: torch.Tensor, op: Any) -> torch.Tensor:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return tensor
    device = _DIST.device if _DIST is not None else tensor.device
    if tensor.device != device and _DIST is not None and _DIST.backend != "gloo":
        # NCCL and friends reduce device tensors only; the trainers keep small counters on CPU.
        moved = tensor.to(device)
        dist.all_reduce(moved, op=op)
        tensor.copy_(moved.to(tensor.device))
    else:
        dist.all_reduce(tensor, op=op)
    return tensor


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (in place and returned); a no-op on one rank. CPU tensors are
    fine under every backend."""
    return _all_reduce(tensor, dist.ReduceOp.SUM)


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Maximum of a tensor over ranks (in place and returned)."""
    return _all_reduce(tensor, dist.ReduceOp.MAX)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Send a picklable object from `src` to every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_objects(obj: Any) -> list[Any]:
    """Collect one picklable object from every rank (in rank order)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------- precision


def resolve_precision(requested: str, device_type: str) -> str:
    """`auto` is bf16 where the GPU supports it, fp16 on older GPUs, fp32 on CPU (bf16 matmuls on
    CPUs without bf16 units run hundreds of times slower than fp32)."""
    if requested != AUTO:
        return requested
    if device_type == "cpu":
        return "fp32"
    return "bf16" if get_accelerator().is_bf16_supported() else "fp16"


def torch_dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def device_type() -> str:
    return get_accelerator().device_name()


# --------------------------------------------------------------------------- preset resolution


@dataclass(frozen=True)
class AdamSettings:
    """AdamW hyper-parameters: fill the preset's optimizer "auto"s and build our optimizer."""

    learning_rate: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    grad_accum: int
    world_size: int
    global_batch: int

    def describe(self) -> str:
        return (
            f"{self.global_batch} = micro {self.micro_batch} × grad_accum {self.grad_accum} "
            f"× world {self.world_size}"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _solve_batch(
    *,
    preset: dict[str, Any],
    world_size: int,
    micro: int | str,
    grad_accum: int | str,
    global_batch: int | str,
    explicit: frozenset[str],
    conflicts: list[str],
) -> BatchPlan:
    """Any two of (micro, grad_accum, global) determine the third; three given must agree.

    Precedence: a number in the preset or a value set on the command line (two such that
    disagree are a conflict) > the task file's defaults, which only fill what is still open.
    """
    names = {
        "micro": ("train_micro_batch_size_per_gpu", "train.per_device_batch_size", micro),
        "accum": ("gradient_accumulation_steps", "train.gradient_accumulation_steps", grad_accum),
        "global": ("train_batch_size", "train.global_batch_size", global_batch),
    }
    firm: dict[str, int] = {}
    defaults: dict[str, int] = {}
    for short, (ds_key, cfg_key, cfg_value) in names.items():
        preset_value = preset.get(ds_key, AUTO)
        if preset_value not in (AUTO, None) and not (
            _is_number(preset_value) and preset_value == int(preset_value) and preset_value > 0
        ):
            conflicts.append(
                f"deepspeed.{ds_key}: expected a positive integer or 'auto', got {preset_value!r}"
            )
            preset_value = AUTO
        if _is_number(preset_value):
            firm[short] = int(preset_value)
            if cfg_key in explicit and cfg_value != AUTO and int(cfg_value) != int(preset_value):
                conflicts.append(
                    f"{cfg_key}={cfg_value} but the preset sets {ds_key}={preset_value}: "
                    f"drop one, or set deepspeed.{ds_key}=auto"
                )
        elif cfg_value != AUTO:
            (firm if cfg_key in explicit else defaults)[short] = int(cfg_value)
    for short in ("micro", "accum"):
        if len(firm) >= 2:
            break
        if short not in firm and short in defaults:
            firm[short] = defaults[short]
    micro_v, accum_v, global_v = firm.get("micro"), firm.get("accum"), firm.get("global")
    if micro_v and accum_v and global_v:
        if micro_v * accum_v * world_size != global_v:
            raise ConfigError(
                f"batch sizes do not add up: train_batch_size {global_v} != micro {micro_v} "
                f"× grad_accum {accum_v} × world {world_size} (= {micro_v * accum_v * world_size}). "
                "Set one of train.per_device_batch_size, train.gradient_accumulation_steps, "
                "train.global_batch_size to auto."
            )
    elif micro_v and accum_v:
        global_v = micro_v * accum_v * world_size
    elif global_v and (micro_v or accum_v):
        known = micro_v or accum_v
        assert known is not None
        if global_v % (known * world_size):
            other = "grad_accum" if micro_v else "micro"
            raise ConfigError(
                f"batch sizes do not add up: train_batch_size {global_v} is not divisible by "
                f"{'micro' if micro_v else 'grad_accum'} {known} × world {world_size}, so "
                f"{other} cannot be a whole number."
            )
        derived = global_v // (known * world_size)
        micro_v, accum_v = (micro_v, derived) if micro_v else (derived, accum_v)
    else:
        raise ConfigError(
            "batch size is undetermined: set at least two of train.per_device_batch_size, "
            "train.gradient_accumulation_steps, train.global_batch_size (or the preset's "
            "train_micro_batch_size_per_gpu / gradient_accumulation_steps / train_batch_size)."
        )
    assert micro_v and accum_v and global_v
    return BatchPlan(micro_v, accum_v, world_size, global_v)


def _find_auto(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _find_auto(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _find_auto(v, f"{path}[{i}]")]
    return [path] if node == AUTO else []


def resolve_ds_config(
    preset: dict[str, Any],
    *,
    world_size: int,
    hidden_size: int,
    device: str,
    precision: str,
    micro_batch: int | str,
    grad_accum: int | str,
    global_batch: int | str,
    max_grad_norm: float,
    adam: AdamSettings,
    explicit: frozenset[str] = frozenset(),
) -> tuple[dict[str, Any], BatchPlan, str]:
    """Fill every "auto" in a preset exactly once; returns (resolved config, batch plan, precision).

    Conflicts between values set on the command line and numbers in the preset are collected
    and raised together. After resolution no "auto" is left (DeepSpeed silently ignores some).
    """
    config = copy.deepcopy(preset)
    conflicts: list[str] = []
    plan = _solve_batch(
        preset=config,
        world_size=world_size,
        micro=micro_batch,
        grad_accum=grad_accum,
        global_batch=global_batch,
        explicit=explicit,
        conflicts=conflicts,
    )
    config["train_micro_batch_size_per_gpu"] = plan.micro_batch
    config["gradient_accumulation_steps"] = plan.grad_accum
    config["train_batch_size"] = plan.global_batch

    clip = config.get("gradient_clipping", AUTO)
    if clip == AUTO:
        config["gradient_clipping"] = float(max_grad_norm)
    elif "train.max_grad_norm" in explicit and float(clip) != float(max_grad_norm):
        conflicts.append(
            f"train.max_grad_norm={max_grad_norm} but the preset sets gradient_clipping={clip}"
        )

    # Precision: the preset's explicit enable flags win over `auto`; an explicit train.precision
    # that disagrees with them is a conflict.
    bf16_flag = config.get("bf16", {}).get("enabled", AUTO)
    fp16_flag = config.get("fp16", {}).get("enabled", AUTO)
    preset_precision = "bf16" if bf16_flag is True else "fp16" if fp16_flag is True else None
    resolved = resolve_precision(precision, device)
    if preset_precision:
        if "train.precision" in explicit and precision not in (AUTO, preset_precision):
            conflicts.append(
                f"train.precision={precision} but the preset enables {preset_precision}"
            )
        resolved = preset_precision
    elif precision == AUTO and (bf16_flag is False and resolved == "bf16"):
        resolved = "fp16" if fp16_flag is not False else "fp32"
    config.setdefault("bf16", {})["enabled"] = resolved == "bf16"
    config.setdefault("fp16", {})["enabled"] = resolved == "fp16"

    zero = config.setdefault("zero_optimization", {})
    fills = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
        "allgather_bucket_size": hidden_size * hidden_size,
    }
    for key, value in fills.items():
        if zero.get(key) == AUTO:
            zero[key] = value

    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict):
        params = optimizer.setdefault("params", {})
        for key, value in {
            "lr": adam.learning_rate,
            "betas": list(adam.betas),
            "eps": adam.eps,
            "weight_decay": adam.weight_decay,
        }.items():
            if params.get(key) == AUTO:
                params[key] = value
    scheduler = config.get("scheduler")
    if isinstance(scheduler, dict):
        conflicts.append(
            "the preset has a 'scheduler' block: align_anything builds the schedule from "
            "train.lr_scheduler / train.warmup_ratio; remove the block from the preset"
        )
    if conflicts:
        raise ConfigError(
            "the task config and the DeepSpeed preset disagree:\n"
            + "\n".join(f"  - {c}" for c in conflicts)
        )
    left = _find_auto(config)
    if left:
        raise ConfigError(
            f"the DeepSpeed preset has 'auto' values align_anything cannot fill: {', '.join(left)}. "
            "Replace them with numbers."
        )
    return config, plan, resolved


def zero_stage_of(config: dict[str, Any]) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def offloads_optimizer(config: dict[str, Any]) -> bool:
    device = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return device not in (None, "none")


def offloads_params(config: dict[str, Any]) -> bool:
    device = config.get("zero_optimization", {}).get("offload_param", {}).get("device", "none")
    return device not in (None, "none")


# --------------------------------------------------------------------------- model construction

# transformers reads a module-level weak reference to this object in `from_pretrained`; it must
# stay alive while ZeRO-3 models are built, so the context keeps it here.
_HF_DS_CONFIGS: list[Any] = []


@contextlib.contextmanager
def model_init_context(ds_config: dict[str, Any]) -> Iterator[None]:
    """Build models inside this context. Under ZeRO-3 transformers then constructs the model
    under `deepspeed.zero.Init`, so weights load straight into partitions (never whole on one
    rank) and `from_pretrained` still applies the checkpoint's weights."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # transformers keeps a process-wide reference; clear any earlier run's so that a stage-0/2
    # model built after a stage-3 one in the same process is not partitioned.
    unset_hf_deepspeed_config()
    _HF_DS_CONFIGS.clear()
    if zero_stage_of(ds_config) == 3:
        # Kept alive after the context: generation under ZeRO-3 checks it (synced_gpus).
        _HF_DS_CONFIGS.append(HfDeepSpeedConfig(ds_config))
    yield


# --------------------------------------------------------------------------- engines


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

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    # torch's fused kernel: the same AdamW update in one multi-tensor kernel. On CPU about 3x
    # faster than the default per-tensor loop on a 135M-parameter model (0.20 s against 0.59 s
    # per step here); on CUDA the counterpart of DeepSpeed's FusedAdam (and what HF Trainer
    # defaults to), without DeepSpeed's compile on first use, which needs the CUDA toolkit.
    return torch.optim.AdamW(groups, fused=True, **kwargs)


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
        load_universal: bool = False,
        tied_grads_in_place: bool = False,
    ) -> None:
        """`load_universal`: the checkpoint to resume from is a universal one (see
        `convert_to_universal`); DeepSpeed reads that flag from the config at initialize.
        `tied_grads_in_place`: accumulate a tied embedding/LM head's gradient in one buffer
        (align_anything/tied_embeddings.py) where the gradients are plain tensors."""
        if load_universal:
            ds_config = copy.deepcopy(ds_config)
            ds_config.setdefault("checkpoint", {})["load_universal"] = True
        self.load_universal = load_universal
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
        # Whether a tied embedding/LM head now accumulates its gradient in place.
        self.tied_grads_in_place = (
            tied_grads_in_place
            and plain
            and tied_embeddings.accumulate_in_place(self.engine.module)
        )
        self._grad_norm: float | None = None

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
            self._grad_norm = self._measure_grad_norm()
        self.engine.step()

    def _measure_grad_norm(self) -> float | None:
        # ZeRO optimizers record the global norm themselves (read after step); stage 0 without
        # mixed precision does not, so measure the (already all-reduced) gradients here.
        if self.zero_stage != 0:
            return None
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return None
        return float(torch.nn.utils.get_total_norm(grads, norm_type=2.0))

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

    def save_checkpoint(self, directory: Path, client_state: dict[str, Any]) -> None:
        """DeepSpeed checkpoint (model, optimizer, scheduler, partitioned on every rank)."""
        self.engine.save_checkpoint(str(directory), tag="deepspeed", client_state=client_state)

    def load_checkpoint(self, directory: Path) -> dict[str, Any]:
        """Load `directory/deepspeed`, or `directory/universal` when the engine was built with
        `load_universal` (a checkpoint of another ZeRO stage or world size)."""
        tag = UNIVERSAL_TAG if self.load_universal else "deepspeed"
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


def memory_kind() -> str:
    """What `peak_memory_bytes` measures here."""
    return "allocated device memory" if get_accelerator().device_name() == "cuda" else "RSS"


def peak_memory_bytes() -> int:
    """This process's peak: allocated accelerator memory, or on CPU the peak RSS."""
    acc = get_accelerator()
    if acc.device_name() == "cuda":
        return int(acc.max_memory_allocated())
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class InferenceEngine:
    """A frozen model (e.g. the DPO reference) without gradients or optimizer state.

    Under ZeRO-3 it is a DeepSpeed stage-3 engine, so the reference is partitioned like the
    policy; under stages 0-2 it is the plain module on the device (a full copy per rank but no
    optimizer or gradients), optionally kept on CPU between uses.
    """

    def __init__(self, model: torch.nn.Module, ds_config: dict[str, Any], *, offload: bool) -> None:
        model.eval()
        model.requires_grad_(False)
        self.stage = zero_stage_of(ds_config)
        self._offload = offload
        if self.stage == 3:
            config = {
                "train_micro_batch_size_per_gpu": ds_config["train_micro_batch_size_per_gpu"],
                "train_batch_size": ds_config["train_batch_size"],
                "gradient_accumulation_steps": ds_config["gradient_accumulation_steps"],
                "bf16": {"enabled": ds_config.get("bf16", {}).get("enabled", False)},
                "fp16": {"enabled": ds_config.get("fp16", {}).get("enabled", False)},
                "zero_optimization": {
                    "stage": 3,
                    "stage3_param_persistence_threshold": ds_config["zero_optimization"].get(
                        "stage3_param_persistence_threshold", 10_000
                    ),
                    "offload_param": {"device": "cpu" if offload else "none"},
                },
                "steps_per_print": 1_000_000,
            }
            self.engine, *_ = deepspeed.initialize(model=model, config=config)
            self.module = self.engine.module
        else:
            precision = (
                "bf16" if ds_config.get("bf16", {}).get("enabled")
                else "fp16" if ds_config.get("fp16", {}).get("enabled") else "fp32"
            )  # fmt: skip
            self.device = dist_info().device
            self.module = model.to(dtype=torch_dtype(precision))
            self.module.to("cpu" if offload else self.device)
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
            self.engine.destroy()
        self.engine = None
        self.module = None  # type: ignore[assignment]
        get_accelerator().empty_cache()


UNIVERSAL_TAG = "universal"


def load_deepspeed_file(path: Path) -> Any:
    """A DeepSpeed checkpoint file read without unpickling arbitrary objects: torch's
    `weights_only` loader, allowing only the three DeepSpeed classes its files hold besides
    tensors and containers (a loss-scaler record, the ZeRO stage enum, fragment addresses).
    DeepSpeed's own loaders (`load_checkpoint`, `ds_to_universal`, `zero_to_fp32`) still
    unpickle fully; see the README on checkpoints from elsewhere."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        return torch.load(path, map_location="cpu", weights_only=True)


def convert_to_universal(checkpoint_dir: Path) -> Path:
    """Convert `…/step-N/deepspeed` (ZeRO-1/2/3, any world size) into DeepSpeed's universal
    checkpoint `…/step-N/universal`, which loads under another ZeRO stage (1-3) or world size.

    Rank 0 converts with DeepSpeed's `ds_to_universal` into a temporary folder renamed when
    complete (a finished conversion is reused); every rank then waits at a barrier. Collective:
    call on every rank.
    """
    import argparse
    import io
    import shutil

    from deepspeed.checkpoint import ds_to_universal

    checkpoint_dir = Path(checkpoint_dir)
    final = checkpoint_dir / UNIVERSAL_TAG
    error: str | None = None
    if dist_info().is_main and not final.is_dir():
        tmp = checkpoint_dir / f".tmp-{UNIVERSAL_TAG}"
        shutil.rmtree(tmp, ignore_errors=True)
        fixed_input = checkpoint_dir / f".tmp-{UNIVERSAL_TAG}-input"
        shutil.rmtree(fixed_input, ignore_errors=True)
        source = checkpoint_dir / "deepspeed"
        if _write_fixed_slice_mappings(source, fixed_input):
            source = fixed_input
        args = argparse.Namespace(
            input_folder=str(source), output_folder=str(tmp),
            # In-process and serial: no worker pool forked from a rank that holds a process group.
            num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
            # transformers models carry no universal-checkpoint metadata; plain data-parallel
            # ZeRO needs none beyond the version DeepSpeed injects.
            inject_missing_state=True,
        )  # fmt: skip
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                ds_to_universal.main(args)
            _link_model_states_for_every_stage(tmp)
            _add_stage3_optimizer_globals(tmp)
            atomic.publish(tmp, final)
            shutil.rmtree(fixed_input, ignore_errors=True)
            # ds_to_universal points `latest_universal` at its output folder (the temporary name).
            (checkpoint_dir / "latest_universal").write_text(UNIVERSAL_TAG)
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(fixed_input, ignore_errors=True)
            error = (
                f"DeepSpeed's ds_to_universal failed on {checkpoint_dir / 'deepspeed'}: "
                f"{type(err).__name__}: {err}\n{log.getvalue()[-2000:]}"
            )
    error = broadcast_object(error)
    if error:
        raise ConfigError(error)
    return final


def _write_fixed_slice_mappings(source: Path, dest: Path) -> bool:
    """Work around a DeepSpeed 0.19 ZeRO-1/2 bug that `ds_to_universal` would copy into the
    universal checkpoint: with `round_robin_gradients` (our z2 preset) and no alignment padding,
    `_link_all_hp_params` (runtime/zero/stage_1_and_2.py) maps each parameter to its offset in
    the *unshuffled* order, but the flat fp32/Adam buffers are in the round-robin order, so the
    saved `param_slice_mappings` point at other parameters' data. The checkpoint's own
    `param_shapes` (which `zero_to_fp32` uses, correctly) and `param_alignment_paddings` give
    the true layout; when the saved mappings disagree with it, write optimizer-state files with
    the true mappings into `dest` (model-state files hard-linked) and return True.
    """
    from deepspeed.utils.tensor_fragment import fragment_address

    model_files = sorted(source.glob("mp_rank_*_model_states.pt"))
    optim_files = sorted(source.glob("*zero_pp_rank_*_optim_states.pt"))
    if len(model_files) != 1 or not optim_files:
        return False  # ZeRO-3 (no such mappings) or a layout this does not know
    param_shapes = load_deepspeed_file(model_files[0])["param_shapes"]
    fixed: dict[Path, dict[str, Any]] = {}
    for path in optim_files:
        state = load_deepspeed_file(path)
        optim = state["optimizer_state_dict"]
        if "param_slice_mappings" not in optim or int(optim.get("zero_stage", 1)) > 2:
            return False
        rank = int(path.name.split("zero_pp_rank_")[1].split("_")[0])
        mappings = []
        for group, shapes in enumerate(param_shapes):
            size = optim["single_partition_of_fp32_groups"][group].numel()
            lo_part, hi_part = rank * size, (rank + 1) * size
            paddings = optim["param_alignment_paddings"][group]
            mapping, offset = {}, 0
            for (name, shape), padding in zip(shapes.items(), paddings, strict=True):
                numel = math.prod(shape)
                lo, hi = max(offset, lo_part), min(offset + numel, hi_part)
                if lo < hi:
                    mapping[name] = fragment_address(numel=hi - lo, start=lo - lo_part)
                offset += numel + padding
            mappings.append(mapping)
        saved = [
            {k: (v.start, v.numel) for k, v in g.items()} for g in optim["param_slice_mappings"]
        ]
        if saved != [{k: (v.start, v.numel) for k, v in g.items()} for g in mappings]:
            optim["param_slice_mappings"] = mappings
            fixed[path] = state
    if not fixed:
        return False
    dest.mkdir(parents=True)
    for path in source.iterdir():
        if path in fixed:
            torch.save(fixed[path], dest / path.name)
        elif path.is_file():
            try:
                os.link(path, dest / path.name)
            except OSError:
                import shutil

                shutil.copy2(path, dest / path.name)
    return True


def _link_model_states_for_every_stage(folder: Path) -> None:
    """DeepSpeed's universal load looks for `mp_rank_XX_model_states.pt` under ZeRO-1/2 and
    `zero_pp_rank_0_mp_rank_XX_model_states.pt` under ZeRO-3, but `ds_to_universal` keeps the
    source's names; give the folder both (hard links: the files hold the same scheduler and step
    counters; the weights and optimizer state load from `zero/`)."""
    for path in list(folder.glob("*model_states.pt")):
        name = path.name
        if name.startswith("zero_pp_rank_0_mp_rank_"):
            other = folder / name.removeprefix("zero_pp_rank_0_")
        elif name.startswith("mp_rank_"):
            other = folder / f"zero_pp_rank_0_{name}"
        else:
            continue
        if not other.exists():
            try:
                os.link(path, other)
            except OSError:
                import shutil

                shutil.copy2(path, other)


def _add_stage3_optimizer_globals(folder: Path) -> None:
    """Let a universal checkpoint converted from ZeRO-1/2 load under ZeRO-3.

    `ds_to_universal` writes `zero/optimizer_state.pt` in its source's layout: from ZeRO-1/2
    with `param_groups` at the top level, from ZeRO-3 also nested under `optimizer_state_dict`
    with the Adam step count. DeepSpeed 0.19's ZeRO-3 universal load reads only the nested
    form (`stage3.py`, `load_hp_checkpoint_state_from_checkpoint_dir_stage3`: KeyError
    'optimizer_state_dict' otherwise). Add it from what the file and the per-parameter
    `step.pt` (the same count for every parameter) already hold; nothing else changes.
    """
    path = folder / "zero" / "optimizer_state.pt"
    state = load_deepspeed_file(path)
    if "optimizer_state_dict" in state:
        return
    steps = sorted((folder / "zero").glob("*/step.pt"))
    if not steps:
        return  # no optimizer step was taken: nothing to carry
    step = load_deepspeed_file(steps[0])
    state["optimizer_state_dict"] = {
        "state": {0: {"step": step}},
        "param_groups": state["param_groups"],
    }
    torch.save(state, path)


def checkpoint_state_dict(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights from an align_anything checkpoint folder (`…/step-N`), whatever the
    ZeRO stage and world size it was written with. ZeRO-2/3 partitions are merged by DeepSpeed's
    own `zero_to_fp32`; stage 0 keeps whole weights in the model-states file."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ds_dir = Path(checkpoint_dir)
    tag_dir = ds_dir / "deepspeed"
    if not tag_dir.is_dir():
        raise ConfigError(
            f"{checkpoint_dir}: no deepspeed/ folder; not an align_anything checkpoint"
        )
    if any(tag_dir.glob("*optim_states.pt")):
        state = get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag="deepspeed")
        return {k: v.contiguous() for k, v in state.items()}
    model_states = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if not model_states:
        raise ConfigError(f"{tag_dir}: no model states file")
    module = load_deepspeed_file(model_states[0])["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}


def memory_summary() -> str:
    """Allocated/peak device memory, or the process RSS on CPU."""
    peak = peak_memory_bytes() / 2**30
    acc = get_accelerator()
    if acc.device_name() == "cuda":
        return f"{acc.memory_allocated() / 2**30:.2f} GiB allocated, {peak:.2f} GiB peak"
    return f"peak RSS {peak:.2f} GiB"


def deepspeed_model_state_estimate(
    stage: int,
    *,
    total_params: int,
    largest_layer_params: int,
    gpus_per_node: int,
    nodes: int,
    offload_optimizer: bool,
    offload_params: bool,
) -> tuple[int, int]:
    """(host bytes per node, device bytes per device) of model states for mixed-precision Adam,
    from DeepSpeed's own estimators (ZeRO-2 and ZeRO-3; ZeRO-0/1 use the ZeRO-2 figure on one
    device, which partitions nothing)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    if stage == 3:
        host, device, _ = estimate_zero3_model_states_mem_needs(
            total_params, largest_layer_params, num_gpus_per_node=gpus_per_node,
            num_nodes=nodes, cpu_offload=offload_optimizer, cpu_offload_params=offload_params,
        )  # fmt: skip
        return host, device
    if stage == 2:
        return estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node=gpus_per_node, num_nodes=nodes,
            cpu_offload=offload_optimizer,
        )  # fmt: skip
    return estimate_zero2_model_states_mem_needs(
        total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=offload_optimizer
    )


def estimate_model_state_memory(
    num_params: int, stage: int, world_size: int, offload: bool
) -> float:
    """Per-device bytes of model states for mixed-precision Adam (ZeRO paper: 2+2+12 bytes per
    parameter, partitioned by stage), in GiB. Offload moves optimizer states (and params) off."""
    per_param = {0: 16.0, 1: 4 + 12 / world_size, 2: 2 + 14 / world_size, 3: 16 / world_size}[
        min(stage, 3)
    ]
    if offload:
        per_param = 2 / world_size if stage == 3 else 4.0
    return num_params * per_param / 2**30
