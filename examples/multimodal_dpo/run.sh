#!/usr/bin/env bash
# DPO on a tiny vision-language model (tiny-random-llava), CPU, a few minutes.
# 1. generate coloured-shape images and preference pairs (right colour chosen, a wrong one rejected);
# 2. train with the same DPO trainer and preset as text models;
# 3. the held-out reward accuracy (eval/rewards/accuracies) says how often the policy now prefers the
#    right colour: the prompt is the same for every image, so above 0.5 only by reading the image.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh  # the project's .venv when no environment is active
OUT=${OUT:-outputs/multimodal_dpo}
DATA=$OUT/data
"$PYTHON" -m align_anything data shapes "$DATA" --rows 192 --seed 0
"$PYTHON" -m align_anything.train task=dpo deepspeed=z0 \
  model.name_or_path=tiny-random-llava train.precision=fp32 \
  data.path="$DATA/pref.jsonl" data.eval_path="$DATA/pref_eval.jsonl" \
  train.epochs=4 train.per_device_batch_size=8 train.learning_rate=1e-3 \
  dpo.rpo_alpha=1.0 dpo.generation_check_samples=0 \
  output_dir="$OUT/run" overwrite_output_dir=true "$@"
