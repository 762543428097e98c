#!/usr/bin/env bash
# PPO with a critic (or, by ppo.advantage_estimator, the critic-free REINFORCE++), online RL with
# two trained engines (the actor and the critic) under the deepspeed launcher on this machine.
#   bash scripts/ppo.sh                                  # all visible GPUs, ZeRO-3, task defaults
#   NUM_GPUS=2 PRESET=z2 bash scripts/ppo.sh reward.functions=[] reward.model=outputs/rm/final ppo.critic_init=reward_model
#   bash scripts/ppo.sh --num_gpus 2 --preset z2 ppo.advantage_estimator=reinforce_plus_plus
# Settings and defaults: see scripts/launch.sh.
TASK=ppo LAUNCHER=deepspeed exec bash "$(dirname "$0")/launch.sh" "$@"
