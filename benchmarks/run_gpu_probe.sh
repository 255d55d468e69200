#!/usr/bin/env bash
# Kernel-decision probe on the GPU machine (benchmarks/verify_probe.py), then Nsight Compute on the
# fastest one-pass and grouped launches at batch 1 and 16. Carry .peers (SGLang's baseline):
#     run(command="bash benchmarks/run_gpu_probe.sh", carry=[".peers"])
# PROBE_BATCHES / PROBE_TREES pick rows; NCU=0 skips the profiles; GPU_TESTS=0 skips the kernel tests,
# TEST_FILES picks them; PROBE=0 skips the probe; NCU_CASES='batch label;batch label' profiles those.
# $OUT receives verify_probe_h200.json / .log, ncu.log and gpu_tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/probe_out}"
mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout -k 5 "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
    ${TEST_FILES:-tests/kernels/test_gdn_tree_verify.py tests/kernels/test_gdn_tree_verify_grouped.py \
    tests/kernels/test_gdn_tree_verify_2pass.py} > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: exit $?"; tail -n 3 "$OUT/gpu_tests.log"
fi
# shellcheck disable=SC2086
[ "${PROBE:-1}" = 1 ] && timeout -k 5 "${PROBE_S:-330}" python3 benchmarks/verify_probe.py --out "$OUT/verify_probe_h200.json" \
  --batches ${PROBE_BATCHES:-1 4 8 16 32} --trees ${PROBE_TREES:-64} --ncu-cases-out /tmp/ncu_cases.txt \
  2>&1 | tee "$OUT/verify_probe_h200.log"
[ -n "${NCU_CASES:-}" ] && printf '%s\n' "$NCU_CASES" | tr ';' '\n' > /tmp/ncu_cases.txt
if [ "${NCU:-1}" = 1 ] && [ -f /tmp/ncu_cases.txt ]; then
  while read -r b lab; do
    case " ${NCU_BATCHES:-1 16} " in *" $b "*) ;; *) continue ;; esac
    echo "=== batch $b $lab"
    timeout -k 5 120 ncu --clock-control none --kernel-name regex:gdn_tree_verify --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis ${NCU_SECTIONS:-} \
      python3 benchmarks/verify_probe.py --ncu-case "$lab" --batches "$b" --trees "${PROBE_TREES:-64}" 2>&1 \
      | grep -v "^==PROF==" | cut -c1-200
  done < /tmp/ncu_cases.txt > "$OUT/ncu.log" 2>&1
  echo "ncu: $(grep -c '^===' "$OUT/ncu.log") profiles"
fi
