"""The flow-matching sibling of `tiny-t2i-shapes`, `tiny-t2i-shapes-flow`: its architecture and
its files.

A Stable-Diffusion-3-shaped diffusers pipeline (`StableDiffusion3Pipeline`) in the same world of
coloured shapes (`shapes.py`), for the tasks whose natural target is a flow-matching model
(Flow-GRPO, DiffusionNFT):
- VAE: the very `AutoencoderKL` of `tiny-t2i-shapes` (its trained weights), with SD3's latent
  normalisation: `shift_factor` (the latents' mean) and `scaling_factor` (one over their
  spread after the shift; the same number as the first model's, since a shift keeps the
  spread); 32x32 images <-> 4x8x8 latents. Its training only reconstructed pictures (it never
  saw a caption or a denoiser), so its latent space serves any denoiser; sharing it also
  makes each model's colour confusion its denoiser's and text encoders' alone;
- text encoders, as SD3 has them: two CLIP text encoders with projection (`text_encoder`: 2
  layers, width 64; `text_encoder_2`: 2 layers, width 32; SD3 takes their penultimate layers'
  tokens side by side, 96 wide, and their pooled projections side by side) on the tokenizer of
  `tiny-t2i-shapes` (8 tokens, one per caption word), and a 2-layer T5 encoder, width 96, with
  a unigram tokenizer in which each caption word is one piece and whose `model_max_length` is
  8. T5 is there for speed more than for its words: SD3 without T5 puts
  `max_sequence_length` (256 by default) zero tokens in every prompt, 16 times the image's 16
  tokens, through every block; with T5 a prompt is 8 CLIP + 8 T5 tokens. The diffusion tasks
  take that length from the T5 tokenizer (`diffusion.load_frozen_parts`); `sample_images`
  passes it to the pipeline, and so must anyone who calls the pipeline directly
  (`max_sequence_length=8`: T5 sees its padding);
- denoiser: an `SD3Transformer2DModel` on the 8x8 latents, patch 2 (16 image tokens), 4 joint
  blocks, 3 heads of 32 (width 96), RMS-normalised queries and keys (as SD3.5); 1.3M
  parameters. Patch 1 (64 image tokens) was not tried beyond timing: a training step of 64
  images cost 3.3 times the CPU (0.44 s against 0.13 s, one thread), and patch 2 already
  draws the shapes cleanly;
- scheduler: `FlowMatchEulerDiscreteScheduler` with shift 1 (SD3's shift 3 is for 1024-pixel
  images; a 32-pixel image needs no push towards high noise).

The shipped weights (`SHIPPED_DIR`, safetensors) are trained by
`scripts/build_builtin_t2i_flow.py` (its docstring: the command and its time) with the
rectified-flow velocity loss on the same noisy captions as `tiny-t2i-shapes`, so the model
draws shapes well and colours badly, on purpose; `SAMPLES_COLOUR_MATCH` is the held-out colour
check of its shipped samples.

`build_components(seed)` gives the architecture with random weights (the VAE too, unless one is
given), `save_pipeline` writes the folder, `sample_images` samples it as the check does.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

from align_anything.families.text_to_image import shapes_model
from align_anything.families.text_to_image.shapes import IMAGE_SIZE

NAME = "tiny-t2i-shapes-flow"
SHIPPED_DIR = Path(__file__).parent / "builtin" / NAME
SAMPLES = SHIPPED_DIR.parent / f"{NAME}-samples.png"

MAX_TOKENS = shapes_model.MAX_TOKENS  # CLIP and T5 tokens per prompt
CLIP_WIDTHS = (64, 32)  # text_encoder, text_encoder_2
JOINT_WIDTH = sum(CLIP_WIDTHS)  # SD3 sets the two CLIPs' tokens side by side; T5's width
LATENT_SIZE = shapes_model.LATENT_SIZE
HEADS, HEAD_WIDTH = 3, 32
PATCH = 2
SCHEDULER_SHIFT = 1.0
CHECK_STEPS = 20  # Euler steps of the held-out check
# The held-out colour check (`shapes.colour_match_rate`) of the shipped samples PNG: the 32
# held-out captions of `t2i-shapes-eval` at their seeds, `CHECK_STEPS` Euler steps, no
# guidance, fp32 CPU, as the build script measured it.
SAMPLES_COLOUR_MATCH = 9 / 32


def t5_tokenizer() -> Any:
    """A T5 unigram tokenizer in which each caption word of the shapes world is one piece
    (any other word is spelt in letters), padding and truncating to `MAX_TOKENS`."""
    from transformers import T5Tokenizer

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(f"▁{word}", -1.0) for word in shapes_model.VOCAB_WORDS]
    known = {piece for piece, _ in pieces}
    pieces += [(f"▁{c}", -2.5) for c in string.ascii_lowercase if f"▁{c}" not in known]
    pieces += [(c, -3.0) for c in string.ascii_lowercase]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=MAX_TOKENS)


def _clip_config(vocab_size: int, width: int) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width,
        projection_dim=width, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=MAX_TOKENS, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip


def _t5_config(vocab_size: int) -> Any:
    from transformers import T5Config

    return T5Config(
        vocab_size=vocab_size, d_model=JOINT_WIDTH, d_kv=JOINT_WIDTH // 4, d_ff=2 * JOINT_WIDTH,
        num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=MAX_TOKENS, dropout_rate=0.0, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip


def transformer_kwargs() -> dict[str, Any]:
    return dict(
        sample_size=LATENT_SIZE, patch_size=PATCH, in_channels=shapes_model.LATENT_CHANNELS,
        out_channels=shapes_model.LATENT_CHANNELS, num_layers=4, attention_head_dim=HEAD_WIDTH,
        num_attention_heads=HEADS, joint_attention_dim=JOINT_WIDTH,
        caption_projection_dim=HEADS * HEAD_WIDTH, pooled_projection_dim=JOINT_WIDTH,
        pos_embed_max_size=LATENT_SIZE, qk_norm="rms_norm",
    )  # fmt: skip


def vae_kwargs() -> dict[str, Any]:
    """`tiny-t2i-shapes`'s VAE architecture (quant convolutions included: its weights have
    them), with SD3's latent shift."""
    return {**shapes_model.vae_kwargs(), "shift_factor": 0.0}


def build_components(seed: int = 0, *, vae: Any = None) -> dict[str, Any]:
    """The pipeline's parts with random weights (seeded), every module fp32: tokenizer,
    text_encoder, tokenizer_2, text_encoder_2, tokenizer_3, text_encoder_3, transformer,
    scheduler and `vae` (given, e.g. `tiny-t2i-shapes`'s trained one, or random)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    tokenizer, t5 = shapes_model.build_tokenizer(), t5_tokenizer()
    torch.manual_seed(seed)
    return {
        "tokenizer": tokenizer,
        "text_encoder": CLIPTextModelWithProjection(_clip_config(len(tokenizer), CLIP_WIDTHS[0])),
        "tokenizer_2": shapes_model.build_tokenizer(),
        "text_encoder_2": CLIPTextModelWithProjection(_clip_config(len(tokenizer), CLIP_WIDTHS[1])),
        "tokenizer_3": t5,
        "text_encoder_3": T5EncoderModel(_t5_config(len(t5))),
        "transformer": SD3Transformer2DModel(**transformer_kwargs()),
        "vae": vae if vae is not None else AutoencoderKL(**vae_kwargs()),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=SCHEDULER_SHIFT),
    }


def pipeline_from(components: dict[str, Any]) -> Any:
    """A `StableDiffusion3Pipeline` of `components` (no image encoder)."""
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline(**components)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def save_pipeline(components: dict[str, Any], folder: Path) -> None:
    """Write `components` as a diffusers pipeline folder (safetensors weights); the CLIP
    tokenizer folders as `shapes_model.save_pipeline` writes its one."""
    import json

    pipeline_from(components).save_pretrained(folder, safe_serialization=True)
    vocab, merges = shapes_model.tokenizer_files()
    for part in ("tokenizer", "tokenizer_2"):
        (Path(folder) / part / "vocab.json").write_text(json.dumps(vocab, indent=1) + "\n")
        (Path(folder) / part / "merges.txt").write_text(
            "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
        )


def sample_images(pipeline: Any, captions: list[str], seeds: list[int], steps: int) -> list[Any]:
    """One PIL image per caption, each from its own seeded CPU generator (the pipeline's
    Euler sampler with `steps` steps, no classifier-free guidance, T5 at `MAX_TOKENS`)."""
    import torch

    generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
    with torch.no_grad():
        return pipeline(
            list(captions), num_inference_steps=steps, guidance_scale=1.0, generator=generators,
            height=IMAGE_SIZE, width=IMAGE_SIZE, max_sequence_length=MAX_TOKENS,
            output_type="pil",
        ).images  # fmt: skip
