"""The skeleton every trainer shares: set-up in named steps, the step loop, evaluation,
checkpoints and the final export.

A task's trainer adds only its data encoding and its batch → loss (`encoding`, `collate`,
`count_items`, `compute_loss`, optionally `build_model`, `after_engine`, `step_rows`,
`before_step`, `evaluate_extra`, `finalize_metrics`). What the steps use lives beside this file: `batching` (which rows form a
step), `checkpoints` (the store, RNG state, resume checks), `output_dir` (lock and run.json),
`report` (what the user reads), `tracking` (metrics sinks, progress), `preemption` (signals).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from align_anything import atomic, errors, forward, plan
from align_anything.backend import distributed as comm
from align_anything.backend import ds_config as dsc
from align_anything.backend import memory, universal
from align_anything.backend.engine import Engine
from align_anything.backend.zero_init import model_init_context
from align_anything.config import AUTO_PRESET, RunConfig
from align_anything.data import cache, pipeline
from align_anything.data.encode import Encoding
from align_anything.data.multimodal import MediaSupport
from align_anything.data.rows import EncodedRows
from align_anything.errors import (
    Preempted,
    UserError,
)
from align_anything.models import loading as model_loading
from align_anything.models import tied_embeddings, zoo
from align_anything.models.ema import WeightEMA
from align_anything.models.prepare import prepare_for_training
from align_anything.trainers import checkpoints, report
from align_anything.trainers import output_dir as outdir
from align_anything.trainers.batching import plan_steps, rank_step_rows, shard_chunks
from align_anything.trainers.preemption import StopRequest, agreed_signal
from align_anything.trainers.tracking import (
    MetricsLogger,
    MetricWindow,
    Progress,
    StepResult,
    check_backends,
    quiet_library_progress_bars,
)


class Trainer:
    """Lifecycle: `setup()` → `train()` (evaluates before and after) → `save()` → `cleanup()`."""

    task: ClassVar[str]
    # Data format the task consumes: "conversation", "preference" or "unpaired".
    record_kind: ClassVar[str]
    # What `samples_per_second` counts ("tokens": not logged, tokens_per_second says it).
    count_unit: ClassVar[str] = "samples"

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.summary_lines: list[str] = []
        self.resume_dir: Path | None = None
        # Set by the entry point while the step loop runs (SIGTERM/SIGINT -> stop after a step).
        self.stop_request: StopRequest | None = None

    # ------------------------------------------------------------------ hooks for subclasses

    def encoding(self) -> Encoding:
        """How the task encodes records (`data.pipeline`, cached by `data.cache`)."""
        raise NotImplementedError

    def prepare_rows(self, rows: EncodedRows, split: str) -> None:
        """Work on a split's opened rows that the cache does not hold (it depends on more than
        the key: RM's pad token choice, KTO's notes and KL partners). Runs on every rank."""

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def build_model(self) -> torch.nn.Module:
        """The model as loaded from model.name_or_path (also the DPO reference)."""
        return model_loading.load_model(
            self.model_path, reward=self.task == "rm", dtype=dsc.torch_dtype(self.precision),
            trust_remote_code=self.cfg.model.trust_remote_code,
            attn_implementation=self.attn_implementation,
        )  # fmt: skip

    def count_items(self, batch: dict[str, torch.Tensor]) -> int:
        """Items the loss averages over (tokens for SFT, pairs for DPO/RM)."""
        raise NotImplementedError

    def compute_loss(
        self, batch: dict[str, torch.Tensor], *, normalizer: float, training: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return (loss to backpropagate, metric sums over this micro-batch's items).

        The loss is the micro-batch's summed per-item loss divided by `normalizer`
        (= global items in the step / (world × grad_accum)); after DeepSpeed's own averaging
        over ranks and accumulation steps the gradient is exactly that of the mean over every
        item of the global batch, however it is split. Metric sums are divided by the global
        item count for logging.
        """
        raise NotImplementedError

    def step_rows(self, step: int, indices: list[int]) -> list[dict]:
        """The encoded rows of one micro-batch of step `step` (KTO adds what depends on the
        step: the completion each row's prompt is paired with for its KL estimate)."""
        return [self.train_rows[i] for i in indices]

    def before_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """Work on this rank's micro-batches of a step before any of their losses: a statistic
        of the whole global batch (KTO's KL reference point). Collective where it reduces."""

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Derive logged figures from averaged metrics (e.g. perplexity from loss)."""
        return metrics

    def metric_keys(self) -> list[str]:
        """Metric names every rank reports in evaluation (so ranks pack the same keys)."""
        return ["loss"]

    def after_engine(self) -> None:
        """Set-up that needs the engine (e.g. the DPO reference model)."""

    def evaluate_extra(self, label: str) -> dict[str, float]:
        """Extra evaluation (e.g. generation checks), run before and after training."""
        return {}

    def extra_summary(self) -> dict[str, Any]:
        """The task's own entries in summary.json."""
        return {}

    def export_module(self) -> Any:
        return self.engine.module

    # ------------------------------------------------------------------ set-up

    def setup(self) -> None:
        """Everything before the first step, cheapest and most likely to fail first: a bad
        folder, dataset or batch size is reported before any weights load."""
        self._start_process()
        self._load_tokenizer()
        self._build_data()
        self._plan_run()
        self._build_engine()
        self._restore()
        self._start_logging()

    @property
    def precision(self) -> str:
        return self.deepspeed.precision

    @property
    def batch_plan(self) -> dsc.BatchPlan:
        return self.deepspeed.batch

    @property
    def ds_config(self) -> dict[str, Any]:
        return self.deepspeed.config

    def _start_process(self) -> None:
        """Logging backends, the process group, seeds, and the output folder: the lock, and
        whether this run may write there and from which checkpoint it resumes."""
        check_backends(self.cfg.logging.backends)
        quiet_library_progress_bars()
        # Distributed first: ranks decide data shards, and ZeRO-3 model construction needs it.
        self.dist = comm.setup_distributed()
        checkpoints.seed_everything(self.cfg.train.seed)
        self._lock = outdir.Lock(self.output_dir)
        self.run_id, resume = comm.decide_on_main(
            lambda: outdir.claim(
                self.output_dir,
                self._lock,
                resume=self.cfg.resume,
                overwrite=self.cfg.overwrite_output_dir,
            )
        )
        self.resume_dir = Path(resume) if resume else None

    def _load_tokenizer(self) -> None:
        """The model's config and tokenizer (for image-text / audio-text models, the
        processor's tokenizer, and media support for the data); the attention kernel checked."""
        cfg = self.cfg.model
        self.model_path = zoo.resolve_model_path(cfg.name_or_path)
        self.model_config, self.tokenizer, self.processor = model_loading.load_text_side(
            self.model_path, trust_remote_code=cfg.trust_remote_code
        )
        modalities = model_loading.modalities_of(self.model_config)
        self.media = MediaSupport(self.processor, modalities) if modalities else None
        self.attn_implementation = model_loading.check_attention(
            cfg.attn_implementation, self.model_config, reward=self.task == "rm",
            device_type=self.dist.device.type, precision=self.cfg.train.precision,
        )  # fmt: skip

    def _build_data(self) -> None:
        """Load, check, split and encode the data (before any weights: a bad dataset fails in
        seconds, not after a model load): into the on-disk Arrow cache (`data.cache`), built by
        local rank 0 of each node while the other ranks wait, then opened by every rank."""
        cfg = self.cfg.data
        spec = self._data_spec(self.encoding())
        root = cache.cache_root(cfg.cache_dir)
        # Rank 0 reads and hashes the files once; every rank gets the key (or the error).
        parts = comm.decide_on_main(
            lambda: cache.key_parts(spec, tokenizer=self.tokenizer, media=self.media)
        )
        folder = cache.folder_for(root, spec, parts)
        note = self._ensure_cache(spec, parts, root)
        prepared = cache.open_prepared(folder, note=note or "")
        self.data_reports = prepared.reports
        self.summary_lines.append(f"  data cache      {prepared.note}")
        self.summary_lines += [f"  data mix        {line}" for line in prepared.mixture]
        self.train_rows, self.eval_rows = prepared.train, prepared.eval
        self.eval_records = prepared.eval_records
        if not len(self.train_rows):
            raise UserError(
                f"no usable training rows in {pipeline.describe_sources(spec.train)}:\n"
                + "\n".join(r.summary() for r in self.data_reports)
            )
        self.prepare_rows(self.train_rows, "train")
        self.prepare_rows(self.eval_rows, "eval")
        self._row_lengths = self.train_rows.lengths()
        self.fingerprints = checkpoints.fingerprints(
            pipeline.describe_sources(spec.train), tokenizer=parts["tokenizer"],
            data=cache.data_fingerprint(parts),
        )  # fmt: skip

    def _data_spec(self, encoding: Encoding) -> pipeline.Spec:
        cfg = self.cfg.data

        def sources(value: Any) -> tuple[pipeline.Source, ...]:
            if value is None:
                return ()
            if isinstance(value, str):
                return (pipeline.Source(value, cfg.format, dict(cfg.columns)),)
            return tuple(
                pipeline.Source(
                    s.path,
                    s.format or cfg.format,
                    dict(s.columns if s.columns is not None else cfg.columns),
                    s.weight,
                    s.rows,
                )  # fmt: skip
                for s in value
            )

        return pipeline.Spec(
            train=sources(cfg.path), eval=sources(cfg.eval_path), eval_fraction=cfg.eval_fraction,
            seed=self.cfg.train.seed, max_train=cfg.max_train_samples,
            max_eval=cfg.max_eval_samples, task=self.task, kind=self.record_kind,
            encoding=encoding, max_length=cfg.max_length, truncation=cfg.truncation,
        )  # fmt: skip

    def _ensure_cache(self, spec: pipeline.Spec, parts: dict[str, Any], root: Path) -> str | None:
        """Local rank 0 builds or checks the cache entry; every rank then learns whether that
        worked (a data error is every rank's error, before any of them loads weights)."""
        note, failure = None, None
        if self.dist.local_rank == 0:
            num_proc = pipeline.auto_num_proc(self.cfg.data.num_proc)

            def started(rows: int) -> None:
                # Only a process that tokenises prints this (tests read it: rank 1 never does).
                print(f"data: rank {self.dist.rank} tokenising {rows} rows "
                      f"(data.num_proc={num_proc})", flush=True)  # fmt: skip

            try:
                note = cache.ensure(
                    spec, parts, root=root, tokenizer=self.tokenizer, media=self.media,
                    model_name=self.cfg.model.name_or_path, num_proc=num_proc, on_start=started,
                )  # fmt: skip
            except UserError as err:
                failure = (type(err).__name__, str(err))
            except BaseException:
                comm.all_gather_objects(("crash", f"rank {self.dist.rank} failed"))
                raise
        for outcome in comm.all_gather_objects(failure):
            if outcome is not None:
                kind, message = outcome
                if kind == "crash":
                    raise UserError(f"data preparation failed on another rank ({message})")
                raise getattr(errors, kind, UserError)(message)
        return note

    def _plan_run(self) -> None:
        """The DeepSpeed plan (config, batch plan, precision: `plan.resolve_deepspeed`), the
        number of steps, and the checks a resumed run must pass before the model loads."""
        cfg, world = self.cfg, self.dist.world_size
        auto = None
        if cfg.deepspeed_source == AUTO_PRESET:
            # Rank 0 decides: ranks on other nodes may see other memory.
            auto = comm.decide_on_main(lambda: plan.choose_auto_preset(cfg, world_size=world))
        state = None
        if self.resume_dir is not None:
            state = checkpoints.read_json(self.resume_dir / checkpoints.STATE)
        self.deepspeed = plan.resolve_deepspeed(
            cfg, world_size=world, model_config=self.model_config,
            device_type=comm.device_type(), bf16_supported=comm.bf16_supported(),
            auto_choice=auto, resume=(self.resume_dir, state) if state is not None else None,
        )  # fmt: skip
        self._plan_steps()
        if state is None:
            return
        checkpoints.check_resume(
            self.resume_dir, state, now={"model": cfg.model.name_or_path, **self.fingerprints},
            global_batch=self.batch_plan.global_batch,
            allow_mismatch=cfg.checkpoint.allow_mismatch, warn=self.dist.is_main,
        )  # fmt: skip
        note = checkpoints.schedule_note(self.resume_dir.name, state, self._schedule())
        self.summary_lines += [f"  schedule        {note}"] if note else []
        if self.deepspeed.universal:
            universal.convert_to_universal(self.resume_dir)

    def _plan_steps(self) -> None:
        train = self.cfg.train
        self.steps_per_epoch, self.total_steps, self.warmup_steps = plan_steps(
            len(self.train_rows), self.batch_plan, max_steps=train.max_steps,
            epochs=train.epochs, warmup_ratio=train.warmup_ratio,
        )  # fmt: skip

    def _schedule(self) -> dict[str, Any]:
        """This run's schedule, as trainer_state.json records it."""
        train = self.cfg.train
        return {
            "total_steps": self.total_steps, "learning_rate": train.learning_rate,
            "lr_scheduler": train.lr_scheduler, "warmup_steps": self.warmup_steps,
        }  # fmt: skip

    def _build_engine(self) -> None:
        """The model (ZeRO-3: partitioned as it loads), its trained parts, the engine."""
        cfg = self.cfg
        # Memory before any weights exist: on CPU the interpreter, libraries and data.
        self.memory_before_model = memory.peak_memory_bytes()
        with model_init_context(self.ds_config):
            model = self.build_model()
        model, lines = prepare_for_training(
            model, name=cfg.model.name_or_path, freeze=cfg.model.freeze,
            adapters=cfg.model.lora.adapters(), reward=self.task == "rm",
            gradient_checkpointing=cfg.speed.gradient_checkpointing,
        )  # fmt: skip
        self.summary_lines += lines
        train = cfg.train
        self.engine = Engine(
            model, self.ds_config,
            adam=dsc.AdamSettings(train.learning_rate, train.adam_betas, train.adam_eps,
                                  train.weight_decay),
            schedule=train.lr_scheduler, total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
        )  # fmt: skip
        # Only where gradients are plain tensors (ZeRO-0, fp32 torch optimizer): see the module.
        if cfg.speed.tied_grads_in_place and self.engine.plain_gradients:
            if tied_embeddings.accumulate_in_place(self.engine.module):
                self.summary_lines.append(
                    "  tied embedding  input embedding and LM head share one matrix: its "
                    "gradient accumulates in place (speed.tied_grads_in_place)"
                )
        self.completion_only_logits = cfg.speed.completion_only_logits and (
            forward.supports_logits_to_keep(self.engine.module)
        )
        self.after_engine()

    def _restore(self) -> None:
        """A resumed run's checkpoint; the weight average (from the checkpoint when it has one)."""
        if self.resume_dir is not None:
            self.step = checkpoints.load(self.resume_dir, engine=self.engine, rank=self.dist.rank)
        self.ema: WeightEMA | None = None
        ema = self.cfg.train.ema
        if ema.enabled:
            self.ema = WeightEMA(
                self.engine, decay=ema.decay, on_device=ema.device == "device",
                is_main=self.dist.is_main,
            )  # fmt: skip
            restored = self.ema.load(self.resume_dir) if self.resume_dir is not None else None
            self.summary_lines.append(f"  ema             {self.ema.describe(restored)}")

    def _start_logging(self) -> None:
        """Metrics sinks, the resolved configs, run.json and the start-up summary (rank 0)."""
        self.logger = None
        if not self.dist.is_main:
            return
        cfg = self.cfg
        self.logger = MetricsLogger(
            self.output_dir, backends=cfg.logging.backends, project=cfg.logging.project,
            run_name=cfg.logging.run_name, config=cfg.to_dict(),
            resume=self.resume_dir is not None,
        )  # fmt: skip
        for name, data in self._configs().items():
            (self.output_dir / name).write_text(atomic.to_json(data))
        outdir.start_run(self.output_dir, self.run_id, task=self.task, step=self.step,
                         resumed_from=self.resume_dir)  # fmt: skip
        self._run_file_written = True
        print(report.startup_summary(self), flush=True)

    def _configs(self) -> dict[str, Any]:
        """The resolved run and DeepSpeed configs, as saved beside every checkpoint and model."""
        return {"run_config.json": self.cfg.to_dict(), "ds_config.json": self.ds_config}

    def collate_with_media(self, rows: list[dict]) -> dict[str, Any]:
        """The trainer's batch, plus decoded media for multimodal models."""
        batch = self.collate(rows)
        if self.media is not None:
            copies = 1 if self.record_kind == "conversation" else 2
            batch = self.media.attach(batch, rows, copies=copies)
        return batch

    # ------------------------------------------------------------------ training

    def _micro_batches_for_step(self, step: int) -> list[dict[str, torch.Tensor]]:
        slices = rank_step_rows(
            step, len(self.train_rows), self.batch_plan, rank=self.dist.rank,
            seed=self.cfg.train.seed, steps_per_epoch=self.steps_per_epoch,
            lengths=self._row_lengths if self.cfg.speed.group_by_length else None,
        )  # fmt: skip
        return [self._to_device(self.collate_with_media(self.step_rows(step, s))) for s in slices]

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        device = self.engine.device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def train(self) -> None:
        """The step loop: `train_step`, then log, evaluate, checkpoint, honour a stop signal."""
        if self.step == 0:
            self._log_eval(self.evaluate(label="before"), "before")
        console = self.dist.is_main and "console" in self.cfg.logging.backends
        progress = Progress(self.total_steps, initial=self.step, enabled=console)
        window = MetricWindow()
        self.engine.train()
        while self.step < self.total_steps:
            window.add(self.train_step())
            if self.step % self.cfg.train.log_every_steps == 0 or self.step == self.total_steps:
                self._log_train(window, progress)
            self._after_step(progress)
        progress.close()
        self.train_seconds = window.elapsed()
        self._log_eval(self.evaluate(label="after"), "after")
        # Every rank's peak (ZeRO stages differ in how evenly memory spreads over ranks).
        self.peak_memory = comm.all_gather_objects(
            (self.memory_before_model, memory.peak_memory_bytes())
        )

    def train_step(self) -> StepResult:
        """One optimizer step over this step's global batch: every micro-batch's loss and
        backward, the update, the weight average. Stops on a non-finite loss (before the
        update) or gradient norm (after it, before any checkpoint)."""
        micro_batches = self._micro_batches_for_step(self.step)
        self.before_step(micro_batches)
        _, (items, tokens) = comm.sum_metrics(
            {}, [], sum(self.count_items(b) for b in micro_batches),
            sum(int(b["attention_mask"].sum()) for b in micro_batches),
        )  # fmt: skip
        batch = self.batch_plan
        normalizer = max(items, 1.0) / (batch.world_size * batch.grad_accum)
        rate = self.engine.learning_rate()  # the rate this step uses (the schedule moves after)
        sums: dict[str, torch.Tensor] = {}
        for index, micro in enumerate(micro_batches):
            loss, metric_sums = self.compute_loss(micro, normalizer=normalizer, training=True)
            self.engine.backward(loss)
            if index < len(micro_batches) - 1:
                self.engine.step()  # not yet the accumulation boundary: no update
            for key, value in metric_sums.items():
                sums[key] = sums.get(key, 0) + value.detach().double().cpu()
        keys = sorted(sums)
        values, _ = comm.sum_metrics(sums, keys)
        # Checked on every rank alike: a non-finite loss never reaches the weights.
        if not all(math.isfinite(v) for v in values):
            self._stop_on_nonfinite(keys, values)
        self.engine.step()
        self.step += 1
        if self.ema is not None:
            self.ema.update()
        grad_norm = self.engine.grad_norm()
        if grad_norm is not None and not math.isfinite(grad_norm):
            self._stop_on_nonfinite(["grad_norm"], [grad_norm])
        return StepResult(dict(zip(keys, values, strict=True)), items, tokens, rate, grad_norm)

    def _log_train(self, window: MetricWindow, progress: Progress) -> None:
        metrics = window.metrics(
            self.finalize_metrics(window.averages()), epoch=self.step / self.steps_per_epoch,
            samples=self.count_unit == "samples",
            # fp16's dynamic loss scaler skips steps whose gradients overflowed.
            skipped_steps=self.engine.skipped_steps() if self.precision == "fp16" else None,
        )  # fmt: skip
        self.history.append({"step": self.step, **metrics})
        if self.logger is not None:
            self.logger.log(self.step, metrics)
        progress.update(self.step, metrics)
        window.reset()

    def _after_step(self, progress: Progress) -> None:
        """Evaluation and a checkpoint when due; a requested stop after a checkpoint."""
        train, every = self.cfg.train, self.cfg.checkpoint.every_steps
        if train.eval_every_steps and self.step % train.eval_every_steps == 0:
            if self.step != self.total_steps:  # the final evaluation follows anyway
                label = f"step {self.step}"
                self._log_eval(self.evaluate(label=label), label, progress)
                self.engine.train()
        saved = bool(every) and self.step % every == 0
        if saved:
            self.save_checkpoint()
        signum = agreed_signal(self.stop_request)
        if signum:
            progress.close()
            path = self.save_checkpoint() if not saved else self._checkpoint_path(self.step)
            raise Preempted(report.preempted(signum, self.step, self.total_steps, path), signum)

    def _stop_on_nonfinite(self, keys: list[str], values: list[float]) -> None:
        """Stop on a non-finite loss (before its update) or gradient norm (after the update,
        before any checkpoint could store it), naming the step and its rows."""
        good = checkpoints.last_complete(self.output_dir / "checkpoints", self.run_id)
        raise UserError(
            report.nonfinite(
                keys, values, step=self.step, rows=len(self.train_rows), batch=self.batch_plan,
                seed=self.cfg.train.seed, steps_per_epoch=self.steps_per_epoch, good=good,
            )
        )  # fmt: skip

    # ------------------------------------------------------------------ evaluation

    def _eval_micro_batches(self) -> Iterator[tuple[dict[str, torch.Tensor], bool]]:
        """This rank's eval micro-batches. Every rank yields the same number (ZeRO-3 forward
        passes are collective); a rank with nothing left runs a dummy batch flagged False."""
        for chunk in shard_chunks(
            len(self.eval_rows), chunk=self.batch_plan.micro_batch,
            rank=self.dist.rank, world=self.dist.world_size,
        ):  # fmt: skip
            rows = [self.eval_rows[i] for i in chunk or [0]]
            yield self._to_device(self.collate_with_media(rows)), chunk is not None

    @torch.no_grad()
    def evaluate(self, *, label: str) -> dict[str, float]:
        """Held-out metrics, averaged over every eval item on every rank, plus the trainer's
        extra evaluation."""
        results: dict[str, float] = {}
        if self.eval_rows:
            self.engine.eval()
            sums: dict[str, torch.Tensor] = {}
            items = 0
            for batch, real in self._eval_micro_batches():
                _, metric_sums = self.compute_loss(batch, normalizer=1.0, training=False)
                if not real:
                    continue
                items += self.count_items(batch)
                for key, value in metric_sums.items():
                    sums[key] = sums.get(key, 0) + value.detach().double().cpu()
            keys = sorted(set(sums) | set(self.metric_keys()))
            values, (total,) = comm.sum_metrics(sums, keys, items)
            averaged = {k: v / max(total, 1.0) for k, v in zip(keys, values, strict=True)}
            results.update({f"eval/{k}": v for k, v in self.finalize_metrics(averaged).items()})
            self.engine.train()
        results.update(self.evaluate_extra(label))
        return results

    def _log_eval(
        self, results: dict[str, float], label: str, progress: Progress | None = None
    ) -> None:
        if not results:
            return
        self.history.append({"step": self.step, "phase": label, **results})
        if self.logger is not None:
            self.logger.log(self.step, {"phase": label, **results})
            text = report.eval_line(results, label)
            (progress.write(text) if progress else print(text, flush=True))

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_path(self, step: int) -> Path:
        return self.output_dir / "checkpoints" / checkpoints.folder_name(step)

    def save_checkpoint(self) -> Path:
        """`checkpoints/step-N`, complete or not at all (see `checkpoints.save`)."""
        state = {
            "run_id": self.run_id, "step": self.step, "epoch": self.step / self.steps_per_epoch,
            **self._schedule(), "global_batch": self.batch_plan.global_batch,
            "world_size": self.dist.world_size, "zero_stage": self.engine.zero_stage,
            "task": self.task, "model": self.cfg.model.name_or_path, **self.fingerprints,
        }  # fmt: skip
        return checkpoints.save(
            self._checkpoint_path(self.step), engine=self.engine, ema=self.ema,
            rank=self.dist.rank, is_main=self.dist.is_main, state=state,
            configs=self._configs(), keep_last=self.cfg.checkpoint.keep_last,
        )  # fmt: skip

    # ------------------------------------------------------------------ export and end

    def save(self) -> Path | None:
        """Export `output_dir/final` (see `checkpoints.save_final`). Collective."""
        if not self.cfg.checkpoint.save_final:
            return None
        state = self.engine.full_state_dict()
        if self.dist.is_main:
            lora_cfg = self.cfg.model.lora
            checkpoints.save_final(
                self.output_dir, self.export_module(), state,
                ema_state=self.ema.state_dict(state) if self.ema is not None else None,
                tokenizer=self.processor or self.tokenizer, configs=self._configs(),
                merge_onto=self.model_path if lora_cfg.enabled and lora_cfg.save_merged else None,
                task=self.task,
            )  # fmt: skip
        comm.barrier()
        return self.output_dir / "final"

    def cleanup(self, status: str = "failed") -> None:
        """Close sinks, print the summary (after a finished run), record the run's `status`
        (complete, stopped, failed) in run.json, release the output_dir lock and leave the
        process group; also called after an error, whatever set-up reached."""
        logger = getattr(self, "logger", None)
        if logger is not None:
            logger.close()
        dist = getattr(self, "dist", None)
        finished = hasattr(self, "train_seconds")
        if dist is not None and dist.is_main:
            if finished:
                print(report.final_summary(self), flush=True)
                atomic.write_text(
                    self.output_dir / "summary.json", atomic.to_json(report.summary_data(self))
                )
            if getattr(self, "_run_file_written", False):
                outdir.finish_run(self.output_dir, status=status, step=self.step)
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()
        comm.teardown_distributed()
