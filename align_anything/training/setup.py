"""Set-up: `setup(cfg, spec, stack) -> Run`, in plain steps with typed inputs and outputs,
cheapest and most likely to fail first (a bad folder, dataset or batch size is reported before
any weights load):

1. `start_process`: logging backends checked, the process group, seeds;
2. `claim_output`: the output folder's lock, the run id, the checkpoint to resume from;
3. the model side: config, tokenizer or processor, media support, attention kernel
   (`load_model_side`; a text-to-image pipeline: its parts and frozen encoders);
4. the data: the encoded splits through the on-disk cache (`build_data`; text-to-image: the
   latent cache);
5. `plan_deepspeed` and the task's schedule, then `check_resume` against the checkpoint;
6. the policy: the model (ZeRO-3: partitioned as it loads), its trained parts, the engine
   (`build_policy`; text-to-image: the denoiser);
7. `restore`: a resumed run's checkpoint; the weight average.

Steps 3, 4 and 6 depend on the kind of model: they are the task's model family's
(`training.family.ModelFamily`, built in each room of `families/`), as is the memory
planner's estimate behind `deepspeed=auto`.

Steps that hold something (the process group, the lock, run.json's status, the metrics
sinks) register their own clean-up on the `ExitStack` the entry point opens, so whatever
set-up reached is undone in reverse order, also after an error.
`start_logging` runs after the task is built (its parts add summary lines): the metrics sinks,
the resolved configs, run.json and the start-up summary.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from align_anything import atomic
from align_anything.backend import distributed as comm
from align_anything.backend import ds_config as dsc
from align_anything.backend import memory, universal, versions
from align_anything.config import AUTO_PRESET, RunConfig
from align_anything.errors import Preempted
from align_anything.training import checkpoints, deepspeed_plan, memory_plan, report
from align_anything.training import output_dir as outdir
from align_anything.training.ema import WeightEMA
from align_anything.training.family import ModelFamily
from align_anything.training.run import Data, OutputClaim, Run, Schedule
from align_anything.training.sources import row_schedule
from align_anything.training.task import TaskSpec
from align_anything.training.tracking import (
    MetricsLogger,
    check_backends,
    quiet_library_progress_bars,
)


def setup(cfg: RunConfig, spec: TaskSpec, stack: ExitStack) -> Run:
    """Everything before the task is built and the first step runs (see the module)."""
    dist = start_process(cfg, stack)
    output = claim_output(cfg, dist, stack)
    family = spec.family  # what the task trains (training/family.py)
    model = family.load_model_side(cfg, dist, spec)
    if spec.check is not None:
        spec.check(cfg, model)  # e.g. reward functions resolved before any data or weights
    data, summary = family.build_data(cfg, dist, model, spec)
    if spec.prepare_data is not None:
        summary += spec.prepare_data(cfg, model, data)
    resume_state = checkpoints.read_json(output.resume_dir / checkpoints.STATE) if (
        output.resume_dir is not None
    ) else None  # fmt: skip
    ds_plan = plan_deepspeed(cfg, dist, family, family.bucket_width(model), output.resume_dir,
                             resume_state)  # fmt: skip
    schedule = (spec.schedule or row_schedule)(cfg, data, ds_plan.batch)
    if resume_state is not None:
        summary += check_resume(cfg, output, resume_state, data, ds_plan, schedule,
                                warn=dist.is_main)  # fmt: skip
    elif output.finished_step is not None:  # a finished run without a checkpoint left
        check_finished(output, schedule)
    memory_before_model = memory.peak_memory_bytes()  # on CPU: interpreter, libraries, data
    policy, lines = family.build_policy(cfg, model, ds_plan, schedule, spec)
    summary += lines
    engines = {"policy": policy}
    if spec.engines is not None:  # trained beside the policy (PPO's critic), before `restore`
        others, lines = spec.engines(cfg, model, ds_plan, schedule)
        engines.update(others)
        summary += lines
    run = Run(
        cfg=cfg, dist=dist, output=output, model=model, data=data,
        ds_plan=ds_plan, schedule=schedule, engines=engines, ema=None,
        memory_before_model=memory_before_model, summary=summary, cleanup=stack,
    )  # fmt: skip
    restore(run)
    return run


# ---------------------------------------------------------------------------- 1, 2: process


def start_process(cfg: RunConfig, stack: ExitStack) -> comm.DistInfo:
    """The logging backends checked (a missing package fails before any compute), library
    progress bars quietened, the process group (left on exit), the seeds."""
    check_backends(cfg.logging.backends)
    quiet_library_progress_bars()
    # Distributed first: ranks decide data shards, and ZeRO-3 model construction needs it.
    dist = comm.setup_distributed()
    stack.callback(comm.teardown_distributed)
    # The precision this device can train in, checked before anything loads (fp16 on a CPU is
    # one message here, not DeepSpeed's error after the model has loaded).
    deepspeed_plan.run_precision(
        cfg, device_type=dist.device.type, bf16_supported=comm.bf16_supported()
    )
    checkpoints.seed_everything(cfg.train.seed)
    return dist


def claim_output(cfg: RunConfig, dist: comm.DistInfo, stack: ExitStack) -> OutputClaim:
    """Rank 0 takes the output folder's lock (released on exit) and decides whether this run
    may write there and from which checkpoint it resumes; every rank learns the outcome."""
    path = Path(cfg.output_dir)
    lock = outdir.Lock(path)
    stack.callback(lock.release)
    run_id, resume, finished = comm.decide_on_main(
        lambda: outdir.claim(path, lock, resume=cfg.resume, overwrite=cfg.overwrite_output_dir)
    )
    return OutputClaim(path, lock, run_id, Path(resume) if resume else None, finished)


# ---------------------------------------------------------------------------- 3: the model


# ---------------------------------------------------------------------------- 5: the plan


def plan_deepspeed(
    cfg: RunConfig, dist: comm.DistInfo, family: ModelFamily, bucket_width: int,
    resume_dir: Path | None, resume_state: dict[str, Any] | None,
) -> deepspeed_plan.DeepSpeedPlan:  # fmt: skip
    """The DeepSpeed config, batch plan and precision (`deepspeed_plan.resolve_deepspeed`; the
    bucket sizes follow `bucket_width`, a language model's hidden size); for deepspeed=auto,
    rank 0 asks the memory planner with the family's estimate (ranks on other nodes may see
    other memory)."""
    world = dist.world_size
    auto = None
    if cfg.deepspeed_source == AUTO_PRESET:
        auto = comm.decide_on_main(
            lambda: memory_plan.choose_auto_preset(cfg, family.estimate_memory, world_size=world)
        )
    return deepspeed_plan.resolve_deepspeed(
        cfg, world_size=world, bucket_width=bucket_width, device_type=comm.device_type(),
        bf16_supported=comm.bf16_supported(), auto_choice=auto,
        resume=(resume_dir, resume_state) if resume_state is not None else None,
    )  # fmt: skip


def check_finished(output: OutputClaim, schedule: Schedule) -> None:
    """A resumed run that had finished: nothing to do (`AlreadyFinished`) unless the schedule
    now goes past its end (`output_dir.check_finished`)."""
    assert output.finished_step is not None
    outdir.check_finished(
        output.path, finished_step=output.finished_step, resume_dir=output.resume_dir,
        total_steps=schedule.total_steps,
    )  # fmt: skip


def check_resume(
    cfg: RunConfig, output: OutputClaim, state: dict[str, Any], data: Data,
    ds_plan: deepspeed_plan.DeepSpeedPlan, schedule: Schedule, *, warn: bool,
) -> list[str]:  # fmt: skip
    """The checks a resumed run passes before the model loads (same model, tokenizer, data,
    global batch); a run that had finished stops there when it has nothing left to do
    (`check_finished`: nothing written yet); the note on a changed schedule, and a checkpoint
    of another ZeRO stage or world size converted once to DeepSpeed's universal format."""
    resume_dir = output.resume_dir
    assert resume_dir is not None
    checkpoints.check_resume(
        resume_dir, state, now={"model": cfg.model.name_or_path, **data.fingerprints},
        global_batch=ds_plan.batch.global_batch, allow_mismatch=cfg.checkpoint.allow_mismatch,
        warn=warn,
    )  # fmt: skip
    if output.finished_step is not None:
        check_finished(output, schedule)
    note = checkpoints.schedule_note(resume_dir.name, state, schedule.state(cfg))
    if ds_plan.universal:
        # Every trained engine's folder: the policy's, and e.g. PPO's critic's.
        for tag in universal.engine_tags(resume_dir):
            universal.convert_to_universal(resume_dir, tag)
    return [f"  schedule        {note}"] if note else []


# ---------------------------------------------------------------------------- 7: restore


def restore(run: Run) -> None:
    """A resumed run's checkpoint into every trained engine and this rank's RNG; the weight
    average (from the checkpoint when it has one)."""
    resume = run.output.resume_dir
    if resume is not None:
        run.state.step = checkpoints.load(resume, engines=run.engines, rank=run.dist.rank)
    ema = run.cfg.train.ema
    if ema.enabled:
        run.ema = WeightEMA(
            run.policy, decay=ema.decay, on_device=ema.device == "device",
            is_main=run.dist.is_main,
        )  # fmt: skip
        restored = run.ema.load(resume) if resume is not None else None
        run.summary.append(f"  ema             {run.ema.describe(restored)}")


# ---------------------------------------------------------------------------- logging


def start_logging(run: Run, family: ModelFamily, stack: ExitStack, *, task: str) -> None:
    """On rank 0: the metrics sinks (closed on exit), the resolved configs, run.json (its
    status recorded on exit: complete, stopped or failed) and the start-up summary."""
    if not run.dist.is_main:
        return
    cfg, out = run.cfg, run.output.path
    run.logger = MetricsLogger(
        out, backends=cfg.logging.backends, project=cfg.logging.project,
        run_name=cfg.logging.run_name, config=cfg.to_dict(),
        resume_step=run.state.step if run.output.resume_dir is not None else None,
        finished=run.output.finished_step == run.state.step,
    )  # fmt: skip
    stack.callback(run.logger.close)
    for name, data in run.configs().items():
        (out / name).write_text(atomic.to_json(data))
    stack.enter_context(run_record(run, task=task))
    print(report.startup_summary(startup_facts(run, family, task=task)), flush=True)


@contextlib.contextmanager
def run_record(run: Run, *, task: str) -> Iterator[None]:
    """run.json says `running` while the block runs, then how it ended: `complete`, `stopped`
    (a signal: a checkpoint was written) or `failed`."""
    outdir.start_run(run.output.path, run.output.run_id, task=task, step=run.state.step,
                     resumed_from=run.output.resume_dir)  # fmt: skip
    status = "failed"
    try:
        yield
        status = "complete"
    except Preempted:
        status = "stopped"
        raise
    finally:
        outdir.finish_run(run.output.path, status=status, step=run.state.step)


def startup_facts(run: Run, family: ModelFamily, *, task: str) -> report.StartupFacts:
    """What the start-up summary shows, read off the set-up run (its model facts are the
    family's)."""
    cfg, ds_plan, policy = run.cfg, run.ds_plan, run.policy
    facts = family.describe(run)
    offload = [
        name for name, on in (("optimizer", dsc.offloads_optimizer(ds_plan.config)),
                              ("parameters", dsc.offloads_params(ds_plan.config))) if on
    ]  # fmt: skip
    return report.StartupFacts(
        task=task, model=cfg.model.name_or_path, model_type=facts.model_type,
        trainable=facts.trainable, frozen=facts.frozen, parts=facts.parts,
        world=f"{ds_plan.batch.world_size} ({run.dist.backend} on {run.dist.device.type})",
        batch=ds_plan.batch.describe(), total_steps=run.schedule.total_steps,
        steps_per_epoch=run.schedule.steps_per_epoch, train_rows=len(run.data.train),
        train_unit=run.data.train_unit, eval_rows=len(run.data.eval),
        zero_stage=policy.zero_stage, offload=offload, preset_file=Path(ds_plan.source).name,
        precision=ds_plan.precision, attention=facts.attention,
        ds_config=json.dumps(ds_plan.config, separators=(",", ":")),
        memory_plan=f"{facts.memory_plan}; now {memory.memory_summary()}",
        lines=[*(f"  overrides       {note}" for note in cfg.override_notes), *ds_plan.notes,
               *run.summary],
        data_reports=[r.summary() for r in run.data.reports],
        logging_notes=list(run.logger.notes) if run.logger is not None else [],
        output_dir=str(run.output.path),
        resumed=(str(run.output.resume_dir), run.state.step) if run.output.resume_dir else None,
        universal=ds_plan.universal,
        versions=versions.library_versions(lora=cfg.model.lora.enabled),
    )  # fmt: skip
