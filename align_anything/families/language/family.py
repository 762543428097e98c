"""The language family's set-up and export steps (`LANGUAGE_MODELS`, a
`training.family.ModelFamily`), and what its tasks share about the model:

- **model side** (`load_model_side`): the config, tokenizer or processor (for image-text and
  audio-text models, the processor's tokenizer and media support), the attention kernel
  checked, before any data or weights;
- **data** (`build_data`): the records tokenised through the task's `Encoding` into the
  on-disk Arrow cache (`token_cache`), local rank 0 of each node building while the others
  wait; a second set beside the run's own (PPO's ptx conversations: `build_extra_data`);
- **policy** (`build_policy`): the model (ZeRO-3: partitioned as it loads), its trained parts
  (frozen parts, LoRA, activation checkpointing) and its engine;
- **describe** and **export** (`describe_model`, `save_final`): the start-up summary's model
  facts and memory estimate; `final/` as a transformers folder (a LoRA run: the adapter,
  `final-merged/` on request), `final-ema/`;
- for the tasks: the frozen pre-training model (`fresh_model_loader`), and the speed switches
  that depend on the model (`completion_only_logits`, `shared_prompt_pairs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from align_anything.backend import distributed as comm
from align_anything.backend import ds_config as dsc
from align_anything.backend.engine import Engine
from align_anything.backend.params import count_parameters
from align_anything.backend.zero_init import model_init_context
from align_anything.config import RunConfig
from align_anything.data import cache
from align_anything.errors import UserError
from align_anything.families import zoo
from align_anything.families.language import (
    export,
    forward,
    memory,
    pipeline,
    tied_embeddings,
    token_cache,
)
from align_anything.families.language import loading as model_loading
from align_anything.families.language import parts as model_parts
from align_anything.families.language.encode import Encoding
from align_anything.families.language.multimodal import MediaSupport
from align_anything.families.language.prepare import prepare_for_training
from align_anything.families.language.sizes import sizes_of
from align_anything.training import checkpoints, report
from align_anything.training.deepspeed_plan import DeepSpeedPlan
from align_anything.training.family import ModelFacts, ModelFamily, training_engine
from align_anything.training.memory_plan import local_devices
from align_anything.training.run import Data, Run, Schedule


@dataclass(frozen=True)
class ModelSide:
    """The model as far as set-up needs it before any weights: `name` as the user gave it,
    `path` it resolved to, its config, tokenizer (for image-text / audio-text models the
    processor's), the processor, media support for the data, the checked attention kernel."""

    name: str
    path: str
    config: Any
    tokenizer: Any
    processor: Any | None
    media: MediaSupport | None
    attn_implementation: str | None

    @property
    def saved_tokenizer(self) -> Any:
        """What is saved beside the weights: the processor, else the tokenizer."""
        return self.processor or self.tokenizer


def load_model_side(cfg: RunConfig, dist: comm.DistInfo, spec: Any) -> ModelSide:
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
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    media = (
        MediaSupport(processor, modalities, cfg.data.max_image_pixels, context)
        if modalities
        else None
    )
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
    cfg: RunConfig, dist: comm.DistInfo, model: ModelSide, spec: Any
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
        data=token_cache.data_fingerprint(parts),
    ) | {"encoder_version": token_cache.ENCODER_VERSION}  # fmt: skip
    data = Data(
        train=prepared.train, eval=prepared.eval, eval_records=prepared.eval_records,
        reports=prepared.reports, fingerprints=fingerprints, lengths=prepared.train.lengths(),
    )  # fmt: skip
    lines = [f"  data cache      {prepared.note}"]
    lines += [f"  data mix        {line}" for line in prepared.mixture]
    return data, lines


def prepare_cached(
    cfg: RunConfig, dist: comm.DistInfo, model: ModelSide, pipe: pipeline.Spec
) -> tuple[token_cache.Prepared, dict[str, Any]]:
    """`pipe`'s data through the on-disk Arrow cache: rank 0 hashes the inputs into the key,
    local rank 0 of each node checks or builds the entry while the other ranks wait (a data
    error stops every rank with one message), then every rank memory-maps it. Returns the
    opened entry and its key parts. Collective."""
    root = cache.cache_root(cfg.data.cache_dir)
    # Rank 0 reads and hashes the files once; every rank gets the key (or the error).
    parts = comm.decide_on_main(
        lambda: token_cache.key_parts(pipe, tokenizer=model.tokenizer, media=model.media)
    )
    note = None
    if dist.local_rank == 0:
        num_proc = pipeline.auto_num_proc(cfg.data.num_proc)

        def started(rows: int) -> None:
            # Only a process that tokenises prints this (tests read it: rank 1 never does).
            print(f"data: rank {dist.rank} tokenising {rows} rows (data.num_proc={num_proc})",
                  flush=True)  # fmt: skip

        build = lambda: token_cache.ensure(  # noqa: E731
            pipe, parts, root=root, tokenizer=model.tokenizer, media=model.media,
            model_name=cfg.model.name_or_path, num_proc=num_proc, on_start=started,
        )  # fmt: skip
        note = comm.fail_together(build, what="data preparation")
    else:
        comm.fail_together(None, what="data preparation")
    folder = token_cache.folder_for(root, pipe, parts)
    return token_cache.open_prepared(folder, note=note or ""), parts


def build_extra_data(
    cfg: RunConfig, model: ModelSide, *, task: str, path: str, kind: str, encoding: Encoding,
    key: str,
) -> tuple[token_cache.Prepared, str]:  # fmt: skip
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
    return prepared, token_cache.data_fingerprint(parts)


def build_policy(
    cfg: RunConfig, model: ModelSide, ds_plan: DeepSpeedPlan, schedule: Schedule, spec: Any
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
    from align_anything.families.language.layouts import supports_shared_prompt

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


def describe_model(run: Run) -> ModelFacts:
    """The start-up summary's model facts of a language model: its type and parameter counts,
    the per-part line (multimodal models and frozen parts), the attention kernel, and the
    planner's per-device estimate for this run's resolved preset (the figure `python -m
    align_anything plan` and `deepspeed=auto` use), every engine trained beside the policy
    (PPO's critic) counted."""
    cfg, ds_plan, module = run.cfg, run.ds_plan, run.policy.module
    trainable, frozen = count_parameters(module)
    parts = None
    if run.model.media is not None or cfg.model.freeze:
        parts = model_parts.describe_parts(model_parts.part_counts(module))
    beside = [
        sizes_of(engine.module, engine.module.config)
        for name, engine in run.engines.items() if name != "policy"
    ]  # fmt: skip
    world = ds_plan.batch.world_size
    estimate = memory.estimate_preset(
        Path(ds_plan.source).stem, ds_plan.config, sizes_of(module, run.model.config), cfg,
        world_size=world, precision=ds_plan.precision, gpus_per_node=local_devices(world),
        trained_beside=beside,
    )  # fmt: skip
    return ModelFacts(
        model_type=run.model.config.model_type, trainable=trainable, frozen=frozen, parts=parts,
        attention=f"{module.config._attn_implementation} "
        f"(model.attn_implementation={cfg.model.attn_implementation})",
        memory_plan=report.describe_estimate(estimate),
    )  # fmt: skip


def save_final(run: Run) -> None:
    """The run's exported folders, from gathered weights (collective; rank 0 writes): each
    engine beside the policy whose model says how (`exported`: PPO's critic, the reward-model
    folder it wraps) as `final-<name>/`, then `final/` (the model, or a LoRA run's adapter),
    `final-ema/` with EMA and `final-merged/` with `model.lora.save_merged`."""
    for name, engine in run.engines.items():
        exported = getattr(engine.module, "exported", None)
        if name == "policy" or exported is None:
            continue
        module, beside = exported(engine.full_state_dict())
        if run.dist.is_main:
            export.write_final(
                run.output.path / f"final-{name}", module, beside,
                tokenizer=run.model.saved_tokenizer, configs=run.configs(),
            )  # fmt: skip
    state = run.policy.full_state_dict()
    if not run.dist.is_main:
        return
    cfg, lora = run.cfg, run.cfg.model.lora
    export.save_final(
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
    estimate_memory=memory.estimate_memory,
)  # fmt: skip
