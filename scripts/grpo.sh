#!/usr/bin/env bash
# Group relative policy optimisation (online RL: G sampled completions per prompt, rewarded by
# reward functions and/or a reward model) under the deepspeed launcher on this machine.
#   bash scripts/grpo.sh                                 # all visible GPUs, ZeRO-3, task defaults
#   NUM_GPUS=2 PRESET=z2 bash scripts/grpo.sh reward.model=outputs/rm/final
#   bash scripts/grpo.sh --num_gpus 2 --preset z2 grpo.num_generations=4 grpo.loss_type=dr_grpo
# Settings and defaults: see scripts/launch.sh.
TASK=grpo LAUNCHER=deepspeed exec bash "$(dirname "$0")/launch.sh" "$@"
