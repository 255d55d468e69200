#!/usr/bin/env bash
# The scale benchmark (benchmarks/e2e.py --scale, benchmarks/e2e_scale.py) on one GPU, in ONE device call
# of < 10 minutes, from the repository root:
#     OUT=$OUT bash benchmarks/run_gpu_scale.sh [--models qwen3.5-9b] [extra e2e_scale.py flags]
# Default: the qwen3.5-9b-cost model only. qwen3.5-27b (25 B parameters with the embedded vocabulary,
# ~50 GB bf16) needs a call of its own with SCALE_BUDGET_S / SCALE_KILL_S raised, and the disk for it: the
# 64 GiB GPU machine holds one of the two checkpoints at a time (WIDEN_DIR=... rm -rf the other first).
#
# Wall time, estimated from the sizes (not yet measured on a GPU):
#   widening: qwen3.5-9b with the embedded model's 8192-token vocabulary is 7.2 B parameters, 14.5 GB in
#     bf16 to compute and write (not the real 9B's ~18 GB: its 248k vocabulary is not there); the CPU
#     widening ran at 0.11 GB/s on one thread here (2.35 GB in 22 s), so <= ~130 s; skipped when
#     $WIDEN_DIR already holds it (a second call on a machine still warm).
#   cells: 6 batches x 3 modes, each a fresh engine: 14.5 GB from the page cache onto the GPU (~5-10 s),
#     its CUDA graphs captured (~5-15 s), a warm-up and 3 runs of 128 tokens per request (a 9B-cost decode
#     step reads 14.5 GB, >= 3 ms at 4.8 TB/s: ~1-3 s a run): ~15-30 s a cell, ~5-9 min for 18.
#   So the last (largest-batch) cells may not fit: no cell starts after --budget-s (470 s from the start,
#   widening included), a worker still running 40 s later is killed, `timeout` ends everything at 540 s.
#   The JSON, rewritten after every cell, keeps what ran and marks the rest (skipped_budget / not_run).
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
