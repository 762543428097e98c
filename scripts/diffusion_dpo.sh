#!/usr/bin/env bash
# Diffusion-DPO of a text-to-image pipeline's denoiser under the deepspeed launcher on this machine.
#   bash scripts/diffusion_dpo.sh                        # all visible GPUs, ZeRO-3, task defaults
#   NUM_GPUS=2 PRESET=z2 bash scripts/diffusion_dpo.sh model.lora.enabled=true
#   bash scripts/diffusion_dpo.sh --num_gpus 8 model.name_or_path=/models/sdxl data.path=/data/pick-a-pic data.resolution=1024
# Settings and defaults: see scripts/launch.sh.
TASK=diffusion_dpo LAUNCHER=deepspeed exec bash "$(dirname "$0")/launch.sh" "$@"
