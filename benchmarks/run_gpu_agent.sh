#!/usr/bin/env bash
# Online agent-serving benchmark on a GPU machine, in ONE command of < 8 minutes, from the repo root:
#     OUT=$OUT bash benchmarks/run_gpu_agent.sh [extra benchmarks/serve_modes.py flags]
#
#   1. The serving stack the GPU image lacks (fastapi, starlette, uvicorn, pydantic, openai and their
#      dependencies, fla-core; no Ray: the server runs with --no-ray) from the carried wheels in
#      $WHEELS (default .gpuwhl, made by `pip download --no-deps --only-binary=:all: --python-version
#      3.12 ...`), installed into $SITE (default /tmp/site), first on PYTHONPATH. Skipped where they
#      all import already (the CPU machines' venv).
#   2. benchmarks/serve_modes.py: per mode of $MODES (ar serial_tree bole; a mode may carry options of its
#      own for an A/B in one run: MODES="bole bole+admit_during_forward=true") a fresh
#      `python -m deployments.launch cluster_configs/local.yaml --no-ray` server on $MODEL (default the
#      embedded model; e.g. a widened checkpoint) on $DEVICE with CUDA graphs, a warm-up phase, then
#      serve_load.py's multi-turn coding workload at each of $RATES conversations/s: TTFT, TPOT (mean,
#      p50, p99), request throughput from the clients; prefix-cache hit rate, preemptions, MAT, queue
#      wait from the server's /metrics (differences of its totals over each phase).
#
# Sizing (the embedded model on an H200): per mode ~15 s to start, warm-up 24 requests (the Triton
# compiles and lazily captured graphs), 3 rates x 48 requests of 64 tokens (16 conversations of 3
# turns each): ~1-2 min a mode. No phase starts after BUDGET_S=390 s and `timeout` kills the run at
# KILL_S=450 s (the JSON, rewritten after every phase, keeps what ran); with the install that fits 8
# minutes. Larger models: raise NUM_BLOCKS, lower RATES / NUM_REQUESTS. The KV cache is sized by
# NUM_BLOCKS (CacheConfig.num_blocks, the engine's only cache-size option today); any other engine
# option goes through as an extra flag: --engine-option KEY=VALUE.
#
# CPU smoke test (the script's own path, minutes):
#     DEVICE=cpu MODES="ar bole" RATES=4 NUM_REQUESTS=4 WARMUP_REQUESTS=2 TURNS=2 MAX_TOKENS=8 \
#         NUM_BLOCKS=512 OUT=/tmp/agent bash benchmarks/run_gpu_agent.sh
#
# Files written to $OUT (copied to benchmarks/results/ when OUT is elsewhere: the JSON):
#   serve_modes_<hw>.json  serve_modes_<hw>.log (environment + driver output)  serve_logs/server_<mode>.log
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-.gpuwhl}"
SITE="${SITE:-/tmp/site}"
DEVICE="${DEVICE:-cuda}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
[ "$DEVICE" = cpu ] || unset TRITON_INTERPRET
mkdir -p "$OUT/serve_logs"

if ! "$PY" -c "import fastapi, starlette, uvicorn, pydantic, openai, prometheus_client" 2>/dev/null; then
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    timeout 180 "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" "$WHEELS"/*.whl \
      && export PYTHONPATH="$SITE:$PYTHONPATH"
  else
    echo "the serving stack is missing and $WHEELS has no wheels" >&2
  fi
fi

HW="$(timeout 120 "$PY" -c "from bole.hardware import detect_hardware; print(detect_hardware('$DEVICE'))" \
  2>/dev/null || echo "$DEVICE")"
LOG="$OUT/serve_modes_$HW.log"
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
  timeout 120 "$PY" -c "import torch, triton, transformers, fastapi, uvicorn, pydantic, openai; print('torch', \
torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fastapi', \
fastapi.__version__, 'uvicorn', uvicorn.__version__, 'pydantic', pydantic.__version__, 'openai', openai.__version__)"
} 2>&1 | tee "$LOG"

# shellcheck disable=SC2086
timeout -k 10 "${KILL_S:-450}" "$PY" benchmarks/serve_modes.py --model "${MODEL:-models/bole-tiny-coder}" \
  --device "$DEVICE" --modes ${MODES:-ar serial_tree bole} --rates ${RATES:-4 16 64} \
  --num-requests "${NUM_REQUESTS:-48}" --warmup-requests "${WARMUP_REQUESTS:-24}" --turns "${TURNS:-3}" \
  --max-tokens "${MAX_TOKENS:-64}" --num-blocks "${NUM_BLOCKS:-2048}" --max-num-seqs "${MAX_NUM_SEQS:-16}" \
  --budget-s "${BUDGET_S:-390}" --tag "$HW" --log-dir "$OUT/serve_logs" --out "$OUT/serve_modes_$HW.json" \
  "$@" 2>&1 | tee -a "$LOG"
echo "serve_modes exit status: ${PIPESTATUS[0]}" | tee -a "$LOG"
if ! [ "$OUT" -ef benchmarks/results ]; then
  mkdir -p benchmarks/results && cp "$OUT/serve_modes_$HW.json" benchmarks/results/ 2>/dev/null || true
fi
