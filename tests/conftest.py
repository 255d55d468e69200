"""Test set-up: Triton kernels run under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is imported anywhere, hence here, at collection start.
"""

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return "cuda" if _HAS_CUDA else "cpu"
