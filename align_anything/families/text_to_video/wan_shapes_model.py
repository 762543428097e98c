"""The project's own tiny text-to-video model, `tiny-t2v-shapes` (shipped, `SHIPPED_DIR`): its
architecture and files.

The earlier UNet-3D layout (`shapes_model.py`) ignored the direction word
(docs/text-to-video.md). This is Wan 2.1's layout (`WanPipeline`) in the same moving-shapes
world, small enough to train and sample on a CPU, built by `scripts/build_builtin_t2v_wan.py`
(the chain of builds that made the shipped folder: its docstring):
- tokenizer: a T5 unigram tokenizer in which each caption word of the built-in moving-shapes
  data (`motion.py`) is one piece (any other word is spelt in letters); 8 tokens per prompt
  (`MAX_TOKENS`: the pipeline is called with `max_sequence_length=8`);
- text encoder: a 2-layer `UMT5EncoderModel`, width 64 (Wan's text encoder is UMT5);
- VAE: a causal 3-D `AutoencoderKLWan` (base width 8, two down blocks): 4x in space and 4x in
  time, keeping the first frame, so a clip of 9 frames of 32x32 <-> 8x3x8x8 latents
  (channels, frames, height, width), each channel normalised by the `latents_mean` /
  `latents_std` measured on the pre-training clips;
- denoiser: a `WanTransformer3DModel` (flow matching) on those latents, 1x2x2 patches (48
  tokens a clip), 4 blocks of 4 heads of 16 (width 64): self attention with 3-D rotary
  positions (frame, row, column), so a token knows its frame, and cross attention from every
  token to each text token, so the direction word reaches each frame through its own keys;
- scheduler: `UniPCMultistepScheduler` in flow-prediction mode, as the released Wan folders
  have it, `flow_shift` `FLOW_SHIFT`.

Clips are `FRAMES` = 9 frames (Wan's VAE takes 4k+1), as the built-in sets' (`motion.FRAMES`).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

from align_anything.families.text_to_video.motion import COLOURS, DIRECTIONS, SHAPES

NAME = "tiny-t2v-shapes"
SHIPPED_DIR = Path(__file__).parent / "builtin" / NAME

FRAMES = 9  # 4k+1: Wan's causal VAE keeps the first frame and compresses the rest 4x

MAX_TOKENS = 8  # a red circle moving left </s>, padded
TEXT_WIDTH = 64
LATENT_CHANNELS = 8
FLOW_SHIFT = 3.0
CHECK_STEPS = 20  # UniPC steps of the held-out check
VOCAB_WORDS: tuple[str, ...] = ("a", "an", "the", "moving", *COLOURS, *SHAPES, *DIRECTIONS)


def build_tokenizer() -> Any:
    """A T5 unigram tokenizer in which each of `VOCAB_WORDS` is one piece (any other word is
    spelt in letters), padding and truncating to `MAX_TOKENS`."""
    from transformers import T5Tokenizer

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(f"▁{word}", -1.0) for word in VOCAB_WORDS]
    known = {piece for piece, _ in pieces}
    pieces += [(f"▁{c}", -2.5) for c in string.ascii_lowercase if f"▁{c}" not in known]
    pieces += [(c, -3.0) for c in string.ascii_lowercase]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=MAX_TOKENS)


def text_encoder_config(vocab_size: int) -> Any:
    from transformers import UMT5Config

    return UMT5Config(
        vocab_size=vocab_size, d_model=TEXT_WIDTH, d_kv=16, d_ff=2 * TEXT_WIDTH, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=MAX_TOKENS,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip


def vae_kwargs() -> dict[str, Any]:
    """The VAE's architecture; `latents_mean` / `latents_std` are placeholders until the build
    measures them."""
    return dict(
        base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 2], num_res_blocks=1,
        temperal_downsample=[True, True], scale_factor_spatial=4, scale_factor_temporal=4,
        latents_mean=[0.0] * LATENT_CHANNELS, latents_std=[1.0] * LATENT_CHANNELS,
    )  # fmt: skip


def transformer_kwargs() -> dict[str, Any]:
    return dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16,
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, text_dim=TEXT_WIDTH,
        freq_dim=64, ffn_dim=128, num_layers=4, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )  # fmt: skip


def build_components(seed: int = 0, *, vae: Any = None) -> dict[str, Any]:
    """The pipeline's parts with random weights (seeded), every module fp32 (the VAE too,
    unless one is given)."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    return {
        "tokenizer": tokenizer,
        "text_encoder": UMT5EncoderModel(text_encoder_config(len(tokenizer))),
        "vae": vae if vae is not None else AutoencoderKLWan(**vae_kwargs()),
        "transformer": WanTransformer3DModel(**transformer_kwargs()),
        "scheduler": UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=FLOW_SHIFT,
            num_train_timesteps=1000,
        ),
    }  # fmt: skip


def pipeline_from(components: dict[str, Any]) -> Any:
    """A `WanPipeline` of `components`, its progress bar off."""
    from diffusers import WanPipeline

    pipeline = WanPipeline(**components)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def save_pipeline(components: dict[str, Any], folder: Path) -> None:
    """Write `components` as a diffusers folder (safetensors)."""
    pipeline_from(components).save_pretrained(folder, safe_serialization=True)


def sample_videos(pipeline: Any, captions: list[str], seeds: list[int],
                  steps: int = CHECK_STEPS, frames: int = FRAMES) -> list[Any]:  # fmt: skip
    """One clip [F, H, W, 3] uint8 per caption, each from its own seeded CPU generator (the
    pipeline's own scheduler, `steps` steps, no classifier-free guidance, 8 text tokens)."""
    import numpy as np
    import torch

    generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
    with torch.no_grad():
        out = pipeline(list(captions), num_frames=frames, height=32, width=32,
                       num_inference_steps=steps, guidance_scale=1.0, generator=generators,
                       max_sequence_length=MAX_TOKENS, output_type="np")  # fmt: skip
    return [np.round(np.clip(v, 0, 1) * 255).astype(np.uint8) for v in out.frames]
