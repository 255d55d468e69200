#!/usr/bin/env bash
# The scale benchmark (benchmarks/e2e.py --scale, benchmarks/e2e_scale.py) on one GPU, in ONE device call
# of < 10 minutes, from the repository root:
#     OUT=$OUT bash benchmarks/run_gpu_scale.sh [--models qwen3.5-9b] [extra e2e_scale.py flags]
# Default: the qwen3.5-9b-cost model only; one model per call (--models qwen3.5-4b / qwen3.5-27b), each with
# its own --calibration-table (calibration_tables/<hw>-qwen3.5-<size>.yaml). The 64 GiB GPU machine's disk
# holds one widened checkpoint of 27B size at a time: WIDEN_DIR=... rm -rf the other first. The MoE shape
# (qwen3.5-35b-a3b, 71 GB) fits no such disk: pass --widen-in-memory (the worker widens into host memory).
#
# Wall time measured (H100 80GB, 2026-12-06; benchmarks/README.md "At scale on the H100"):
#   widening: 4B-cost 9.9 GB in 28 s, 9B-cost 18.4 GB in 53 s (88 s on the H200), 27B-cost 54.6 GB in
#     123 s; skipped when $WIDEN_DIR already holds it (a second call on a machine still warm: ~7 s).
#   cells (batches 1-16 x ar / bole / serial_tree, a fresh engine each): the first cell pays the Triton
#     compiles (74-90 s), the others 3-50 s (27B: 5-34 s). Whole grids: 4B 268 s, 27B 249 s (reused
#     checkpoint); the 9B grid after a 119 s calibration in the same call reached batch 4 in ~300 s.
#   No cell starts after --budget-s (470 s from the start, widening included), a worker still running 40 s
#   later is killed, `timeout` ends everything at 540 s. The JSON, rewritten after every cell, keeps what
#   ran and marks the rest (skipped_budget / not_run).
#
# Files written to $OUT (3): e2e_scale_<hw>.json, e2e_scale_<hw>.png, e2e_scale_<hw>.log
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
WIDEN_DIR="${WIDEN_DIR:-/tmp/bole-widened}"
mkdir -p "$OUT" "$WIDEN_DIR"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
HW=$("$PY" -c "from bole.hardware import detect_hardware; print(detect_hardware('cuda'))" 2>/dev/null || echo gpu)
LOG="$OUT/e2e_scale_$HW.log"
MODELS=(--models qwen3.5-9b)
for a in "$@"; do [ "$a" = "--models" ] && MODELS=(); done
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  df -h "$WIDEN_DIR" | tail -1
  ls -la "$WIDEN_DIR"
  timeout -k 10 "${SCALE_KILL_S:-540}" "$PY" benchmarks/e2e.py --scale "${MODELS[@]}" --widen-dir "$WIDEN_DIR" \
    --tag "$HW" --out "$OUT/e2e_scale_$HW.json" --png "$OUT/e2e_scale_$HW.png" \
    --budget-s "${SCALE_BUDGET_S:-470}" --grace-s 40 "$@"
  echo "e2e --scale exit status: $?"
} 2>&1 | tee "$LOG"
