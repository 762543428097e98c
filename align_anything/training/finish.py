"""The end of a run: the exported folders (`final/`, `final-ema/`, `final-merged/`, and
`final-<name>` of an engine trained beside the policy, e.g. PPO's `final-critic/`), as the
model family writes them, and, on rank 0, the closing summary and `summary.json`."""

from __future__ import annotations

from pathlib import Path

from align_anything import atomic
from align_anything.backend import distributed as comm
from align_anything.training import report
from align_anything.training.family import ModelFamily
from align_anything.training.run import Run
from align_anything.training.task import Task


def save_final(run: Run, family: ModelFamily) -> Path | None:
    """Export `output_dir/final` (and `final-ema/`, `final-merged/`, and `final-<name>` of an
    engine trained beside the policy) as the model family writes them (a transformers folder,
    or a diffusers pipeline). Collective."""
    if not run.cfg.checkpoint.save_final:
        return None
    family.save_final(run)
    comm.barrier()
    return run.output.path / "final"


def report_finished(run: Run, task: Task) -> None:
    """Rank 0: the closing summary (steps, time, peak memory, each held-out metric before →
    after) and `summary.json`."""
    if not run.dist.is_main:
        return
    state, data = run.state, run.data
    print(
        report.final_summary(
            task=run.cfg.task, steps=state.step, history=state.history,
            train_seconds=state.train_seconds, peaks=state.peak_memory,
            no_eval_reason=task.eval_off or report.why_no_eval(
                eval_records=len(data.eval_records), reports=data.reports,
                max_length=run.cfg.data.max_length,
            ),
        ),
        flush=True,
    )  # fmt: skip
    summary = report.summary_data(
        run_id=run.output.run_id, task=run.cfg.task, steps=state.step, history=state.history,
        train_seconds=state.train_seconds, peaks=state.peak_memory, extra=task.summary(),
    )  # fmt: skip
    atomic.write_text(run.output.path / "summary.json", atomic.to_json(summary))
