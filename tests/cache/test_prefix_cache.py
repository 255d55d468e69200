"""PrefixCache on its own (no model): matching, restore points, reference counts, LRU eviction of
KV blocks and of checkpoints with separate budgets, MTP completeness, the router's chain hashes."""

from __future__ import annotations

import pytest
import torch

from bole.cache.block_hash import prefix_block_hashes
from bole.cache.kv_cache import BlockAllocator, blocks_needed
from bole.cache.prefix_cache import PrefixCache
from bole.cache.state_pool import StatePool
from bole.engine.sequence import Request
from bole.sampling_params import SamplingParams

B = 4


class Harness:
    """A cache over small pools and a fake 'model' whose GDN state after n tokens is the value n."""

    def __init__(self, num_blocks=16, num_slots=4, num_ckpts=3, interval=1, track_mtp=False):
        self.alloc = BlockAllocator(num_blocks)
        self.pool = StatePool(2, num_slots, 2, 3, 3, 5, 4, conv_dtype=torch.float32)
        self.cache = PrefixCache(self.alloc, self.pool, B, interval, num_ckpts, track_mtp)
        self.ids = 0

    def admit(self, tokens) -> Request:
        self.ids += 1
        req = Request(f"r{self.ids}", list(tokens), SamplingParams(), seed=0)
        self.cache.share(req, self.cache.match(tokens))
        req.state_slot = self.pool.allocate()
        self.cache.restore(req)
        return req

    def compute(self, req: Request, upto: int, step: int = 1) -> None:
        """Advance req to ``upto`` committed tokens, ``step`` at a time, as the engine would."""
        while req.num_computed < upto:
            n = min(step, upto - req.num_computed)
            need = blocks_needed(req.num_computed + n, B) - len(req.block_table)
            if need > 0:
                if self.alloc.num_free < need:
                    self.cache.evict(need - self.alloc.num_free)
                req.block_table += self.alloc.allocate(need)
            req.num_computed += n
            self.pool.ssm[:, req.state_slot] = float(req.num_computed)
            self.cache.publish(req)
            self.cache.checkpoint(req)

    def finish(self, req: Request) -> None:
        self.cache.release(req)
        self.pool.free(req.state_slot)

    def assert_accounted(self, private: int = 0) -> None:
        c = self.cache
        assert self.alloc.num_free + c.num_cached_blocks + private == self.alloc.num_blocks
        assert c.checkpoints.num_free + c.num_checkpoints == c.checkpoint_budget


def test_chain_hashes_are_the_routers():
    h = Harness()
    tokens = [5, 1, 2, 9, 4, 4, 6, 1, 0, 3, 2, 2, 8]
    h.compute(h.admit(tokens), len(tokens))
    assert h.cache.summary() == prefix_block_hashes(tokens, B)
    assert h.cache.summary(limit=2) == prefix_block_hashes(tokens, B)[-2:]


def test_chain_hash_wire_values_are_pinned():
    # the router and every replica must agree across versions: a changed seed or encoding fails here
    assert prefix_block_hashes(list(range(10)), 4) == [-6131645867168517519, 8319581474130825117]


def test_match_restores_the_deepest_checkpoint_and_leaves_a_token():
    h = Harness(interval=2)                      # checkpoints every 8 tokens
    a = h.admit(list(range(14)))
    h.compute(a, 14)
    assert h.cache.num_cached_blocks == 3 and h.cache.num_checkpoints == 1
    h.finish(a)
    for tokens, restored in ((list(range(14)), 8), (list(range(8)), 0), (list(range(9)), 8),
                             (list(range(7)) + [99] * 5, 0)):
        r = h.admit(tokens)
        assert r.num_computed == restored and len(r.block_table) == restored // B
        assert float(h.pool.ssm[0, r.state_slot, 0, 0, 0]) == float(restored)  # the state at `restored`
        h.finish(r)
    h.assert_accounted()


def test_running_requests_are_never_evicted_and_refcounts_return_to_zero():
    h = Harness(num_blocks=8)
    a = h.admit(list(range(12)))
    h.compute(a, 12)
    b = h.admit(list(range(12)) + [7, 7, 7])     # shares a's three blocks
    assert b.num_computed == 12 and b.block_table == a.block_table
    assert [n.ref for n in b.prefix_nodes] == [2, 2, 2]
    h.compute(b, 15)
    h.finish(a)
    assert h.cache.evict(100) == 0               # b still uses all of them
    assert h.alloc.num_free == 8 - 3 - 1         # b's private tail block
    h.assert_accounted(private=1)
    h.finish(b)
    assert all(n.ref == 0 for n in h.cache._nodes)
    assert h.cache.clear() == 3
    assert h.alloc.num_free == 8 and h.cache.checkpoints.num_free == 3
    h.assert_accounted()


def test_eviction_is_lru_over_leaves_and_takes_unrestorable_leaves_first():
    h = Harness(num_blocks=12, num_ckpts=8, interval=2)
    old = h.admit([1] * 8)
    h.compute(old, 8)                            # two blocks, checkpoint at the leaf
    h.finish(old)
    new = h.admit([2] * 12)
    h.compute(new, 12)                           # three blocks, the leaf has no checkpoint
    h.finish(new)
    assert h.cache.evict(1) == 1                 # the newer but unrestorable leaf goes first
    r = h.admit([2] * 9)
    assert r.num_computed == 8                   # ... and [2] * 8 is now the most recently used
    h.finish(r)
    assert h.cache.evict(1) == 1                 # so [1] * 8's leaf goes next
    assert h.admit([1] * 9).num_computed == 0
    assert h.admit([2] * 9).num_computed == 8
    h.assert_accounted()


def test_checkpoint_budget_is_separate_and_lru():
    h = Harness(num_blocks=32, num_ckpts=2)
    reqs = []
    for k in range(3):                           # 3 chains of one block: 3 checkpoints wanted
        r = h.admit([k] * 4 + [0])
        h.compute(r, 4)
        reqs.append(r)
    assert h.cache.num_checkpoints == 2 and h.cache.evicted_checkpoints == 1
    assert h.cache.num_cached_blocks == 3        # KV blocks are not evicted with checkpoints
    for r in reqs:
        h.finish(r)
    assert [h.admit([k] * 4 + [0]).num_computed for k in range(3)] == [0, 4, 4]
    h.assert_accounted()


def test_concurrent_copies_of_a_block_are_deduplicated():
    h = Harness()
    a, b = h.admit(list(range(9))), h.admit(list(range(9)))
    h.compute(a, 8)
    h.compute(b, 8)                              # same blocks computed twice: b adopts a's
    assert b.block_table == a.block_table and h.cache.num_cached_blocks == 2
    assert [n.ref for n in a.prefix_nodes] == [2, 2]
    h.finish(a)
    h.finish(b)
    h.cache.clear()
    assert h.alloc.num_free == h.alloc.num_blocks


def test_speculative_matches_need_complete_drafter_entries():
    h = Harness(track_mtp=True)
    a = h.admit(list(range(13)))
    h.compute(a, 12)
    a.mtp_computed = 5                           # the drafter has seen positions < 5 only
    h.cache.mark_drafted(a)
    assert [n.mtp_complete for n in a.prefix_nodes] == [True, False, False]
    assert h.admit(list(range(13))).num_computed == 4
    a.mtp_computed = 12
    h.cache.mark_drafted(a)
    assert h.admit(list(range(13))).num_computed == 12


def test_a_finished_requests_undrafted_checkpoints_are_freed():
    h = Harness(num_ckpts=4, track_mtp=True)
    r = h.admit(list(range(13)))
    h.compute(r, 12)                             # checkpoints at 4, 8 and 12
    r.mtp_computed = 8                           # the drafter has covered positions < 8 only
    h.cache.mark_drafted(r)
    h.finish(r)
    assert h.cache.num_checkpoints == 2          # 12's block was never drafted over: no match reaches it
    assert h.admit(list(range(13))).num_computed == 8
    h.assert_accounted()


def test_chunk_alignment_and_path_cuts():
    c = Harness(interval=2).cache                # boundaries every 8 tokens
    assert c.align_chunk(0, 16) == 16 and c.align_chunk(0, 19) == 16 and c.align_chunk(3, 6) == 5
    assert c.align_chunk(8, 5) == 5              # no boundary inside: the chunk is kept
    assert c.path_cut(6, 4) == 2 and c.path_cut(6, 2) == 0 and c.path_cut(8, 4) == 0
    assert c.path_cut(15, 2) == 1                # [15, 17) jumps over 16
    with pytest.raises(ValueError):
        PrefixCache(BlockAllocator(2), StatePool(1, 1, 1, 1, 1, 1, 2), 0)


def test_superseded_checkpoints_are_evicted_before_older_leaves():
    h = Harness(num_blocks=32, num_ckpts=3)
    x = h.admit([1] * 5)
    h.compute(x, 4)                              # X4: the oldest checkpoint, a leaf
    y = h.admit([2] * 9)
    h.compute(y, 8)                              # Y4 then Y8: Y4 is superseded by Y8
    for r in (x, y):
        h.finish(r)
    assert h.cache.num_checkpoints == 3
    z = h.admit([3] * 5)
    h.compute(z, 4)                              # the pool is full: Y4 goes, not the older X4
    h.finish(z)
    assert [h.admit(t).num_computed for t in ([1] * 5, [2] * 9, [2] * 4 + [7] * 5, [3] * 5)] == [4, 8, 0, 4]
    h.assert_accounted()


def test_a_reservation_never_evicts_a_kept_checkpoint():
    """``reserve_checkpoint(keep=...)`` takes the next victim in eviction order past the kept blocks (the
    engine keeps those a request of the step found at its boundary), and nothing when all are kept."""
    h = Harness(num_blocks=32, num_ckpts=2)
    for k in (1, 2):                             # X4 the older checkpoint, then Y4
        r = h.admit([k] * 5)
        h.compute(r, 4)
        h.finish(r)
    x, y = h.cache.checkpointed([1] * 4), h.cache.checkpointed([2] * 4)
    assert x is not None and y is not None and h.cache.checkpointed([3] * 4) is None
    assert h.cache.checkpointed([1] * 3) is None   # not a whole block
    slot = h.cache.reserve_checkpoint(keep={x})   # LRU would take X4: Y4 goes
    assert slot is not None and h.cache.checkpointed([1] * 4) is x and h.cache.checkpointed([2] * 4) is None
    assert h.cache.reserve_checkpoint(keep={x}) is None and h.cache.checkpointed([1] * 4) is x
    assert h.cache.reserve_checkpoint(evict=False) is None
    h.cache.checkpoints.free(slot)
    assert h.cache.evicted_checkpoints == 1
    h.assert_accounted()


def test_a_branch_point_is_kept_like_a_leaf():
    h = Harness(num_blocks=32, num_ckpts=3)
    y = h.admit([2] * 9)
    h.compute(y, 8)                              # Y4, Y8
    h.finish(y)
    b = h.admit([2] * 4 + [7] * 5)               # leaves Y's path after Y4: restores from it ...
    assert b.num_computed == 4
    h.compute(b, 8)                              # ... and takes B8: Y4 has two children now
    h.finish(b)
    x = h.admit([1] * 5)
    h.compute(x, 4)                              # nothing is superseded: plain LRU, Y8 goes
    h.finish(x)
    assert [h.admit(t).num_computed for t in ([2] * 4 + [5] * 5, [2] * 4 + [7] * 5, [1] * 5, [2] * 9)] == \
        [4, 8, 4, 4]
    h.assert_accounted()


def test_queued_conversations_keep_their_deepest_checkpoint():
    # the agent replay under queueing: more conversations than running slots, each turn the previous
    # prompt + answer + a new message; as in the engine, a prefill takes one checkpoint (its chunk is
    # cut at the last boundary) and decode one at every boundary. 6 conversations take ~5 checkpoints
    # a turn against 8 slots: under plain LRU each conversation's checkpoints are gone before its next
    # turn and every later turn hits nothing; here every later turn restores from its previous
    # answer's deepest checkpoint
    h = Harness(num_blocks=400, num_slots=4, num_ckpts=8)
    convs = [[100 + c] * 6 for c in range(6)]
    restored, deepest = [], []
    for turn in range(3):
        for c, prompt in enumerate(convs):
            answer = [(c * 7 + turn * 3 + i) % 50 for i in range(17)]   # 17 generated tokens
            r = h.admit(prompt + answer)         # the engine appends the answer as it goes
            restored.append(r.num_computed)
            h.compute(r, h.cache.align_chunk(r.num_computed, len(prompt) - r.num_computed) + r.num_computed,
                      step=len(prompt))          # the prefill: one chunk up to its last boundary ...
            h.compute(r, len(prompt), step=len(prompt))
            h.compute(r, len(prompt) + len(answer) - 1)                 # ... then decode token by token
            deepest.append((len(prompt) + len(answer) - 1) // B * B)
            h.finish(r)
            convs[c] = prompt + answer + [60 + turn]
    assert restored[:6] == [0] * 6
    assert restored[6:] == deepest[:-6]          # every later turn restores from its previous turn's end
    h.assert_accounted()


def test_below_counts_stay_exact_under_random_use():
    import random
    rng = random.Random(0)
    h = Harness(num_blocks=48, num_slots=8, num_ckpts=5)
    live = []

    def subtree(node):
        return sum((c.checkpoint is not None) + subtree(c) for c in node.children.values())

    for _ in range(300):
        op = rng.random()
        if op < 0.4 and len(live) < 6:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(2, 20))]
            r = h.admit(tokens)
            if len(r.block_table) + blocks_needed(len(tokens), B) <= h.alloc.num_free + h.cache.num_cached_blocks - 8:
                live.append((r, tokens))
            else:
                h.finish(r)
        elif op < 0.8 and live:
            r, tokens = rng.choice(live)
            r.all_token_ids = list(tokens)
            h.compute(r, rng.randrange(r.num_computed, len(tokens)))
        elif live:
            r, _ = live.pop(rng.randrange(len(live)))
            h.finish(r)
        else:
            h.cache.evict(rng.randrange(1, 4))
        nodes = [h.cache.root, *h.cache._nodes]
        assert all(n.below == subtree(n) for n in nodes)
