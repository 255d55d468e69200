#!/usr/bin/env bash
# GDN tree-verification benchmark on a GPU machine. Run from anywhere in the repo,
# with .peers/ fetched beforehand by scripts/fetch_peers.sh (where PyPI is reachable) and carried along:
#     bash benchmarks/run_gpu_gdn.sh [extra gdn_verify.py flags, e.g. --quick]
# The table has one column per kernel method (blocked, horner, tuned), each its fastest validated
# config. With CHECK_TREES="64" (and optionally CHECK_METHODS="horner") benchmarks/kernel_check.py
# first validates every (block_v, num_warps, precision) of those methods and tree sizes.
# Writes JSON, PNG and log under $OUT (the device tool's folder; default benchmarks/results) and copies
# them into benchmarks/results/ for later.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT" benchmarks/results
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader || true
[ -f .peers/sglang/fused_recurrent.py ] || echo "warning: no .peers/sglang: the SGLang column is skipped" >&2
unset TRITON_INTERPRET
if [ -n "${CHECK_TREES:-}" ]; then
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 "${PYTHON:-python3}" benchmarks/kernel_check.py --out "$OUT/kernel_check_h200.json" \
    --trees $CHECK_TREES ${CHECK_METHODS:+--methods $CHECK_METHODS} 2>&1 | tee "$OUT/kernel_check_h200.log"
  [ "$OUT" -ef benchmarks/results ] || cp "$OUT"/kernel_check_h200.* benchmarks/results/
fi
PYTHONUNBUFFERED=1 "${PYTHON:-python3}" benchmarks/gdn_verify.py --out "$OUT/gdn_verify_h200.json" "$@" \
  2>&1 | tee "$OUT/gdn_verify_h200.log"
[ "$OUT" -ef benchmarks/results ] || cp "$OUT"/gdn_verify_h200.* benchmarks/results/
