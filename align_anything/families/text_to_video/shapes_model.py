"""The earlier UNet-3D layout of the project's tiny text-to-video model (no longer shipped:
`tiny-t2v-shapes` is now `wan_shapes_model.py`'s): its architecture and files.

ModelScope's text-to-video layout (`TextToVideoSDPipeline`, the one align-anything trains),
small enough to train and sample on a CPU:
- tokenizer: a CLIP BPE tokenizer whose vocabulary is the letters plus every caption word of
  the built-in moving-shapes data (`motion.py`) as one token each; 8 tokens per prompt;
- text encoder: a 2-layer `CLIPTextModel`, width 64;
- VAE: `tiny-t2i-shapes`' trained `AutoencoderKL` (three blocks, 4 latent channels: each
  32x32 frame <-> 4x8x8), reused as it is: the frames are the same kind of picture, and the
  UNet-3D layout encodes and decodes frame by frame;
- denoiser: a `UNet3DConditionModel` on 4x8x8x8 latents (channels, frames, height, width), two
  blocks (32 and 48 channels), spatial cross attention to the text at 4x4, temporal
  convolutions and temporal attention at every level;
- scheduler: DDIM, epsilon prediction, SD's scaled-linear betas, trailing timesteps.

The weights once shipped were trained by `scripts/build_builtin_t2v.py`
(its docstring: the command, its time and its check). They are deliberately good at shapes,
colours and motion and poor at direction (pre-trained on captions whose direction word is
usually the opposite of the clip's), so that an alignment run has something to fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from align_anything.families.diffusion.tiny_text import word_tokenizer_files
from align_anything.families.text_to_video.motion import COLOURS, DIRECTIONS, FRAMES, SHAPES

NAME = "tiny-t2v-shapes"
SHIPPED_DIR = Path(__file__).parent / "builtin" / NAME

MAX_TOKENS = 8  # <start> a red circle moving left <end>
TEXT_WIDTH = 64
LATENT_CHANNELS = 4
LATENT_SIZE = 8
VOCAB_WORDS: tuple[str, ...] = ("a", "an", "the", "moving", *COLOURS, *SHAPES, *DIRECTIONS)


def build_tokenizer() -> Any:
    """The CLIP tokenizer of `word_tokenizer_files(VOCAB_WORDS)`, padding to `MAX_TOKENS`."""
    from transformers import CLIPTokenizer

    vocab, merges = word_tokenizer_files(VOCAB_WORDS)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=MAX_TOKENS)


def text_encoder_config(vocab_size: int) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
        projection_dim=TEXT_WIDTH, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=MAX_TOKENS, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip


def unet_kwargs() -> dict[str, Any]:
    return dict(
        sample_size=LATENT_SIZE, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
        down_block_types=("DownBlock3D", "CrossAttnDownBlock3D"),
        up_block_types=("CrossAttnUpBlock3D", "UpBlock3D"), block_out_channels=(32, 48),
        layers_per_block=1, norm_num_groups=8, cross_attention_dim=TEXT_WIDTH,
        attention_head_dim=4,
    )  # fmt: skip


def scheduler_kwargs(prediction_type: str = "epsilon") -> dict[str, Any]:
    return dict(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
        beta_schedule="scaled_linear", prediction_type=prediction_type, clip_sample=False,
        set_alpha_to_one=False, steps_offset=1, timestep_spacing="trailing",
    )  # fmt: skip


def build_components(vae: Any, seed: int = 0,
                     prediction_type: str = "epsilon") -> dict[str, Any]:  # fmt: skip
    """The pipeline's parts with random weights (seeded) around a given frame `vae`."""
    import torch
    from diffusers import DDIMScheduler, UNet3DConditionModel
    from transformers import CLIPTextModel

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    return {
        "tokenizer": tokenizer,
        "text_encoder": CLIPTextModel(text_encoder_config(len(tokenizer))),
        "vae": vae,
        "unet": UNet3DConditionModel(**unet_kwargs()),
        "scheduler": DDIMScheduler(**scheduler_kwargs(prediction_type)),
    }


def pipeline_from(components: dict[str, Any]) -> Any:
    """A `TextToVideoSDPipeline` of `components` (without diffusers' note that the class is
    deprecated: it still works, and is the layout align-anything trains)."""
    from diffusers import TextToVideoSDPipeline
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        return TextToVideoSDPipeline(**components)
    finally:
        diffusers_logging.set_verbosity(verbosity)


def save_pipeline(components: dict[str, Any], folder: Path) -> None:
    """Write `components` as a diffusers folder (safetensors); the tokenizer folder also gets
    `vocab.json` and `merges.txt` (what transformers 4.x's CLIPTokenizer reads)."""
    pipeline_from(components).save_pretrained(folder, safe_serialization=True)
    vocab, merges = word_tokenizer_files(VOCAB_WORDS)
    tokenizer_dir = Path(folder) / "tokenizer"
    (tokenizer_dir / "vocab.json").write_text(json.dumps(vocab, indent=1) + "\n")
    (tokenizer_dir / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    )


def sample_videos(pipeline: Any, captions: list[str], seeds: list[int], steps: int,
                  frames: int = FRAMES) -> list[Any]:  # fmt: skip
    """One clip [F, H, W, 3] uint8 per caption, each from its own seeded CPU generator (the
    pipeline's own scheduler, `steps` steps, no classifier-free guidance)."""
    import numpy as np
    import torch

    generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
    with torch.no_grad():
        out = pipeline(list(captions), num_frames=frames, num_inference_steps=steps,
                       guidance_scale=1.0, generator=generators, output_type="np")  # fmt: skip
    return [np.round(np.clip(v, 0, 1) * 255).astype(np.uint8) for v in out.frames]
