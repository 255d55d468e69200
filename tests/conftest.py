"""Test set-up: Triton kernels run under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is imported anywhere, hence here, at collection start.
"""

import logging
import os

import pytest

from deployments.logs import LOGGERS  # stdlib only: imports neither torch nor triton nor Ray

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


@pytest.fixture(autouse=True)
def _server_logging_restored():
    """A test that builds a server part in process (``BoleReplica``) configures the servers' loggers
    (``deployments.logs``: their own stderr handler, no propagation): put them back after every test, so
    caplog sees the records of the tests after it."""
    loggers = [logging.getLogger(n) for n in LOGGERS]
    saved = [(lg.level, list(lg.handlers), lg.propagate) for lg in loggers]
    yield
    for lg, (level, handlers, propagate) in zip(loggers, saved):
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.propagate = propagate
