"""LLMEngine and TPEngine satisfy the engine contract (``bole.engine.core.EngineCore``); what crosses
it is typed (no Ray needed: TPEngine is checked as a class)."""

import asyncio
import dataclasses
import inspect

from conftest import ENGINE_OPTIONS

from bole.engine.async_engine import AsyncEngine
from bole.engine.core import EngineCore, EngineLimits, EngineStats
from bole.engine.engine import LLMEngine
from bole.llm import build_engine
from bole.sampling_params import SamplingParams
from deployments.tp import TPEngine

MEMBERS = [m for m in dir(EngineCore) if not m.startswith("_")] + list(EngineCore.__annotations__)


def test_llm_engine_satisfies_the_contract_and_reports_dataclasses(tiny_model):
    engine = build_engine(tiny_model, **ENGINE_OPTIONS)
    assert isinstance(engine, EngineCore)
    limits = engine.limits()
    assert isinstance(limits, EngineLimits) and dataclasses.is_dataclass(limits)
    positions = engine.model.config.max_position_embeddings
    assert limits.max_model_len == min(positions, engine.capacity_tokens - engine.lookahead)
    assert limits.max_num_seqs == ENGINE_OPTIONS["max_num_seqs"]
    assert limits.block_size == ENGINE_OPTIONS["block_size"] and limits.tp_size == 1
    stats = engine.stats()
    assert type(stats) is EngineStats and stats.running == stats.waiting == 0
    assert stats.table_id == engine.calibration.table_id
    assert set(engine.metrics.snapshot()) <= {f.name for f in dataclasses.fields(EngineStats)}


def test_async_engine_publishes_engine_stats(tiny_model):
    aeng = AsyncEngine(build_engine(tiny_model, **ENGINE_OPTIONS))
    try:
        async def run():
            async for out in aeng.generate([3, 4, 5], SamplingParams(temperature=0, max_tokens=3), "r"):
                last = out
            return last
        assert asyncio.run(run()).finished
        stats = aeng.stats()
        assert type(stats) is EngineStats and stats.finished == 1 and stats.peak_batch == 1
        assert "running_ids" not in stats.to_dict() and stats.to_dict()["finished"] == 1
        assert aeng.is_alive()
    finally:
        aeng.shutdown()
    assert not aeng.is_alive()


def test_tp_engine_class_implements_every_member():
    for name in MEMBERS:
        assert hasattr(TPEngine, name) or name == "tokenizer", name   # tokenizer: set per instance
        if callable(getattr(EngineCore, name, None)) and name != "model_config":
            ours = inspect.signature(getattr(LLMEngine, name)).parameters
            theirs = inspect.signature(getattr(TPEngine, name)).parameters
            assert list(theirs)[:len(ours)] == list(ours) or list(ours) == list(theirs), name
    assert not hasattr(TPEngine, "scheduler") and not hasattr(TPEngine, "metrics")
