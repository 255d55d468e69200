#!/usr/bin/env bash
# The budget sweep (the paper's Fig. 11) on one GPU: tokens/s and MAT of the engine in `bole`
# mode against a fixed verification budget B = 8..256 draft nodes per step, at batch 1, 4 and 8, on
# the held-out prompts, with the calibrated B_ver marked. From the repository root:
#     OUT=$OUT bash benchmarks/run_gpu_budget.sh [extra budget_sweep.py flags]
# Model: models/bole-tiny-coder when its weights exist, else random weights of the same shapes and
# tokenizer (timings representative, MAT not). B_ver: calibration_tables/<hw>-bole-tiny-coder.yaml
# when it exists (h200 on the H200), else a quick in-process calibration sweep (--calibrate).
# Budget: about 1.5-2.5 minutes; the python process starts no point after 140 s and is killed at 170 s.
# Writes 3 files to $OUT: budget_sweep_<hw>.json, budget_sweep_<hw>.png, budget_sweep_<hw>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="${PYTHONPATH:-}:$PWD"
HW=$("$PY" -c "from bole.hardware import detect_hardware; print(detect_hardware('cuda'))")
TINY=models/bole-tiny-coder
TABLE="calibration_tables/$HW-bole-tiny-coder.yaml"
if ls "$TINY"/*.safetensors >/dev/null 2>&1; then SRC=(--model "$TINY"); else SRC=(--random full); fi
if [ -f "$TABLE" ]; then CAL=(--table "$TABLE"); else CAL=(--calibrate); fi
LOG="$OUT/budget_sweep_$HW.log"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  echo "hardware class: $HW; model: ${SRC[*]}; calibration: ${CAL[*]}"
  timeout -k 10 "${BUDGET_KILL_S:-170}" "$PY" benchmarks/budget_sweep.py "${SRC[@]}" "${CAL[@]}" --device cuda \
    --batches 1 4 8 --budgets 8 16 32 64 128 256 --waves 4 --max-tokens 32 --time-budget-s "${BUDGET_S:-140}" \
    --out "$OUT/budget_sweep_$HW.json" "$@"
} 2>&1 | tee "$LOG"
