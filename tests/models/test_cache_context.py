"""Block allocator, KV cache slots and moves, state pool slots, ForwardContext validation, backends."""

import logging

import pytest
import torch

from bole.backend import available_backends, resolve_backend
from bole.cache.kv_cache import BlockAllocator, PagedKVCache
from bole.cache.state_pool import StatePool
from bole.models.context import ForwardContext, TreeFactors
from bole.spec.tree import PackedForest


def test_block_allocator():
    a = BlockAllocator(4)
    assert a.num_free == 4 and a.can_allocate(4) and not a.can_allocate(5)
    got = a.allocate(3)
    assert len(set(got)) == 3 and a.num_free == 1
    with pytest.raises(ValueError, match="cannot allocate 2"):
        a.allocate(2)
    a.free(got[:2])
    assert a.num_free == 3
    with pytest.raises(ValueError, match="double free"):
        a.free([got[0]])


def test_kv_slots_write_gather_move():
    kv = PagedKVCache(2, 8, 4, 2, 3, dtype=torch.float32)
    table = [5, 2, 7]
    slots = kv.slots_for(table, torch.arange(10))
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]
    with pytest.raises(ValueError, match="past the request"):
        kv.slots_for(table, torch.tensor([12]))
    k, v = torch.randn(10, 2, 3), torch.randn(10, 2, 3)
    kv.write(1, slots, k, v)
    gk, gv = kv.gather(1, slots)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert torch.equal(kv.k(1)[5, 1], k[1])
    kv.move(slots[[6, 9]], slots[[4, 5]])  # overlapping-safe gather then scatter
    gk, _ = kv.gather(1, slots)
    assert torch.equal(gk[4], k[6]) and torch.equal(gk[5], k[9])


def test_state_pool_allocate_zeroes():
    p = StatePool(3, 2, 4, 8, 16, 40, 4, conv_dtype=torch.float32)
    assert p.ssm.shape == (3, 2, 4, 8, 16) and p.ssm.dtype == torch.float32 and p.ssm.stride(-1) == 1
    assert p.conv.shape == (3, 2, 40, 3)
    s = p.allocate()
    p.ssm[:, s] = 1.0
    p.conv[:, s] = 1.0
    p.free(s)
    s2 = p.allocate()
    assert s2 == s and p.ssm[:, s2].abs().sum() == 0 and p.conv[:, s2].abs().sum() == 0
    p.allocate()
    with pytest.raises(ValueError, match="no free state slot"):
        p.allocate()


def test_context_positions_and_validation(checkpoints):
    kv = PagedKVCache(1, 8, 4, 2, 16, dtype=torch.float32)
    ctx = ForwardContext.build("prefill", [3, 2], [5, 0], [0, 1], [[0, 1, 2], [3]], kv, None)
    assert ctx.positions.tolist() == [5, 6, 7, 0, 1] and ctx.cu_seqlens.tolist() == [0, 3, 5]
    assert ctx.slot_mapping.tolist() == [5, 6, 7, 12, 13]
    # the layers' prefill routing: sync-free (recurrence, one-launch attention) below FLA_MIN_TOKENS in all
    from bole.backend import FLA_MIN_TOKENS
    assert ctx.sync_free and FLA_MIN_TOKENS > 5
    big = PagedKVCache(1, 64, 4, 2, 16, dtype=torch.float32)
    n = FLA_MIN_TOKENS // 2
    routed = [ForwardContext.build("prefill", [n, m], [0, 0], [0, 1], [list(range(32)), list(range(32, 64))], big,
                                   None).sync_free for m in (FLA_MIN_TOKENS - 1 - n, FLA_MIN_TOKENS - n)]
    assert routed == [True, False]
    assert not ForwardContext.build("decode", [1], [3], [0], [[0]], kv, None).sync_free
    with pytest.raises(ValueError, match="exactly one token"):
        ForwardContext.build("decode", [2], [0], [0], [[0]], kv, None)
    with pytest.raises(ValueError, match="needs a PackedForest"):
        ForwardContext.build("verify", [2], [0], [0], [[0]], kv, None)
    with pytest.raises(ValueError, match="mode must be"):
        ForwardContext.build("train", [2], [0], [0], [[0]], kv, None)
    with pytest.raises(ValueError, match="state_slots has 1 entries for 2"):
        ForwardContext.build("prefill", [1, 1], [0, 0], [0], [[0], [1]], kv, None)
    # verify: positions = cached + depth - 1, KV at cached + node index
    from bole.config import ModelConfig
    from bole.models.loader import read_config
    _, cfg = read_config(checkpoints("dense").path)
    forest = PackedForest.from_trees([[-1, 0, -1, 1], [-1]])
    f = TreeFactors.allocate(cfg, 5)
    ctx = ForwardContext.build("verify", None, [6, 2], [0, 1], [[0, 1, 2], [3]], kv, None, forest=forest,
                               factors=f)
    assert ctx.positions.tolist() == [6, 7, 6, 8, 2]
    assert ctx.kv_positions.tolist() == [6, 7, 8, 9, 2]
    with pytest.raises(ValueError, match="factor buffer holds 4"):
        ForwardContext.build("verify", None, [6, 2], [0, 1], [[0, 1, 2], [3]], kv, None, forest=forest,
                             factors=TreeFactors.allocate(cfg, 4))
    assert isinstance(cfg, ModelConfig)


def test_backend_registry(caplog):
    assert {"torch", "triton"} <= set(available_backends())
    with caplog.at_level(logging.INFO, logger="bole.backend"):
        b = resolve_backend("auto", "cpu")
    assert b.name == "torch" and "auto -> torch" in caplog.text
    with pytest.raises(ValueError, match="unknown GDN backend"):
        resolve_backend("cuda-magic")
