#!/usr/bin/env bash
# Quick calibration sweeps on one GPU (written for the H200; about 3-4 minutes in all):
#     bash scripts/run_gpu_calibrate.sh
# 1. measured: bole-tiny-coder (only once its weights exist) and Qwen3.5-9B shapes with random weights,
#    quick plan (batch 1/4/16, kv 1024/8192, depth 5, G = 8..256), eager forwards (an engine with
#    enable_cuda_graphs replays graphs instead: `python -m bole.calibrate --cuda-graphs` measures those);
# 2. modeled: a100 / gb10 tables from the roofline model, its overhead terms fitted on this GPU's
#    measurement and its error against that measurement in `model_error`.
# Everything (YAML + PNG) goes to $OUT (default calibration_out/); copy the YAML files you keep into
# calibration_tables/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-calibration_out}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
HW=$("$PY" -c "from bole.hardware import detect_hardware; print(detect_hardware('cuda'))")
echo "hardware class: $HW"
TINY=models/bole-tiny-coder
{
  if [ -f "$TINY/model.safetensors" ]; then
    timeout -k 10 90 "$PY" -m bole.calibrate --model "$TINY" --quick --no-progress \
      --out "$OUT/$HW-bole-tiny-coder.yaml"
  else
    echo "$TINY has no weights yet: its sweep is skipped"
  fi
  timeout -k 10 "${CAL_9B_S:-200}" "$PY" -m bole.calibrate --shapes qwen3.5-9b --quick --no-progress \
    --out "$OUT/$HW-qwen3.5-9b.yaml"
  for hw in a100 gb10; do
    "$PY" -m bole.calibrate --modeled "$hw" --shapes qwen3.5-9b --fit "$OUT/$HW-qwen3.5-9b.yaml" \
      --compare "$OUT/$HW-qwen3.5-9b.yaml" --out "$OUT/$hw-qwen3.5-9b.yaml" --png none
    if [ -f "$OUT/$HW-bole-tiny-coder.yaml" ]; then
      "$PY" -m bole.calibrate --modeled "$hw" --model "$TINY" --fit "$OUT/$HW-bole-tiny-coder.yaml" \
        --compare "$OUT/$HW-bole-tiny-coder.yaml" --out "$OUT/$hw-bole-tiny-coder.yaml" --png none
    fi
  done
} 2>&1
