"""``budget_used`` is <= 1 by construction: the draft nodes the depth-1 floor verifies beyond B_ver
(every request keeps its top-k children, so a batch of B verifies >= B x topk nodes) are counted
apart, as ``floor_excess_nodes``. Counted together they had read 1.26 on the served tiny model."""

from __future__ import annotations

import pytest
import yaml
from checkpoints import make_checkpoint
from engine_helpers import default_table, run_arrivals

from bole.config import EngineConfig
from bole.engine.engine import LLMEngine
from bole.engine.metrics import EngineMetrics, StepStats
from bole.llm import resolve_repo_path
from bole.models.loader import load_model
from bole.sampling_params import SamplingParams
from bole.spec.budget import CalibrationTable


def test_step_accounting():
    m = EngineMetrics()
    # batch 4, topk 3: the floor is 12 drafts, B_ver 8 -> 8 budgeted, 4 beyond
    m.record_step(StepStats(0.0, 1.0, decode_requests=4, emitted_tokens=6, tree_nodes=4 + 12, b_ver=8))
    # batch 1 well inside its budget: 5 of 16
    m.record_step(StepStats(1.0, 2.0, decode_requests=1, emitted_tokens=2, tree_nodes=1 + 5, b_ver=16))
    # a prefill-only step: its time counts, it is no decode step
    m.record_step(StepStats(2.0, 2.5, prefill_tokens=7, prefill_time=0.375, first_tokens=2, eager_prefill=True))
    snap = m.snapshot()
    assert snap["budget_used"] == (8 + 5) / (8 + 16)
    assert snap["floor_excess_nodes"] == 4 / 2
    assert (snap["step_time_s"], snap["decode_steps"], snap["eager_forwards"]) == (2.5, 2, 0)
    m.record_step(StepStats(3.0, 3.25, decode_requests=2, emitted_tokens=5, tree_nodes=9, b_ver=8,
                            eager_draft=True, eager_tail=True, verify_time=0.125))
    m.record_step(StepStats(4.0, 4.25, decode_requests=2, emitted_tokens=2, tree_nodes=2, eager_forward=True))
    snap = m.snapshot()
    assert (snap["step_time_s"], snap["decode_steps"]) == (3.0, 4)
    assert snap["decode_time_s"] == 0.125   # the decode part of the steps (StepStats.verify_time)
    assert (snap["eager_forwards"], snap["eager_drafts"], snap["eager_tails"]) == (1, 1, 1)
    # the prefilling steps: one, eagerly, 0.375 s to its two first tokens; a chunk-only step is not timed
    m.record_step(StepStats(5.0, 5.5, prefill_tokens=16, prefill_time=0.01))
    snap = m.snapshot()
    assert (snap["prefill_steps"], snap["eager_prefills"]) == (2, 1)
    assert (snap["first_token_steps"], snap["prefill_time_s"]) == (1, 0.375)


def test_served_engine_budget_used_stays_within_one(tmp_path):
    make_checkpoint(tmp_path, "dense", 32)
    with open(default_table()) as f:
        table = yaml.safe_load(f)
    for b in table["buckets"]:
        b["b_ver"] = 8   # below the paper's floor of a full batch (4 requests x topk 4 = 16 depth-1 nodes)
    cfg = EngineConfig.from_options(mode="bole", num_blocks=96, block_size=4, depth=2, topk=4, beam=2,
                                    max_num_seqs=4, calibration_table=default_table(), budget_floor="children")
    eng = LLMEngine(load_model(str(tmp_path), dtype="float32"), cfg,
                    calibration=CalibrationTable.from_dict(table))
    for p in ([1, 2, 3], [4, 5, 6, 7], [8, 9], [3, 3, 3, 3, 3]):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    snap = eng.metrics.snapshot()
    assert 0 < snap["budget_used"] <= 1.0
    # no CUDA graphs on the CPU: every decode step's draft, verify forward and acceptance ran eagerly
    assert snap["decode_steps"] > 0 and snap["step_time_s"] > 0
    assert snap["eager_forwards"] == snap["eager_drafts"] == snap["eager_tails"] == snap["decode_steps"]
    assert eng.stats().eager_drafts == snap["eager_drafts"]
    # and every prefill forward (no prefill graphs on the CPU), within the steps' time
    assert snap["eager_prefills"] == snap["prefill_steps"] >= snap["first_token_steps"] > 0
    assert 0 < snap["prefill_time_s"] < snap["step_time_s"]
    assert eng.stats().eager_prefills == snap["eager_prefills"]
    assert snap["floor_excess_nodes"] > 0
    # the old ratio (every verified draft over B_ver) is what exceeded 1
    m = eng.metrics
    assert (m.tree_nodes - m.request_steps) / m.b_ver_sum > 1.0


def test_budget_epsilon_rederives_the_installed_table(tmp_path):
    """``budget_epsilon``: the engine's table is the given one with B_ver re-derived at that ε from its
    timings, at start and for any table installed later (recalibration, a replica's reconfigure); the
    greedy tokens stay ar's. ar ignores the option; a table without timings refuses it by name."""
    make_checkpoint(tmp_path, "dense", 32)
    measured = CalibrationTable.load(resolve_repo_path("calibration_tables/cpu-bole-tiny-coder.yaml"))
    model = load_model(str(tmp_path), dtype="float32")
    opts = dict(num_blocks=96, block_size=4, depth=3, topk=2, beam=2, max_num_seqs=4,
                calibration_table=default_table())
    eng = LLMEngine(model, EngineConfig.from_options(mode="bole", budget_epsilon=50.0, **opts), calibration=measured)
    assert eng.calibration == measured.with_epsilon(50.0) != measured
    assert {b.b_ver for b in eng.calibration.buckets} == {max(measured.capture_set)}
    eng.calibration = measured                      # installed later: re-derived the same way
    assert eng.calibration.epsilon == 50.0 and eng.calibration == measured.with_epsilon(50.0)
    ar = LLMEngine(model, EngineConfig.from_options(mode="ar", budget_epsilon=50.0, **opts))
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [3, 3, 3, 3, 3]]
    assert run_arrivals(eng, prompts, [9, 7, 8, 6]) == run_arrivals(ar, prompts, [9, 7, 8, 6])
    with pytest.raises(ValueError, match="without timings"):
        LLMEngine(model, EngineConfig.from_options(mode="bole", budget_epsilon=0.5, **opts))
    with pytest.raises(ValueError, match="budget_epsilon"):
        EngineConfig.from_options(mode="bole", budget_epsilon=-1.0)
