#!/usr/bin/env bash
# One-GPU benchmark in one call (under 10 minutes): bf16 SFT and DPO of a ~0.7B Llama built from
# config, ZeRO-2 and ZeRO-3, sequence length 2048; prints tokens/s and MFU against the device's
# dense bf16 peak (see benchmarks/gpu_bench.py for the formula and the peak table).
#   bash benchmarks/gpu.sh                  # defaults
#   bash benchmarks/gpu.sh --micro-batch 4  # options pass through to gpu_bench.py
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# Four runs of at most --run-timeout seconds each (default 240, typically well under a minute
# each after start-up); the outer limit keeps the whole call under 10 minutes.
exec timeout --signal=TERM 570 "$PYTHON" benchmarks/gpu_bench.py --run-timeout 130 --json "${OUT:-/tmp}/gpu_bench.json" "$@"
