"""The built-in tiny random text-to-audio pipeline of the tests, built from config.

Built with seeded random weights, saved once into the model cache (`families.zoo`, like the
tiny text-to-image and text-to-video pipelines) and from then on loaded like any pipeline
folder, so every process and ZeRO stage starts from the very same numbers.

- `tiny-random-audioldm`: AudioLDM's layout (`AudioLDMPipeline`, what PKU's align-anything
  trains for text-to-audio): a `UNet2DConditionModel` given the caption's CLAP embedding as a
  class embedding (`class_embed_type="simple_projection"`, concatenated with the time
  embedding; no cross attention to text), over the latents of a one-channel `AutoencoderKL`
  of log-mel spectrograms (two blocks: 1/2 of the frames and mels), a one-layer CLAP text
  encoder with a byte-level RoBERTa tokenizer, AudioLDM's DDIM schedule (epsilon), and a
  `SpeechT5HifiGan` vocoder at 16 kHz with AudioLDM's hop of 160 samples (upsampling
  8 x 5 x 4) reading 16 mel bins. Its default clip is the UNet's sample size (32) x the VAE's
  scale (2) = 64 mel frames = 0.64 s.
"""

from __future__ import annotations

from pathlib import Path

import torch

from align_anything.families.diffusion import tiny_text

SAMPLING_RATE = 16000
MEL_BINS = 16
UPSAMPLE_RATES = (8, 5, 4)  # the hop: 160 samples per mel frame, as AudioLDM's


def build_tiny_audioldm(target: Path) -> None:
    """AudioLDM layout: UNet with CLAP class embeddings, 1-channel VAE, HiFi-GAN, DDIM."""
    from diffusers import AudioLDMPipeline, AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import SpeechT5HifiGan, SpeechT5HifiGanConfig

    torch.manual_seed(13)
    vae = AutoencoderKL(
        in_channels=1, out_channels=1, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1,
        latent_channels=4, norm_num_groups=4,
    )  # fmt: skip
    unet = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(16, 32), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=(16, 32),
        attention_head_dim=4, norm_num_groups=8, class_embed_type="simple_projection",
        projection_class_embeddings_input_dim=tiny_text.CLAP_PROJECTION,
        class_embeddings_concat=True,
    )  # fmt: skip
    scheduler = DDIMScheduler(
        beta_start=0.0015, beta_end=0.0195, beta_schedule="scaled_linear", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1,
    )  # fmt: skip
    vocoder = SpeechT5HifiGan(SpeechT5HifiGanConfig(
        model_in_dim=MEL_BINS, sampling_rate=SAMPLING_RATE, upsample_initial_channel=16,
        upsample_rates=list(UPSAMPLE_RATES), upsample_kernel_sizes=[16, 10, 8],
        resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]], normalize_before=False,
    ))  # fmt: skip
    pipe = AudioLDMPipeline(
        vae=vae, text_encoder=tiny_text.clap_text_encoder(),
        tokenizer=tiny_text.roberta_tokenizer(), unet=unet, scheduler=scheduler, vocoder=vocoder,
    )  # fmt: skip
    pipe.save_pretrained(target, safe_serialization=True)
