#!/usr/bin/env bash
# Several GPU jobs in ONE device call, their outputs packed so that they fit the device tool's
# 8-file limit. From the repository root on the GPU machine:
#     bash scripts/gpu_batch.sh STEP [STEP ...]
# Steps (each under its own `timeout`; a failing step does not stop the next):
#   tests      pytest -m gpu over the whole suite, 8 processes (pytest-xdist; compiles in parallel)
#   calibrate  scripts/run_gpu_calibrate.sh; the measured tiny-model table is then copied to
#              calibration_tables/ so that later steps of the same call use it            (~3 min)
#   budget     benchmarks/run_gpu_budget.sh (Fig. 11 sweep)                              (~2.5 min)
#   gdn        benchmarks/run_gpu_gdn.sh --models qwen3.5-9b --budget-s 120 $GDN_FLAGS  (~2.5 min)
#   e2e        benchmarks/run_gpu_e2e.sh (set E2E_FLAGS for extra e2e.py flags)          (~5-6 min)
#   profile    benchmarks/profile_step.py: torch.profiler over the engine's steps           (~1 min)
#   exactness  benchmarks/verify_exactness.py $EXACT_FLAGS: every verifier's error against float64
#   fp32verify benchmarks/verify_fp32.py: verify launches on fp32 activations vs serial_tree (~3 min)
#   draftlogits benchmarks/draft_logits.py: the drafter's lm_head, flattened GEMM vs strided call (<1 min)
#   moe        benchmarks/moe_dispatch.py --sweep: routed experts at the 35B-A3B shape      (~1 min)
#   scale      benchmarks/run_gpu_scale.sh with the README's headline flags ($SCALE_FLAGS appended;
#              SCALE_BUDGET_S / SCALE_KILL_S as there): widening, then the grid of $SCALE_MODEL (default
#              qwen3.5-9b), its table calibrated first where this GPU has none ($CAL_FLAGS)   (<= 9 min)
#   calmoe     the MoE shape's calibration table (qwen3.5-35b-a3b, CUDA graphs; an H200), into the step's
#              folder and calibration_tables/ for later steps of the call (commit it to reuse it); its
#              buckets from $CAL_MOE_FLAGS (the grid's prompts stay under kv 1024)                  (<= 4 min)
#   scalemoe   the MoE shape's grid (71 GB: an H200), widened into host memory (--widen-in-memory; no disk
#              holds it), with calibration_tables/<hw>-qwen3.5-35b-a3b.yaml (calmoe first where missing); on an
#              80 GB card SCALE_FLAGS="--max-num-batched-tokens 512 --gpu-memory-utilization 0.95" (at 1024 tokens
#              or at 0.9 the memory plan refuses the cells there: run MH1, benchmarks/README.md); the cells
#              beside ar and bole_fr32768 (budget_rule auto: goodput here) from $MOE_CELLS (default
#              serial_tree_fr32768; "bole_fr32768-eq12": eq. 12's budget, run MG1's comparison)
#   rows       max_verify_rows at 27B cost: ar, bole (its default: max_num_batched_tokens rows) and bole with
#              every request's whole tree (-r65536, capped at the whole trees) at batches 32 and 16 with
#              calibration_tables/<hw>-qwen3.5-27b.yaml (whole trees are refused at 32 on 80 GB)  (~8.5 min
#              on a fresh H100, the 27B widening 170 s of it)
#   split      cuda_graph_prefill_split at 9B cost: ar and bole at batches 16 8 4 2 1 with --no-prefill-split,
#              then with the default (one process each, the same machine and table)  (~6 min: 226 + 108 s)
#   arrival    benchmarks/arrival.py at 9B cost: ar / bole, admit_during_forward off / on / main / hold, batch 15,
#              30 arrivals a cell, one traced ($ARRIVAL_FLAGS appended); the widening first        (~6 min)
# $OUT receives results.tar.gz (every step's files, one folder per step) and summary.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?OUT must be set (the device run tool sets it)}"
RES=/tmp/gpu_batch
rm -rf "$RES" && mkdir -p "$RES"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
T0=$(date +%s)
# What the GPU machine lacks, from carried wheels (carry .gpuwhl; made by `pip download --no-deps
# --only-binary=:all: --python-version 3.12 ... pytest pluggy iniconfig packaging hypothesis
# sortedcontainers attrs fla-core einops -d .gpuwhl`, only what the machine lacks: today fla-core):
# installed beside the machine's own packages, which come first on the path. fla-core + einops: the
# `gpu` extra of pyproject.toml (GDN prefill).
if ls .gpuwhl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/gpusite .gpuwhl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/gpusite"
fi
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/summary.log"; }

step_tests() {
  # shellcheck disable=SC2086
  timeout -k 10 "${TESTS_S:-300}" python3 -m pytest -p no:cacheprovider -n "${TEST_WORKERS:-8}" \
    -m "${TEST_MARK:-gpu}" ${TEST_PATHS:-tests} -rs --junitxml "$1/junit.xml"
  local rc=$?
  # the counts from the JUnit report: under xdist on the GPU machine pytest's own summary line has gone missing
  python3 -c "import sys, xml.etree.ElementTree as E; s = E.parse(sys.argv[1]).getroot(); s = s.find('testsuite') \
if s.tag == 'testsuites' else s; print('junit: tests', s.get('tests'), 'failures', s.get('failures'), 'errors', \
s.get('errors'), 'skipped', s.get('skipped'))" "$1/junit.xml" || true
  return $rc
}
step_calibrate() {
  OUT="$1" bash scripts/run_gpu_calibrate.sh
  local hw; hw=$(python3 -c "from bole.hardware import detect_hardware; print(detect_hardware('cuda'))")
  cp "$1/$hw-bole-tiny-coder.yaml" calibration_tables/ 2>/dev/null || true
}
step_budget() { OUT="$1" bash benchmarks/run_gpu_budget.sh; }
step_gdn() {
  # shellcheck disable=SC2086
  OUT="$1" timeout -k 10 "${GDN_S:-300}" bash benchmarks/run_gpu_gdn.sh --models qwen3.5-9b \
    --budget-s "${GDN_BUDGET_S:-120}" ${GDN_FLAGS:-}
}
step_e2e() {
  # shellcheck disable=SC2086
  OUT="$1" SKIP_GPU_TESTS=1 E2E_BUDGET_S="${E2E_BUDGET_S:-260}" E2E_KILL_S="${E2E_KILL_S:-320}" \
    bash benchmarks/run_gpu_e2e.sh ${E2E_FLAGS:-}
}
step_exactness() {
  # shellcheck disable=SC2086
  timeout -k 10 "${EXACT_S:-240}" python3 benchmarks/verify_exactness.py --out "$1/verify_exactness_h200.json" ${EXACT_FLAGS:-}
}
step_fp32verify() {
  # shellcheck disable=SC2086
  timeout -k 10 "${FP32_S:-300}" python3 benchmarks/verify_fp32.py --out "$1/verify_fp32_h200.json" ${FP32_FLAGS:-}
}
step_profile() {
  # shellcheck disable=SC2086
  timeout -k 10 "${PROFILE_S:-240}" python3 benchmarks/profile_step.py --out "$1/profile_h200.json" ${PROFILE_FLAGS:-}
}
step_draftlogits() {
  timeout -k 10 "${DRAFT_S:-120}" python3 benchmarks/draft_logits.py --out "$1/draft_logits_h200.json"
}
step_moe() {
  timeout -k 10 "${MOE_S:-180}" python3 benchmarks/moe_dispatch.py --sweep --out "$1/moe_dispatch_h200.json"
}
step_scale() {
  # $SCALE_MODEL (default qwen3.5-9b) with calibration_tables/<hw>-<model>.yaml, measured first (into the step's
  # folder and calibration_tables/ for later steps; commit it to reuse it) where this GPU has none
  local hw m="${SCALE_MODEL:-qwen3.5-9b}"
  hw=$(python3 -c "from bole.hardware import detect_hardware; print(detect_hardware('cuda'))")
  if [ ! -f "calibration_tables/$hw-$m.yaml" ]; then
    # shellcheck disable=SC2086
    timeout -k 10 "${CAL_S:-240}" python3 -m bole.calibrate --shapes "$m" --cuda-graphs \
      ${CAL_FLAGS:---batch-buckets 1,2,4,8,16 --kv-buckets 1024,4096} --out "$1/$hw-$m.yaml" --no-progress || return 1
    cp "$1/$hw-$m.yaml" calibration_tables/
  fi
  # shellcheck disable=SC2086
  OUT="$1" bash benchmarks/run_gpu_scale.sh --models "$m" --depth 8 --topk 4 --beam 4 --draft-vocab 32768 \
    --calibration-table "calibration_tables/$hw-$m.yaml" ${SCALE_FLAGS:-}
}

step_calmoe() {
  local hw; hw=$(python3 -c "from bole.hardware import detect_hardware; print(detect_hardware('cuda'))")
  # shellcheck disable=SC2086
  timeout -k 10 "${CAL_MOE_S:-240}" python3 -m bole.calibrate --shapes qwen3.5-35b-a3b --cuda-graphs \
    ${CAL_MOE_FLAGS:---batch-buckets 1,2,4,8,16 --kv-buckets 1024,4096} --out "$1/$hw-qwen3.5-35b-a3b.yaml" \
    --no-progress || return 1
  cp "$1/$hw-qwen3.5-35b-a3b.yaml" calibration_tables/
}
step_scalemoe() {
  local hw; hw=$(python3 -c "from bole.hardware import detect_hardware; print(detect_hardware('cuda'))")
  local table="calibration_tables/$hw-qwen3.5-35b-a3b.yaml"
  [ -f "$table" ] || step_calmoe "$1" || return 1
  # shellcheck disable=SC2086
  OUT="$1" bash benchmarks/run_gpu_scale.sh --models qwen3.5-35b-a3b --widen-in-memory --batches 1 8 16 4 2 \
    --modes ar --draft-vocab 32768 --also-cell ${MOE_CELLS:-serial_tree_fr32768} --depth 8 --topk 4 --beam 4 \
    --calibration-table "$table" ${SCALE_FLAGS:-}
}
step_rows() {
  local hw; hw=$(python3 -c "from bole.hardware import detect_hardware; print(detect_hardware('cuda'))")
  # shellcheck disable=SC2086
  OUT="$1" bash benchmarks/run_gpu_scale.sh --models qwen3.5-27b --batches 32 16 --modes ar --draft-vocab 32768 \
    --also-cell bole_fr32768-r65536 --depth 8 --topk 4 --beam 4 \
    --calibration-table "calibration_tables/$hw-qwen3.5-27b.yaml" ${SCALE_FLAGS:-}
}
step_split() {
  local hw; hw=$(python3 -c "from bole.hardware import detect_hardware; print(detect_hardware('cuda'))")
  local f d
  for f in --no-prefill-split ""; do
    d="$1/split"; [ -n "$f" ] && d="$1/base"
    mkdir -p "$d"
    # shellcheck disable=SC2086
    OUT="$d" SCALE_BUDGET_S="${SPLIT_BUDGET_S:-250}" SCALE_KILL_S="${SPLIT_KILL_S:-290}" \
      bash benchmarks/run_gpu_scale.sh --models qwen3.5-9b --batches 16 8 4 2 1 --modes ar --draft-vocab 32768 \
      --depth 8 --topk 4 --beam 4 --calibration-table "calibration_tables/$hw-qwen3.5-9b.yaml" $f ${SCALE_FLAGS:-}
  done
}
step_arrival() {
  local hw w=/tmp/bole-widened/qwen3.5-9b
  hw=$(python3 -c "from bole.hardware import detect_hardware; print(detect_hardware('cuda'))")
  # e2e_scale.widened reuses a matching widening (its widen.json record) and rebuilds a stale one
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from e2e_scale import widened; \
widened('models/bole-tiny-coder', 'qwen3.5-9b', '/tmp/bole-widened')" || return 1
  # shellcheck disable=SC2086
  timeout -k 10 "${ARRIVAL_S:-420}" python3 benchmarks/arrival.py --model "$w" --draft-vocab 32768 \
    --calibration-table "calibration_tables/$hw-qwen3.5-9b.yaml" --batch 15 --arrivals 30 --settle 1 \
    --max-tokens 900 --trace "$1/traces" --out "$1/arrival_$hw.json" ${ARRIVAL_FLAGS:-}
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$OUT/summary.log"
for s in "$@"; do
  mkdir -p "$RES/$s"
  log "step $s: start"
  "step_$s" "$RES/$s" > "$RES/$s/stdout.txt" 2>&1
  rc=$?
  log "step $s: exit $rc"
  tail -n 25 "$RES/$s/stdout.txt" | cut -c1-240 | tee -a "$OUT/summary.log"
  # packed after every step: a call killed at its time limit still returns the finished steps
  tar -czf "$OUT/results.tar.gz.tmp" -C "$RES" . && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
  log "packed $(du -h "$OUT/results.tar.gz" | cut -f1)"
done
