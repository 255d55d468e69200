"""LLMEngine and TPEngine satisfy the engine contract (``bole.engine.core.EngineCore``); what crosses
it is typed (no Ray needed: TPEngine is checked as a class)."""

import asyncio
import dataclasses
import inspect
import pickle

import pytest
from conftest import ENGINE_OPTIONS

from bole.engine.async_engine import AsyncEngine
from bole.engine.core import EngineCore, EngineLimits, EngineStats, RequestTimings
from bole.engine.engine import LLMEngine
from bole.llm import build_engine
from bole.sampling_params import SamplingParams
from deployments.replica_stats import ReplicaStats
from deployments.tp import TPEngine

MEMBERS = [m for m in dir(EngineCore) if not m.startswith("_")] + list(EngineCore.__annotations__)


def test_llm_engine_satisfies_the_contract_and_reports_dataclasses(tiny_model):
    engine = build_engine(tiny_model, **ENGINE_OPTIONS)
    assert isinstance(engine, EngineCore)
    limits = engine.limits()
    assert isinstance(limits, EngineLimits) and dataclasses.is_dataclass(limits)
    positions = engine.model.config.max_position_embeddings
    assert limits.kv_tokens == engine.capacity_tokens - engine.lookahead
    assert limits.max_model_len == min(positions, limits.kv_tokens)
    assert limits.max_num_seqs == ENGINE_OPTIONS["max_num_seqs"]
    assert limits.block_size == ENGINE_OPTIONS["block_size"] and limits.tp_size == 1
    stats = engine.stats()
    assert type(stats) is EngineStats and stats.running == stats.waiting == stats.held == 0
    assert stats.table_id == engine.calibration.table_id
    assert set(engine.metrics.snapshot()) <= {f.name for f in dataclasses.fields(EngineStats)}


def test_async_engine_publishes_engine_stats(tiny_model):
    aeng = AsyncEngine(build_engine(tiny_model, **ENGINE_OPTIONS))
    try:
        async def run():
            timings = []
            async for out in aeng.generate([3, 4, 5], SamplingParams(temperature=0, max_tokens=3), "r"):
                last = out
                timings.append(aeng.request_timings("r"))   # the request stays until its stream ends
            return last, timings
        last, timings = asyncio.run(run())
        assert last.finished and len(timings) == 3 and timings[0] is not None
        assert type(timings[0]) is RequestTimings and timings[0].prefill_s > 0 and timings[0].engine_queue_s >= 0
        stats = aeng.stats()
        assert type(stats) is EngineStats and stats.finished == 1 and stats.peak_batch == 1
        assert aeng.is_alive()
    finally:
        aeng.shutdown()
    assert not aeng.is_alive()
    assert aeng.stats().held == 0   # the release sent as the stream ended was applied, and published
    assert aeng.request_timings("r") is None   # released: nothing left to time


def test_tp_engine_class_implements_every_member():
    for name in MEMBERS:
        assert hasattr(TPEngine, name) or name == "tokenizer", name   # tokenizer: set per instance
        if callable(getattr(EngineCore, name, None)) and name != "model_config":
            ours = inspect.signature(getattr(LLMEngine, name)).parameters
            theirs = inspect.signature(getattr(TPEngine, name)).parameters
            assert list(theirs)[:len(ours)] == list(ours) or list(ours) == list(theirs), name
    assert not hasattr(TPEngine, "scheduler") and not hasattr(TPEngine, "metrics")


def test_replica_stats_round_trip_through_their_one_wire_form():
    engine = EngineStats(steps=3, mat=1.5, running=2, waiting=1, held=3, running_ids=("a", "b"), table_id="t")
    stats = ReplicaStats(engine, "r1", "cpu", 4, 16, 2, False, 5, "dtype", prefix_blocks=(7, 8, 9),
                         prefix_source="engine_cache", deployment="bole")
    wire = stats.to_dict()
    assert wire["running"] == 2 and wire["refused"] == 5 and wire["num_prefix_blocks"] == 3
    assert wire["running_ids"] == ["a", "b"] and wire["prefix_blocks"] == [7, 8, 9]   # plain lists on the wire
    assert ReplicaStats.from_dict(wire) == stats and pickle.loads(pickle.dumps(stats)) == stats
    assert stats.load == 3
    engine_names = {f.name for f in dataclasses.fields(EngineStats)}
    own_names = {f.name for f in dataclasses.fields(ReplicaStats)}
    assert not engine_names & own_names   # the flat dict has one key per field
    with pytest.raises(ValueError, match="unknown replica stats keys: \\['mystery'\\]"):
        ReplicaStats.from_dict({**wire, "mystery": 1})
    with pytest.raises(TypeError, match="engine must be an EngineStats"):
        ReplicaStats(dict(vars(engine)), "r1", "cpu", 4, 16, 2, False, 5, "")


def test_a_dead_engine_is_a_retryable_503_for_the_ingress():
    """``EngineDead`` out of the AsyncEngine leaves the replica's client as ``EngineUnavailable`` naming the
    replica: the ingress retries it on another replica before any output, else answers 503."""
    from bole.errors import EngineDead
    from deployments.engine_client import EngineUnavailable, LocalEngineClient, SubRequest
    from deployments.http_errors import engine_error
    from deployments.retry import retryable

    class Dead:
        async def generate(self, *a):
            raise EngineDead("the engine failed and serves no more requests (ConnectionError: gone)")
            yield

    client = object.__new__(LocalEngineClient)
    client.async_engine, client.replica_id, client.hardware_class = Dead(), "r1", "cpu"

    async def main():
        async for _ in client._one(SubRequest([1], SamplingParams(), "a")):
            pass
    with pytest.raises(EngineUnavailable, match="serves no more") as e:
        asyncio.run(main())
    assert e.value.replica_id == "r1" and retryable(e.value)
    assert engine_error(e.value, "a").status == 503
