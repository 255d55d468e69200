"""The replica's routing stats report the engine prefix cache's real block hashes (no Ray needed)."""

import asyncio
import gc
from dataclasses import replace

from conftest import ENGINE_OPTIONS

from bole.cache.block_hash import prefix_block_hashes
from bole.sampling_params import SamplingParams
from deployments.engine_client import SubRequest
from deployments.replica import BoleReplica
from deployments.replica_stats import ReplicaStats


def test_routing_stats_carry_the_engine_prefix_cache(tiny_model):
    gc.unfreeze()
    replica = BoleReplica(tiny_model, dict(ENGINE_OPTIONS), hardware="cpu")
    try:
        assert gc.get_freeze_count() > 0   # the replica's start froze its heap (freeze_startup_heap)
        stats = ReplicaStats.from_dict(replica.record_routing_stats())   # Serve's dict, read back as the router does
        assert stats.prefix_blocks == () and stats.prefix_source == "recent_prompts"
        assert stats == replace(replica.stats(), prefix_source="recent_prompts")
        prompt = list(range(3, 3 + 4 * 5))  # five full blocks of 4

        async def run():
            sub = SubRequest(prompt, SamplingParams(temperature=0, max_tokens=3), "r1")
            async for _ in replica.generate_many([sub]):
                pass
        asyncio.run(run())
        raw = replica.record_routing_stats()
        stats = ReplicaStats.from_dict(raw)
        assert stats.prefix_source == "engine_cache" and stats.engine.finished == 1 and stats.replica_id == "local"
        cached = set(stats.prefix_blocks)
        assert prefix_block_hashes(prompt, replica.block_size)[0] in cached
        assert raw["num_prefix_blocks"] == len(stats.prefix_blocks) >= 4
    finally:
        replica.engine.shutdown()
        gc.unfreeze()   # this test process's later tests collect as before
