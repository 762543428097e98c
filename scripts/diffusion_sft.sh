#!/usr/bin/env bash
# Diffusion fine-tuning (the denoising loss) of a text-to-image pipeline's denoiser under the
# deepspeed launcher on this machine.
#   bash scripts/diffusion_sft.sh                        # all visible GPUs, ZeRO-3, task defaults
#   NUM_GPUS=2 PRESET=z2 bash scripts/diffusion_sft.sh data.path=/data/my-images train.ema.enabled=true
# Settings and defaults: see scripts/launch.sh.
TASK=diffusion_sft LAUNCHER=deepspeed exec bash "$(dirname "$0")/launch.sh" "$@"
