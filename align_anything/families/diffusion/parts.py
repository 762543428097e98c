"""A diffusers pipeline's parts for training: the trained denoiser loaded on its own
(`load_denoiser`, `empty_denoiser`; under ZeRO-3 built partitioned, see `backend.zero_init`),
the frozen VAE, text encoders, tokenizers and schedulers outside any engine
(`load_frozen_parts`), saving a trained pipeline (`save_pipeline`), the width DeepSpeed's
buckets follow, and the parts' identity for the latent cache's key (`encoder_identity`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from align_anything.errors import ModelError
from align_anything.families.diffusion.kinds import DEFAULT_T5_LENGTH, T5_TOKENIZER, UNET_KINDS
from align_anything.families.diffusion.pipeline import PipelineInfo, _component, _read_json

# ----------------------------------------------------------------- the denoiser


def _denoiser_cls(info: PipelineInfo) -> type:
    import diffusers

    return getattr(diffusers, info.denoiser_class)


def empty_denoiser(info: PipelineInfo, *, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The denoiser built from its config with fresh weights (under `torch.device("meta")`:
    sizes only, no memory)."""
    from diffusers.utils import logging as diffusers_logging

    model = _denoiser_cls(info).from_config(info.denoiser_config)
    if dtype is None:
        return model
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # "modules that should be kept in float32: []"
    try:
        return model.to(dtype)
    finally:
        diffusers_logging.set_verbosity(verbosity)


def _weight_files(folder: Path) -> list[Path]:
    """The denoiser's safetensors files (one, or the shards an index names)."""
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index, str(folder))["weight_map"].values()))
        return [folder / shard for shard in shards]
    single = folder / "diffusion_pytorch_model.safetensors"
    if single.is_file():
        return [single]
    pickled = sorted(p.name for p in folder.glob("*.bin"))
    raise ModelError(
        f"{folder} has no diffusion_pytorch_model.safetensors"
        + (f" (only {', '.join(pickled)}: pickled weights are not loaded here; convert them "
           "with diffusers: load the pipeline and save_pretrained(safe_serialization=True))"
           if pickled else "")
    )  # fmt: skip


def load_denoiser(
    info: PipelineInfo, *, dtype: torch.dtype, ds_config: dict[str, Any] | None = None
) -> torch.nn.Module:
    """The trained denoiser with the folder's weights, in train mode, every parameter
    trainable. With a ZeRO-3 `ds_config` it is built partitioned (`deepspeed.zero.Init`) and
    the weights are copied into the partitions one layer at a time (diffusers' own loader does
    not know ZeRO-3), in the config's precision (its bf16 / fp16 section, else fp32, which
    should be `dtype`); otherwise diffusers' `from_pretrained` loads it whole in `dtype`
    (safetensors only)."""
    from align_anything.backend import zero_init

    folder = info.part_path(info.denoiser_part)
    files = _weight_files(folder)
    # Imported before zero.Init patches tensor creation: importing diffusers imports
    # torch._dynamo, whose start-up checks fail under the patch.
    cls = _denoiser_cls(info)
    with zero_init.partitioned_construction(ds_config or {}) as partitioned:
        if partitioned:
            model = cls.from_config(info.denoiser_config)
    if partitioned:
        from safetensors import safe_open

        handles = [safe_open(str(f), framework="pt") for f in files]
        where = {key: h for h in handles for key in h.keys()}
        expected = set(model.state_dict())
        if set(where) != expected:
            missing, unexpected = sorted(expected - set(where)), sorted(set(where) - expected)
            raise ModelError(
                f"{folder}: the weights do not match {info.denoiser_class}'s parameters "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]}); re-save the pipeline "
                "with this diffusers version (DiffusionPipeline.save_pretrained)"
            )
        zero_init.load_into_partitions(model, lambda key: where[key].get_tensor(key))
    else:
        try:
            model = cls.from_pretrained(
                info.path, subfolder=info.denoiser_part, torch_dtype=dtype, use_safetensors=True
            )
        except (OSError, ValueError) as err:
            raise ModelError(
                f"cannot load the denoiser of {info.name} ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:200]})"
            ) from None
    model.train()
    model.requires_grad_(True)
    return model


# ----------------------------------------------------------------- the frozen parts


def training_scheduler(info: PipelineInfo) -> Any:
    """The noise scheduler that training draws timesteps from and adds noise with, from the
    folder's scheduler config as diffusers' training scripts make it: `DDPMScheduler` for the
    UNet families (whatever sampler the folder ships; the noise schedule and prediction_type
    carry over), `FlowMatchEulerDiscreteScheduler` for the flow families."""
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

    if not info.flow:
        return DDPMScheduler.from_config(info.scheduler_config)
    config = dict(info.scheduler_config)
    if "shift" not in config and config.get("flow_shift") is not None:
        # Wan's folders ship a UniPC sampler in flow mode, whose shift is `flow_shift`.
        config["shift"] = config["flow_shift"]
    return FlowMatchEulerDiscreteScheduler.from_config(config)


def _load_part(info: PipelineInfo, part: str, dtype: torch.dtype | None) -> Any:
    import importlib

    library, class_name = _component(info.components, part)  # type: ignore[misc]
    if library not in ("diffusers", "transformers"):
        raise ModelError(
            f"{info.name}: part {part} is a {library}.{class_name}; only diffusers and "
            "transformers parts load here (no custom code)"
        )
    cls = getattr(importlib.import_module(library), class_name)
    kwargs: dict[str, Any] = {"subfolder": part}
    if dtype is not None:
        kwargs["use_safetensors"] = True
        kwargs["torch_dtype" if library == "diffusers" else "dtype"] = dtype
    try:
        return cls.from_pretrained(str(info.path), **kwargs)
    except (OSError, ValueError) as err:
        raise ModelError(
            f"cannot load part {part} of {info.name} ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]})"
        ) from None


def _frozen(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    module.to(device)
    module.eval()
    module.requires_grad_(False)
    return module


def _pipeline_class(name: str) -> Any:
    """A diffusers pipeline class, imported without transformers' notes on image processors
    the text-to-image pipelines never use ("CLIPImageProcessor requires torchvision")."""
    import diffusers
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        return getattr(diffusers, name)
    finally:
        transformers_logging.set_verbosity(verbosity)


@dataclass
class FrozenParts:
    """The parts of a pipeline that do not train: VAE, text encoders and tokenizers (in eval
    mode, no gradients, the run's dtype, whole on every rank, outside any engine), the
    folder's sampling scheduler and the training noise scheduler."""

    info: PipelineInfo
    vae: Any
    text_encoders: dict[str, Any]
    tokenizers: dict[str, Any]
    scheduler: Any  # the folder's own (sampling)
    noise_scheduler: Any  # training: see `training_scheduler`
    max_sequence_length: int | None  # T5 tokens of SD3 / Flux prompts
    extra: dict[str, Any] = field(default_factory=dict)  # the kind's other parts (a vocoder)
    _text_pipeline: Any = field(default=None, init=False, repr=False)

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    def pipeline(self, denoiser: torch.nn.Module | None) -> Any:
        """The kind's text-to-image pipeline object over these modules and `denoiser` (None
        for the text side only: a denoiser on the meta device stands in, whose config the
        prompt encoding reads, e.g. SD3 without T5): references, no copies. No progress bar."""

        if denoiser is None:
            with torch.device("meta"):
                denoiser = empty_denoiser(self.info)
        cls = _pipeline_class(self.info.pipeline_class)
        expected, optional = cls._get_signature_keys(cls)
        parts: dict[str, Any] = {
            "vae": self.vae, "scheduler": self.scheduler, self.info.denoiser_part: denoiser,
            **self.text_encoders, **self.tokenizers, **self.extra,
        }  # fmt: skip
        kwargs = {name: parts.get(name) for name in expected}
        if "requires_safety_checker" in optional:
            kwargs["requires_safety_checker"] = False
        from diffusers.utils import logging as diffusers_logging

        verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # TextToVideoSDPipeline: "deprecated" (it works)
        try:
            pipe = cls(**kwargs)
        finally:
            diffusers_logging.set_verbosity(verbosity)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Scaled latents of images in [-1, 1] ([B, 3, H, W]): the VAE posterior's mean,
        `(mean − shift_factor) × scaling_factor`. The mean, not a draw from the posterior:
        the cache then holds one deterministic latent per image, independent of the batch it
        was encoded in (the SD VAEs' posterior std is small beside the noise training adds)."""
        vae = self.vae
        pixels = pixels.to(device=self.device, dtype=vae.dtype)
        mean = vae.encode(pixels).latent_dist.mean
        return (mean - self.info.shift_factor) * self.info.scaling_factor

    @torch.no_grad()
    def encode_videos(self, pixels: torch.Tensor) -> torch.Tensor:
        """Scaled latents [B, C, F', h, w] of clips in [-1, 1] ([B, 3, F, H, W]), as the kind's
        pipeline decodes them: through a 2-D VAE frame by frame (`unet3d`: F' = F, times
        `scaling_factor`), or a 3-D one whole (`wan`: F' = (F − 1) / 4 + 1, each channel
        normalised by the VAE's `latents_mean` and `latents_std`). The posterior mean, as for
        images."""
        vae, info = self.vae, self.info
        pixels = pixels.to(device=self.device, dtype=vae.dtype)
        if info.latents_mean is None:  # a 2-D VAE: the frames as a batch of images
            b, c, f, h, w = pixels.shape
            frames = pixels.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
            latents = self.encode_images(frames)
            return latents.reshape(b, f, *latents.shape[1:]).permute(0, 2, 1, 3, 4)
        mean = vae.encode(pixels).latent_dist.mean
        shape = (1, -1, 1, 1, 1)
        offset = torch.tensor(info.latents_mean, dtype=mean.dtype, device=mean.device)
        scale = torch.tensor(info.latents_std, dtype=mean.dtype, device=mean.device)
        return (mean - offset.view(shape)) / scale.view(shape)

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] from scaled latents (the inverse of `encode_images`)."""
        latents = latents.to(device=self.device, dtype=self.vae.dtype)
        return self.vae.decode(latents / self.info.scaling_factor + self.info.shift_factor).sample

    @torch.no_grad()
    def encode_prompts(self, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """The text conditioning of each caption, through the kind's own pipeline
        `encode_prompt` (so training sees exactly what sampling feeds the denoiser):
        `prompt_embeds` [B, L, D] and, except for SD 1.x/2.x, `pooled_prompt_embeds` [B, P];
        AudioLDM's `prompt_embeds` are one vector per caption, [B, P] (its pipeline's
        `_encode_prompt`: it has no public one), which its UNet takes as a class embedding."""
        if self._text_pipeline is None:  # built once: the meta denoiser takes a moment
            self._text_pipeline = self.pipeline(None)
        pipe = self._text_pipeline
        captions, device = list(captions), self.device
        kind = self.info.kind
        if kind == "audioldm":  # CLAP's projected text embedding, L2-normalised: [B, P]
            return {"prompt_embeds": pipe._encode_prompt(captions, device, 1, False)}
        if kind in ("sd", "unet3d"):
            embeds, _ = pipe.encode_prompt(captions, device, 1, False)
            return {"prompt_embeds": embeds}
        if kind == "wan":
            embeds, _ = pipe.encode_prompt(
                captions, do_classifier_free_guidance=False, device=device,
                max_sequence_length=self.max_sequence_length,
            )  # fmt: skip
            return {"prompt_embeds": embeds}
        if kind == "sdxl":
            embeds, _, pooled, _ = pipe.encode_prompt(
                captions, device=device, do_classifier_free_guidance=False
            )
        elif kind == "sd3":
            embeds, _, pooled, _ = pipe.encode_prompt(
                captions, None, None, device=device, do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length,
            )  # fmt: skip
        else:
            embeds, pooled, _ = pipe.encode_prompt(
                captions, None, device=device, max_sequence_length=self.max_sequence_length
            )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def load_frozen_parts(
    info: PipelineInfo, *, dtype: torch.dtype, device: torch.device | str = "cpu",
    max_sequence_length: int | None = None,
) -> FrozenParts:  # fmt: skip
    """VAE, text encoders and tokenizers (frozen, in `dtype` on `device`) and the schedulers.
    Built whole even inside a ZeRO-3 run (`backend.zero_init.whole_models`): they stay outside
    the trained engine's partition. `max_sequence_length`: T5 tokens per prompt for SD3 / Flux
    (None: the pipeline's default, at most the T5 tokenizer's `model_max_length`)."""
    from diffusers.utils import logging as diffusers_logging

    from align_anything.backend.zero_init import whole_models

    with whole_models():
        vae = _frozen(_load_part(info, "vae", dtype), device)
        encoders = {p: _frozen(_load_part(info, p, dtype), device) for p in info.text_encoders}
        tokenizers = {p: _load_part(info, p, None) for p in info.tokenizers}
        extra = {p: _frozen(_load_part(info, p, dtype), device) for p in info.extra_parts}
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # "steps_offset should be 1" of old SD folders
    try:
        scheduler = _load_part(info, "scheduler", None)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    length = max_sequence_length
    if length is None and info.kind in DEFAULT_T5_LENGTH:
        t5 = tokenizers.get(T5_TOKENIZER[info.kind])
        limit = getattr(t5, "model_max_length", None) or DEFAULT_T5_LENGTH[info.kind]
        length = min(DEFAULT_T5_LENGTH[info.kind], int(limit))
    return FrozenParts(
        info=info, vae=vae, text_encoders=encoders, tokenizers=tokenizers, scheduler=scheduler,
        noise_scheduler=training_scheduler(info), max_sequence_length=length, extra=extra,
    )  # fmt: skip


def denoiser_from_state_dict(
    info: PipelineInfo, state_dict: dict[str, torch.Tensor], *,
    adapters: dict[str, Any] | None = None,
) -> torch.nn.Module:  # fmt: skip
    """A whole denoiser on the CPU with the weights of a full (gathered) state dict of the
    run's denoiser, for export from any ZeRO stage; with `adapters` (the run's LoRA settings:
    r, alpha, dropout, target_modules) the adapter is rebuilt, loaded and merged into the base
    weights, so the result is a plain diffusers model."""
    from align_anything.families.diffusion.adapters import add_denoiser_adapters, merge_adapters

    model = empty_denoiser(info)
    if adapters:
        add_denoiser_adapters(model, kind=info.kind, **adapters)
    model.load_state_dict(state_dict, strict=True)
    return merge_adapters(model).eval()


def save_pipeline(
    parts: FrozenParts, denoiser: torch.nn.Module, out: Path, *,
    configs: dict[str, Any] | None = None,
) -> Path:  # fmt: skip
    """Write a complete diffusers folder (every part, the folder's own sampling scheduler) that
    `DiffusionPipeline.from_pretrained(out)` loads, atomically (`atomic.folder`): `final/`.
    `denoiser` is a whole model without adapters (`denoiser_from_state_dict`); `configs` (file
    name -> JSON data, e.g. the run's resolved configs) are written beside the parts."""
    from align_anything import atomic

    with atomic.folder(Path(out)) as tmp:
        parts.pipeline(denoiser).save_pretrained(tmp, safe_serialization=True)
        for name, data in (configs or {}).items():
            (tmp / name).write_text(atomic.to_json(data))
    return Path(out)


# A UNet's bucket width per channel of its widest block: 3, so that h² = 9c² holds one c -> c
# 3x3 convolution kernel (see `bucket_width`).
UNET_KERNEL_SIDE = 3
# A transformer's bucket width in hidden sizes: (3d)² holds its Linear(d, 6d) modulation weight.
TRANSFORMER_BUCKET_SIDE = 3


def bucket_width(info: PipelineInfo) -> int:
    """The width h that DeepSpeed's "auto" bucket sizes follow (`backend.ds_config`: h², 0.9·h²,
    10·h), as a language model's hidden size does. There h² is one h x h weight of a layer;
    the denoiser's counterpart of that weight gives h:

    - a transformer (SD3, Flux, Wan): 3·d, d its hidden size (heads x head size), so that
      h² = 9d² holds a block's largest weight, the adaptive norm's modulation Linear(d, 6d)
      (the feed-forward's are 4d²). With h = d, 59 of `tiny-t2i-shapes-flow`'s 138 gradients
      overflowed the ZeRO-2 reduce bucket: 119 reductions per step (20 at 3·d);
    - a UNet (SD 1.x/2.x, SDXL): 3·c, c the widest block's channels, so that h² = 9c² is one
      c -> c 3x3 convolution kernel. With h = c nearly every convolution's gradient overflowed
      the ZeRO-2 reduce bucket, which then reduced gradients one at a time: 124 reductions per
      step for `tiny-t2i-shapes` (37 at 3·c), about a tenth of its Diffusion-DPO step at z2 on
      busy CPU cores (benchmarks/README.md, "Diffusion-DPO")."""
    config = info.denoiser_config
    if info.kind in UNET_KINDS:
        return UNET_KERNEL_SIDE * int(max(config.get("block_out_channels") or [320]))
    hidden = int(config.get("num_attention_heads", 1)) * int(config.get("attention_head_dim", 64))
    return TRANSFORMER_BUCKET_SIDE * hidden


# ----------------------------------------------------------------- identity, for the cache key


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    import xxhash

    digest = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _folder_digest(folder: Path) -> list[list[Any]]:
    rows = []
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.name.startswith("."):
            stat = path.stat()
            rows.append([str(path.relative_to(folder)), stat.st_size,
                         _file_digest(str(path), stat.st_size, stat.st_mtime_ns)])  # fmt: skip
    return rows


def encoder_identity(
    info: PipelineInfo, *, max_sequence_length: int | None, dtype: torch.dtype
) -> str:
    """A hash of what turns an image and a caption into cached latents and text embeddings:
    the VAE's and every text encoder's and tokenizer's files (configs and weights, each file's
    size and xxh3-64 digest; remembered per file size and modification time within a process),
    the kind's encoding choices and the dtype they ran in."""
    parts = ["vae", *info.text_encoders, *info.tokenizers]
    content: dict[str, Any] = {p: _folder_digest(info.part_path(p)) for p in parts}
    content["encoding"] = {
        "family": info.kind, "scaling_factor": info.scaling_factor,
        "shift_factor": info.shift_factor, "max_sequence_length": max_sequence_length,
        "dtype": str(dtype), "latent": "posterior mean",
    }  # fmt: skip
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:20]
