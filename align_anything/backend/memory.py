"""Memory: this process's measured peak, and DeepSpeed's model-state estimators."""

from __future__ import annotations

from deepspeed.accelerator import get_accelerator


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
