"""What a run tells its user: the start-up summary, the eval lines, the final summary and
`summary.json`. Views of a set-up trainer; nothing here changes it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from align_anything import plan
from align_anything.backend import ds_config as dsc
from align_anything.backend import memory, versions
from align_anything.models import parts as model_parts
from align_anything.models.loading import count_parameters
from align_anything.models.sizes import sizes_of

if TYPE_CHECKING:
    from align_anything.trainers.base import Trainer


def count(n: int) -> str:
    """A parameter count for people: 135.0M, 1.24B, 41.2K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


def startup_summary(t: Trainer) -> str:
    """Model and parameters, world size, effective batch, ZeRO stage, precision, the resolved
    DeepSpeed config, the memory plan, data and output: printed once by rank 0."""
    cfg, ds = t.cfg, t.deepspeed
    trainable, frozen = count_parameters(t.engine.module)
    offload = [
        name
        for name, on in (
            ("optimizer", dsc.offloads_optimizer(ds.config)),
            ("parameters", dsc.offloads_params(ds.config)),
        )
        if on
    ]
    parts = []  # per-part sizes, for multimodal models and frozen parts
    if t.media is not None or cfg.model.freeze:
        counts = model_parts.part_counts(t.engine.module)
        parts.append(f"  parts           {model_parts.describe_parts(counts)}")
    lines = [
        f"align_anything {t.task}",
        f"  model           {cfg.model.name_or_path} ({t.model_config.model_type}): "
        f"{count(trainable)} trainable, {count(frozen)} frozen parameters",
        f"  versions        {versions.library_versions()}",
        f"  world size      {ds.batch.world_size} ({t.dist.backend} on {t.dist.device.type})",
        f"  effective batch {ds.batch.describe()}",
        f"  steps           {t.total_steps} ({t.steps_per_epoch} per epoch, "
        f"{len(t.train_rows)} train {getattr(t, 'train_unit', 'rows')}, "
        f"{len(t.eval_rows)} eval rows)",
        f"  deepspeed       ZeRO stage {t.engine.zero_stage}"
        + (f", offload {' + '.join(offload)}" if offload else "")
        + f" ({Path(ds.source).name})",
        f"  precision       {ds.precision}",
        f"  attention       {t.engine.module.config._attn_implementation} "
        f"(model.attn_implementation={cfg.model.attn_implementation})",
        f"  ds config       {json.dumps(ds.config, separators=(',', ':'))}",
        f"  memory plan     {memory_plan(t)}; now {memory.memory_summary()}",
        *parts,
        *ds.notes,
        *t.summary_lines,
        *(f"  data            {r.summary()}" for r in t.data_reports),
        *(f"  logging         {note}" for note in t.logger.notes),
        f"  output          {t.output_dir} (metrics.jsonl, run_config.json, ds_config.json)",
    ]
    if t.resume_dir is not None:
        lines.append(f"  resumed         from {t.resume_dir} at step {t.step}")
        if ds.universal:
            lines.append(f"                  via a universal checkpoint: {ds.universal}")
    return "\n".join(lines)


def memory_plan(t: Trainer) -> str:
    """The planner's per-device estimate for this run's resolved preset (the figure
    `python -m align_anything plan` and `deepspeed=auto` use)."""
    sizes = sizes_of(t.engine.module, t.model_config)
    world = t.deepspeed.batch.world_size
    estimate = plan.estimate_preset(
        Path(t.deepspeed.source).stem, t.deepspeed.config, sizes, t.cfg, world_size=world,
        precision=t.deepspeed.precision, gpus_per_node=plan.local_devices(world),
    )  # fmt: skip
    gib = plan.GIB
    shares = [f"model states {estimate.model_states / gib:.2f}"]
    if estimate.reference:
        shares.append(f"reference {estimate.reference / gib:.2f}")
    if estimate.generation:  # online RL: generation and the training forward do not overlap
        shares.append(f"max(activations {estimate.activations / gib:.2f}, generation "
                      f"{estimate.generation / gib:.2f})")  # fmt: skip
    else:
        shares.append(f"activations {estimate.activations / gib:.2f}")
    host = f", host {estimate.host / gib:.2f} GiB per node" if estimate.host else ""
    return (
        f"≈ {estimate.total / gib:.2f} GiB per device = {' + '.join(shares)} "
        f"(states {estimate.source}){host}"
    )


def eval_line(results: dict[str, Any], label: str) -> str:
    return f"eval ({label}): " + ", ".join(
        f"{k.removeprefix('eval/')} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
        for k, v in results.items()
    )


def why_no_eval(t: Trainer) -> str:
    """Why a run has no held-out metrics, and what to set."""
    if not t.eval_records:
        return (
            "no eval split (data.eval_fraction=0 and no data.eval_path); set "
            "data.eval_fraction or data.eval_path to measure held-out loss"
        )
    found = next((r for r in t.data_reports if r.source.startswith("eval split")), None)
    dropped = f" ({found.summary()})" if found is not None else ""
    return (
        f"every one of the {len(t.eval_records)} eval rows was dropped{dropped}; "
        f"raise data.max_length (now {t.cfg.data.max_length}) or check data.eval_path"
    )


def summary_data(t: Trainer) -> dict[str, Any]:
    """`summary.json`: held-out metrics per evaluation, steps, time and every rank's peak."""
    evals = {h["phase"]: h for h in t.history if "phase" in h}
    peaks = getattr(t, "peak_memory", [])
    return {
        "run_id": t.run_id,
        "task": t.task,
        "steps": t.step,
        "evaluations": evals,
        "train_seconds": getattr(t, "train_seconds", None),
        "memory_kind": memory.memory_kind(),
        "peak_memory_gib_per_rank": [round(p / 2**30, 4) for _, p in peaks],
        "memory_before_model_gib_per_rank": [round(b / 2**30, 4) for b, _ in peaks],
        **t.extra_summary(),
    }


def final_summary(t: Trainer) -> str:
    """The closing lines: steps and time, peak memory per rank, each held-out metric before →
    after (or why there are none)."""
    evals = [h for h in t.history if "phase" in h]
    lines = [f"finished {t.task}: {t.step} steps in {getattr(t, 'train_seconds', 0):.0f} s"]
    if not evals:
        lines.append(f"  no held-out metrics: {why_no_eval(t)}")
    peaks = getattr(t, "peak_memory", [])
    if peaks:
        lines.append(
            f"  peak memory per rank ({memory.memory_kind()}): "
            + ", ".join(f"{p / 2**30:.2f}" for _, p in peaks)
            + " GiB"
        )
    keys = sorted({k for h in evals for k in h if k not in ("step", "phase")})
    for key in keys:
        values = " → ".join(
            f"{h[key]:.4f}" if isinstance(h.get(key), float) else str(h.get(key, "-"))
            for h in evals
        )
        lines.append(f"  {key:28s} {values}   ({' → '.join(h['phase'] for h in evals)})")
    return "\n".join(lines)


def preempted(signum: int, step: int, total: int, checkpoint: Path) -> str:
    import signal

    return (
        f"stopped by {signal.Signals(signum).name} after step {step} of {total}: checkpoint "
        f"{checkpoint} is complete. Run the same command with resume=auto to continue from it."
    )


def nonfinite(
    keys: list[str], values: list[float], *, step: int, rows: int, batch: Any, seed: int,
    steps_per_epoch: int, good: Path | None,
) -> str:  # fmt: skip
    """The message of a run stopped on a non-finite loss (`keys` of the step's metrics, before
    the update of step `step` + 1) or gradient norm (`keys` == ["grad_norm"], after the update
    of step `step`): the step, its rows, the last good checkpoint."""
    from align_anything.trainers.batching import step_indices

    before_update = keys != ["grad_norm"]
    step = step + 1 if before_update else step
    epoch, in_epoch = divmod(step - 1, steps_per_epoch)
    rows_of_step = step_indices(
        rows, global_batch=batch.global_batch, seed=seed, epoch=epoch, step=in_epoch
    )
    bad = ", ".join(f"{k}={v}" for k, v in zip(keys, values, strict=True) if not math.isfinite(v))
    shown = ", ".join(map(str, rows_of_step[:16])) + (", …" if len(rows_of_step) > 16 else "")
    last = f"the last good checkpoint is {good}" if good else "no checkpoint was written"
    applied = (
        "its update was not applied"
        if before_update
        else "its update was applied in memory only: no checkpoint holds it"
    )
    return (
        f"non-finite training {'metric' if before_update else 'gradient norm'} at step {step} "
        f"(epoch {epoch}, {bad}); stopping: {applied}, and {last}. The step's global batch "
        f"holds training rows [{shown}] (indices into the encoded train split). Lower "
        "train.learning_rate, or check those rows."
    )
