#!/usr/bin/env bash
# Several nodes under the deepspeed launcher, started from the first node of a hostfile.
#
#   HOSTFILE=scripts/hostfile.example TASK=dpo PRESET=z3 bash scripts/multinode.sh train.max_steps=200
#   DRY_RUN=1 bash scripts/multinode.sh        # print the command only
#
# Settings: HOSTFILE (default: scripts/hostfile.example), TASK (sft), PRESET (z3), MODEL,
# OUTPUT_DIR (on a filesystem every node shares), MASTER_ADDR (default: the hostfile's first
# host), MASTER_PORT (29500), DS_LAUNCHER (pdsh; or openmpi, mvapich, slurm: how the deepspeed
# runner reaches the other nodes). Further arguments are Hydra overrides.
set -euo pipefail

here=$(dirname "$0")
HOSTFILE=${HOSTFILE:-$here/hostfile.example}
TASK=${TASK:-sft}
PRESET=${PRESET:-z3}
MASTER_PORT=${MASTER_PORT:-29500}
DS_LAUNCHER=${DS_LAUNCHER:-pdsh}
if [ ! -f "$HOSTFILE" ]; then
    echo "error: HOSTFILE=$HOSTFILE does not exist (see scripts/hostfile.example)" >&2
    exit 2
fi
# The first host line (comments and blank lines skipped) runs rank 0 and the rendezvous.
MASTER_ADDR=${MASTER_ADDR:-$(awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$HOSTFILE")}
if [ -z "$MASTER_ADDR" ]; then
    echo "error: no host in $HOSTFILE; expected lines like 'node1 slots=8'" >&2
    exit 2
fi

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
given task "$@" || args+=("task=$TASK")
given deepspeed "$@" || args+=("deepspeed=$PRESET")
[ -n "${MODEL:-}" ] && ! given model.name_or_path "$@" && args+=("model.name_or_path=$MODEL")
[ -n "${OUTPUT_DIR:-}" ] && ! given output_dir "$@" && args+=("output_dir=$OUTPUT_DIR")
cmd=(deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
     --launcher "$DS_LAUNCHER" --module align_anything.train ${args[@]+"${args[@]}"} "$@")

if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "${cmd[*]}"
    exit 0
fi
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
