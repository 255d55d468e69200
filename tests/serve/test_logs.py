"""deployments.logs: the servers' start log (the served paths are in tests/serve/test_launch.py; the
loggers are put back after each test by tests/conftest.py)."""

import logging

import pytest

from deployments.logs import LOGGERS, configure_logging


def test_info_records_reach_stderr_once(capsys, monkeypatch):
    monkeypatch.delenv("BOLE_LOGGING_LEVEL", raising=False)
    configure_logging()
    configure_logging()   # idempotent: still one handler each
    logging.getLogger("bole.cache.memory_plan").info("memory plan on cuda: 1 GiB")
    logging.getLogger("deployments.replica").info("replica r1 up")
    logging.getLogger("bole.engine").debug("not shown at INFO")
    err = capsys.readouterr().err
    assert err.count("memory plan on cuda: 1 GiB") == 1 and err.count("replica r1 up") == 1
    assert "not shown" not in err and "INFO" in err and "bole.cache.memory_plan" in err
    for n in LOGGERS:
        assert sum(getattr(h, "bole_server", False) for h in logging.getLogger(n).handlers) == 1


def test_level_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("BOLE_LOGGING_LEVEL", "warning")
    configure_logging()
    logging.getLogger("bole.engine").info("hidden")
    logging.getLogger("bole.engine").warning("shown")
    err = capsys.readouterr().err
    assert "shown" in err and "hidden" not in err


def test_a_bad_level_names_the_variable(monkeypatch):
    monkeypatch.setenv("BOLE_LOGGING_LEVEL", "chatty")
    with pytest.raises(ValueError, match="BOLE_LOGGING_LEVEL='CHATTY'"):
        configure_logging()
