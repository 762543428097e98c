"""What a run tells its user: the start-up summary, the eval lines, the final summary,
`summary.json`, and the messages of a stopped run. Pure formatting of the typed values it is
given; nothing here reads or changes a run."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align_anything.backend import memory


def count(n: int) -> str:
    """A parameter count for people: 135.0M, 1.24B, 41.2K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


@dataclass(frozen=True)
class StartupFacts:
    """What the start-up summary shows (read off a set-up run by `setup.startup_facts`)."""

    task: str
    model: str
    model_type: str
    trainable: int
    frozen: int
    parts: str | None  # per-part sizes (multimodal models, frozen parts), or None
    world: str
    batch: str
    total_steps: int
    steps_per_epoch: int
    train_rows: int
    train_unit: str
    eval_rows: int
    zero_stage: int
    offload: list[str]
    preset_file: str
    precision: str
    attention: str | None  # the attention kernel (None: not a transformers model's choice)
    ds_config: str
    memory_plan: str
    lines: list[str]  # the set-up steps' and the task's own lines
    data_reports: list[str]
    logging_notes: list[str]
    output_dir: str
    resumed: tuple[str, int] | None = None  # (checkpoint, step)
    universal: str | None = None  # resumed through a universal checkpoint: the change
    versions: str = ""  # torch, deepspeed, transformers, datasets: what a bug report needs


def startup_summary(f: StartupFacts) -> str:
    """Model and parameters, world size, effective batch, ZeRO stage, precision, the resolved
    DeepSpeed config, the memory plan, data and output: printed once by rank 0."""
    lines = [
        f"align_anything {f.task}",
        f"  model           {f.model} ({f.model_type}): {count(f.trainable)} trainable, "
        f"{count(f.frozen)} frozen parameters",
        f"  world size      {f.world}",
        f"  effective batch {f.batch}",
        f"  steps           {f.total_steps} ({f.steps_per_epoch} per epoch, {f.train_rows} "
        f"train {f.train_unit}, {f.eval_rows} eval rows)",
        f"  deepspeed       ZeRO stage {f.zero_stage}"
        + (f", offload {' + '.join(f.offload)}" if f.offload else "")
        + f" ({f.preset_file})",
        f"  precision       {f.precision}",
        *([f"  versions        {f.versions}"] if f.versions else []),
        *([f"  attention       {f.attention}"] if f.attention else []),
        f"  ds config       {f.ds_config}",
        f"  memory plan     {f.memory_plan}",
        *([f"  parts           {f.parts}"] if f.parts else []),
        *f.lines,
        *(f"  data            {r}" for r in f.data_reports),
        *(f"  logging         {note}" for note in f.logging_notes),
        f"  output          {f.output_dir} (metrics.jsonl, run_config.json, ds_config.json)",
    ]
    if f.resumed is not None:
        lines.append(f"  resumed         from {f.resumed[0]} at step {f.resumed[1]}")
        if f.universal:
            lines.append(f"                  via a universal checkpoint: {f.universal}")
    return "\n".join(lines)


def describe_estimate(estimate: Any) -> str:
    """The memory planner's estimate (`plan.estimate_preset`) as one line: the total per
    device and its shares."""
    gib = 2**30
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


def why_no_eval(*, eval_records: int, reports: list[Any], max_length: int) -> str:
    """Why a run has no held-out metrics, and what to set: no eval split, or every eval row
    dropped (the eval split's report says why)."""
    if not eval_records:
        return (
            "no eval split (data.eval_fraction=0 and no data.eval_path); set "
            "data.eval_fraction or data.eval_path to measure held-out loss"
        )
    found = next((r for r in reports if r.source.startswith("eval split")), None)
    dropped = f" ({found.summary()})" if found is not None else ""
    return (
        f"every one of the {eval_records} eval rows was dropped{dropped}; "
        f"raise data.max_length (now {max_length}) or check data.eval_path"
    )


def summary_data(
    *, run_id: str, task: str, steps: int, history: list[dict[str, Any]],
    train_seconds: float | None, peaks: list[tuple[int, int]], extra: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """`summary.json`: held-out metrics per evaluation, steps, time, every rank's memory before
    the model and at its peak, and the task's own entries."""
    evals = {h["phase"]: h for h in history if "phase" in h}
    return {
        "run_id": run_id,
        "task": task,
        "steps": steps,
        "evaluations": evals,
        "train_seconds": train_seconds,
        "memory_kind": memory.memory_kind(),
        "peak_memory_gib_per_rank": [round(p / 2**30, 4) for _, p in peaks],
        "memory_before_model_gib_per_rank": [round(b / 2**30, 4) for b, _ in peaks],
        **extra,
    }


def final_summary(
    *, task: str, steps: int, history: list[dict[str, Any]], train_seconds: float | None,
    peaks: list[tuple[int, int]], no_eval_reason: str,
) -> str:  # fmt: skip
    """The closing lines: steps and time, peak memory per rank, each held-out metric before →
    after (or `no_eval_reason` when there are none)."""
    evals = [h for h in history if "phase" in h]
    lines = [f"finished {task}: {steps} steps in {train_seconds or 0:.0f} s"]
    if not evals:
        lines.append(f"  no held-out metrics: {no_eval_reason}")
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
    from align_anything.training.batching import step_indices

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
