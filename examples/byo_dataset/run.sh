#!/usr/bin/env bash
# The "bring your own dataset" example: one preference file with its own column names, used
# for DPO, a reward model and SFT through data.columns.* mappings. From the repository root:
#   bash examples/byo_dataset/run.sh                 # SmolLM2-135M-Instruct, a few steps each
#   MODEL=tiny-random-llama STEPS=1 bash examples/byo_dataset/run.sh   # seconds (a smoke test)
set -euo pipefail

here=$(dirname "$0")
OUT=${OUT:-outputs/byo_dataset}
MODEL=${MODEL:-smollm2-135m-instruct}
STEPS=${STEPS:-3}
source "$(dirname "$0")/../../scripts/env.sh"  # PYTHON: the project's .venv when none is active
common=(data.path="$here/capitals.jsonl" data.eval_path=null data.eval_fraction=0.25 model.name_or_path="$MODEL"
        train.max_steps="$STEPS" train.per_device_batch_size=4 checkpoint.save_final=false
        overwrite_output_dir=true)  # a rerun starts over in the example's own folders
pairs=(data.columns.prompt=question data.columns.chosen=good_answer data.columns.rejected=bad_answer)

"$PYTHON" -m align_anything.train task=dpo "${common[@]}" "${pairs[@]}" \
    dpo.generation_check_samples=0 output_dir="$OUT/dpo"
"$PYTHON" -m align_anything.train task=rm "${common[@]}" "${pairs[@]}" output_dir="$OUT/rm"
"$PYTHON" -m align_anything.train task=sft "${common[@]}" \
    data.columns.prompt=question data.columns.response=good_answer output_dir="$OUT/sft"
