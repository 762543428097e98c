#!/usr/bin/env bash
# REINFORCE leave-one-out (online RL: G sampled completions per prompt, each against the mean
# reward of the others) under the deepspeed launcher on this machine.
#   bash scripts/rloo.sh                                 # all visible GPUs, ZeRO-3, task defaults
#   NUM_GPUS=2 PRESET=z2 bash scripts/rloo.sh rloo.beta=0.0
#   bash scripts/rloo.sh --num_gpus 2 --preset z2 rloo.num_generations=8
# Settings and defaults: see scripts/launch.sh.
TASK=rloo LAUNCHER=deepspeed exec bash "$(dirname "$0")/launch.sh" "$@"
