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
(`training.family.ModelFamily`: `LANGUAGE_MODELS` below, or `text_to_image.PIPELINES`).

Steps that hold something (the process group, the lock, run.json's status, the metrics
sinks) register their own clean-up on the `ExitStack` the entry point opens, so whatever
set-up reached is undone in reverse order, also after an error.
`start_logging` runs after the task is built (its parts add summary lines): the metrics sinks,
the resolved configs, run.json and the start-up summary.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from align_anything import atomic, forward, plan
from align_anything.backend import distributed as comm
from align_anything.backend import ds_config as dsc
from align_anything.backend import memory, universal, versions
from align_anything.backend.engine import Engine
from align_anything.backend.zero_init import model_init_context
from align_anything.config import AUTO_PRESET, RunConfig
from align_anything.data import cache, pipeline
from align_anything.data.encode import Encoding
from align_anything.data.multimodal import MediaSupport
from align_anything.errors import Preempted, UserError
from align_anything.models import loading as model_loading
from align_anything.models import parts as model_parts
from align_anything.models import tied_embeddings, zoo
from align_anything.models.ema import WeightEMA
from align_anything.models.prepare import prepare_for_training
from align_anything.models.sizes import sizes_of
from align_anything.training import checkpoints, report
from align_anything.training import output_dir as outdir
from align_anything.training.family import ModelFacts, ModelFamily, training_engine
from align_anything.training.run import Data, ModelSide, OutputClaim, Run, Schedule
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
    family = spec.family or LANGUAGE_MODELS  # what the task trains (training/family.py)
    model = family.load_model_side(cfg, dist, spec)
    if spec.check is not None:
        spec.check(cfg, model)  # e.g. reward functions resolved before any data or weights
    data, summary = family.build_data(cfg, dist, model, spec)
    if spec.prepare_data is not None:
        summary += spec.prepare_data(cfg, model, data)
    resume_state = checkpoints.read_json(output.resume_dir / checkpoints.STATE) if (
        output.resume_dir is not None
    ) else None  # fmt: skip
    ds_plan = plan_deepspeed(cfg, dist, family.bucket_width(model), output.resume_dir,
                             resume_state)  # fmt: skip
    schedule = (spec.schedule or row_schedule)(cfg, data, ds_plan.batch)
    if resume_state is not None:
        assert output.resume_dir is not None
        summary += check_resume(cfg, output.resume_dir, resume_state, data, ds_plan, schedule,
                                warn=dist.is_main)  # fmt: skip
    memory_before_model = memory.peak_memory_bytes()  # on CPU: interpreter, libraries, data
    policy, lines = family.build_policy(cfg, model, ds_plan, schedule, spec)
    summary += lines
    engines = {"policy": policy}
    if spec.engines is not None:  # trained beside the policy (PPO's critic), before `restore`
        others, lines = spec.engines(cfg, model, ds_plan, schedule)
        engines.update(others)
        summary += lines
    run = Run(
        cfg=cfg, dist=dist, output=output, family=family, model=model, data=data,
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
    checkpoints.seed_everything(cfg.train.seed)
    return dist


def claim_output(cfg: RunConfig, dist: comm.DistInfo, stack: ExitStack) -> OutputClaim:
    """Rank 0 takes the output folder's lock (released on exit) and decides whether this run
    may write there and from which checkpoint it resumes; every rank learns the outcome."""
    path = Path(cfg.output_dir)
    lock = outdir.Lock(path)
    stack.callback(lock.release)
    run_id, resume = comm.decide_on_main(
        lambda: outdir.claim(path, lock, resume=cfg.resume, overwrite=cfg.overwrite_output_dir)
    )
    return OutputClaim(path, lock, run_id, Path(resume) if resume else None)


# ---------------------------------------------------------------------------- 3: the model


def load_model_side(cfg: RunConfig, dist: comm.DistInfo, spec: TaskSpec) -> ModelSide:
    """The model's config and tokenizer (for image-text / audio-text models, the processor's
    tokenizer, and media support for the data); the attention kernel checked."""
    model, reward_head = cfg.model, spec.reward_head
    path = zoo.resolve_model_path(model.name_or_path)
    config, tokenizer, processor = model_loading.load_text_side(
        path, trust_remote_code=model.trust_remote_code
    )
    modalities = model_loading.modalities_of(config)
    kernel = model_loading.check_attention(
        model.attn_implementation, config, reward=reward_head, device_type=dist.device.type,
        precision=cfg.train.precision,
    )  # fmt: skip
    media = MediaSupport(processor, modalities) if modalities else None
    return ModelSide(model.name_or_path, path, config, tokenizer, processor, media, kernel)


def load_pretrained(cfg: RunConfig, model: ModelSide, *, precision: str, reward_head: bool) -> Any:
    """The model as loaded from `model.name_or_path` (the policy before training, and the
    frozen reference of DPO, KTO and online RL). Inside `model_init_context` ZeRO-3 loads it
    partitioned."""
    loaded = model_loading.load_model(
        model.path, reward=reward_head, dtype=dsc.torch_dtype(precision),
        trust_remote_code=cfg.model.trust_remote_code,
        attn_implementation=model.attn_implementation,
    )  # fmt: skip
    if reward_head:
        # transformers reads the score at the last token that is not the pad token.
        loaded.config.pad_token_id = model.tokenizer.pad_token_id
    return loaded


# ---------------------------------------------------------------------------- 4: data


def data_spec(cfg: RunConfig, *, task: str, kind: str, encoding: Encoding) -> pipeline.Spec:
    """The data pipeline's input: sources of both splits, split and caps, the encoding."""
    data = cfg.data

    def sources(value: Any) -> tuple[pipeline.Source, ...]:
        if value is None:
            return ()
        if isinstance(value, str):
            return (pipeline.Source(value, data.format, dict(data.columns)),)
        return tuple(
            pipeline.Source(
                s.path,
                s.format or data.format,
                dict(s.columns if s.columns is not None else data.columns),
                s.weight,
                s.rows,
            )  # fmt: skip
            for s in value
        )

    return pipeline.Spec(
        train=sources(data.path), eval=sources(data.eval_path), eval_fraction=data.eval_fraction,
        seed=cfg.train.seed, max_train=data.max_train_samples, max_eval=data.max_eval_samples,
        task=task, kind=kind, encoding=encoding, max_length=data.max_length,
        truncation=data.truncation,
    )  # fmt: skip


def build_data(
    cfg: RunConfig, dist: comm.DistInfo, model: ModelSide, spec: TaskSpec
) -> tuple[Data, list[str]]:
    """Load, check, split and encode the data (before any weights: a bad dataset fails in
    seconds, not after a model load) into the on-disk Arrow cache (`data.cache`), built by
    local rank 0 of each node while the other ranks wait, then opened by every rank. Returns
    the data and its start-up summary lines."""
    assert spec.encoding is not None, f"{spec.name} encodes no text"
    pipe = data_spec(cfg, task=spec.name, kind=spec.record_kind, encoding=spec.encoding(cfg))
    prepared, parts = prepare_cached(cfg, dist, model, pipe)
    if not len(prepared.train):
        raise UserError(
            f"no usable training rows in {pipeline.describe_sources(pipe.train)}:\n"
            + "\n".join(r.summary() for r in prepared.reports)
        )
    fingerprints = checkpoints.fingerprints(
        pipeline.describe_sources(pipe.train), tokenizer=parts["tokenizer"],
        data=cache.data_fingerprint(parts),
    ) | {"encoder_version": cache.ENCODER_VERSION}  # fmt: skip
    data = Data(
        train=prepared.train, eval=prepared.eval, eval_records=prepared.eval_records,
        reports=prepared.reports, fingerprints=fingerprints, lengths=prepared.train.lengths(),
    )  # fmt: skip
    lines = [f"  data cache      {prepared.note}"]
    lines += [f"  data mix        {line}" for line in prepared.mixture]
    return data, lines


def prepare_cached(
    cfg: RunConfig, dist: comm.DistInfo, model: ModelSide, pipe: pipeline.Spec
) -> tuple[cache.Prepared, dict[str, Any]]:
    """`pipe`'s data through the on-disk Arrow cache: rank 0 hashes the inputs into the key,
    local rank 0 of each node checks or builds the entry while the other ranks wait (a data
    error stops every rank with one message), then every rank memory-maps it. Returns the
    opened entry and its key parts. Collective."""
    root = cache.cache_root(cfg.data.cache_dir)
    # Rank 0 reads and hashes the files once; every rank gets the key (or the error).
    parts = comm.decide_on_main(
        lambda: cache.key_parts(pipe, tokenizer=model.tokenizer, media=model.media)
    )
    note = None
    if dist.local_rank == 0:
        num_proc = pipeline.auto_num_proc(cfg.data.num_proc)

        def started(rows: int) -> None:
            # Only a process that tokenises prints this (tests read it: rank 1 never does).
            print(f"data: rank {dist.rank} tokenising {rows} rows (data.num_proc={num_proc})",
                  flush=True)  # fmt: skip

        build = lambda: cache.ensure(  # noqa: E731
            pipe, parts, root=root, tokenizer=model.tokenizer, media=model.media,
            model_name=cfg.model.name_or_path, num_proc=num_proc, on_start=started,
        )  # fmt: skip
        note = comm.fail_together(build, what="data preparation")
    else:
        comm.fail_together(None, what="data preparation")
    return cache.open_prepared(cache.folder_for(root, pipe, parts), note=note or ""), parts


def build_extra_data(
    cfg: RunConfig, model: ModelSide, *, task: str, path: str, kind: str, encoding: Encoding,
    key: str,
) -> tuple[cache.Prepared, str]:  # fmt: skip
    """A second encoded data set beside the run's own (PPO's ptx conversations from
    `ppo.ptx_data`): all of `path`'s rows for training (no held-out split), encoded with
    `encoding` through the same cache (`data.max_length`, `data.truncation`, `data.cache_dir`).
    Returns the opened entry and its data fingerprint (for the resume check); a source without
    a usable row is one error naming `key`. Collective."""
    source = pipeline.Source(path, "auto", {})
    pipe = pipeline.Spec(
        train=(source,), eval=(), eval_fraction=0.0, seed=cfg.train.seed, max_train=None,
        max_eval=None, task=task, kind=kind, encoding=encoding, max_length=cfg.data.max_length,
        truncation=cfg.data.truncation,
    )  # fmt: skip
    prepared, parts = prepare_cached(cfg, comm.dist_info(), model, pipe)
    if not len(prepared.train):
        raise UserError(
            f"{key}={path!r}: no usable rows:\n" + "\n".join(r.summary() for r in prepared.reports)
        )
    return prepared, cache.data_fingerprint(parts)


# ---------------------------------------------------------------------------- 5: the plan


def plan_deepspeed(
    cfg: RunConfig, dist: comm.DistInfo, bucket_width: int, resume_dir: Path | None,
    resume_state: dict[str, Any] | None,
) -> plan.DeepSpeedPlan:  # fmt: skip
    """The DeepSpeed config, batch plan and precision (`plan.resolve_deepspeed`; the bucket
    sizes follow `bucket_width`, a language model's hidden size); for deepspeed=auto, rank 0
    asks the memory planner (ranks on other nodes may see other memory)."""
    world = dist.world_size
    auto = None
    if cfg.deepspeed_source == AUTO_PRESET:
        auto = comm.decide_on_main(lambda: plan.choose_auto_preset(cfg, world_size=world))
    return plan.resolve_deepspeed(
        cfg, world_size=world, bucket_width=bucket_width, device_type=comm.device_type(),
        bf16_supported=comm.bf16_supported(), auto_choice=auto,
        resume=(resume_dir, resume_state) if resume_state is not None else None,
    )  # fmt: skip


def check_resume(
    cfg: RunConfig, resume_dir: Path, state: dict[str, Any], data: Data,
    ds_plan: plan.DeepSpeedPlan, schedule: Schedule, *, warn: bool,
) -> list[str]:  # fmt: skip
    """The checks a resumed run passes before the model loads (same model, tokenizer, data,
    global batch), the note on a changed schedule, and a checkpoint of another ZeRO stage or
    world size converted once to DeepSpeed's universal format."""
    checkpoints.check_resume(
        resume_dir, state, now={"model": cfg.model.name_or_path, **data.fingerprints},
        global_batch=ds_plan.batch.global_batch, allow_mismatch=cfg.checkpoint.allow_mismatch,
        warn=warn,
    )  # fmt: skip
    note = checkpoints.schedule_note(resume_dir.name, state, schedule.state(cfg))
    if ds_plan.universal:
        # Every trained engine's folder: the policy's, and e.g. PPO's critic's.
        for tag in universal.engine_tags(resume_dir):
            universal.convert_to_universal(resume_dir, tag)
    return [f"  schedule        {note}"] if note else []


# ---------------------------------------------------------------------------- 6: the engine


def build_policy(
    cfg: RunConfig, model: ModelSide, ds_plan: plan.DeepSpeedPlan, schedule: Schedule,
    spec: TaskSpec,
) -> tuple[Engine, list[str]]:  # fmt: skip
    """The trained model (ZeRO-3: partitioned as it loads), its trained parts (frozen parts,
    LoRA adapters, activation checkpointing), and its engine; start-up summary lines."""
    reward_head = spec.reward_head
    with model_init_context(ds_plan.config):
        loaded = load_pretrained(cfg, model, precision=ds_plan.precision, reward_head=reward_head)
    prepared, lines = prepare_for_training(
        loaded, name=cfg.model.name_or_path, freeze=cfg.model.freeze,
        adapters=cfg.model.lora.adapters(), reward=reward_head,
        gradient_checkpointing=cfg.speed.gradient_checkpointing,
    )  # fmt: skip
    engine = training_engine(prepared, cfg, ds_plan, schedule)
    # Only where gradients are plain tensors (ZeRO-0, fp32 torch optimizer): see the module.
    if cfg.speed.tied_grads_in_place and engine.plain_gradients:
        if tied_embeddings.accumulate_in_place(engine.module):
            lines.append(
                "  tied embedding  input embedding and LM head share one matrix: its "
                "gradient accumulates in place (speed.tied_grads_in_place)"
            )
    return engine, lines


def completion_only_logits(cfg: RunConfig, policy: Engine) -> bool:
    """Whether the LM head runs only where a scored token is predicted
    (`speed.completion_only_logits`, where the model's forward takes `logits_to_keep`)."""
    return cfg.speed.completion_only_logits and forward.supports_logits_to_keep(policy.module)


def shared_prompt_pairs(run: Run) -> bool:
    """Whether a preference pair runs as one row prompt + chosen + rejected
    (`speed.share_prefix`, for text models whose attention takes a dense mask; media are
    attached per sequence, so image-text and audio-text pairs take two rows); says which in the
    start-up summary."""
    from align_anything.data.layouts import supports_shared_prompt

    cfg = run.cfg
    share = (
        cfg.speed.share_prefix and run.model.media is None
        and supports_shared_prompt(run.policy.module.config)
    )  # fmt: skip
    if share:
        run.summary.append(
            "  pairs           prompt + chosen + rejected in one row, the prompt computed once, "
            "short pairs sharing a row (speed.share_prefix)"
        )
    elif cfg.speed.share_prefix:
        run.summary.append(
            "  pairs           two rows per pair (speed.share_prefix needs a text model with "
            "sdpa or eager attention)"
        )
    return share


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


def start_logging(run: Run, stack: ExitStack, *, task: str) -> None:
    """On rank 0: the metrics sinks (closed on exit), the resolved configs, run.json (its
    status recorded on exit: complete, stopped or failed) and the start-up summary."""
    if not run.dist.is_main:
        return
    cfg, out = run.cfg, run.output.path
    run.logger = MetricsLogger(
        out, backends=cfg.logging.backends, project=cfg.logging.project,
        run_name=cfg.logging.run_name, config=cfg.to_dict(),
        resume=run.output.resume_dir is not None,
    )  # fmt: skip
    stack.callback(run.logger.close)
    for name, data in run.configs().items():
        (out / name).write_text(atomic.to_json(data))
    stack.enter_context(run_record(run, task=task))
    print(report.startup_summary(startup_facts(run, task=task)), flush=True)


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


def startup_facts(run: Run, *, task: str) -> report.StartupFacts:
    """What the start-up summary shows, read off the set-up run."""
    cfg, ds_plan, policy = run.cfg, run.ds_plan, run.policy
    facts = run.family.describe(run)
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
        lines=[*ds_plan.notes, *run.summary],
        data_reports=[r.summary() for r in run.data.reports],
        logging_notes=list(run.logger.notes) if run.logger is not None else [],
        output_dir=str(run.output.path),
        resumed=(str(run.output.resume_dir), run.state.step) if run.output.resume_dir else None,
        universal=ds_plan.universal, versions=versions.library_versions(),
    )  # fmt: skip


def describe_model(run: Run) -> ModelFacts:
    """The start-up summary's model facts of a language model: its type and parameter counts,
    the per-part line (multimodal models and frozen parts), the attention kernel, and the
    planner's per-device estimate for this run's resolved preset (the figure `python -m
    align_anything plan` and `deepspeed=auto` use), every engine trained beside the policy
    (PPO's critic) counted."""
    cfg, ds_plan, module = run.cfg, run.ds_plan, run.policy.module
    trainable, frozen = model_loading.count_parameters(module)
    parts = None
    if run.model.media is not None or cfg.model.freeze:
        parts = model_parts.describe_parts(model_parts.part_counts(module))
    beside = [
        sizes_of(engine.module, engine.module.config)
        for name, engine in run.engines.items() if name != "policy"
    ]  # fmt: skip
    world = ds_plan.batch.world_size
    estimate = plan.estimate_preset(
        Path(ds_plan.source).stem, ds_plan.config, sizes_of(module, run.model.config), cfg,
        world_size=world, precision=ds_plan.precision, gpus_per_node=plan.local_devices(world),
        trained_beside=beside,
    )  # fmt: skip
    return ModelFacts(
        model_type=run.model.config.model_type, trainable=trainable, frozen=frozen, parts=parts,
        attention=f"{module.config._attn_implementation} "
        f"(model.attn_implementation={cfg.model.attn_implementation})",
        memory_plan=report.describe_estimate(estimate),
    )  # fmt: skip


def save_final(run: Run, state: dict[str, torch.Tensor] | None) -> None:
    """Rank 0: `final/` (the model, or a LoRA run's adapter), `final-ema/` with EMA and
    `final-merged/` with `model.lora.save_merged`, from the policy's gathered `state`."""
    cfg, lora = run.cfg, run.cfg.model.lora
    checkpoints.save_final(
        run.output.path, run.policy.module, state,
        ema_state=run.ema.state_dict(state) if run.ema is not None else None,
        tokenizer=run.model.saved_tokenizer, configs=run.configs(),
        merge_onto=run.model.path if lora.enabled and lora.save_merged else None, task=cfg.task,
    )  # fmt: skip


def fresh_model_loader(run: Run, *, reward_head: bool = False) -> Callable[[], torch.nn.Module]:
    """A function that loads the model as it was before training (a frozen reference),
    partitioned like the policy under ZeRO-3."""

    def load() -> torch.nn.Module:
        with model_init_context(run.ds_plan.config):
            return load_pretrained(run.cfg, run.model, precision=run.ds_plan.precision,
                                   reward_head=reward_head)  # fmt: skip

    return load


# Language models: transformers models with a tokenizer or processor (every task but the
# text-to-image ones, whose family is `text_to_image.PIPELINES`).
LANGUAGE_MODELS = ModelFamily(
    name="language model", load_model_side=load_model_side, build_data=build_data,
    bucket_width=lambda model: model_loading.text_hidden_size(model.config),
    build_policy=build_policy, describe=describe_model, save_final=save_final,
)  # fmt: skip
