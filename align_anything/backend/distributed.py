"""The process group: set-up under any launcher, the collectives the trainers use, the device."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from align_anything import errors
from align_anything.backend import zero_init
from align_anything.errors import UserError


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
        with _without_shm_comm_op():
            deepspeed.init_distributed(
                dist_backend=backend,
                auto_mpi_discovery=False,
                verbose=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
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
    """Destroy the process group (end of run) and forget ZeRO-3 model construction.

    Through DeepSpeed, which created the group (`setup_distributed`): its `destroy_process_group`
    also drops the groups DeepSpeed cached from it (data-parallel, world), which a second run in
    the same process (a notebook, the tests' in-process runs) would otherwise find stale."""
    global _DIST
    zero_init.forget()
    if dist.is_initialized():
        deepspeed.comm.destroy_process_group()
    _DIST = None


@contextlib.contextmanager
def _without_shm_comm_op() -> Iterator[None]:
    """Keep DeepSpeed from building its CPU shared-memory communication op while it sets up the
    process group.

    DeepSpeed 0.19's TorchBackend compiles `deepspeed_shm_comm` (C++, one to two minutes on two
    cores, on every new environment's first run) and probes every op's compiler first, on any
    CPU run, even of one process. The op serves only `inference_all_reduce`, the all-reduce of
    DeepSpeed's tensor-parallel inference layers (`module_inject`), which nothing here uses:
    training's collectives go through torch.distributed (gloo on CPU) either way, so no number
    changes. Without the op, DeepSpeed also creates no 66 MB buffer per rank in /dev/shm (which
    it never removed). No DeepSpeed setting skips it at run time: the DS_BUILD_* variables only
    choose what `pip install` builds ahead."""
    # `from deepspeed.comm import torch` would give the torch package (deepspeed.comm re-exports it).
    ds_torch_backend = importlib.import_module("deepspeed.comm.torch")

    build = ds_torch_backend.build_shm_op
    ds_torch_backend.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch_backend.build_shm_op = build


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


def device_type() -> str:
    return get_accelerator().device_name()


def bf16_supported() -> bool:
    return bool(get_accelerator().is_bf16_supported())


def sum_metrics(
    sums: dict[str, Any], keys: list[str], *extra: float
) -> tuple[list[float], list[float]]:
    """Sum per-rank metric sums (`keys`, a value of 0 where a rank has none) and `extra`
    numbers over ranks in one all-reduce; returns (the summed metrics in `keys` order, the
    summed extras). Every rank must pass the same keys."""
    zero = torch.zeros((), dtype=torch.float64)
    values = [torch.as_tensor(sums.get(k, zero), dtype=torch.float64).reshape(()) for k in keys]
    packed = torch.stack([*values, *(torch.tensor(float(x), dtype=torch.float64) for x in extra)])
    all_reduce_sum(packed)
    out = packed.tolist()
    return out[: len(keys)], out[len(keys) :]


T = TypeVar("T")


def fail_together(work: Callable[[], T] | None, *, what: str) -> T | None:
    """Run `work` where a rank has it (None: this rank has nothing to do, it only waits) and
    make every rank learn whether any rank failed, so that all stop with one message instead
    of the others waiting for a rank that left: a `UserError` on any rank is raised on every
    rank (its class and message, the first failing rank's); any other exception stops the
    other ranks with "<what> failed on rank N" while its own rank shows the traceback.
    Returns `work`'s result (None where there was no work). Collective."""
    result, failure, crash = None, None, None
    if work is not None:
        try:
            result = work()
        except UserError as err:
            failure = (type(err).__name__, str(err))
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the others know
            rank = dist.get_rank() if dist.is_initialized() else 0
            failure, crash = ("crash", f"{what} failed on rank {rank}"), err
    outcomes = all_gather_objects(failure)
    if crash is not None:
        raise crash
    for outcome in outcomes:
        if outcome is not None:
            kind, message = outcome
            if kind == "crash":
                raise UserError(message)
            raise getattr(errors, kind, UserError)(message)
    return result


def decide_on_main(decide: Callable[[], T]) -> T:
    """Run `decide` on rank 0 and give every rank its result, or its UserError on every rank
    (each must leave with the message, not wait for rank 0; see `fail_together`)."""
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    value = fail_together(decide if is_main else None, what="a decision on rank 0")
    return broadcast_object(value)
