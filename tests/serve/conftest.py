"""Fixtures for the serving tests: a tiny model folder and a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_model import make_tiny_model  # noqa: E402

# Small engine shapes so CPU steps are quick; block_size 4 so short prompts span several blocks.
# Autoregressive mode by default: ~35 ms a step here against ~250 ms for tree verification on CPU;
# the speculative path is served in test_bole_mode_is_served_token_identically.
ENGINE_OPTIONS = dict(mode="ar", depth=2, topk=2, beam=2, num_blocks=128, block_size=4, max_num_seqs=4,
                      max_num_batched_tokens=64, calibration_table="calibration_tables/default.yaml")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_served_model"))


class UvicornThread:
    """A uvicorn server for ``app`` in a background thread, on a free port of 127.0.0.1."""

    def __init__(self, app):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="session")
def serve_app():
    """``with serve_app(app) as srv: httpx.get(srv.url + ...)``."""
    return UvicornThread
