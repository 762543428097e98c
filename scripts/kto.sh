#!/usr/bin/env bash
# Kahneman-Tversky optimisation (unpaired thumbs-up / thumbs-down rows) under the deepspeed
# launcher on this machine.
#   bash scripts/kto.sh                                  # all visible GPUs, ZeRO-3, task defaults
#   NUM_GPUS=2 PRESET=z2 bash scripts/kto.sh data.path=my_feedback.jsonl
#   bash scripts/kto.sh --num_gpus 2 --preset z2 kto.desirable_weight=1.33
# Settings and defaults: see scripts/launch.sh.
TASK=kto LAUNCHER=deepspeed exec bash "$(dirname "$0")/launch.sh" "$@"
