#!/usr/bin/env bash
# Download the wheels that the GPU training run (scripts/run_gpu_train.sh) installs offline.
#
# The GPU machine has Python 3.12, torch 2.11 (cu130), triton 3.6, transformers 5.17, einops,
# tokenizers, safetensors, numpy, matplotlib, and no network. transformers uses
# flash-linear-attention (import name `fla`) for the Gated DeltaNet chunked kernels when it is
# importable; without it, it falls back to a much slower PyTorch reference. `fla-core` is pure
# Python + Triton (py3-none-any). Its Requires-Dist is `einops` (+ torch>=2.7 / triton>=3.3 for
# the cuda extra, both already on the GPU machine); einops is fetched too in case it is missing
# (it is tiny and pure Python).
#
# Run here (the build machine, which has PyPI), from the repository root:
#     bash scripts/fetch_train_wheels.sh
# Output: .whl/fla_core-*.whl, .whl/einops-*.whl  (.whl/ is git-ignored; pass it in `carry`).
set -euo pipefail
cd "$(dirname "$0")/.."
FLA_VERSION="${FLA_VERSION:-0.6.0}"
EINOPS_VERSION="${EINOPS_VERSION:-0.8.1}"
PY="${PY:-.venv/bin/python}"
mkdir -p .whl
rm -f .whl/fla_core-*.whl .whl/einops-*.whl
"$PY" -m pip download --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
    -d .whl "fla-core==${FLA_VERSION}" "einops==${EINOPS_VERSION}"
ls -la .whl
du -sh .whl
