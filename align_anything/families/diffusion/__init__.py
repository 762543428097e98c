"""Text-to-image models: diffusers pipelines from a folder (`model_index.json`), for the
diffusion tasks (denoising fine-tuning, Diffusion-DPO).

- `families`: the kind names and what each needs (shared constants).
- `pipeline`: which kind a folder is (SD 1.x/2.x, SDXL, SD3-style flow matching, Flux), its
  parts (`PipelineInfo`, from the folder's JSON files alone), loading the trained denoiser on
  its own (`load_denoiser`, `empty_denoiser`) and the frozen parts (`load_frozen_parts`: VAE,
  text encoders, tokenizers, noise scheduler), encoding images and captions for the latent
  cache, and the parts' identity for that cache's key (parameter counts from the config
  alone: `models.sizes.denoiser_sizes`).
- `adapters`: LoRA on the denoiser through PEFT (diffusers' own adapter integration), saved in
  the format diffusers' `load_lora_weights` reads.
- `sampling`: images for fixed prompts and seeds through the kind's diffusers pipeline class
  (given the run's modules, no second copy of the weights), and a labelled PNG grid.
- `tiny`: the built-in tiny random pipelines of the tests (`tiny-random-sd`, ...), built from
  config and saved once, like the `tiny-random-*` language models of `models.zoo`.
"""

from align_anything.families.diffusion.adapters import (
    LORA_WEIGHTS,
    adapters_disabled,
    add_denoiser_adapters,
    default_denoiser_targets,
    save_denoiser_adapter,
)
from align_anything.families.diffusion.kinds import KINDS
from align_anything.families.diffusion.parts import (
    FrozenParts,
    bucket_width,
    denoiser_from_state_dict,
    empty_denoiser,
    encoder_identity,
    load_denoiser,
    load_frozen_parts,
    save_pipeline,
    training_scheduler,
)
from align_anything.families.diffusion.pipeline import (
    PipelineInfo,
    check_audio_length,
    inspect_pipeline,
    is_pipeline_folder,
    training_resolution,
)
from align_anything.families.diffusion.sampling import sample_images, save_grid

__all__ = [
    "KINDS",
    "LORA_WEIGHTS",
    "FrozenParts",
    "PipelineInfo",
    "adapters_disabled",
    "add_denoiser_adapters",
    "bucket_width",
    "check_audio_length",
    "denoiser_from_state_dict",
    "default_denoiser_targets",
    "empty_denoiser",
    "encoder_identity",
    "inspect_pipeline",
    "is_pipeline_folder",
    "load_denoiser",
    "load_frozen_parts",
    "sample_images",
    "save_denoiser_adapter",
    "save_grid",
    "save_pipeline",
    "training_resolution",
    "training_scheduler",
]
