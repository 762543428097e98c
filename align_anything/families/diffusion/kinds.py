"""The kinds of diffusers pipeline the pipeline families train, and what each needs: names
shared by the pipeline loader, the adapters and the forward pass (a module of its own so that
none of them imports another for a constant). A kind is a denoiser architecture with its text
encoders and target; its `MEDIUM` says which family's room turns data into its inputs and its
outputs into files (`families.pipelines.MEDIA`). Adding a kind is a row in each table here."""

from __future__ import annotations

KINDS = ("sd", "sdxl", "sd3", "flux")
INDEX = "model_index.json"

# What each kind makes: the medium (a key of `families.pipelines.MEDIA`).
MEDIUM = {"sd": "image", "sdxl": "image", "sd3": "image", "flux": "image"}

# diffusers' pipeline class of each kind: sampling goes through it, and its
# `save_lora_weights` writes adapters in the layout its `load_lora_weights` reads.
PIPELINE_CLASSES = {
    "sd": "StableDiffusionPipeline",
    "sdxl": "StableDiffusionXLPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
}
# The parts each kind needs (beyond the denoiser), in the pipeline's order.
TEXT_ENCODERS = {
    "sd": ("text_encoder",),
    "sdxl": ("text_encoder", "text_encoder_2"),
    "sd3": ("text_encoder", "text_encoder_2", "text_encoder_3"),
    "flux": ("text_encoder", "text_encoder_2"),
}
OPTIONAL_PARTS = {"text_encoder_3", "tokenizer_3"}  # SD3 runs without its T5 (zeros instead)
# The longest T5 prompt each flow kind's pipeline takes by default (its `__call__` default).
DEFAULT_T5_LENGTH = {"sd3": 256, "flux": 512}
# diffusers' default guidance for training a guidance-distilled Flux (its DreamBooth script).
FLUX_TRAINING_GUIDANCE = 3.5
