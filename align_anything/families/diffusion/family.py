"""What every diffusers-pipeline family shares, as one `ModelFamily` (`pipeline_family`): the
set-up and export steps of a pipeline folder, whatever it makes, and the samples and held-out
checks the pipeline tasks draw. What differs between media (an image, a video, a sound) is a
`Medium`, which each family's room provides (`families/text_to_image/media.py`'s `IMAGES`) and
`families/pipelines.py` lists; a folder's kind says its medium (`kinds.MEDIUM`).

Set-up of a pipeline folder (`model_index.json`), step by step as `setup.setup` calls them:

- **model side** (`load_pipeline_side`): the folder's kind, parts and training target from its
  JSON files, its medium; the LoRA targets checked on a meta-device denoiser; the VAE, text
  encoders and tokenizers loaded frozen, whole on every rank's device in the run's precision
  (under ZeRO-3 too: they stay outside the trained engine's partition);
- **data** (`build_data`): the source read and every row checked by the medium before any
  compute, then encoded once into the latent cache (`latents`: VAE latents and text
  embeddings, keyed by the files, the resolution and the encoders' identity): local rank 0 of
  each node builds it while the other ranks wait, a data error stops every rank with one
  message, and every rank memory-maps it;
- **policy** (`build_denoiser`): the denoiser alone (ZeRO-3: built partitioned), with LoRA
  adapters when asked, in its engine;
- **export** (`save_final`): `final/` as a diffusers folder `DiffusionPipeline.from_pretrained`
  loads (a LoRA run: the adapter in the layout `load_lora_weights` reads, with
  `final-merged/` the merged pipeline), `final-ema/` likewise with the weight average.

What the pipeline tasks draw from the denoiser while it trains, the samples and the held-out
check, is `outputs`; a medium's check (`OutputCheck`, its rule) is here with the `Medium`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from align_anything.backend import distributed as comm
from align_anything.backend import ds_config as dsc
from align_anything.backend.engine import Engine
from align_anything.backend.params import count_parameters
from align_anything.config import RunConfig
from align_anything.data import cache
from align_anything.data.formats import split_records
from align_anything.errors import ConfigError, ModelError, UserError
from align_anything.families import diffusion
from align_anything.families.diffusion import memory
from align_anything.families.diffusion.adapters import adapter_summary, has_adapters
from align_anything.families.diffusion.latents import (
    LatentRows,
    MediaRef,
    Prepared,
    ensure_latent_cache,
    latent_cache_folder,
    open_latent_cache,
)
from align_anything.families.diffusion.parts import FrozenParts
from align_anything.families.diffusion.sizes import denoiser_sizes
from align_anything.training import checkpoints, deepspeed_plan, report
from align_anything.training.family import ModelFacts, ModelFamily, training_engine
from align_anything.training.memory_plan import local_devices
from align_anything.training.run import Data, Run, Schedule

# Held-out captions kept for the samples (the data may hold many more).
KEPT_CAPTIONS = 256
ENCODE_BATCH = 32  # media (and captions) per pass through the VAE (text encoders) when caching


@dataclass(frozen=True)
class OutputCheck:
    """A held-out check on generated outputs: `captions` with their `seeds`, and `rule`
    (outputs, captions) -> the share that passes."""

    name: str
    captions: list[str]
    seeds: list[int]
    rule: Callable[[Sequence[np.ndarray], Sequence[str]], float]


@dataclass(frozen=True)
class Medium:
    """What a pipeline family's room says about its medium, for the shared steps here:

    - `name` ("image") and `unit`, the summary's word for several ("images");
    - `read_source(path, kind, columns, max_pixels)`: the data source ("captioned" media,
      preference "pairs", or "prompts" for online RL), every row checked before any compute (a
      `latents.MediaSource`; `max_pixels`: `data.max_image_pixels`);
    - `key_parts(source, resolution, encoder, columns)`: everything its latents depend on;
    - `refs(source)`: per row, its media (one, or chosen and rejected);
    - `prepare(resolution)`: a function that makes one medium ready for the VAE (crop, resize);
    - `sample(parts, prompts, seeds, resolution, steps, guidance_scale, gathered)`: outputs of
      the pipeline class over the run's modules, one numpy array each;
    - `save_samples(rows, path, row_labels, column_labels)`: the samples as files (an image
      grid, ...), returning the still image to log;
    - `check(data_path)`: the held-out check of built-in data (None for other data);
    - `describe(resolution, latent_shape)`: the start-up summary's line on shapes;
    - `encoder(parts)`: the frozen parts' encoding of prepared media into latents
      (`FrozenParts.encode_images`; a clip's: `encode_videos`);
    - `configure(cfg, info)`: the medium bound to the run's own settings of it (a video's
      `data.num_frames` and `data.fps`, checked against the kind), or None when it has none:
      set-up calls it once, so the callables above need no more arguments than an image's.
    """

    name: str
    unit: str
    read_source: Callable[[str, str, dict[str, str], int | None], Any]
    key_parts: Callable[[Any, int, str, dict[str, str]], dict[str, Any]]
    refs: Callable[[Any], list[list[MediaRef]]]
    prepare: Callable[[int], Callable[[MediaRef], Prepared]]
    sample: Callable[..., list[np.ndarray]]
    save_samples: Callable[[list[list[np.ndarray]], Path, list[str], list[str]], Path]
    check: Callable[[Any], OutputCheck | None]
    describe: Callable[[int, tuple[int, ...]], str]
    encoder: Callable[[Any], Callable[[Any], Any]] = lambda parts: parts.encode_images
    configure: Callable[[RunConfig, Any], Medium] | None = None


@dataclass(frozen=True)
class PipelineSide:
    """A pipeline as far as set-up needs it before the denoiser loads: `name` as the user gave
    it, `path` it resolved to, `info` (kind, parts, target, from its JSON files), its `medium`,
    the frozen `parts` (VAE, text encoders, tokenizers, schedulers: whole on this rank's device
    in the run's precision, outside any engine) and the training `resolution`."""

    name: str
    path: str
    info: diffusion.PipelineInfo
    medium: Medium
    parts: FrozenParts
    resolution: int


# ---------------------------------------------------------------------------- the model side


def resolution_of(cfg: RunConfig, info: diffusion.PipelineInfo) -> int:
    """`data.resolution`, or the pipeline's own; a side the denoiser cannot take (its latents
    must halve evenly through the UNet's blocks, or split into the transformer's patches) is a
    `ConfigError` naming the nearest sizes that work."""
    from align_anything.families.diffusion.kinds import UNET_KINDS

    resolution = diffusion.training_resolution(info, cfg.data.resolution, cfg.data.audio_seconds)
    config = info.denoiser_config
    if info.kind in UNET_KINDS:
        step = 2 ** (len(config.get("block_out_channels") or [0]) - 1)
    else:  # SD3 patches, Flux's 2x2 packing, Wan's (frames, height, width) patches
        patch = config.get("patch_size") or 1
        patch = patch[-1] if isinstance(patch, (list, tuple)) else patch
        step = int(patch) * (2 if info.kind == "flux" else 1)
    multiple = info.vae_scale_factor * step
    if info.medium == "audio":
        diffusion.check_audio_length(info, resolution, multiple, cfg.data.audio_seconds)
        return resolution
    if resolution % multiple:
        lower, upper = resolution // multiple * multiple, (resolution // multiple + 1) * multiple
        raise ConfigError(
            f"data.resolution={resolution}: {info.name}'s images must be a multiple of "
            f"{multiple} pixels (the VAE's 1/{info.vae_scale_factor} latents through the "
            f"denoiser's {step}x down-sampling); e.g. data.resolution={lower or upper} or {upper}"
        )
    return resolution


def check_model_settings(cfg: RunConfig, info: diffusion.PipelineInfo) -> None:
    """Settings of the language models that mean nothing to a denoiser are errors, not silently
    ignored; the LoRA targets are checked on the denoiser built on the meta device."""
    model = cfg.model
    problems = []
    if model.freeze:
        problems.append(
            f"model.freeze={model.freeze} names parts of multimodal language models; a diffusion "
            "task trains the denoiser (the VAE and text encoders are always frozen): set "
            "model.freeze=[]"
        )
    if model.attn_implementation != "auto":
        problems.append(
            f"model.attn_implementation={model.attn_implementation} selects a transformers "
            "attention kernel; a diffusers denoiser uses its own attention processors (sdpa): "
            "leave it auto"
        )
    if cfg.speed.gradient_checkpointing:
        import diffusers

        if not getattr(diffusers, info.denoiser_class)._supports_gradient_checkpointing:
            problems.append(
                f"speed.gradient_checkpointing=true: diffusers' {info.denoiser_class} does not "
                "support gradient checkpointing; set speed.gradient_checkpointing=false (and a "
                "smaller train.per_device_batch_size or deepspeed=z3_offload for memory)"
            )
    if info.medium != "video" and (cfg.data.num_frames is not None or cfg.data.fps is not None):
        problems.append(
            f"data.num_frames={cfg.data.num_frames} / data.fps={cfg.data.fps} sample video "
            f"clips; {cfg.model.name_or_path} is a {info.kind} pipeline, which makes "
            f"{'audio' if info.medium == 'audio' else info.medium + 's'}: leave them null"
        )
    if info.medium == "audio" and cfg.data.resolution is not None:
        problems.append(
            f"data.resolution={cfg.data.resolution} sets an image side; {cfg.model.name_or_path} "
            "is an audio pipeline, whose spectrograms follow data.audio_seconds and the "
            "vocoder's mel bins: leave it null"
        )
    if info.medium != "audio" and cfg.data.audio_seconds is not None:
        problems.append(
            f"data.audio_seconds={cfg.data.audio_seconds} sets the length of audio clips; "
            f"{cfg.model.name_or_path} is a {info.kind} pipeline, which makes {info.medium}s: "
            "leave it null"
        )
    if info.medium != "audio" and cfg.data.refuse_silent_audio:
        problems.append(
            f"data.refuse_silent_audio=true checks audio clips; {cfg.model.name_or_path} is a "
            f"{info.kind} pipeline, which makes {info.medium}s: leave it false"
        )
    if problems:
        raise ConfigError("; ".join(problems))
    if model.lora.enabled:
        denoiser_sizes(info, adapters=model.lora.adapters())  # raises for unknown targets


def load_pipeline_side(
    cfg: RunConfig, dist: comm.DistInfo, media: dict[str, Medium]
) -> PipelineSide:
    """The pipeline's parts from its JSON files (a folder that is not a pipeline, or a
    language model, is one `ModelError` naming the fix), its medium, the settings checked, and
    the frozen VAE and text encoders loaded whole on this rank's device."""
    info = diffusion.inspect_pipeline(cfg.model.name_or_path)
    if info.medium not in media:
        raise ModelError(
            f"model.name_or_path={cfg.model.name_or_path!r} is a {info.kind} pipeline, which "
            f"makes {info.medium}s; no pipeline family here trains those (media: "
            f"{', '.join(media)})"
        )
    check_model_settings(cfg, info)
    resolution = resolution_of(cfg, info)
    medium = media[info.medium]
    if medium.configure is not None:
        medium = medium.configure(cfg, info)
    precision = deepspeed_plan.run_precision(
        cfg, device_type=dist.device.type, bf16_supported=comm.bf16_supported()
    )
    parts = diffusion.load_frozen_parts(info, dtype=dsc.torch_dtype(precision), device=dist.device)
    return PipelineSide(cfg.model.name_or_path, str(info.path), info, medium, parts, resolution)


# ---------------------------------------------------------------------------- data


@dataclass(frozen=True)
class _Prepared:
    """What local rank 0 hands every rank after reading and encoding: each split's cache
    folder and summary note, the sources' reports, the data fingerprint."""

    train_folder: Path
    eval_folder: Path | None
    notes: list[str]
    reports: list[Any]
    fingerprint: str


def _read(medium: Medium, path: str, kind: str, columns: dict[str, str], what: str,
          max_pixels: int | None) -> Any:  # fmt: skip
    try:
        return medium.read_source(path, kind, columns, max_pixels)
    except UserError as err:
        raise type(err)(f"{what}={path!r}: {err}") from None


def _prepare_media(
    cfg: RunConfig, model: PipelineSide, kind: str, *, root: Path, rank: int
) -> _Prepared:
    """Read and check each source, then make sure its latent cache entry exists (encoding
    what is missing). Runs on local rank 0 of each node."""
    data, parts, medium = cfg.data, model.parts, model.medium
    encoder = diffusion.encoder_identity(
        model.info, max_sequence_length=parts.max_sequence_length, dtype=parts.vae.dtype
    )
    columns = dict(data.columns)
    sources = [("data.path", data.path)]
    if data.eval_path is not None:
        sources.append(("data.eval_path", data.eval_path))
    folders, notes, reports, keys = [], [], [], []
    for what, path in sources:
        source = _read(medium, str(path), kind, columns, what, data.max_image_pixels)

        def started(media: int, captions: int, path: str = str(path)) -> None:
            print(f"data: rank {rank} encoding {media} {medium.unit} and {captions} captions "
                  f"of {path} through the VAE and text encoders", flush=True)  # fmt: skip

        key = medium.key_parts(source, model.resolution, encoder, columns)
        note = ensure_latent_cache(
            source, key, root=root, resolution=model.resolution, refs=medium.refs(source),
            prepare=medium.prepare(model.resolution), encode_media=medium.encoder(parts),
            encode_prompts=parts.encode_prompts, unit=medium.unit, batch_size=ENCODE_BATCH,
            on_start=started,
        )  # fmt: skip
        folders.append(latent_cache_folder(root, key))
        notes.append(f"{what}: {note}")
        reports.append(source.report)
        keys.append(key)
    held_out_here = data.eval_path is None  # the split of data.path decides the training rows
    split = {"eval_fraction": data.eval_fraction if held_out_here else None,
             "seed": cfg.train.seed if held_out_here else None,
             "max_train": data.max_train_samples}  # fmt: skip
    fingerprint = cache.key_hash({"train": keys[0], "split": split})[:16]
    eval_folder = folders[1] if len(folders) > 1 else None
    return _Prepared(folders[0], eval_folder, notes, reports, fingerprint)


def build_data(
    cfg: RunConfig, dist: comm.DistInfo, model: PipelineSide, spec: Any
) -> tuple[Data, list[str]]:
    """The training and held-out rows of the latent cache (see the module docstring); without
    `data.eval_path`, `data.eval_fraction` of the rows are held out (seeded by `train.seed`).
    Returns the data and its start-up summary lines."""
    root = cache.cache_root(cfg.data.cache_dir)
    prepared = None
    if dist.local_rank == 0:

        def work() -> _Prepared:
            return _prepare_media(cfg, model, spec.record_kind, root=root, rank=dist.rank)

        prepared = comm.fail_together(work, what="data preparation")
    else:
        comm.fail_together(None, what="data preparation")
    # Every node's local rank 0 built the same entries; global rank 0's description is used.
    prepared = comm.broadcast_object(prepared)
    train_entry = open_latent_cache(prepared.train_folder)
    data = cfg.data
    if prepared.eval_folder is not None:
        eval_entry = open_latent_cache(prepared.eval_folder)
        train_ids, eval_ids = list(range(len(train_entry))), list(range(len(eval_entry)))
    else:
        eval_entry = train_entry
        train_ids, eval_ids = split_records(
            list(range(len(train_entry))), eval_fraction=data.eval_fraction, seed=cfg.train.seed
        )
    train_ids = train_ids[: data.max_train_samples]
    eval_ids = eval_ids[: data.max_eval_samples]
    if not train_ids:
        raise UserError(f"no usable training rows in {data.path}")
    train, held_out = LatentRows(train_entry, train_ids), LatentRows(eval_entry, eval_ids)
    fingerprints = checkpoints.fingerprints(
        str(data.path), tokenizer=diffusion.encoder_identity(
            model.info, max_sequence_length=model.parts.max_sequence_length,
            dtype=model.parts.vae.dtype,
        ), data=prepared.fingerprint,
    )  # fmt: skip
    captions = held_out_captions(eval_entry, eval_ids[:KEPT_CAPTIONS])
    unit = spec.record_kind if spec.record_kind in ("pairs", "prompts") else model.medium.unit
    result = Data(
        train=train, eval=held_out, eval_records=captions, reports=prepared.reports,
        fingerprints=fingerprints, lengths=[1] * len(train), train_unit=unit,
    )  # fmt: skip
    info = model.info
    latent_shape = (
        tuple(train_entry.latents.shape[1:]) if train_entry.latents is not None
        else (info.latent_channels, *info.latent_size(model.resolution))  # prompts: sampled
    )  # fmt: skip
    lines = [
        f"  pipeline        {model.info.describe()}",
        f"  resolution      {model.medium.describe(model.resolution, latent_shape)}",
        *(f"  data cache      {note}" for note in prepared.notes),
    ]
    if prepared.eval_folder is None:
        lines.append(
            f"  held out        {len(eval_ids)} of {len(train_entry)} rows of data.path "
            f"(data.eval_fraction={data.eval_fraction})"
        )
    return result, lines


def held_out_captions(entry: Any, ids: Sequence[int]) -> list[str]:
    """The captions of held-out rows `ids` of a latent cache entry, as its source wrote them."""
    return [entry.captions[int(entry.rows[i, 0])] for i in ids]


# ---------------------------------------------------------------------------- the policy


def build_denoiser(
    cfg: RunConfig, model: PipelineSide, ds_plan: deepspeed_plan.DeepSpeedPlan, schedule: Schedule,
    spec: Any,
) -> tuple[Engine, list[str]]:  # fmt: skip
    """The denoiser (ZeRO-3: partitioned as it loads; the frozen parts stay whole), LoRA
    adapters when asked, gradient checkpointing when asked, in its engine."""
    info = model.info
    denoiser = diffusion.load_denoiser(
        info, dtype=dsc.torch_dtype(ds_plan.precision), ds_config=ds_plan.config
    )
    lines = []
    adapters = cfg.model.lora.adapters()
    if adapters:
        # The adapter's A matrices drawn from train.seed alone: loading (partitioned under
        # ZeRO-3 or not) draws differently, and every stage and world size must start alike.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.train.seed)
            diffusion.add_denoiser_adapters(denoiser, kind=info.kind, **adapters)
        lines.append(f"  lora            {adapter_summary(denoiser)}")
    if cfg.speed.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    return training_engine(denoiser, cfg, ds_plan, schedule), lines


# ---------------------------------------------------------------------------- summary, export


def _frozen_parts(model: PipelineSide) -> dict[str, int]:
    parts = model.parts
    modules = {"vae": parts.vae, **parts.text_encoders}
    return {name: sum(p.numel() for p in module.parameters()) for name, module in modules.items()}


def describe_pipeline(run: Run) -> ModelFacts:
    """The start-up summary's model facts: the denoiser's trained and frozen parameters and
    the frozen parts, and the planner's estimate for this run's preset."""
    model: PipelineSide = run.model
    module = run.policy.module
    trainable, frozen = count_parameters(module)
    outside = _frozen_parts(model)
    lora = " (LoRA adapters)" if has_adapters(module) else ""
    shown = [f"{model.info.denoiser_part} {report.count(trainable + frozen)}: "
             f"{report.count(trainable)} trained{lora}"]  # fmt: skip
    shown += [f"{name} {report.count(count)} frozen" for name, count in outside.items()]
    ds_plan, cfg = run.ds_plan, run.cfg
    world = ds_plan.batch.world_size
    figures = memory.denoiser_figures(
        cfg, model.info, precision=ds_plan.precision, resolution=model.resolution
    )
    estimate = memory.estimate_denoiser(
        Path(ds_plan.source).stem, ds_plan.config, cfg, figures, world_size=world,
        precision=ds_plan.precision, gpus_per_node=local_devices(world),
    )  # fmt: skip
    return ModelFacts(
        model_type=f"{model.info.kind} pipeline, {model.info.denoiser_class}",
        trainable=trainable, frozen=frozen + sum(outside.values()),
        parts=", ".join(shown) + " (the frozen parts whole on every rank, outside the engine)",
        attention=None, memory_plan=report.describe_estimate(estimate),
    )  # fmt: skip


def save_final(run: Run) -> None:
    """From the denoiser's gathered weights (collective; rank 0 writes): `final/` (a diffusers
    pipeline folder; a LoRA run's adapter, which `load_lora_weights` reads, and with
    `model.lora.save_merged`, or a kind diffusers loads no adapter into, also
    `final-merged/`) and, with EMA, `final-ema/` the same from
    the average, each with the run's resolved configs."""
    state = run.policy.full_state_dict()
    if not run.dist.is_main:
        return
    assert state is not None
    model: PipelineSide = run.model
    out, configs = run.output.path, run.configs()
    lora = run.cfg.model.lora
    states = {"final": state}
    if run.ema is not None:
        states["final-ema"] = run.ema.state_dict(state)
    for name, weights in states.items():
        if lora.enabled:
            diffusion.save_denoiser_adapter(
                run.policy.module, weights, out / name, kind=model.info.kind,
                denoiser_part=model.info.denoiser_part, configs=configs,
            )  # fmt: skip
        else:
            denoiser = diffusion.denoiser_from_state_dict(model.info, weights)
            diffusion.save_pipeline(model.parts, denoiser, out / name, configs=configs)
    from align_anything.families.diffusion.kinds import NO_LORA_LOADING

    if lora.enabled and (lora.save_merged or model.info.kind in NO_LORA_LOADING):
        # diffusers cannot load an adapter into some kinds' denoisers: give them a whole one
        denoiser = diffusion.denoiser_from_state_dict(model.info, state, adapters=lora.adapters())
        diffusion.save_pipeline(model.parts, denoiser, out / "final-merged", configs=configs)


def pipeline_family(name: str, media: dict[str, Medium]) -> ModelFamily:
    """The `ModelFamily` of diffusers pipelines whose media are `media` (by `Medium.name`):
    the shared steps above, the model side picking each folder's medium."""
    return ModelFamily(
        name=name,
        load_model_side=lambda cfg, dist, spec: load_pipeline_side(cfg, dist, media),
        build_data=build_data,
        bucket_width=lambda model: diffusion.bucket_width(model.info),
        build_policy=build_denoiser, describe=describe_pipeline, save_final=save_final,
        estimate_memory=memory.estimate_memory,
    )  # fmt: skip
