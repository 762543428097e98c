"""The project's own tiny text-to-audio model, `tiny-t2a-tones`: its architecture and files.

AudioLDM's layout (`AudioLDMPipeline`, the one align-anything trains for text-to-audio), small
enough to train and sample on a CPU, for the built-in tones (`tones.py`: one second at 16 kHz):
- tokenizer: RoBERTa's byte-level tokenizer over the 256 byte symbols (no merges: one token per
  character, `families/diffusion/tiny_text.py`), `MAX_TOKENS` tokens per prompt;
- text encoder: CLAP's text tower with its projection (`ClapTextModelWithProjection`), two
  layers of width 32, projected to 16; AudioLDM conditions on its L2-normalised pooled output;
- VAE: a one-channel `AutoencoderKL` of log-mel spectrograms (two blocks: 1/2 of the frames
  and mels, 4 latent channels): 100 frames x 16 mels <-> 4 x 50 x 8;
- denoiser: a `UNet2DConditionModel` on those latents given the caption's embedding as a class
  embedding (`simple_projection`, concatenated with the time embedding; no cross attention to
  text), two blocks (32 and 64 channels), self-attention at the lower one; the shipped one
  with `resnet_time_scale_shift="scale_shift"`;
- scheduler: AudioLDM's DDIM (epsilon, scaled-linear betas 0.0015-0.0195);
- vocoder: a `SpeechT5HifiGan` at 16 kHz reading `MEL_BINS` mels with AudioLDM's hop of 160
  samples (upsampling 8 x 5 x 4).

The shipped weights (`SHIPPED_DIR`, safetensors) are trained by `scripts/build_builtin_t2a.py`
(its docstring: the commands, their times and checks): the UNet on true captions (one in ten
empty, for classifier-free guidance), then the text tower alone on misheard pitch words
(`tones.MISHEARD`), so the base draws the caption's pattern at the wrong pitch, systematically:
held-out check 0.00, the misheard caption 0.77 (guidance 2.5; docs/text-to-audio.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from align_anything.families.text_to_audio.tones import SAMPLING_RATE

NAME = "tiny-t2a-tones"
SHIPPED_DIR = Path(__file__).parent / "builtin" / NAME

MAX_TOKENS = 20  # <s> two high beeps </s>, padded
MEL_BINS = 16
HOP = 160
UPSAMPLE_RATES = (8, 5, 4)
LATENT_FRAMES = 50  # the UNet's sample size: 100 mel frames = 1 s, the default clip
TEXT_WIDTH = 32
PROJECTION = 16


def build_tokenizer() -> Any:
    """RoBERTa's byte-level tokenizer, one token per character (`tiny_text.roberta_tokenizer`),
    padding to `MAX_TOKENS`."""
    from align_anything.families.diffusion.tiny_text import roberta_tokenizer

    tokenizer = roberta_tokenizer()
    tokenizer.model_max_length = MAX_TOKENS
    return tokenizer


def build_text_encoder(vocab_size: int) -> Any:
    from transformers import ClapTextConfig, ClapTextModelWithProjection

    config = ClapTextConfig(
        vocab_size=vocab_size, hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=MAX_TOKENS + 2,
        bos_token_id=0, pad_token_id=1, eos_token_id=2, projection_dim=PROJECTION,
    )  # fmt: skip
    return ClapTextModelWithProjection(config)


def build_vae() -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=1, out_channels=1, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16],
        layers_per_block=1, latent_channels=4, norm_num_groups=8,
    )  # fmt: skip


def build_unet(time_shift: str = "default") -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        resnet_time_scale_shift=time_shift,
        sample_size=LATENT_FRAMES, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=(32, 64),
        attention_head_dim=8, norm_num_groups=8, class_embed_type="simple_projection",
        projection_class_embeddings_input_dim=PROJECTION, class_embeddings_concat=True,
    )  # fmt: skip


def build_scheduler() -> Any:
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        beta_start=0.0015, beta_end=0.0195, beta_schedule="scaled_linear", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1,
    )  # fmt: skip


def build_vocoder() -> Any:
    from transformers import SpeechT5HifiGan, SpeechT5HifiGanConfig

    return SpeechT5HifiGan(SpeechT5HifiGanConfig(
        model_in_dim=MEL_BINS, sampling_rate=SAMPLING_RATE, upsample_initial_channel=64,
        upsample_rates=list(UPSAMPLE_RATES), upsample_kernel_sizes=[16, 10, 8],
        resblock_kernel_sizes=[3, 7], resblock_dilation_sizes=[[1, 3], [1, 3]],
        normalize_before=True,
    ))  # fmt: skip


def build_components(seed: int = 0, time_shift: str = "default") -> dict[str, Any]:
    """The pipeline's parts with random weights (seeded)."""
    import torch

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    return {
        "tokenizer": tokenizer, "text_encoder": build_text_encoder(len(tokenizer)),
        "vae": build_vae(), "unet": build_unet(time_shift), "scheduler": build_scheduler(),
        "vocoder": build_vocoder(),
    }  # fmt: skip


def pipeline_from(components: dict[str, Any]) -> Any:
    from diffusers import AudioLDMPipeline

    return AudioLDMPipeline(**components)


def save_pipeline(components: dict[str, Any], folder: Path) -> None:
    """Write `components` as a diffusers folder (safetensors)."""
    pipeline_from(components).save_pretrained(folder, safe_serialization=True)


def sample_audio(pipeline: Any, captions: list[str], seeds: list[int], steps: int,
                 seconds: float = 1.0, guidance: float = 1.0) -> list[Any]:  # fmt: skip
    """One waveform [samples] float32 per caption, each from its own seeded CPU generator (the
    pipeline's own scheduler, `steps` steps, classifier-free guidance `guidance`: 1, none)."""
    import numpy as np
    import torch

    generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
    with torch.no_grad():
        out = pipeline(list(captions), num_inference_steps=steps, audio_length_in_s=seconds,
                       guidance_scale=guidance, generator=generators, output_type="np")  # fmt: skip
    return [np.asarray(w, dtype=np.float32) for w in out.audios]
