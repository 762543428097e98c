"""Built-in tiny random text-to-image pipelines for the tests, one per kind.

Built from config with seeded random weights, saved once into the model cache
(`models.zoo`, like the `tiny-random-*` language models) and from then on loaded like any
pipeline folder, so every process and ZeRO stage starts from the very same numbers. Images are
32×32 pixels (a VAE with two blocks: 16×16 latents); each denoiser has a few hundred thousand
parameters or fewer, each pipeline builds in about a second.

Tokenizers and text encoders come from `families/diffusion/tiny_text.py`, built offline: a CLIP BPE tokenizer over the 256 byte symbols (each with
and without CLIP's end-of-word mark, no merges: one token per character) and a T5 unigram
tokenizer over letters, digits and a little punctuation. Real tokenizers, tiny vocabularies.

- `tiny-random-sd`: SD 1.x layout, epsilon prediction;
- `tiny-random-sd-v`: the same with v-prediction (SD 2.x 768 style);
- `tiny-random-sdxl`: two CLIP text encoders (the second with projection: pooled embeddings),
  size and crop conditioning (`addition_embed_type="text_time"`);
- `tiny-random-sd3`: SD3 transformer, flow matching, two CLIP + T5 text encoders;
- `tiny-random-flux`: Flux transformer (double and single blocks, guidance embedding), CLIP
  (pooled) + T5, packed latents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from align_anything.families.diffusion import tiny_text
from align_anything.families.diffusion.tiny_text import (
    CLIP_WIDTH,
    T5_WIDTH,
    clip_tokenizer,
    t5_tokenizer,
)

IMAGE_SIZE = 32


def _vae(*, flow: bool) -> Any:
    from diffusers import AutoencoderKL

    # SD3 and Flux VAEs have a shift factor and no quant convolutions.
    flow_kwargs = dict(shift_factor=0.0609, scaling_factor=1.5035, use_quant_conv=False,
                       use_post_quant_conv=False) if flow else {}  # fmt: skip
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=IMAGE_SIZE, **flow_kwargs,
    )  # fmt: skip


def _unet(*, xl: bool) -> Any:
    from diffusers import UNet2DConditionModel

    kwargs: dict[str, Any] = dict(
        sample_size=IMAGE_SIZE // 2, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(16, 32), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=CLIP_WIDTH,
        attention_head_dim=4, norm_num_groups=8,
    )  # fmt: skip
    if xl:  # SDXL: the two encoders' states side by side, pooled + 6 time ids as added embedding
        kwargs.update(
            cross_attention_dim=2 * CLIP_WIDTH, addition_embed_type="text_time",
            addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + CLIP_WIDTH,
            use_linear_projection=True,
        )  # fmt: skip
    return UNet2DConditionModel(**kwargs)


def _ddpm_style_scheduler(prediction_type: str, *, euler: bool = False) -> Any:
    from diffusers import DDIMScheduler, EulerDiscreteScheduler

    common = dict(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type=prediction_type,
        steps_offset=1,
        timestep_spacing="leading",
    )
    if euler:
        return EulerDiscreteScheduler(**common)
    return DDIMScheduler(**common, clip_sample=False, set_alpha_to_one=False)


def _save(pipe: Any, target: Path) -> None:
    pipe.save_pretrained(target, safe_serialization=True)


def build_tiny_sd(target: Path, *, prediction_type: str = "epsilon") -> None:
    """SD 1.x layout (one CLIP text encoder, UNet, VAE, DDIM sampler)."""
    from diffusers import StableDiffusionPipeline

    torch.manual_seed(0 if prediction_type == "epsilon" else 1)
    pipe = StableDiffusionPipeline(
        vae=_vae(flow=False), text_encoder=tiny_text.clip_text_encoder(projection=False), tokenizer=clip_tokenizer(),
        unet=_unet(xl=False), scheduler=_ddpm_style_scheduler(prediction_type),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip
    _save(pipe, target)


def build_tiny_sd_v(target: Path) -> None:
    build_tiny_sd(target, prediction_type="v_prediction")


def build_tiny_sdxl(target: Path) -> None:
    """SDXL layout (CLIP + CLIP with projection, text_time conditioning, Euler sampler)."""
    from diffusers import StableDiffusionXLPipeline

    torch.manual_seed(2)
    pipe = StableDiffusionXLPipeline(
        vae=_vae(flow=False), text_encoder=tiny_text.clip_text_encoder(projection=False),
        text_encoder_2=tiny_text.clip_text_encoder(projection=True), tokenizer=clip_tokenizer(),
        tokenizer_2=clip_tokenizer(), unet=_unet(xl=True),
        scheduler=_ddpm_style_scheduler("epsilon", euler=True),
    )  # fmt: skip
    _save(pipe, target)


def build_tiny_sd3(target: Path) -> None:
    """SD3 layout (MMDiT transformer, flow matching with shift 3, CLIP + CLIP + T5)."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    torch.manual_seed(3)
    transformer = SD3Transformer2DModel(
        sample_size=IMAGE_SIZE // 2, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=T5_WIDTH,
        caption_projection_dim=16, pooled_projection_dim=2 * CLIP_WIDTH, pos_embed_max_size=16,
    )  # fmt: skip
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(flow=True), text_encoder=tiny_text.clip_text_encoder(projection=True), tokenizer=clip_tokenizer(),
        text_encoder_2=tiny_text.clip_text_encoder(projection=True), tokenizer_2=clip_tokenizer(),
        text_encoder_3=tiny_text.t5_text_encoder(), tokenizer_3=t5_tokenizer(),
    )  # fmt: skip
    _save(pipe, target)


def build_tiny_flux(target: Path) -> None:
    """Flux layout (double- and single-stream blocks, guidance embedding, CLIP pooled + T5,
    dynamic shifting by image size)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(4)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=T5_WIDTH, pooled_projection_dim=CLIP_WIDTH,
        guidance_embeds=True, axes_dims_rope=(4, 2, 2),
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )  # fmt: skip
    pipe = FluxPipeline(
        scheduler=scheduler, vae=_vae(flow=True), text_encoder=tiny_text.clip_text_encoder(projection=False),
        tokenizer=clip_tokenizer(), text_encoder_2=tiny_text.t5_text_encoder(), tokenizer_2=t5_tokenizer(),
        transformer=transformer,
    )  # fmt: skip
    _save(pipe, target)
