#!/usr/bin/env bash
# Shared launcher behind sft.sh, dpo.sh, rm.sh, kto.sh, grpo.sh, rloo.sh, ppo.sh and
# torchrun.sh: one machine, N processes.
#
#   bash scripts/sft.sh [--num_gpus N] [--preset NAME] [key=value ...]
#
# Settings (an argument wins over the environment variable, which wins over the default):
#   --num_gpus N   / NUM_GPUS     processes to start (default: the GPUs nvidia-smi sees, else 1;
#                                 on a CPU-only machine each process is a CPU rank on gloo)
#   --preset NAME  / PRESET       z0 | z2 | z3 | z3_offload | path/to/ds.json (default: z3)
#                    MODEL        model.name_or_path (default: the task config's)
#                    OUTPUT_DIR   output_dir (default: outputs/<task>)
#                    MASTER_PORT  rendezvous port on this machine (default: 29500)
#                    LAUNCHER     deepspeed | torchrun (set by the wrapper scripts)
#                    DRY_RUN=1    print the command instead of running it
# Every other argument is a Hydra override passed through to align_anything.train.
set -euo pipefail
# shellcheck source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

TASK=${TASK:?set TASK=sft|dpo|rm|kto|grpo|rloo|ppo|diffusion_sft|diffusion_dpo, or call scripts/sft.sh, dpo.sh, rm.sh, kto.sh, grpo.sh, rloo.sh, ppo.sh, diffusion_sft.sh or diffusion_dpo.sh}
LAUNCHER=${LAUNCHER:-deepspeed}
PRESET=${PRESET:-z3}
MASTER_PORT=${MASTER_PORT:-29500}
if [ -z "${NUM_GPUS:-}" ]; then
    NUM_GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "${NUM_GPUS:-0}" -ge 1 ] || NUM_GPUS=1
fi

overrides=()
while [ $# -gt 0 ]; do
    case "$1" in
        --num_gpus|--num-gpus) NUM_GPUS=$2; shift 2 ;;
        --num_gpus=*|--num-gpus=*) NUM_GPUS=${1#*=}; shift ;;
        --preset) PRESET=$2; shift 2 ;;
        --preset=*) PRESET=${1#*=}; shift ;;
        *) overrides+=("$1"); shift ;;
    esac
done

# The settings above are defaults: an override of the same key among the arguments takes its
# place (align_anything.train refuses a key given twice).
given() {
    local key=$1 arg
    shift
    for arg in "$@"; do
        case "${arg%%=*}" in "$key" | "+$key" | "++$key") return 0 ;; esac
    done
    return 1
}
args=()
given task ${overrides[@]+"${overrides[@]}"} || args+=("task=$TASK")
given deepspeed ${overrides[@]+"${overrides[@]}"} || args+=("deepspeed=$PRESET")
[ -n "${MODEL:-}" ] && ! given model.name_or_path ${overrides[@]+"${overrides[@]}"} &&
    args+=("model.name_or_path=$MODEL")
[ -n "${OUTPUT_DIR:-}" ] && ! given output_dir ${overrides[@]+"${overrides[@]}"} &&
    args+=("output_dir=$OUTPUT_DIR")
args+=(${overrides[@]+"${overrides[@]}"})

case "$LAUNCHER" in
    deepspeed)
        cmd=(deepspeed --num_gpus "$NUM_GPUS" --master_port "$MASTER_PORT"
             --module align_anything.train "${args[@]}") ;;
    torchrun)
        cmd=(torchrun --nproc_per_node "$NUM_GPUS" --master_addr 127.0.0.1
             --master_port "$MASTER_PORT" -m align_anything.train "${args[@]}") ;;
    *) echo "error: LAUNCHER=$LAUNCHER: expected deepspeed or torchrun" >&2; exit 2 ;;
esac

if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "${cmd[*]}"
    exit 0
fi
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
