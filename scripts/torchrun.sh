#!/usr/bin/env bash
# Any task under torchrun instead of the deepspeed launcher (same settings as scripts/launch.sh;
# TASK picks the task, default sft).
#   TASK=dpo bash scripts/torchrun.sh --num_gpus 8 --preset z3
#   TASK=rm NUM_GPUS=2 bash scripts/torchrun.sh train.max_steps=50
TASK=${TASK:-sft} LAUNCHER=torchrun exec bash "$(dirname "$0")/launch.sh" "$@"
