"""A table's execution (eager or CUDA-graph sweep) against the engine's: ``table_mismatch`` names it, and
an engine's limits say whether it replays graphs."""

import dataclasses

import pytest

from bole.hardware import table_execution, table_mismatch
from bole.llm import resolve_repo_path
from bole.models.loader import read_config
from bole.spec.budget import CalibrationTable

EAGER_TABLE = resolve_repo_path("calibration_tables/h200-bole-tiny-coder.yaml")


@pytest.fixture
def eager():
    return CalibrationTable.load(EAGER_TABLE)


def graphed_copy(table):
    how = "cuda graphs: runner.decode / runner.verify through the runner's DecodeGraphs / VerifyGraphs"
    return dataclasses.replace(table, provenance={**table.provenance, "execution": how})


def mismatch(table, cuda_graphs):
    _, cfg = read_config(resolve_repo_path("models/bole-tiny-coder"))   # the shapes the table was measured on
    return table_mismatch(table, cfg, table.dtype, table.tp_size, table.hardware, cuda_graphs)


def test_execution_is_read_from_the_provenance(eager):
    assert table_execution(eager) == "eager"
    assert table_execution(graphed_copy(eager)) == "graphs"
    assert table_execution(dataclasses.replace(eager, provenance={})) is None
    assert table_execution(CalibrationTable.load(resolve_repo_path("calibration_tables/default.yaml"))) is None


def test_eager_table_on_a_graphed_engine_is_a_mismatch(eager):
    assert mismatch(eager, True) == {"execution": ("eager", "graphs")}
    assert mismatch(graphed_copy(eager), False) == {"execution": ("graphs", "eager")}


def test_matching_or_unknown_execution_is_not(eager):
    assert mismatch(eager, False) == {}
    assert mismatch(graphed_copy(eager), True) == {}
    assert mismatch(eager, None) == {}                       # caller did not say: not compared
    assert mismatch(dataclasses.replace(eager, provenance={}), True) == {}


def test_cpu_engine_limits_say_eager():
    from bole.llm import build_engine

    eng = build_engine(resolve_repo_path("models/bole-tiny-coder"), device="cpu", mode="ar", enable_cuda_graphs=True)
    assert eng.limits().cuda_graphs is False    # graphs are GPU-only: the CPU engine runs eagerly
