"""The kinds of diffusers pipeline the pipeline families train, and what each needs: names
shared by the pipeline loader, the adapters and the forward pass (a module of its own so that
none of them imports another for a constant). A kind is a denoiser architecture with its text
encoders and target; its `MEDIUM` says which family's room turns data into its inputs and its
outputs into files (`families.pipelines.MEDIA`). Adding a kind is a row in each table here."""

from __future__ import annotations

KINDS = ("sd", "sdxl", "sd3", "flux", "unet3d", "wan", "audioldm")
INDEX = "model_index.json"

# What each kind makes: the medium (a key of `families.pipelines.MEDIA`).
MEDIUM = {"sd": "image", "sdxl": "image", "sd3": "image", "flux": "image", "unet3d": "video",
          "wan": "video", "audioldm": "audio"}  # fmt: skip

# diffusers' pipeline class of each kind: sampling goes through it, and its
# `save_lora_weights` writes adapters in the layout its `load_lora_weights` reads.
PIPELINE_CLASSES = {
    "sd": "StableDiffusionPipeline",
    "sdxl": "StableDiffusionXLPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
    "unet3d": "TextToVideoSDPipeline",  # ModelScope's layout (align-anything's text-to-video)
    "wan": "WanPipeline",
    "audioldm": "AudioLDMPipeline",  # what align-anything's text-to-audio trains
}
# The parts each kind needs (beyond the denoiser), in the pipeline's order.
TEXT_ENCODERS = {
    "sd": ("text_encoder",),
    "sdxl": ("text_encoder", "text_encoder_2"),
    "sd3": ("text_encoder", "text_encoder_2", "text_encoder_3"),
    "flux": ("text_encoder", "text_encoder_2"),
    "unet3d": ("text_encoder",),
    "wan": ("text_encoder",),  # UMT5
    "audioldm": ("text_encoder",),  # CLAP's text tower with its projection
}
# Parts beyond the denoiser, VAE, scheduler and text side that a kind's pipeline needs: loaded
# frozen with them, handed to the pipeline and saved in `final/`.
EXTRA_PARTS = {"audioldm": ("vocoder",)}  # SpeechT5HifiGan: mel spectrogram -> waveform
OPTIONAL_PARTS = {"text_encoder_3", "tokenizer_3"}  # SD3 runs without its T5 (zeros instead)
# The longest T5 prompt each flow kind's pipeline takes by default (its `__call__` default).
DEFAULT_T5_LENGTH = {"sd3": 256, "flux": 512, "wan": 512}
# The tokenizer part of each kind's T5 encoder.
T5_TOKENIZER = {"sd3": "tokenizer_3", "flux": "tokenizer_2", "wan": "tokenizer"}
# Kinds whose pipeline cannot load an adapter with `load_lora_weights` (diffusers 0.42's
# `UNet3DConditionModel` has no PEFT integration and its pipeline is deprecated;
# `AudioLDMPipeline` has no LoRA loader mixin): a LoRA run of these also writes
# `final-merged/`.
NO_LORA_LOADING = ("unet3d", "audioldm")
# The UNet kinds (a `block_out_channels` denoiser, epsilon or v prediction).
UNET_KINDS = ("sd", "sdxl", "unet3d", "audioldm")
# The frames each video kind's pipeline makes by default (its `__call__` default), for
# `data.num_frames: null`; and the side of a kind whose denoiser config names none.
DEFAULT_FRAMES = {"unet3d": 16, "wan": 81}
DEFAULT_RESOLUTION = {"wan": 480}
# diffusers' default guidance for training a guidance-distilled Flux (its DreamBooth script).
FLUX_TRAINING_GUIDANCE = 3.5
