"""What every trainer shares: set-up order, the step loop, evaluation, checkpoints and export.

A trainer subclass adds only its data encoding and its batch -> loss function
(`encode`, `collate`, `compute_loss`, optionally `evaluate_extra` and `count_items`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import random
import shutil
import signal
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from align_anything import atomic, checkpoints, lora, models, multimodal
from align_anything import engine as eng
from align_anything import output_dir as outdir
from align_anything.config import AUTO_PRESET, RunConfig, load_preset, merge_nested
from align_anything.data import DataReport, load_records, split_records
from align_anything.ema import WeightEMA
from align_anything.errors import (
    CheckpointError,
    CheckpointWriteError,
    ConfigError,
    Preempted,
    UserError,
)
from align_anything.losses import IGNORE_INDEX, completion_logps, selected_token_logps
from align_anything.preemption import StopRequest
from align_anything.tracking import MetricsLogger, Progress, check_backends


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_indices(
    num_rows: int, *, global_batch: int, seed: int, epoch: int, step: int
) -> list[int]:
    """Row indices of one optimizer step's global batch: a seeded permutation per epoch cut
    into consecutive global batches. Depends only on (seed, epoch, step), so the same rows form
    each step whatever the world size or micro-batch split, and resume needs only the step."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(num_rows, generator=generator)
    return order[step * global_batch : (step + 1) * global_batch].tolist()


def row_tokens(row: dict[str, Any]) -> int:
    """Tokens an encoded row puts through the model (every id list it carries: an SFT row's
    `input_ids`, a pair's prompt, chosen and rejected ids)."""
    return sum(len(v) for k, v in row.items() if k.endswith("ids") and isinstance(v, list))


def group_by_length(indices: list[int], lengths: list[int]) -> list[int]:
    """The same rows, longest first (ties keep their order): cut into micro-batches by
    `rank_micro_batches`, each micro-batch then holds rows of similar length, so padding to its
    longest row costs little, and the ranks of one micro-step get neighbouring lengths."""
    return sorted(indices, key=lambda i: -lengths[i])


def rank_micro_batches(
    indices: list[int], *, micro: int, accum: int, world: int, rank: int
) -> list[list[int]]:
    """This rank's micro-batches of a global batch: micro-batch m of rank r takes the slice
    (m·world + r)·micro … +micro."""
    return [
        indices[(m * world + rank) * micro : (m * world + rank + 1) * micro] for m in range(accum)
    ]


def _jsonable(value: Any) -> Any:
    """An RNG state as JSON data (tuples and arrays become lists): a checkpoint's RNG files are
    read back without unpickling anything."""
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _tuples(state: list[Any]) -> tuple[Any, ...]:
    """Python's `random` state back from its JSON form: (version, internal state, gauss)."""
    version, internal, gauss = state
    return version, tuple(internal), gauss


def _hash_array(value: Any) -> str:
    """JSON stand-in for a tensor or array inside an encoded row (media features)."""
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    return hashlib.sha256(array.tobytes()).hexdigest()


def _count(n: int) -> str:
    """A parameter count for people: 135.0M, 1.24B, 41.2K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


def quiet_library_progress_bars() -> None:
    """Our progress display is the only one: transformers' per-load bars and datasets' split
    bars would otherwise print once per rank."""
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()


def shard_chunks(
    num_items: int, *, chunk: int, rank: int, world: int
) -> Iterator[list[int] | None]:
    """This rank's share of `range(num_items)` (every world-th item) in chunks of `chunk`.

    Every rank yields the same number of chunks, because forward passes under ZeRO-3 are
    collective; a rank whose share has run out yields None, and should run a dummy batch and
    discard it.
    """
    mine = list(range(rank, num_items, world))
    per_rank = math.ceil(num_items / world)
    for start in range(0, per_rank, chunk):
        yield mine[start : start + chunk] or None


def supports_logits_to_keep(module: torch.nn.Module) -> bool:
    """Whether a causal LM's forward can project only selected positions onto the vocabulary
    (transformers' `logits_to_keep` with a boolean [B, T] mask). A PEFT model passes the
    argument through to its base model."""
    if lora.is_peft_model(module):
        module = module.get_base_model()
    return "logits_to_keep" in inspect.signature(module.forward).parameters


def completion_forward(
    model: Any, batch: dict[str, torch.Tensor], *, completion_only: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of each sequence's completion tokens and their counts ([B], [B]).

    With `completion_only`, the LM head runs only at positions whose next token is scored:
    prompt logits are never needed, and the vocabulary projection is a large share of a small
    model's FLOPs. The numbers equal the full path (same per-position maths).
    """
    labels = batch["labels"]
    # A multimodal batch may end with a dummy row (see MediaSupport.attach): cut it off here.
    real = batch.get("real_rows", labels.shape[0])
    inputs = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        **multimodal.media_inputs(batch),
    }
    if not completion_only:
        logits = model(**inputs).logits
        sums, counts = completion_logps(logits, labels)
        return sums[:real], counts[:real]
    # Position t is kept when it predicts a scored token t+1.
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    logits = model(**inputs, logits_to_keep=keep).logits
    targets = labels[:, 1:][keep[:, :-1]]
    token_logps = selected_token_logps(logits, targets)
    rows = keep.nonzero()[:, 0]
    sums = torch.zeros(labels.shape[0], dtype=token_logps.dtype, device=token_logps.device)
    return sums.index_add(0, rows, token_logps)[:real], keep.sum(dim=1)[:real]


class Trainer:
    """Lifecycle: `setup()` → `train()` (evaluates before and after) → `save()` → `cleanup()`."""

    task: ClassVar[str]
    # Data format the task consumes: "conversation" or "preference".
    record_kind: ClassVar[str]

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.summary_lines: list[str] = []
        # Set by the entry point while the step loop runs (SIGTERM/SIGINT -> stop after a step).
        self.stop_request: StopRequest | None = None

    # ------------------------------------------------------------------ hooks for subclasses

    def encode(self, records: list[dict], *, split: str) -> tuple[list[dict], DataReport]:
        raise NotImplementedError

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def build_model(self) -> torch.nn.Module:
        if self.media is not None:
            return multimodal.load_multimodal_lm(
                self.model_path,
                dtype=eng.torch_dtype(self.precision),
                trust_remote_code=self.cfg.model.trust_remote_code,
            )
        return models.load_causal_lm(
            self.model_path,
            dtype=eng.torch_dtype(self.precision),
            trust_remote_code=self.cfg.model.trust_remote_code,
        )

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

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Derive logged figures from averaged metrics (e.g. perplexity from loss)."""
        return metrics

    def after_engine(self) -> None:
        """Set-up that needs the engine (e.g. the DPO reference model)."""

    def evaluate_extra(self, label: str) -> dict[str, float]:
        """Extra evaluation (e.g. generation checks), run before and after training."""
        return {}

    # ------------------------------------------------------------------ set-up

    def setup(self) -> None:
        cfg = self.cfg
        check_backends(cfg.logging.backends)
        quiet_library_progress_bars()
        # Distributed first: ranks decide data shards, and ZeRO-3 model construction needs it.
        self.dist = eng.setup_distributed()
        seed_everything(cfg.train.seed)
        # Before any compute: the lock, and whether this run may write here (and from where
        # it resumes). Decided on rank 0 and shared, so every rank stops with the same message.
        self._claim_output_dir()
        self.model_path = models.resolve_model_path(cfg.model.name_or_path)
        self.model_config = models.load_config(
            self.model_path, trust_remote_code=cfg.model.trust_remote_code
        )
        # Image-text / audio-text models: the processor's tokenizer, and media in the batches.
        self.processor: Any = None
        self.media: multimodal.MediaSupport | None = None
        modalities = multimodal.modalities_of(self.model_config)
        if modalities:
            self.processor = multimodal.load_processor(
                self.model_path, trust_remote_code=cfg.model.trust_remote_code
            )
            self.media = multimodal.MediaSupport(self.processor, modalities)
            self.tokenizer = self.processor.tokenizer
        else:
            self.tokenizer = models.load_tokenizer(
                self.model_path, trust_remote_code=cfg.model.trust_remote_code
            )
        # Data before weights: a bad dataset fails in seconds, not after a model load.
        self._build_data()
        # Hashed now, as encoded: trainers may add to the rows later (DPO reference log-probs).
        self._fingerprints()
        if cfg.deepspeed_source == AUTO_PRESET:
            self._choose_preset()
        adam = eng.AdamSettings(
            cfg.train.learning_rate,
            cfg.train.adam_betas,
            cfg.train.adam_eps,
            cfg.train.weight_decay,
        )
        self.ds_config, self.batch_plan, self.precision = eng.resolve_ds_config(
            cfg.deepspeed,
            world_size=self.dist.world_size,
            hidden_size=models.text_hidden_size(self.model_config),
            device=eng.device_type(),
            precision=cfg.train.precision,
            micro_batch=cfg.train.per_device_batch_size,
            grad_accum=cfg.train.gradient_accumulation_steps,
            global_batch=cfg.train.global_batch_size,
            max_grad_norm=cfg.train.max_grad_norm,
            adam=adam,
            explicit=cfg.explicit_keys,
        )
        self._plan_steps()
        self._resume_universal: str | None = None
        if self._resume_dir is not None:
            self._check_resume_compatible(self._resume_dir)  # before the (slow) model load
            self._resume_universal = self._resume_topology_change(self._resume_dir)
            if self._resume_universal:
                eng.convert_to_universal(self._resume_dir)
        # Memory before any weights exist: on CPU the interpreter, libraries and data.
        self.memory_before_model = eng.peak_memory_bytes()
        with eng.model_init_context(self.ds_config):
            model = self.build_model()
        if cfg.train.gradient_checkpointing:
            self._enable_gradient_checkpointing(model)
        # Before the engine: DeepSpeed partitions and builds optimizer state for trainable ones.
        multimodal.freeze_parts(model, cfg.model.freeze, model_name=cfg.model.name_or_path)
        if cfg.model.lora.enabled:
            # After the base is built (and, under ZeRO-3, partitioned): DeepSpeed partitions
            # the new adapter parameters when the engine wraps the model.
            model = lora.add_adapters(
                model,
                r=cfg.model.lora.r,
                alpha=cfg.model.lora.alpha,
                dropout=cfg.model.lora.dropout,
                target_modules=cfg.model.lora.target_modules,
                sequence_classification=self.task == "rm",
            )
            self.summary_lines.append(f"  adapters        {lora.adapter_summary(model)}")
        self.engine = eng.Engine(
            model,
            self.ds_config,
            adam=adam,
            schedule=cfg.train.lr_scheduler,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            load_universal=bool(self._resume_universal),
            tied_grads_in_place=cfg.train.tied_grads_in_place,
        )
        if self.engine.tied_grads_in_place:
            self.summary_lines.append(
                "  tied embedding  input embedding and LM head share one matrix: its gradient "
                "accumulates in place (train.tied_grads_in_place)"
            )
        self.completion_only_logits = cfg.train.completion_only_logits and supports_logits_to_keep(
            self.engine.module
        )
        self.after_engine()
        if self._resume_dir is not None:
            self._load_checkpoint(self._resume_dir)
        self.ema: WeightEMA | None = None
        if cfg.train.ema.enabled:
            self._start_ema()
        self.logger = None
        if self.dist.is_main:
            self.logger = MetricsLogger(
                self.output_dir,
                backends=cfg.logging.backends,
                project=cfg.logging.project,
                run_name=cfg.logging.run_name,
                config=cfg.to_dict(),
                resume=self._resume_dir is not None,
            )
            self._write_resolved_config(self.output_dir)
            outdir.write_run(
                self.output_dir, run_id=self.run_id, task=self.task, status="running",
                step=self.step, started=time.time(),
                resumed_from=str(self._resume_dir) if self._resume_dir else None,
            )  # fmt: skip
            self._run_file_written = True
            self._print_summary()

    def _enable_gradient_checkpointing(self, model: torch.nn.Module) -> None:
        """transformers' activation checkpointing, non-reentrant (works with frozen inputs, so
        with LoRA and frozen parts, and under ZeRO-3)."""
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(
                f"train.gradient_checkpointing=true: {type(model).__name__} "
                f"({self.cfg.model.name_or_path}) does not support gradient checkpointing in "
                "transformers; set train.gradient_checkpointing=false (and lower "
                "train.per_device_batch_size or data.max_length if memory is short)"
            )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.summary_lines.append(
            "  checkpointing   each layer's activations recomputed in the backward pass "
            "(train.gradient_checkpointing)"
        )

    def _choose_preset(self) -> None:
        """deepspeed=auto: the lowest ZeRO stage whose memory estimate fits (plan.py), decided
        on rank 0 (ranks on other nodes may see other memory) and applied on every rank, with
        the command line's `deepspeed.*` overrides on top."""
        from align_anything import plan

        choice = ("", "")
        if self.dist.is_main:
            estimates, budget, _, _ = plan.plan(self.cfg, world_size=self.dist.world_size)
            try:
                estimate, reason = plan.choose(estimates, budget)
                choice = (estimate.preset, reason)
            except ConfigError as err:  # every rank must leave with it, not wait for rank 0
                choice = ("", str(err))
        name, reason = eng.broadcast_object(choice)
        if not name:
            raise ConfigError(reason)
        preset, source = load_preset(name)
        self.cfg.deepspeed = merge_nested(preset, self.cfg.deepspeed)
        self.cfg.deepspeed_source = source
        self.summary_lines.append(f"  deepspeed=auto  {reason}")

    def _start_ema(self) -> None:
        """The weight average starts from the current weights (a resumed run: the
        checkpoint's average, when it has one)."""
        ema_cfg = self.cfg.train.ema
        self.ema = WeightEMA(
            self.engine, decay=ema_cfg.decay, on_device=ema_cfg.device == "device",
            is_main=self.dist.is_main,
        )  # fmt: skip
        where = "on the device" if ema_cfg.device == "device" else "in host memory"
        note = ""
        if self._resume_dir is not None:
            restored = self.ema.load(self._resume_dir)
            note = ", restored from the checkpoint" if restored else (
                ", started from the checkpoint's weights (it holds no average)"
            )  # fmt: skip
        self.summary_lines.append(
            f"  ema             decay {ema_cfg.decay} over {len(self.ema.params)} trained "
            f"tensors, fp32 {where} of rank 0{note}; exported to final-ema"
        )

    def _claim_output_dir(self) -> None:
        """Take `output_dir` for this run (rank 0 decides, every rank learns the outcome): the
        lock, the refusal to replace another run's results, and the checkpoint to resume."""
        self._lock = outdir.Lock(self.output_dir)
        notes: list[str] = []  # what rank 0 did or skipped on the way, printed even on refusal
        decision: tuple[str | None, str, str | None] = (None, "", None)
        if self.dist.is_main:
            try:
                run_id, resume = self._decide_output_dir(notes)
                decision = (None, run_id, str(resume) if resume else None)
            except UserError as err:
                decision = (str(err), "", None)
            for note in notes:
                print(f"note: {note}", flush=True)
        error, self.run_id, resume = eng.broadcast_object(decision)
        if error:
            raise ConfigError(error)
        self._resume_dir = Path(resume) if resume else None

    def _decide_output_dir(self, notes: list[str]) -> tuple[str, Path | None]:
        """(run id, checkpoint to resume or None); appends what it did to `notes`. Rank 0."""
        cfg, out = self.cfg, self.output_dir
        if out.exists() and not out.is_dir():
            raise ConfigError(f"output_dir={str(out)!r} exists and is not a folder")
        try:
            out.mkdir(parents=True, exist_ok=True)
            probe = out / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"output_dir={str(out)!r} is not writable: {err}") from None
        self._lock.acquire()
        notes += [self._lock.note] if self._lock.note else []
        resume = cfg.resume
        if cfg.overwrite_output_dir and resume is not None:
            raise ConfigError(
                f"overwrite_output_dir=true starts over, resume={resume!r} continues: choose one"
            )
        previous = outdir.previous_outputs(out)
        run = outdir.read_run(out) or {}
        root = self._checkpoint_root()
        if resume is None:
            if previous and not cfg.overwrite_output_dir:
                raise outdir.refuse_existing(out)
            if previous:
                removed = outdir.remove_previous(out)
                notes.append(f"overwrite_output_dir=true: removed {', '.join(removed)} from {out}")
            return outdir.new_run_id(), None
        if resume == "auto":
            found, skipped = checkpoints.newest_complete(root, run.get("run_id"))
            notes += [f"resume=auto skipped {s.describe()}" for s in skipped]
            if found is not None:
                return checkpoints.run_id_of(found) or outdir.new_run_id(), found
            if previous:
                why = "; ".join(s.describe() for s in skipped)
                raise outdir.refuse_existing(
                    out, reason=" but no complete checkpoint of it to resume"
                    + (f" (skipped {why})" if why else "")
                )  # fmt: skip
            return outdir.new_run_id(), None
        path = Path(resume)
        problem = checkpoints.verify(path)
        if problem is not None:
            raise CheckpointError(
                f"resume={resume!r} is not a complete align_anything checkpoint: {problem} "
                f"(checkpoints live under {root}/{checkpoints.PREFIX}N; resume=auto picks the "
                "newest complete one)"
            )
        run_id = checkpoints.run_id_of(path) or outdir.new_run_id()
        if previous and run.get("run_id") != run_id:
            raise outdir.refuse_existing(out, reason=f", not the run of {path}")
        return run_id, path

    def _build_data(self) -> None:
        cfg = self.cfg.data
        records, load_report = load_records(cfg.path, format=cfg.format, columns=cfg.columns)
        self._check_kind(records, cfg.path)
        # Before any split, so media problems are reported with the file's row numbers.
        records = self._prepare_media(records, cfg.path)
        if cfg.eval_path:
            eval_records, _ = load_records(cfg.eval_path, format=cfg.format, columns=cfg.columns)
            self._check_kind(eval_records, cfg.eval_path)
            eval_records = self._prepare_media(eval_records, cfg.eval_path)
            train_records = records
        elif cfg.eval_fraction > 0:
            train_records, eval_records = split_records(
                records, eval_fraction=cfg.eval_fraction, seed=self.cfg.train.seed
            )
        else:
            train_records, eval_records = records, []
        if cfg.max_train_samples:
            train_records = train_records[: cfg.max_train_samples]
        if cfg.max_eval_samples:
            eval_records = eval_records[: cfg.max_eval_samples]
        self.eval_records = eval_records
        self.train_rows, train_report = self._encode_checked(train_records, split="train")
        self.eval_rows, eval_report = (
            self._encode_checked(eval_records, split="eval") if eval_records else ([], None)
        )
        for report, split in ((train_report, "train"), (eval_report, "eval")):
            if report is not None:
                report.source = f"{split} split, {report.source}"
        self.data_reports = [r for r in (load_report, train_report, eval_report) if r is not None]
        if not self.train_rows:
            raise UserError(
                f"no usable training rows in {cfg.path}:\n"
                + "\n".join(r.summary() for r in self.data_reports)
            )
        self._row_lengths = [row_tokens(row) for row in self.train_rows]

    def _prepare_media(self, records: list[dict], source: str) -> list[dict]:
        """Check media and write their placeholders into the text (multimodal models); a text
        model given media is an error rather than silently training on the text alone."""
        if self.media is not None:
            return self.media.prepare(records, data_path=source)
        if multimodal.has_media(records):
            raise UserError(
                f"{source} has images or audio, but model {self.cfg.model.name_or_path} is a "
                "text-only model. Use an image-text or audio-text model (e.g. "
                "model.name_or_path=tiny-random-llava), or data without media."
            )
        return records

    def _encode_checked(self, records: list[dict], *, split: str) -> tuple[list[dict], DataReport]:
        rows, report = self.encode(records, split=split)
        if self.media is not None:
            rows = self.media.drop_cut_rows(rows, report)
        return rows, report

    def collate_with_media(self, rows: list[dict]) -> dict[str, Any]:
        """The trainer's batch, plus decoded media for multimodal models."""
        batch = self.collate(rows)
        if self.media is not None:
            copies = 1 if self.record_kind == "conversation" else 2
            batch = self.media.attach(batch, rows, copies=copies)
        return batch

    def _check_kind(self, records: list[dict], source: str) -> None:
        if not records:
            return
        key = "messages" if self.record_kind == "conversation" else "chosen"
        if key not in records[0]:
            found = "preference pairs" if "chosen" in records[0] else "conversations"
            raise UserError(
                f"task={self.task} needs {self.record_kind} data, but {source} holds {found}. "
                f"Choose a {self.record_kind} dataset with data.path=..."
            )

    def _plan_steps(self) -> None:
        plan = self.batch_plan
        n = len(self.train_rows)
        self.steps_per_epoch = n // plan.global_batch
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"the training set has {n} usable rows, fewer than one global batch "
                f"({plan.describe()}): lower train.per_device_batch_size or "
                "train.gradient_accumulation_steps, or add data"
            )
        max_steps = self.cfg.train.max_steps
        self.total_steps = (
            max_steps if max_steps > 0 else self.steps_per_epoch * self.cfg.train.epochs
        )
        self.warmup_steps = math.ceil(self.cfg.train.warmup_ratio * self.total_steps)

    # ------------------------------------------------------------------ summary

    def _print_summary(self) -> None:
        cfg = self.cfg
        trainable, frozen = models.count_parameters(self.engine.module)
        plan = self.batch_plan
        stage = self.engine.zero_stage
        offload = []
        if eng.offloads_optimizer(self.ds_config):
            offload.append("optimizer")
        if eng.offloads_params(self.ds_config):
            offload.append("parameters")
        memory_plan = self._memory_plan()
        parts = []  # per-part sizes, for multimodal models and frozen parts
        if self.media is not None or cfg.model.freeze:
            counts = multimodal.part_counts(self.engine.module)
            parts.append(f"  parts           {multimodal.describe_parts(counts)}")
        lines = [
            f"align_anything {self.task}",
            f"  model           {cfg.model.name_or_path} ({self.model_config.model_type}): "
            f"{_count(trainable)} trainable, {_count(frozen)} frozen parameters",
            f"  world size      {plan.world_size} ({self.dist.backend} on {self.dist.device.type})",
            f"  effective batch {plan.describe()}",
            f"  steps           {self.total_steps} ({self.steps_per_epoch} per epoch, "
            f"{len(self.train_rows)} train rows, {len(self.eval_rows)} eval rows)",
            f"  deepspeed       ZeRO stage {stage}"
            + (f", offload {' + '.join(offload)}" if offload else "")
            + f" ({Path(cfg.deepspeed_source).name})",
            f"  precision       {self.precision}",
            f"  ds config       {json.dumps(self.ds_config, separators=(',', ':'))}",
            f"  memory plan     {memory_plan}; now {eng.memory_summary()}",
            *parts,
            *self.summary_lines,
            *(f"  data            {r.summary()}" for r in self.data_reports),
            *(f"  logging         {note}" for note in self.logger.notes),
            f"  output          {self.output_dir} (metrics.jsonl, run_config.json, ds_config.json)",
        ]
        if self._resume_dir is not None:
            lines.append(f"  resumed         from {self._resume_dir} at step {self.step}")
            if self._resume_universal:
                lines.append(
                    f"                  via a universal checkpoint: {self._resume_universal}"
                )
        print("\n".join(lines), flush=True)

    def _memory_plan(self) -> str:
        """The planner's per-device estimate for this run's resolved preset (the figure
        `python -m align_anything.plan` and `deepspeed=auto` use)."""
        from align_anything import plan

        sizes = plan.sizes_of(self.engine.module, self.model_config)
        world = self.batch_plan.world_size
        estimate = plan.estimate_preset(
            Path(self.cfg.deepspeed_source).stem, self.ds_config, sizes, self.cfg,
            world_size=world, precision=self.precision,
            gpus_per_node=plan.local_devices(world),
        )  # fmt: skip
        gib = plan.GIB
        parts = [f"model states {estimate.model_states / gib:.2f}"]
        if estimate.reference:
            parts.append(f"reference {estimate.reference / gib:.2f}")
        parts.append(f"activations {estimate.activations / gib:.2f}")
        host = f", host {estimate.host / gib:.2f} GiB per node" if estimate.host else ""
        return (
            f"≈ {estimate.total / gib:.2f} GiB per device = {' + '.join(parts)} "
            f"(states {estimate.source}){host}"
        )

    def _write_resolved_config(self, directory: Path) -> None:
        (directory / "run_config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        (directory / "ds_config.json").write_text(json.dumps(self.ds_config, indent=2) + "\n")

    # ------------------------------------------------------------------ training

    def _micro_batches_for_step(self, step: int) -> list[dict[str, torch.Tensor]]:
        plan = self.batch_plan
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        indices = step_indices(
            len(self.train_rows),
            global_batch=plan.global_batch,
            seed=self.cfg.train.seed,
            epoch=epoch,
            step=in_epoch,
        )
        if self.cfg.train.group_by_length and plan.grad_accum > 1:
            # Without accumulation each rank pads only within its one micro-batch already, and
            # sorting would only hand rank 0 all the longest rows.
            indices = group_by_length(indices, self._row_lengths)
        slices = rank_micro_batches(
            indices,
            micro=plan.micro_batch,
            accum=plan.grad_accum,
            world=plan.world_size,
            rank=self.dist.rank,
        )
        return [
            self._to_device(self.collate_with_media([self.train_rows[i] for i in s]))
            for s in slices
        ]

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        device = self.engine.device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def train(self) -> None:
        """The step loop: batches → loss → backward → step → log, evaluate, checkpoint."""
        cfg = self.cfg
        plan = self.batch_plan
        if self.step == 0:
            self._log_eval(self.evaluate(label="before"), "before")
        console = self.dist.is_main and "console" in cfg.logging.backends
        progress = Progress(self.total_steps, initial=self.step, enabled=console)
        self.engine.train()
        window_tokens = 0.0
        window_start = time.perf_counter()
        train_start = window_start
        sums: dict[str, float] = defaultdict(float)
        items_logged = 0.0
        while self.step < self.total_steps:
            micro_batches = self._micro_batches_for_step(self.step)
            counts = torch.tensor(
                [float(sum(self.count_items(b) for b in micro_batches)),
                 float(sum(int(b["attention_mask"].sum()) for b in micro_batches))],
                dtype=torch.float64,
            )  # fmt: skip
            eng.all_reduce_sum(counts)
            global_items, global_tokens = float(counts[0]), float(counts[1])
            normalizer = max(global_items, 1.0) / (plan.world_size * plan.grad_accum)
            step_sums: dict[str, torch.Tensor] = {}
            step_lr = (
                self.engine.learning_rate()
            )  # the rate this step uses (the schedule moves on after it)
            for index, batch in enumerate(micro_batches):
                loss, metric_sums = self.compute_loss(batch, normalizer=normalizer, training=True)
                self.engine.backward(loss)
                if index < len(micro_batches) - 1:
                    self.engine.step()  # not yet the accumulation boundary: no update
                for key, value in metric_sums.items():
                    step_sums[key] = step_sums.get(key, 0) + value.detach().double().cpu()
            keys = sorted(step_sums)
            packed = (
                torch.stack([step_sums[k].reshape(()) for k in keys]) if keys else torch.zeros(0)
            )
            eng.all_reduce_sum(packed)
            # Checked before the optimizer step, on every rank alike: a non-finite loss never
            # reaches the weights, and no checkpoint is written after it.
            if not all(math.isfinite(v) for v in packed.tolist()):
                self._stop_on_nonfinite(keys, packed.tolist())
            self.engine.step()
            self.step += 1
            if self.ema is not None:
                self.ema.update()
            grad_norm = self.engine.grad_norm()
            if grad_norm is not None and not math.isfinite(grad_norm):
                self._stop_on_nonfinite(["grad_norm"], [grad_norm])
            for key, value in zip(keys, packed.tolist(), strict=True):
                sums[key] += value
            items_logged += global_items
            window_tokens += global_tokens

            if self.step % cfg.train.log_every_steps == 0 or self.step == self.total_steps:
                now = time.perf_counter()
                elapsed = max(now - window_start, 1e-9)
                metrics = {k: v / max(items_logged, 1.0) for k, v in sums.items()}
                metrics = self.finalize_metrics(metrics)
                metrics.update(
                    epoch=self.step / self.steps_per_epoch,
                    learning_rate=step_lr,
                    grad_norm=grad_norm,
                    tokens_per_second=window_tokens / elapsed,
                    samples_per_second=items_logged / elapsed
                    if self.count_unit == "samples"
                    else None,
                    elapsed_seconds=now - train_start,
                    # fp16's dynamic loss scaler skips steps whose gradients overflowed.
                    skipped_steps=self.engine.skipped_steps() if self.precision == "fp16" else None,
                )
                metrics = {k: v for k, v in metrics.items() if v is not None}
                self.history.append({"step": self.step, **metrics})
                if self.logger is not None:
                    self.logger.log(self.step, metrics)
                progress.update(self.step, metrics)
                sums.clear()
                items_logged = 0.0
                window_tokens = 0.0
                window_start = time.perf_counter()

            if (
                cfg.train.eval_every_steps
                and self.step % cfg.train.eval_every_steps == 0
                and self.step != self.total_steps
            ):
                self._log_eval(
                    self.evaluate(label=f"step {self.step}"), f"step {self.step}", progress
                )
                self.engine.train()
            saved = bool(cfg.checkpoint.every_steps) and self.step % cfg.checkpoint.every_steps == 0
            if saved:
                self.save_checkpoint()
            signum = self._stop_signal()
            if signum:
                progress.close()
                self._stop_for_signal(signum, already_saved=saved)
        progress.close()
        self.train_seconds = time.perf_counter() - train_start
        self._log_eval(self.evaluate(label="after"), "after")
        # Every rank's peak (ZeRO stages differ in how evenly memory spreads over ranks).
        self.peak_memory = eng.all_gather_objects(
            (self.memory_before_model, eng.peak_memory_bytes())
        )

    count_unit: ClassVar[str] = "samples"

    def _stop_signal(self) -> int:
        """The stop signal any rank received (0: none). Collective, so that every rank stops
        after the same step even when the signal reached them at different moments."""
        signum = self.stop_request.signum if self.stop_request is not None else None
        flag = torch.tensor([float(signum or 0)])
        eng.all_reduce_max(flag)
        return int(flag.item())

    def _stop_for_signal(self, signum: int, *, already_saved: bool) -> None:
        path = self._checkpoint_root() / checkpoints.folder_name(self.step)
        if not already_saved:
            path = self.save_checkpoint()
        raise Preempted(
            f"stopped by {signal.Signals(signum).name} after step {self.step} of "
            f"{self.total_steps}: checkpoint {path} is complete. Run the same command with "
            "resume=auto to continue from it.",
            signum,
        )

    def _stop_on_nonfinite(self, keys: list[str], values: list[float]) -> None:
        """Stop the run on a non-finite loss (before its update) or gradient norm (after the
        update, but before any checkpoint could store it), naming the step and its rows."""
        before_update = keys != ["grad_norm"]
        step = self.step + 1 if before_update else self.step
        bad = ", ".join(
            f"{k}={v}" for k, v in zip(keys, values, strict=True) if not math.isfinite(v)
        )
        epoch, in_epoch = divmod(step - 1, self.steps_per_epoch)
        rows = step_indices(
            len(self.train_rows), global_batch=self.batch_plan.global_batch,
            seed=self.cfg.train.seed, epoch=epoch, step=in_epoch,
        )  # fmt: skip
        shown = ", ".join(map(str, rows[:16])) + (", …" if len(rows) > 16 else "")
        good = self._last_good_checkpoint()
        last = f"the last good checkpoint is {good}" if good else "no checkpoint was written"
        applied = (
            "its update was not applied"
            if before_update
            else "its update was applied in memory only: no checkpoint holds it"
        )
        raise UserError(
            f"non-finite training {'metric' if before_update else 'gradient norm'} at step "
            f"{step} (epoch {epoch}, {bad}); stopping: {applied}, and {last}. The step's global "
            f"batch holds training rows [{shown}] (indices into the encoded train split). Lower "
            "train.learning_rate, or check those rows."
        )

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
            items = torch.zeros((), dtype=torch.float64)
            for batch, real in self._eval_micro_batches():
                _, metric_sums = self.compute_loss(batch, normalizer=1.0, training=False)
                if not real:
                    continue
                items += self.count_items(batch)
                for key, value in metric_sums.items():
                    sums[key] = sums.get(key, 0) + value.detach().double().cpu()
            keys = sorted(set(sums) | set(self._metric_keys()))
            packed = torch.stack(
                [sums.get(k, torch.zeros((), dtype=torch.float64)).reshape(()) for k in keys]
                + [items]
            )
            eng.all_reduce_sum(packed)
            total = max(float(packed[-1]), 1.0)
            averaged = {k: v / total for k, v in zip(keys, packed[:-1].tolist(), strict=True)}
            results.update({f"eval/{k}": v for k, v in self.finalize_metrics(averaged).items()})
            self.engine.train()
        results.update(self.evaluate_extra(label))
        return results

    def _why_no_eval(self) -> str:
        data = self.cfg.data
        if not self.eval_records:
            return (
                "no eval split (data.eval_fraction=0 and no data.eval_path); set "
                "data.eval_fraction or data.eval_path to measure held-out loss"
            )
        report = next((r for r in self.data_reports if r.source.startswith("eval split")), None)
        dropped = f" ({report.summary()})" if report is not None else ""
        return (
            f"every one of the {len(self.eval_records)} eval rows was dropped{dropped}; "
            f"raise data.max_length (now {data.max_length}) or check data.eval_path"
        )

    def _metric_keys(self) -> list[str]:
        """Metric names every rank reports (so ranks pack the same keys)."""
        return ["loss"]

    def _log_eval(
        self, results: dict[str, float], label: str, progress: Progress | None = None
    ) -> None:
        if not results:
            return
        results = {k: v for k, v in results.items()}
        self.history.append({"step": self.step, "phase": label, **results})
        if self.logger is not None:
            self.logger.log(self.step, {"phase": label, **results})
            text = f"eval ({label}): " + ", ".join(
                f"{k.removeprefix('eval/')} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in results.items()
            )
            (progress.write(text) if progress else print(text, flush=True))

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_root(self) -> Path:
        return self.output_dir / "checkpoints"

    def _last_good_checkpoint(self) -> Path | None:
        """This run's newest checkpoint with a manifest (not re-verified: for messages)."""
        ours = [
            p for p in checkpoints.listed(self._checkpoint_root())
            if checkpoints.run_id_of(p) == self.run_id and (p / checkpoints.MANIFEST).is_file()
        ]  # fmt: skip
        return ours[-1] if ours else None

    def save_checkpoint(self) -> Path:
        """Write `checkpoints/step-N` under a temporary name, its manifest last, rename when
        complete, then prune this run's old ones: a crash mid-save never damages the last good
        checkpoint. A failed write (disk full, unwritable folder) stops the run with a
        UserError naming the file; on several ranks the failing rank exits and the launcher
        ends the others."""
        root = self._checkpoint_root()
        final = root / checkpoints.folder_name(self.step)
        tmp = atomic.temporary_sibling(final)
        try:
            self._write_checkpoint(tmp, final)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)  # give back whatever space it took
            good = self._last_good_checkpoint()
            kept = f"the previous checkpoint {good} is intact" if good else "no earlier checkpoint"
            raise CheckpointWriteError(
                f"could not write checkpoint {final.name} (step {self.step}): {err.strerror or err}"
                f"{f' ({err.filename})' if err.filename else ''}; {kept}. Free space or make "
                f"{root} writable, then run again with resume=auto."
            ) from None
        if self.dist.is_main:  # only once the new one is complete
            checkpoints.prune(root, run_id=self.run_id, keep_last=self.cfg.checkpoint.keep_last)
        eng.barrier()
        return final

    def _write_checkpoint(self, tmp: Path, final: Path) -> None:
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        eng.barrier()
        self.engine.save_checkpoint(tmp, client_state={"step": self.step})
        rng = {
            "python": _jsonable(random.getstate()),
            "numpy": _jsonable(np.random.get_state()),
            "torch": torch.get_rng_state().tolist(),
        }
        (tmp / f"rng_state_rank{self.dist.rank}.json").write_text(json.dumps(rng))
        if self.ema is not None:
            self.ema.save(tmp)
        eng.barrier()
        if self.dist.is_main:
            self._write_resolved_config(tmp)
            train = self.cfg.train
            state = {
                "run_id": self.run_id,
                "step": self.step,
                "epoch": self.step / self.steps_per_epoch,
                "total_steps": self.total_steps,
                "learning_rate": train.learning_rate,
                "lr_scheduler": train.lr_scheduler,
                "warmup_steps": self.warmup_steps,
                "global_batch": self.batch_plan.global_batch,
                "world_size": self.dist.world_size,
                "zero_stage": self.engine.zero_stage,
                "task": self.task,
                "model": self.cfg.model.name_or_path,
                **self._fingerprints(),
            }
            (tmp / checkpoints.STATE).write_text(json.dumps(state, indent=2) + "\n")
            checkpoints.write_manifest(tmp, run_id=self.run_id, step=self.step)  # last
            atomic.publish(tmp, final)

    def _fingerprints(self) -> dict[str, str]:
        """Hashes that tell whether a resumed run trains on what the checkpoint saw: the
        tokenizer (vocabulary, special tokens, chat template) and the encoded training rows."""
        if not hasattr(self, "_fingerprint_cache"):
            tokenizer = hashlib.sha256()
            tokenizer.update(json.dumps(sorted(self.tokenizer.get_vocab().items())).encode())
            tokenizer.update(json.dumps(self.tokenizer.special_tokens_map, sort_keys=True).encode())
            tokenizer.update(str(getattr(self.tokenizer, "chat_template", None)).encode())
            data = hashlib.sha256()
            for row in self.train_rows:
                data.update(json.dumps(row, sort_keys=True, default=_hash_array).encode())
            self._fingerprint_cache = {
                "data_path": self.cfg.data.path,
                "tokenizer_fingerprint": tokenizer.hexdigest()[:16],
                "data_fingerprint": data.hexdigest()[:16],
            }
        return self._fingerprint_cache

    def _check_resume_compatible(self, directory: Path) -> None:
        """Refuse a resume that would silently train something else than the checkpoint did."""
        state = checkpoints.read_json(directory / checkpoints.STATE)
        self._report_schedule_changes(directory, state)
        if state.get("global_batch") != self.batch_plan.global_batch:
            raise ConfigError(
                f"checkpoint {directory} was trained with global batch {state.get('global_batch')}, "
                f"this run has {self.batch_plan.global_batch}: the data order would differ"
            )
        now = {"model": self.cfg.model.name_or_path, **self._fingerprints()}
        what = {
            "model": "model.name_or_path",
            "tokenizer_fingerprint": "tokenizer (vocabulary, special tokens or chat template)",
            "data_fingerprint": f"training data (encoded rows of data.path; checkpoint: "
            f"{state.get('data_path')!r}, this run: {now['data_path']!r})",
        }
        changed = [
            f"  - {label}: checkpoint {state[key]!r}, this run {now[key]!r}"
            for key, label in what.items()
            if state.get(key) != now[key]
        ]
        if not changed:
            return
        if self.cfg.checkpoint.allow_mismatch:
            if self.dist.is_main:
                print(f"warning: resuming from {directory} although:\n" + "\n".join(changed))
            return
        raise ConfigError(
            f"resume from {directory} refused: this run differs from the checkpoint's\n"
            + "\n".join(changed)
            + "\nSet checkpoint.allow_mismatch=true to resume anyway, or start fresh "
            "(resume=null, or another output_dir)."
        )

    def _resume_topology_change(self, directory: Path) -> str | None:
        """None when the checkpoint loads as written (same ZeRO stage and world size, or ZeRO-0
        on both sides, whose checkpoint holds whole weights and optimizer state); otherwise a
        description of the change, which resumes through DeepSpeed's universal checkpoint.
        The global batch is the same (checked before), so the data order is too."""
        state = checkpoints.read_json(directory / checkpoints.STATE)
        source_stage, source_world = int(state["zero_stage"]), int(state["world_size"])
        stage, world = eng.zero_stage_of(self.ds_config), self.dist.world_size
        if (source_stage, source_world) == (stage, world) or source_stage == stage == 0:
            return None
        change = f"ZeRO-{source_stage} on {source_world} rank(s) -> ZeRO-{stage} on {world} rank(s)"
        if source_stage == 0:
            raise ConfigError(
                f"cannot resume {directory} ({change}): a ZeRO-0 checkpoint has no ZeRO "
                "optimizer-state files, which the conversion to DeepSpeed's universal checkpoint "
                "needs. Cross-stage resume needs a ZeRO-1/2/3 checkpoint; resume this one with "
                "a ZeRO-0 preset (any world size), or export its weights and start anew."
            )
        if stage == 0:
            raise ConfigError(
                f"cannot resume {directory} ({change}): DeepSpeed loads a universal checkpoint "
                "only into a ZeRO-1/2/3 engine. Resume with deepspeed=z2 or z3 (or a ZeRO-1 preset)."
            )
        return change

    def _report_schedule_changes(self, directory: Path, state: dict[str, Any]) -> None:
        """A resumed run follows this run's schedule (length, peak rate, shape, warmup) from
        the checkpoint's step on; say so where it differs from the checkpoint's."""
        train = self.cfg.train
        now = {
            "total steps (train.max_steps / train.epochs)": self.total_steps,
            "train.learning_rate": train.learning_rate,
            "train.lr_scheduler": train.lr_scheduler,
            "warmup steps (train.warmup_ratio)": self.warmup_steps,
        }
        keys = ("total_steps", "learning_rate", "lr_scheduler", "warmup_steps")
        changed = [
            f"{label} {state.get(key)!r} -> {value!r}"
            for (label, value), key in zip(now.items(), keys, strict=True)
            if state.get(key) != value
        ]
        if changed:
            self.summary_lines.append(
                f"  schedule        changed since {directory.name}: {'; '.join(changed)}. The "
                f"learning-rate schedule is rebuilt for {self.total_steps} steps and continues "
                f"at step {state.get('step')} of it"
            )

    def _load_checkpoint(self, directory: Path) -> None:
        state = checkpoints.read_json(directory / checkpoints.STATE)
        try:
            self.engine.load_checkpoint(directory)
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - DeepSpeed's loader raises anything
            raise CheckpointError(
                f"could not load checkpoint {directory}: {type(err).__name__}: {err}. Resume "
                "from an earlier checkpoint (resume=PATH), or start over."
            ) from None
        self.step = int(state["step"])
        rng_file = directory / f"rng_state_rank{self.dist.rank}.json"
        if rng_file.exists():  # a checkpoint of another world size has fewer or more ranks
            rng = json.loads(rng_file.read_text())
            random.setstate(_tuples(rng["python"]))
            numpy_state = rng["numpy"]
            np.random.set_state(
                (numpy_state[0], np.asarray(numpy_state[1], dtype=np.uint32), *numpy_state[2:])
            )
            torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))

    # ------------------------------------------------------------------ export

    def save(self) -> Path | None:
        """Export `output_dir/final` as a Hugging Face folder (safetensors + tokenizer; a LoRA
        run writes its adapter there, and with `model.lora.save_merged` also `final-merged`)."""
        if not self.cfg.checkpoint.save_final:
            return None
        state = self.engine.full_state_dict()
        final = self.output_dir / "final"
        if self.dist.is_main:
            self._write_final(final, state)
            if self.ema is not None:
                self._write_final(self.output_dir / "final-ema", self.ema.state_dict(state))
            if self.cfg.model.lora.enabled and self.cfg.model.lora.save_merged:
                lora.merge_adapter_folder(
                    final, self.model_path, self.output_dir / "final-merged", task=self.task
                )
        eng.barrier()
        return final

    def _write_final(self, final: Path, state: dict[str, torch.Tensor] | None) -> None:
        """Write a Hugging Face folder from a full state dict (rank 0): the model (or, for a
        LoRA run, the adapter) as safetensors, the tokenizer and the resolved config."""
        module = self.export_module()
        with atomic.folder(final) as tmp:
            if lora.is_peft_model(module):
                lora.save_adapter(module, state, tmp)
            else:
                module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            (self.processor or self.tokenizer).save_pretrained(tmp)
            self._write_resolved_config(tmp)

    def export_module(self) -> Any:
        return self.engine.module

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
                print(self.final_summary(), flush=True)
                atomic.write_text(
                    self.output_dir / "summary.json",
                    json.dumps(self.summary_data(), indent=2) + "\n",
                )
            if getattr(self, "_run_file_written", False):
                final = self.output_dir / "final"
                outdir.write_run(
                    self.output_dir, status=status, step=self.step,
                    final_step=self.step if status == "complete" and final.is_dir() else None,
                )  # fmt: skip
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()
        eng.teardown_distributed()

    def summary_data(self) -> dict[str, Any]:
        evals = {h["phase"]: h for h in self.history if "phase" in h}
        peaks = getattr(self, "peak_memory", [])
        return {
            "run_id": self.run_id,
            "task": self.task,
            "steps": self.step,
            "evaluations": evals,
            "train_seconds": getattr(self, "train_seconds", None),
            "memory_kind": eng.memory_kind(),
            "peak_memory_gib_per_rank": [round(p / 2**30, 4) for _, p in peaks],
            "memory_before_model_gib_per_rank": [round(b / 2**30, 4) for b, _ in peaks],
        }

    def final_summary(self) -> str:
        evals = [h for h in self.history if "phase" in h]
        lines = [
            f"finished {self.task}: {self.step} steps in {getattr(self, 'train_seconds', 0):.0f} s"
        ]
        if not evals:
            lines.append(f"  no held-out metrics: {self._why_no_eval()}")
        peaks = getattr(self, "peak_memory", [])
        if peaks:
            lines.append(
                f"  peak memory per rank ({eng.memory_kind()}): "
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
