#!/usr/bin/env bash
# Reward modelling under the deepspeed launcher on this machine.
#   bash scripts/rm.sh                                  # all visible GPUs, ZeRO-3, task defaults
#   NUM_GPUS=2 PRESET=z2 bash scripts/rm.sh train.max_steps=100
#   bash scripts/rm.sh --num_gpus 2 --preset z2 model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct
# Settings and defaults: see scripts/launch.sh.
TASK=rm LAUNCHER=deepspeed exec bash "$(dirname "$0")/launch.sh" "$@"
