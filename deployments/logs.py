"""The servers' log lines: the engine's and the Serve layer's INFO records on stderr.

A library leaves logging to its application. Here the application is the server: ``deployments.launch
--no-ray``, each Ray Serve replica and each tensor-parallel worker. Each calls ``configure_logging`` once at
start, so its start log shows, as vLLM's and SGLang's servers print theirs: the memory plan, the CUDA
graphs captured, the warm-up, "replica up". Without it those records, INFO under Python's default WARNING
root, were dropped. ``BOLE_LOGGING_LEVEL`` (default INFO) sets the level. Ray sends a replica's stderr to the
driver (``log_to_driver``) and to its log files.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGERS = ("bole", "deployments")
_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def configure_logging() -> None:
    """One stderr handler on each of ``LOGGERS`` at ``BOLE_LOGGING_LEVEL``; a second call changes nothing.
    The records stop there (no propagation), so a root logger the host process configured does not print
    them twice."""
    level = os.environ.get("BOLE_LOGGING_LEVEL", "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"BOLE_LOGGING_LEVEL={level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
    for name in LOGGERS:
        log = logging.getLogger(name)
        log.setLevel(level)
        if not any(getattr(h, "bole_server", False) for h in log.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT))
            handler.bole_server = True
            log.addHandler(handler)
        log.propagate = False
