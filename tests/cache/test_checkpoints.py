"""Checkpoint planning of speculative commits (``bole.cache.checkpoints``), pinned on small pools:
which slots a step's commit (a graph's tail or eager) writes, and what becomes of them."""

from __future__ import annotations

import pytest
import torch

from bole.cache.checkpoints import CheckpointPlanner, PendingCheckpoint, TailPlan
from bole.cache.kv_cache import BlockAllocator, blocks_needed
from bole.cache.prefix_cache import PrefixCache
from bole.cache.state_pool import StatePool
from bole.engine.sequence import Request
from bole.sampling_params import SamplingParams

B = 4   # block size; a checkpoint boundary every block


def cache_with(filled: int) -> PrefixCache:
    """A cache of 3 checkpoint slots after one request committed ``filled`` tokens one at a time
    (a checkpoint at every block end, the oldest evicted past 3)."""
    alloc, pool = BlockAllocator(32), StatePool(2, 4, 2, 3, 3, 5, 4, conv_dtype=torch.float32)
    cache = PrefixCache(alloc, pool, B, 1, 3)
    req = Request("r", list(range(filled)) or [0], SamplingParams(), seed=0)
    req.state_slot = pool.allocate()
    for n in range(1, filled + 1):
        if blocks_needed(n, B) > len(req.block_table):
            req.block_table += alloc.allocate(1)
        req.num_computed = n
        cache.publish(req)
        cache.checkpoint(req)
    return cache


def reserved(plan: TailPlan | None):
    return None if plan is None else [r and (r.slot, r.victim and r.victim.end) for r in plan.reserved]


@pytest.mark.parametrize("filled, starts, longest, tail, lengths, want_reserved, want_pending, free, kept", [
    # only the request at 2 can cross a boundary (at 4) with 3 nodes; it commits 1 and gives its slot back
    (0, [1, 2, 5], 3, True, [3, 1, 2], [None, (1, None), None], [None, None, None], 3, 0),
    # nobody can cross: nothing reserved, nothing to settle
    (0, [0, 1], 2, True, [1, 2], [], None, 3, 0),
    # one free slot (taken last-allocated first), then the least recently used checkpoint's slot
    (8, [9, 3, 14], 3, True, [3, 3, 1], [None, (3, None), (1, 4)], [None, PendingCheckpoint(4, 3), None], 0, 2),
    # a full pool: victims in LRU order; the crossing one loses its checkpoint, the other keeps its
    (12, [9, 3, 14], 3, True, [1, 3, 3], [None, (1, 4), (2, 8)],
     [None, PendingCheckpoint(4, 1), PendingCheckpoint(16, 2)], 0, 1),
])
def test_tail_plan(filled, starts, longest, tail, lengths, want_reserved, want_pending, free, kept):
    cache = cache_with(filled)
    planner = CheckpointPlanner(cache)
    plan = planner.reserve_tail(starts, longest, tail)
    assert reserved(plan) == want_reserved
    assert plan.slots == ([r and r[0] for r in want_reserved] if want_reserved else None)
    assert planner.settle_tail(plan, starts, lengths) == want_pending
    assert (cache.checkpoints.num_free, cache.num_checkpoints) == (free, kept)


@pytest.mark.parametrize("filled, starts, longest", [
    (0, [3, 6], 3),           # the tail takes no checkpoints
    (12, [1, 5, 9, 13], 4),   # four crossing paths, three victims
])
def test_tail_plan_falls_back_to_eager_and_gives_slots_back(filled, starts, longest):
    cache = cache_with(filled)
    before = (cache.checkpoints.num_free, cache.num_checkpoints)
    assert CheckpointPlanner(cache).reserve_tail(starts, longest, tail_takes_checkpoints=filled > 0) is None
    assert (cache.checkpoints.num_free, cache.num_checkpoints) == before


def test_cancel_frees_only_free_slots():
    cache = cache_with(8)
    planner = CheckpointPlanner(cache)
    plan = planner.reserve_tail([3, 14], 3, True)
    assert reserved(plan) == [(3, None), (1, 4)]
    planner.cancel(plan)
    assert (cache.checkpoints.num_free, cache.num_checkpoints) == (1, 2)
