#!/usr/bin/env bash
# A text alignment pipeline on one machine: SFT -> reward model -> DPO, each step starting from
# the SFT model, on the built-in SmolLM2-135M-Instruct and the built-in number-question data.
#
#   bash examples/text_pipeline/run.sh                   # from the repository root
#   SFT_STEPS=3 RM_STEPS=3 DPO_STEPS=3 bash examples/text_pipeline/run.sh   # a quick smoke run
#
# Settings: OUT (default outputs/text_pipeline), SFT_STEPS (20), RM_STEPS (12), DPO_STEPS (12),
# PRESET (z0; z2/z3 need nothing else), PYTHON (default: the active environment, else .venv). On several GPUs, put
# `deepspeed --num_gpus N --module` in front of align_anything.train (see scripts/).
set -euo pipefail

OUT=${OUT:-outputs/text_pipeline}
PRESET=${PRESET:-z0}
source "$(dirname "$0")/../../scripts/env.sh"  # PYTHON: the project's .venv when none is active
here=$(dirname "$0")
# A rerun starts each stage over in its folder under $OUT (the example's own outputs only).
train() { "$PYTHON" -m align_anything.train deepspeed="$PRESET" overwrite_output_dir=true "$@"; }

echo "== 1/4 SFT: teach the answer format 'Answer: N' (built-in arith-sft conversations)"
train task=sft train.max_steps="${SFT_STEPS:-20}" train.learning_rate=5e-5 \
    data.max_eval_samples=16 output_dir="$OUT/sft"

echo "== 2/4 reward model, initialised from the SFT model (built-in arith-pref pairs)"
train task=rm model.name_or_path="$OUT/sft/final" train.max_steps="${RM_STEPS:-12}" \
    train.learning_rate=3e-5 data.max_eval_samples=32 output_dir="$OUT/rm"

echo "== 3/4 score answers with the reward model (the preferred one of each pair should win)"
"$PYTHON" -m align_anything score "$OUT/rm/final" "$here/pairs.jsonl" --out "$OUT/scored.jsonl"
"$PYTHON" - "$OUT/scored.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for row in rows:
    print(f"{row['score']:+.3f}  {row['prompt']!r} -> {row['response']!r}")
PY

echo "== 4/4 DPO from the SFT model (built-in arith-pref pairs; reference = the SFT model)"
train task=dpo model.name_or_path="$OUT/sft/final" train.max_steps="${DPO_STEPS:-12}" \
    dpo.generation_check_samples=16 data.max_eval_samples=32 output_dir="$OUT/dpo"

for stage in sft rm dpo; do
    "$PYTHON" -m align_anything plot "$OUT/$stage"
done
echo "done: models in $OUT/{sft,rm,dpo}/final, curves in $OUT/*/metrics.png"
