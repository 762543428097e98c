"""A diffusers pipeline folder: its kind, its parts, and loading them for training.

A folder is a pipeline when it holds `model_index.json` (diffusers' own layout: one subfolder
per part). The kind follows from the denoiser's class and the parts present:

| kind | denoiser | text encoders | target |
| --- | --- | --- | --- |
| `sd` (SD 1.x / 2.x) | `UNet2DConditionModel` | one CLIP | epsilon or v (the scheduler's `prediction_type`) |
| `sdxl` | `UNet2DConditionModel` with `addition_embed_type="text_time"` | two CLIP (pooled from the second) | epsilon or v; size and crop conditioning (`add_time_ids`) |
| `sd3` | `SD3Transformer2DModel` | two CLIP with projection, T5 when the folder has it | flow velocity |
| `flux` | `FluxTransformer2DModel` | CLIP (pooled) + T5 | flow velocity; packed latents, guidance embedding |
| `unet3d` (ModelScope text-to-video) | `UNet3DConditionModel` | one CLIP | epsilon or v; latents [C, F, h, w] of a 2-D VAE, frame by frame |
| `wan` (Wan 2.1) | `WanTransformer3DModel` | UMT5 | flow velocity; latents of a causal 3-D VAE (4x in time), per-channel mean and std |
| `audioldm` (AudioLDM) | `UNet2DConditionModel` given the text as its class embedding | CLAP (projected, L2-normalised) | epsilon or v; latents of a 1-channel VAE over log-mel spectrograms [1, frames, mels]; a HiFi-GAN vocoder |

`inspect_pipeline` reads only JSON files (the start-up checks and the memory planner need no
weights); loading the parts for training is `parts`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align_anything.errors import ConfigError, ModelError, did_you_mean
from align_anything.families.diffusion.kinds import (
    DEFAULT_FRAMES,
    DEFAULT_RESOLUTION,
    EXTRA_PARTS,
    INDEX,
    MEDIUM,
    OPTIONAL_PARTS,
    PIPELINE_CLASSES,
    TEXT_ENCODERS,
)


def _tokenizer_of(encoder_part: str) -> str:
    return encoder_part.replace("text_encoder", "tokenizer")


@dataclass(frozen=True)
class PipelineInfo:
    """What a pipeline folder is, from its JSON files alone (no weights).

    `prediction` is what the denoiser predicts and so the training target: "epsilon",
    "v_prediction" (from the scheduler's `prediction_type`) or "flow" (velocity ε − x₀).
    Latents are `(vae mean − shift_factor) × scaling_factor`; a latent pixel covers
    `vae_scale_factor` image pixels per side. A video VAE that normalises each channel (Wan's)
    has `latents_mean` and `latents_std` instead: latents are `(mean − latents_mean) /
    latents_std`; one that compresses time (Wan's, 4x) has `temporal_scale_factor` > 1."""

    name: str
    path: Path
    kind: str
    denoiser_part: str  # "unet" or "transformer": the subfolder
    denoiser_class: str
    text_encoders: tuple[str, ...]  # the parts present, in the pipeline's order
    prediction: str
    scaling_factor: float
    shift_factor: float
    vae_scale_factor: int
    latent_channels: int
    default_resolution: int
    components: dict[str, Any] = field(repr=False)  # model_index.json's part -> [lib, class]
    denoiser_config: dict[str, Any] = field(repr=False)
    scheduler_config: dict[str, Any] = field(repr=False)
    temporal_scale_factor: int = 1
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    # An audio kind's vocoder: its sampling rate, the waveform samples per mel frame (the
    # product of its upsampling rates: the STFT hop) and the mel bins it reads.
    sampling_rate: int | None = None
    hop_length: int | None = None
    mel_bins: int | None = None

    @property
    def flow(self) -> bool:
        return self.prediction == "flow"

    @property
    def tokenizers(self) -> tuple[str, ...]:
        return tuple(_tokenizer_of(part) for part in self.text_encoders)

    @property
    def pipeline_class(self) -> str:
        return PIPELINE_CLASSES[self.kind]

    @property
    def medium(self) -> str:
        """What the pipeline makes ("image", "video"): which family's room reads its data."""
        return MEDIUM[self.kind]

    def frames(self, num_frames: int | None) -> int | None:
        """The frames of a training clip: `data.num_frames`, or the kind's pipeline default
        (None for an image kind)."""
        if self.medium != "video":
            return None
        return int(num_frames or DEFAULT_FRAMES[self.kind])

    @property
    def extra_parts(self) -> tuple[str, ...]:
        """Parts beyond the denoiser, VAE, scheduler and text side (AudioLDM's vocoder)."""
        return EXTRA_PARTS.get(self.kind, ())

    def latent_size(self, resolution: int) -> tuple[int, int]:
        """The latent (height, width) of one training input at `resolution`: a square image's
        side over the VAE's scale, or for audio (`resolution`: mel frames) the frames and the
        mel bins over it."""
        side = resolution // self.vae_scale_factor
        if self.medium == "audio":
            return side, int(self.mel_bins or 0) // self.vae_scale_factor
        return side, side

    def mel_frames(self, seconds: float) -> int:
        """Mel frames of `seconds` of audio (one per `hop_length` samples)."""
        assert self.sampling_rate and self.hop_length, f"{self.kind} is not an audio kind"
        return round(seconds * self.sampling_rate / self.hop_length)

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of `frames` (a causal 3-D VAE keeps the first frame and
        compresses the rest `temporal_scale_factor` times)."""
        return (frames - 1) // self.temporal_scale_factor + 1

    def part_path(self, part: str) -> Path:
        return self.path / part

    def describe(self) -> str:
        """One line for the start-up summary."""
        side = "spectrogram's frames and mels" if self.medium == "audio" else "image side"
        return (
            f"{self.kind} ({self.denoiser_class}, {self.prediction} target; text encoders: "
            f"{', '.join(self.text_encoders)}; latents {self.latent_channels} channels, "
            f"1/{self.vae_scale_factor} of the {side})"
        )


def training_resolution(
    info: PipelineInfo, resolution: int | None, audio_seconds: float | None
) -> int:
    """The side the data are prepared at: for images and video `data.resolution` (null: the
    pipeline's own), for audio the mel frames of `data.audio_seconds` (null: the pipeline's
    own, its UNet's sample size x the VAE's scale, as `AudioLDMPipeline` defaults)."""
    if info.medium == "audio":
        return info.mel_frames(audio_seconds) if audio_seconds else info.default_resolution
    return resolution or info.default_resolution


def check_audio_length(
    info: PipelineInfo, frames: int, multiple: int, seconds: float | None
) -> None:
    """An audio clip's mel frames (and its mel bins) must halve evenly through the VAE and
    the UNet; a `ConfigError` naming the nearest `data.audio_seconds` that work otherwise."""
    bins = int(info.mel_bins or 0)
    if bins % multiple:
        raise ConfigError(
            f"{info.name}: its vocoder reads {bins} mel bins, which the VAE's 1/"
            f"{info.vae_scale_factor} latents and the UNet's down-sampling cannot split into "
            f"a multiple of {multiple}; this pipeline folder cannot train"
        )
    if frames % multiple == 0 and frames > 0:
        return
    frame_s = info.hop_length / info.sampling_rate  # type: ignore[operator]
    lower, upper = frames // multiple * multiple, (frames // multiple + 1) * multiple
    given = f"data.audio_seconds={seconds:g}" if seconds else "the pipeline's default length"
    raise ConfigError(
        f"{given}: {frames} mel frames (one per {info.hop_length} samples at "
        f"{info.sampling_rate} Hz); {info.name}'s spectrograms take a multiple of {multiple} "
        f"frames (the VAE's 1/{info.vae_scale_factor} latents through the UNet's "
        f"{multiple // info.vae_scale_factor}x down-sampling); e.g. "
        f"data.audio_seconds={(lower or upper) * frame_s:g} or {upper * frame_s:g}"
    )


def is_pipeline_folder(path: str | Path) -> bool:
    """Whether `path` is a local diffusers pipeline folder (it holds model_index.json)."""
    return (Path(path).expanduser() / INDEX).is_file()


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{what}: {path} is missing") from None
    except (OSError, ValueError) as err:
        raise ModelError(f"{what}: {path} cannot be read as JSON ({err})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{what}: {path} holds no JSON object")
    return data


def _not_a_pipeline(name: str, folder: Path) -> ModelError:
    """The error for a local folder without model_index.json, saying what it looks like."""
    config = folder / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError):
            data = {}
        architectures = data.get("architectures") or []
        kind = (
            "a transformers language model" if any("CausalLM" in a for a in architectures)
            else f"a transformers model (model_type {data.get('model_type')!r})"
            if "model_type" in data else "a single diffusers model, not a whole pipeline"
        )  # fmt: skip
        return ModelError(
            f"model.name_or_path={name!r} is {kind}: a diffusion task needs a diffusers "
            f"pipeline folder (with {INDEX} and its parts vae/, unet/ or transformer/, "
            "text_encoder/, tokenizer/, scheduler/), e.g. tiny-random-sd or a folder saved by "
            "DiffusionPipeline.save_pretrained"
        )
    present = sorted(p.name for p in folder.iterdir())[:12] if folder.is_dir() else []
    return ModelError(
        f"model.name_or_path={name!r} is not a diffusers pipeline folder: {folder / INDEX} is "
        f"missing (found: {', '.join(present) or 'nothing'}). A pipeline folder holds "
        f"{INDEX} and one subfolder per part; save one with DiffusionPipeline.save_pretrained"
    )


def resolve_pipeline_path(name_or_path: str) -> Path:
    """The local folder of a built-in name (`tiny-random-sd`, ...), a local folder, or a hub
    name already in the local Hugging Face cache; a `ModelError` naming the fix otherwise."""
    from align_anything.families.zoo import (
        BUILTIN_MODELS,
        SHIPPED_MODELS,
        names_of,
        resolve_model_path,
    )

    if name_or_path in BUILTIN_MODELS or name_or_path in SHIPPED_MODELS:
        folder = Path(resolve_model_path(name_or_path))
        if not is_pipeline_folder(folder):
            raise _not_a_pipeline(name_or_path, folder)
        return folder
    folder = Path(name_or_path).expanduser()
    if folder.exists():
        if not is_pipeline_folder(folder):
            raise _not_a_pipeline(name_or_path, folder)
        return folder
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        names = names_of("text_to_image") + names_of("text_to_video") + names_of("text_to_audio")
        hint = did_you_mean(name_or_path, names)
        raise ModelError(
            f"model.name_or_path={name_or_path!r}: no such folder{hint}; built-in pipelines: "
            f"{', '.join(names)}"
        )
    try:  # a hub name: diffusers' own download (safetensors only), from the cache when offline
        from diffusers import DiffusionPipeline

        return Path(DiffusionPipeline.download(name_or_path, use_safetensors=True))
    except Exception as err:
        raise ModelError(
            f"model.name_or_path={name_or_path!r} is not a local folder and could not be "
            f"fetched as a diffusers pipeline from the hub ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200] if str(err) else ''}); download it first "
            "(huggingface-cli download NAME --local-dir DIR) and give the folder"
        ) from None


def _component(index: dict[str, Any], part: str) -> tuple[str, str] | None:
    entry = index.get(part)
    if isinstance(entry, (list, tuple)) and len(entry) == 2 and all(entry):
        return str(entry[0]), str(entry[1])
    return None


def _kind(name: str, index: dict[str, Any], denoiser_class: str, config: dict) -> str:
    if denoiser_class == "SD3Transformer2DModel":
        return "sd3"
    if denoiser_class == "FluxTransformer2DModel":
        return "flux"
    if denoiser_class == "UNet3DConditionModel":
        return "unet3d"
    if denoiser_class == "WanTransformer3DModel":
        return "wan"
    if denoiser_class == "UNet2DConditionModel" and _component(index, "vocoder") is not None:
        if index.get("_class_name") == "AudioLDMPipeline":
            return "audioldm"
        raise ModelError(
            f"model.name_or_path={name!r} is a {index.get('_class_name')} (a UNet with a "
            "vocoder); of the text-to-audio pipelines only AudioLDMPipeline trains here"
        )
    if denoiser_class == "UNet2DConditionModel":
        if config.get("addition_embed_type") == "text_time":
            if _component(index, "text_encoder") is None:
                raise ModelError(
                    f"model.name_or_path={name!r} is an SDXL refiner (no text_encoder): only "
                    "text-to-image pipelines train here; use the SDXL base pipeline"
                )
            return "sdxl"
        return "sd"
    raise ModelError(
        f"model.name_or_path={name!r}: its denoiser is a {denoiser_class}, which no diffusion "
        "task here trains; supported: UNet2DConditionModel (SD 1.x/2.x, SDXL), "
        "SD3Transformer2DModel (SD3), FluxTransformer2DModel (Flux), UNet3DConditionModel "
        "(ModelScope text-to-video), WanTransformer3DModel (Wan 2.1), UNet2DConditionModel "
        "with a vocoder (AudioLDM)"
    )


def _check_parts(name: str, folder: Path, index: dict[str, Any], parts: Sequence[str]) -> None:
    problems = []
    for part in parts:
        if _component(index, part) is None:
            problems.append(f"{part} (not named in {INDEX})")
        elif not (folder / part).is_dir():
            problems.append(f"{part}/ (named in {INDEX}, but the subfolder is missing)")
    if problems:
        raise ModelError(
            f"model.name_or_path={name!r}: the pipeline folder {folder} lacks "
            f"{'; '.join(problems)}. Copy the whole pipeline folder (every part's subfolder)"
        )


def inspect_pipeline(name_or_path: str) -> PipelineInfo:
    """What the pipeline folder (or built-in name) is, from its JSON files; a `ModelError`
    naming what is missing for a folder that is not a usable text-to-image pipeline."""
    folder = resolve_pipeline_path(name_or_path)
    index = _read_json(folder / INDEX, f"model.name_or_path={name_or_path!r}")
    denoiser_part = next((p for p in ("unet", "transformer") if _component(index, p)), None)
    if denoiser_part is None:
        raise ModelError(
            f"model.name_or_path={name_or_path!r}: {folder / INDEX} names no denoiser (neither "
            "unet nor transformer); it is not a text-to-image pipeline"
        )
    denoiser_class = _component(index, denoiser_part)[1]  # type: ignore[index]
    _check_parts(name_or_path, folder, index, [denoiser_part, "vae", "scheduler"])
    what = f"model.name_or_path={name_or_path!r}"
    config = _read_json(folder / denoiser_part / "config.json", what)
    kind = _kind(name_or_path, index, denoiser_class, config)
    encoders = [p for p in TEXT_ENCODERS[kind] if p not in OPTIONAL_PARTS or _component(index, p)]
    _check_parts(name_or_path, folder, index,
                 [x for p in encoders for x in (p, _tokenizer_of(p))] + list(EXTRA_PARTS.get(kind, ())))  # fmt: skip
    audio: dict[str, Any] = {}
    if kind == "audioldm":  # the vocoder's config says the waveform's rate and mel frames
        vocoder = _read_json(folder / "vocoder" / "config.json", what)
        rates = [int(r) for r in vocoder.get("upsample_rates") or [1]]
        audio = {"sampling_rate": int(vocoder.get("sampling_rate") or 16000),
                 "hop_length": math.prod(rates),
                 "mel_bins": int(vocoder.get("model_in_dim") or 64)}  # fmt: skip
    scheduler = _read_json(folder / "scheduler" / "scheduler_config.json", what)
    vae = _read_json(folder / "vae" / "config.json", what)
    if kind in ("sd3", "flux", "wan"):
        prediction = "flow"
    else:
        prediction = scheduler.get("prediction_type") or "epsilon"
        if prediction not in ("epsilon", "v_prediction"):
            raise ModelError(
                f"{what}: the scheduler's prediction_type is {prediction!r}; the denoising "
                "tasks train epsilon or v_prediction UNets"
            )
    scale = int(
        vae.get("scale_factor_spatial") or 2 ** (len(vae.get("block_out_channels") or [0]) - 1)
    )
    per_channel = vae.get("latents_mean") is not None and vae.get("latents_std") is not None
    sample_size = config.get("sample_size")
    resolution = (
        int(sample_size) * scale if sample_size else DEFAULT_RESOLUTION.get(kind, 128 * scale)
    )
    return PipelineInfo(
        name=name_or_path, path=folder, kind=kind, denoiser_part=denoiser_part,
        denoiser_class=denoiser_class, text_encoders=tuple(encoders), prediction=prediction,
        scaling_factor=float(vae.get("scaling_factor") or 0.18215),
        shift_factor=float(vae.get("shift_factor") or 0.0), vae_scale_factor=scale,
        latent_channels=int(vae.get("latent_channels") or vae.get("z_dim") or 4),
        default_resolution=resolution,
        components=index, denoiser_config=config, scheduler_config=scheduler,
        temporal_scale_factor=int(vae.get("scale_factor_temporal") or 1),
        latents_mean=tuple(vae["latents_mean"]) if per_channel else None,
        latents_std=tuple(vae["latents_std"]) if per_channel else None, **audio,
    )  # fmt: skip
