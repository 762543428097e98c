"""Built-in tiny random text-to-video pipelines for the tests, one per video kind.

Built from config with seeded random weights, saved once into the model cache (`families.zoo`,
like the tiny text-to-image pipelines) and from then on loaded like any pipeline folder, so
every process and ZeRO stage starts from the very same numbers. Frames are 32x32 pixels.

- `tiny-random-t2v-unet3d`: ModelScope's layout (`TextToVideoSDPipeline`, the one PKU's
  align-anything trains): a `UNet3DConditionModel` over per-frame latents of a 2-D
  `AutoencoderKL` (two blocks: 4x16x16 latents per frame; cross attention at the 8x8 level
  only, which keeps a forward pass cheap on a CPU), one CLIP text encoder, DDIM, epsilon
  prediction;
- `tiny-random-t2v-unet3d-v`: the same with v-prediction;
- `tiny-random-wan`: Wan 2.1's layout (`WanPipeline`): a `WanTransformer3DModel` (flow
  matching, 3-D rotary positions, 1x2x2 patches) over the latents of the causal 3-D
  `AutoencoderKLWan` (4x in time, 8x in space: 9 frames of 32x32 -> 16x3x4x4, per-channel
  `latents_mean` / `latents_std`), a UMT5 text encoder, and like the released Wan folders a
  `UniPCMultistepScheduler` in flow-prediction mode with `flow_shift` 3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from align_anything.families.diffusion import tiny_text

FRAME_SIZE = 32


def _save(pipe: Any, target: Path) -> None:
    pipe.save_pretrained(target, safe_serialization=True)


def _frame_vae() -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=FRAME_SIZE,
    )  # fmt: skip


def _unet3d() -> Any:
    from diffusers import UNet3DConditionModel

    return UNet3DConditionModel(
        sample_size=FRAME_SIZE // 2, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(16, 32), down_block_types=("DownBlock3D", "CrossAttnDownBlock3D"),
        up_block_types=("CrossAttnUpBlock3D", "UpBlock3D"),
        cross_attention_dim=tiny_text.CLIP_WIDTH, attention_head_dim=4, norm_num_groups=8,
    )  # fmt: skip


def build_tiny_unet3d(target: Path, *, prediction_type: str = "epsilon") -> None:
    """ModelScope text-to-video layout: UNet3D, per-frame 2-D VAE, one CLIP, DDIM."""
    from diffusers import DDIMScheduler, TextToVideoSDPipeline

    torch.manual_seed(10 if prediction_type == "epsilon" else 11)
    scheduler = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type=prediction_type, clip_sample=False, set_alpha_to_one=False,
        steps_offset=1, timestep_spacing="leading",
    )  # fmt: skip
    pipe = TextToVideoSDPipeline(
        vae=_frame_vae(), text_encoder=tiny_text.clip_text_encoder(),
        tokenizer=tiny_text.clip_tokenizer(), unet=_unet3d(), scheduler=scheduler,
    )  # fmt: skip
    _save(pipe, target)


def build_tiny_unet3d_v(target: Path) -> None:
    build_tiny_unet3d(target, prediction_type="v_prediction")


def build_tiny_wan(target: Path) -> None:
    """Wan 2.1 layout: WanTransformer3DModel, causal 3-D VAE, UMT5, UniPC flow sampler."""
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    torch.manual_seed(12)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )  # fmt: skip
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=tiny_text.T5_WIDTH, freq_dim=32, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )  # fmt: skip
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
        num_train_timesteps=1000,
    )  # fmt: skip
    pipe = WanPipeline(
        tokenizer=tiny_text.t5_tokenizer(), text_encoder=tiny_text.t5_text_encoder(umt5=True),
        vae=vae, scheduler=scheduler, transformer=transformer,
    )  # fmt: skip
    _save(pipe, target)
