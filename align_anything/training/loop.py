"""The one training loop, for every task: `train(run, task, source, stop)`.

Each optimizer step reads top to bottom: the step's micro-batches (from the step source:
seeded rows, or an online-RL generation round) → the task's statistic over the whole step
(KTO's KL point) → per micro-batch its loss and backward → the update of every engine that got
a loss → the weight average → log → the task's own work after the step (a sample grid) →
evaluate, checkpoint, honour a stop signal, when due.
Evaluation (`evaluate`) runs before the first step and after the last.

Normalisation: a micro-batch's loss is its summed per-item loss divided by (global items in the
step / (world × grad_accum)); DeepSpeed then averages over ranks and accumulation steps, so the
gradient is that of the mean over every item of the global batch however it is split.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from align_anything.backend import distributed as comm
from align_anything.backend import memory
from align_anything.errors import Preempted, UserError
from align_anything.training import checkpoints, report
from align_anything.training.batching import shard_chunks, to_device
from align_anything.training.preemption import StopRequest, agreed_signal
from align_anything.training.run import Run
from align_anything.training.task import StepSource, Task
from align_anything.training.tracking import MetricWindow, Progress, StepResult, completions_table


def train(run: Run, task: Task, source: StepSource, stop: StopRequest | None) -> None:
    """Run the steps from `run.state.step` to the schedule's end, with an evaluation before
    (fresh runs) and after; records the step loop's time and every rank's peak memory."""
    cfg, state = run.cfg, run.state
    if state.step == 0:
        log_eval(run, evaluate(run, task, label="before"), "before")
    console = run.dist.is_main and "console" in cfg.logging.backends
    progress = Progress(run.schedule.total_steps, initial=state.step, enabled=console)
    window = MetricWindow()
    for engine in run.engines.values():
        engine.train()
    while state.step < run.schedule.total_steps:
        window.add(train_step(run, task, source))
        every = cfg.train.log_every_steps
        if state.step % every == 0 or state.step == run.schedule.total_steps:
            log_train(run, task, window, progress)
        after_step(run, task, source, progress, stop)
    progress.close()
    state.train_seconds = window.elapsed()
    log_eval(run, evaluate(run, task, label="after"), "after")
    # Every rank's peak (ZeRO stages differ in how evenly memory spreads over ranks).
    state.peak_memory = comm.all_gather_objects(
        (run.memory_before_model, memory.peak_memory_bytes())
    )


def train_step(run: Run, task: Task, source: StepSource) -> StepResult:
    """One optimizer step over this step's global batch. Stops on a non-finite loss (before
    the update) or gradient norm (after it, before any checkpoint)."""
    start = time.perf_counter()
    produced = source.step(run.state.step)
    batches = produced.batches
    task.before_losses(batches, [True] * len(batches))
    _, (items, tokens) = comm.sum_metrics(
        {}, [], sum(task.count_items(b) for b in batches), sum(task.count_tokens(b) for b in batches)
    )  # fmt: skip
    plan = run.ds_plan.batch
    normalizer = max(items, 1.0) / (plan.world_size * plan.grad_accum)
    rate = run.policy.learning_rate()  # the rate this step uses (the schedule moves after)
    sums: dict[str, torch.Tensor] = {}
    # The engines that got a loss, in the order they got it (the task's, the same on every
    # rank). Not a set: a set of strings iterates in an order of the process's own hash seed,
    # which differs between ranks, and under ZeRO-3 each engine's step is collective (its
    # gradient norm all-reduce, its persistent parameters' all-gather), so two ranks stepping
    # policy and critic in opposite orders hang (issue #23's desynchronised PPO).
    stepped: dict[str, None] = {}
    for index, batch in enumerate(batches):
        out = task.loss(batch, normalizer=normalizer, training=True)
        for name, loss in out.losses.items():
            run.engines[name].backward(loss)
            stepped[name] = None
            if index < len(batches) - 1:
                run.engines[name].step()  # not yet the accumulation boundary: no update
        for key, value in out.metrics.items():
            sums[key] = sums.get(key, 0) + value.detach().double().cpu()
    keys = sorted(sums)
    values, _ = comm.sum_metrics(sums, keys)
    # Checked on every rank alike: a non-finite loss never reaches the weights.
    if not all(math.isfinite(v) for v in values):
        stop_on_nonfinite(run, keys, values)
    for name in stepped:
        run.engines[name].step()
    run.state.step += 1
    if run.ema is not None:
        run.ema.update()
    grad_norm = run.policy.grad_norm() if "policy" in stepped else None
    if grad_norm is not None and not math.isfinite(grad_norm):
        stop_on_nonfinite(run, ["grad_norm"], [grad_norm])
    result = StepResult(dict(zip(keys, values, strict=True)), items, tokens, rate, grad_norm)
    for name in [n for n in stepped if n != "policy"]:
        # An engine trained beside the policy (PPO's critic): its rate and norm, per-step
        # figures `learning_rate/<name>` and `grad_norm/<name>`.
        norm = run.engines[name].grad_norm()
        if norm is not None and not math.isfinite(norm):
            stop_on_nonfinite(run, [f"grad_norm/{name}"], [norm])
        result.figures[f"learning_rate/{name}"] = run.engines[name].learning_rate()
        if norm is not None:
            result.figures[f"grad_norm/{name}"] = norm
    if produced.metrics or produced.seconds:
        # Figures of the step's production (an online-RL round: rewards, lengths, generation
        # speed), and the training throughput without the time it took.
        seconds = time.perf_counter() - start - produced.seconds
        result.figures.update(produced.metrics)
        if tokens:  # (the text-to-image tasks count images: samples_per_second)
            result.figures["train/tokens_per_second"] = tokens / max(seconds, 1e-9)
    if produced.table and run.dist.is_main:
        completions_table(
            produced.table, step=run.state.step, logger=run.logger,
            console="console" in run.cfg.logging.backends,
        )  # fmt: skip
    return result


def log_train(run: Run, task: Task, window: MetricWindow, progress: Progress) -> None:
    state = run.state
    metrics = window.metrics(
        task.finalize_metrics(window.averages()), epoch=state.step / run.schedule.steps_per_epoch,
        samples=task.count_unit == "samples",
        # fp16's dynamic loss scaler skips steps whose gradients overflowed.
        skipped_steps=run.policy.skipped_steps() if run.ds_plan.precision == "fp16" else None,
    )  # fmt: skip
    state.history.append({"step": state.step, **metrics})
    if run.logger is not None:
        run.logger.log(state.step, metrics)
    progress.update(state.step, metrics)
    window.reset()


def after_step(
    run: Run, task: Task, source: StepSource, progress: Progress, stop: StopRequest | None
) -> None:
    """Evaluation and a checkpoint when due; a requested stop after a checkpoint."""
    cfg, step = run.cfg, run.state.step
    task.after_step(step)  # e.g. the text-to-image tasks' sample grid, when due
    every_eval, every_save = cfg.train.eval_every_steps, cfg.checkpoint.every_steps
    if every_eval and step % every_eval == 0 and step != run.schedule.total_steps:
        label = f"step {step}"  # (the final evaluation follows anyway)
        log_eval(run, evaluate(run, task, label=label), label, progress)
    saved = bool(every_save) and step % every_save == 0
    if saved:
        save_checkpoint(run, source)
    signum = agreed_signal(stop)
    if signum:
        progress.close()
        path = save_checkpoint(run, source) if not saved else checkpoint_path(run, step)
        raise Preempted(report.preempted(signum, step, run.schedule.total_steps, path), signum)


def stop_on_nonfinite(run: Run, keys: list[str], values: list[float]) -> None:
    """Stop on a non-finite loss (before its update) or gradient norm (after the update,
    before any checkpoint could store it), naming the step and its rows."""
    good = checkpoints.last_complete(run.output.path / "checkpoints", run.output.run_id)
    raise UserError(
        report.nonfinite(
            keys, values, step=run.state.step, rows=len(run.data.train),
            batch=run.ds_plan.batch, seed=run.cfg.train.seed,
            steps_per_epoch=run.schedule.steps_per_epoch, good=good,
        )
    )  # fmt: skip


# ---------------------------------------------------------------------------- evaluation


def eval_batches(run: Run, task: Task) -> Iterator[tuple[Any, bool]]:
    """This rank's held-out micro-batches. Every rank yields the same number (ZeRO-3 forward
    passes are collective); a rank with nothing left runs a dummy batch flagged False."""
    rows = run.data.eval
    for chunk in shard_chunks(
        len(rows), chunk=run.ds_plan.batch.micro_batch, rank=run.dist.rank,
        world=run.dist.world_size,
    ):  # fmt: skip
        batch = task.collate([rows[i] for i in chunk or [0]])
        yield to_device(batch, run.policy.device), chunk is not None


@torch.no_grad()
def evaluate(run: Run, task: Task, *, label: str) -> dict[str, float]:
    """Held-out metrics: the task's loss and metrics averaged over every eval item on every
    rank (where the task has an eval loss), plus the task's own extras."""
    results: dict[str, float] = {}
    if task.eval_loss and len(run.data.eval):
        run.policy.eval()
        batches, real = zip(*eval_batches(run, task), strict=True)
        task.before_losses(batches, real)
        sums: dict[str, torch.Tensor] = {}
        items = 0
        for batch, is_real in zip(batches, real, strict=True):
            out = task.loss(batch, normalizer=1.0, training=False)
            if not is_real:
                continue
            items += task.count_items(batch)
            for key, value in out.metrics.items():
                sums[key] = sums.get(key, 0) + value.detach().double().cpu()
        keys = sorted(set(sums) | set(task.metric_keys))
        values, (total,) = comm.sum_metrics(sums, keys, items)
        averaged = {k: v / max(total, 1.0) for k, v in zip(keys, values, strict=True)}
        results.update({f"eval/{k}": v for k, v in task.finalize_metrics(averaged).items()})
    results.update(task.evaluate_extra(label))
    for engine in run.engines.values():
        engine.train()
    return results


def log_eval(
    run: Run, results: dict[str, float], label: str, progress: Progress | None = None
) -> None:
    if not results:
        return
    run.state.history.append({"step": run.state.step, "phase": label, **results})
    if run.logger is not None:
        run.logger.log(run.state.step, {"phase": label, **results})
        text = report.eval_line(results, label)
        (progress.write(text) if progress else print(text, flush=True))


# ---------------------------------------------------------------------------- checkpoints


def checkpoint_path(run: Run, step: int) -> Path:
    return run.output.path / "checkpoints" / checkpoints.folder_name(step)


def save_checkpoint(run: Run, source: StepSource | None = None) -> Path:
    """`checkpoints/step-N`, complete or not at all (see `checkpoints.save`), with what the
    step source needs to continue exactly (`StepSource.save`)."""
    step, cfg = run.state.step, run.cfg
    state = {
        "run_id": run.output.run_id, "step": step,
        "epoch": step / run.schedule.steps_per_epoch, **run.schedule.state(cfg),
        "global_batch": run.ds_plan.batch.global_batch, "world_size": run.dist.world_size,
        "zero_stage": run.policy.zero_stage, "task": cfg.task, "model": cfg.model.name_or_path,
        **run.data.fingerprints,
    }  # fmt: skip
    return checkpoints.save(
        checkpoint_path(run, step), engines=run.engines, ema=run.ema, rank=run.dist.rank,
        is_main=run.dist.is_main, state=state, configs=run.configs(),
        keep_last=cfg.checkpoint.keep_last,
        extra=(lambda folder: source.save(folder, step)) if source is not None else None,
    )  # fmt: skip
