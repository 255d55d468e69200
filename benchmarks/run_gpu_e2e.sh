#!/usr/bin/env bash
# End-to-end benchmark on a GPU machine, in ONE command of < 10 minutes, from the repo root:
#     OUT=$OUT bash benchmarks/run_gpu_e2e.sh [extra benchmarks/e2e.py flags]
#
#   1. GPU tests (<= 150 s): CUDA-graph decode (tests/engine/test_cuda_graphs.py) and the engine / model
#      on CUDA vs the CPU (tests/engine/test_engine.py, tests/models/test_gpu.py), `-m gpu` only;
#      skipped when pytest is not installed.
#   2. benchmarks/e2e.py, every section (a gdn_share, b state_bytes, c throughput, d decode_floor):
#      ~6 min on an H200 (no new point starts after --budget-s 320; `timeout` kills it at 400 s, and
#      the JSON, written after every point, keeps what ran).
#
# Files written to $OUT (4; copied to benchmarks/results/ when OUT is elsewhere):
#   e2e_<hw>.json  e2e_<hw>.png  e2e_<hw>.log (environment + benchmark output)  e2e_gpu_tests.log
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
mkdir -p "$OUT"
HW="$("$PY" -c 'from bole.hardware import detect_hardware; print(detect_hardware())' 2>/dev/null || echo gpu)"
LOG="$OUT/e2e_$HW.log"
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader || true
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
  ls models/bole-tiny-coder
} 2>&1 | tee "$LOG"

if [ -n "${SKIP_GPU_TESTS:-}" ]; then
  echo "GPU tests skipped (SKIP_GPU_TESTS)" | tee "$OUT/e2e_gpu_tests.log"
elif "$PY" -c "import pytest" 2>/dev/null; then
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_cuda_graphs.py \
    tests/engine/test_engine.py tests/models/test_gpu.py 2>&1 | tee "$OUT/e2e_gpu_tests.log"
  echo "gpu tests exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/e2e_gpu_tests.log"
else
  echo "pytest is not installed: GPU tests skipped" | tee "$OUT/e2e_gpu_tests.log"
fi

timeout "${E2E_KILL_S:-400}" "$PY" benchmarks/e2e.py --tag "$HW" --out "$OUT/e2e_$HW.json" --png "$OUT/e2e_$HW.png" \
  --budget-s "${E2E_BUDGET_S:-320}" "$@" 2>&1 | tee -a "$LOG"
echo "e2e exit status: ${PIPESTATUS[0]}" | tee -a "$LOG"
if ! [ "$OUT" -ef benchmarks/results ]; then
  mkdir -p benchmarks/results && cp "$OUT"/e2e_* benchmarks/results/ 2>/dev/null || true
fi
