#!/usr/bin/env bash
# Download the serving stack that benchmarks/run_gpu_agent.sh installs offline on the GPU machine.
#
# The GPU image (Python 3.12, torch 2.11, triton 3.6, transformers 5.17) lacks fastapi, starlette,
# uvicorn, pydantic, openai and Ray. The --no-ray server (python -m deployments.launch ... --no-ray)
# and serve_load.py's openai client need the packages below, pinned to the versions this repository's
# venv tests with; packages the image has (anyio, h11, idna, typing-extensions, prometheus-client,
# annotated-doc) are fetched too, because fastapi / pydantic / openai need newer ones than an image
# may hold (pydantic 2.14: typing-extensions >= 4.16; openai 3.x: anyio >= 4.10, httpx2: idna >= 3.18).
# Two are compiled (pydantic-core, jiter: cp312 manylinux); the rest are pure Python. ~6.5 MiB.
#
# Run here (the build machine, which has PyPI), from the repository root:
#     bash scripts/fetch_serve_wheels.sh
# Output: .gpuwhl/*.whl beside what is there (git-ignored; pass it in `carry`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
mkdir -p .gpuwhl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpuwhl \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 h11==0.16.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.2 \
    openai==3.60.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 anyio==4.16.0 sniffio==1.3.1 \
    idna==3.20 jiter==0.19.0 typing-extensions==4.16.0 prometheus-client==0.26.0
ls -la .gpuwhl
du -sh .gpuwhl
