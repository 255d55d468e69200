"""Fixtures for the serving tests: a tiny model folder and a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_model import make_tiny_model  # noqa: E402
from uvicorn_thread import UvicornThread  # noqa: E402

# Small engine shapes so CPU steps are quick; block_size 4 so short prompts span several blocks.
# Autoregressive mode by default: ~35 ms a step here against ~250 ms for tree verification on CPU;
# the speculative path is served in test_bole_mode_is_served_token_identically.
ENGINE_OPTIONS = dict(mode="ar", depth=2, topk=2, beam=2, num_blocks=128, block_size=4, max_num_seqs=4,
                      max_num_batched_tokens=64, calibration_table="calibration_tables/default.yaml")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_served_model"))


@pytest.fixture(scope="session")
def serve_app():
    """``with serve_app(app) as srv: httpx.get(srv.url + ...)``."""
    return UvicornThread


# The serving stack is an install dependency, but machines that run only the kernel and engine tests
# (the GPU machine: `pytest -m gpu tests`) may lack it: there each test module here is reported as one
# skipped item with the reason, instead of an import error that stops the whole collection.
SERVING_DEPS = ("fastapi", "pydantic", "uvicorn", "httpx", "openai", "prometheus_client", "ray")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


MISSING_SERVING_DEPS = [m for m in SERVING_DEPS if not _installed(m)]


class _MissingDeps(pytest.Item):
    def runtest(self):
        pytest.skip(f"serving dependencies not installed: {', '.join(MISSING_SERVING_DEPS)}")

    def reportinfo(self):
        return self.path, 0, self.name


class _SkippedModule(pytest.File):
    def collect(self):
        yield _MissingDeps.from_parent(self, name="serving_deps")


def pytest_pycollect_makemodule(module_path, parent):
    if MISSING_SERVING_DEPS:
        return _SkippedModule.from_parent(parent, path=module_path)
    return None
