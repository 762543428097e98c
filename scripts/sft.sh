#!/usr/bin/env bash
# Supervised fine-tuning under the deepspeed launcher on this machine.
#   bash scripts/sft.sh                                  # all visible GPUs, ZeRO-3, task defaults
#   NUM_GPUS=2 PRESET=z2 bash scripts/sft.sh train.max_steps=100
#   bash scripts/sft.sh --num_gpus 2 --preset z2 model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct
# Settings and defaults: see scripts/launch.sh.
TASK=sft LAUNCHER=deepspeed exec bash "$(dirname "$0")/launch.sh" "$@"
