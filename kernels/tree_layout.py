"""The forest layout of a graphed speculative step in ONE Triton launch (twin:
``bole.ops.tree_layout.tree_layout_ref``, whose docstring defines every output).

Why a kernel: the torch composition is ~80 small launches per tree (an ancestor walk of D gathers,
bitmasks, the [B, T, L] attention mask), and a step lays out one tree per drafter level plus the
verified tree. At batch 1 on an H200 those launches, not the FLOPs, set the step time.

Grid (B, ceil(T / BT)): a program walks BT nodes of one tree up to D ancestors (parents are local
indices, loaded per step of the walk), writes their per-node outputs, then their rows of the mask over
the L keys; the first program of a row also writes its kv_index row, num_cached and state slot. The
ancestor-or-self set is kept as up to four 64-bit words (T <= 256), so the mask needs no [T, T] matrix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_tensor
from kernels.limits import LAYOUT_MAX_NODES

_INDEX = (torch.int32, torch.int64)


@triton.jit
def tree_layout_kernel(
    par, nc_in, tab, slots_in,
    par_out, depth_out, anc_out, bits_out, pos_out, kvpos_out, slot_out, kvidx_out, mask_out, nc_out, slots_out,
    T, L, bs, s_pb, s_pt, s_nc, s_tb, s_tn, s_sl, s_bits,
    D: tl.constexpr, DP: tl.constexpr, NW: tl.constexpr, HAS_SLOTS: tl.constexpr,
    BT: tl.constexpr, BL: tl.constexpr,
):
    b, tb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t = tb * BT + tl.arange(0, BT)
    tm = t < T
    n = b * T + t                                                   # flat node index
    nc = tl.load(nc_in + b * s_nc).to(tl.int64)
    p_par = par + b * s_pb
    # the walk: depth first (the chain's length), then the root-first chain and its bits
    cur = tl.where(tm, t, -1).to(tl.int64)
    depth = tl.zeros([BT], dtype=tl.int32)
    for _ in tl.static_range(D):
        ok = cur >= 0
        depth += ok.to(tl.int32)
        cur = tl.where(ok, tl.load(p_par + cur * s_pt, mask=ok, other=-1).to(tl.int64), -1)
    cols = tl.arange(0, DP)
    anc = tl.full([BT, DP], -1, dtype=tl.int32)
    w0 = tl.zeros([BT], dtype=tl.int64)
    w1 = tl.zeros([BT], dtype=tl.int64)
    w2 = tl.zeros([BT], dtype=tl.int64)
    w3 = tl.zeros([BT], dtype=tl.int64)
    one = tl.full([BT], 1, dtype=tl.int64)
    cur = tl.where(tm, t, -1).to(tl.int64)
    for i in tl.static_range(D):
        ok = cur >= 0
        at = (depth - 1 - i)[:, None] == cols[None, :]
        anc = tl.where(at & ok[:, None], cur.to(tl.int32)[:, None], anc)
        bit = one << (tl.where(ok, cur, 0) % 64)
        w0 = w0 | tl.where(ok & (cur < 64), bit, 0)
        w1 = w1 | tl.where(ok & (cur >= 64) & (cur < 128), bit, 0)
        w2 = w2 | tl.where(ok & (cur >= 128) & (cur < 192), bit, 0)
        w3 = w3 | tl.where(ok & (cur >= 192), bit, 0)
        cur = tl.where(ok, tl.load(p_par + cur * s_pt, mask=ok, other=-1).to(tl.int64), -1)
    tl.store(par_out + n, tl.load(p_par + t * s_pt, mask=tm, other=-1).to(tl.int32), mask=tm)
    tl.store(depth_out + n, depth, mask=tm)
    tl.store(anc_out + n[:, None] * D + cols[None, :], anc, mask=tm[:, None] & (cols[None, :] < D))
    tl.store(bits_out + n * s_bits, w0, mask=tm)
    if NW > 1:
        tl.store(bits_out + n * s_bits + 1, w1, mask=tm)
    if NW > 2:
        tl.store(bits_out + n * s_bits + 2, w2, mask=tm)
    if NW > 3:
        tl.store(bits_out + n * s_bits + 3, w3, mask=tm)
    p_tab = tab + b * s_tb
    tl.store(pos_out + n, nc + depth.to(tl.int64) - 1, mask=tm)
    kvp = nc + t
    tl.store(kvpos_out + n, kvp, mask=tm)
    blk = tl.load(p_tab + (kvp // bs) * s_tn, mask=tm, other=0).to(tl.int64)
    tl.store(slot_out + n, blk * bs + kvp % bs, mask=tm)
    if tb == 0:
        tl.store(nc_out + b, nc)
        if HAS_SLOTS:
            tl.store(slots_out + b, tl.load(slots_in + b * s_sl).to(tl.int64))
    # the mask rows of these nodes over the L keys: the committed prefix, then ancestor-or-self bits
    l0 = tl.program_id(1) * 0   # a while loop: the interpreter cannot range() over a runtime bound
    while l0 < L:
        p = l0 + tl.arange(0, BL)
        pm = p < L
        rel = p - nc
        in_tree = (rel >= 0) & (rel < T)
        r = tl.where(in_tree, rel, 0)
        word = tl.where((r < 64)[None, :], w0[:, None], w1[:, None])
        if NW > 2:
            word = tl.where((r >= 128)[None, :], w2[:, None], word)
        if NW > 3:
            word = tl.where((r >= 192)[None, :], w3[:, None], word)
        hit = ((word >> (r % 64)[None, :]) & 1) != 0
        m = (rel < 0)[None, :] | (in_tree[None, :] & hit)
        tl.store(mask_out + (b * T + t[:, None]) * L + p[None, :], m.to(tl.int8), mask=tm[:, None] & pm[None, :])
        if tb == 0:
            kb = tl.load(p_tab + (p // bs) * s_tn, mask=pm, other=0).to(tl.int64)
            tl.store(kvidx_out + b * L + p, kb * bs + p % bs, mask=pm)
        l0 += BL


def _check_out(name, t, shape, dtype, device):
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype \
            or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, got "
                         f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")


def tree_layout(parents, num_cached, tables, block_size: int, *, forest, positions, kv_positions, slot_mapping,
                kv_index, mask, num_cached_out, state_slots=None, state_slots_out=None):
    """``bole.ops.tree_layout.tree_layout_ref`` in one launch; same arguments, outputs written in place.

    The caller guarantees num_cached + T <= L for every row (a graph's key does: its KV bucket covers
    the committed prefix and the tree): checking it would read num_cached on the host. The twin
    raises on an out-of-range block lookup; the kernel would read past the table.
    """
    dev = parents.device
    check_tensor("parents", parents, 2, _INDEX, dev)
    check_tensor("num_cached", num_cached, 1, _INDEX, dev)
    check_tensor("tables", tables, 2, _INDEX, dev)
    B, T = parents.shape
    if not 1 <= T <= LAYOUT_MAX_NODES:
        raise ValueError(f"trees of {T} nodes: the layout kernel takes 1..{LAYOUT_MAX_NODES}")
    if num_cached.shape[0] != B or tables.shape[0] != B:
        raise ValueError(f"num_cached {tuple(num_cached.shape)} and tables {tuple(tables.shape)} must have "
                         f"{B} rows (parents {tuple(parents.shape)})")
    bs = int(block_size)
    if bs < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    L, D = kv_index.shape[1], forest.anc.shape[1]
    if tables.shape[1] * bs < L:
        raise ValueError(f"tables of {tables.shape[1]} blocks of {bs} cannot cover {L} keys")
    if not 1 <= D <= 16:
        raise ValueError(f"max depth {D} outside 1..16")
    N, W = B * T, forest.anc_bits.shape[1]
    for name, t, shape, dtype in (("forest.parents", forest.parents, (N,), torch.int32),
                                  ("forest.depth", forest.depth, (N,), torch.int32),
                                  ("forest.anc", forest.anc, (N, D), torch.int32),
                                  ("forest.anc_bits", forest.anc_bits, (N, (T + 63) // 64), torch.int64),
                                  ("positions", positions, (N,), torch.int64),
                                  ("kv_positions", kv_positions, (N,), torch.int64),
                                  ("slot_mapping", slot_mapping, (N,), torch.int64),
                                  ("kv_index", kv_index, (B, L), torch.int64),
                                  ("mask", mask, (B, 1, T, L), torch.bool),
                                  ("num_cached_out", num_cached_out, (B,), torch.int64)):
        _check_out(name, t, shape, dtype, dev)
    if state_slots is not None:
        check_tensor("state_slots", state_slots, 1, _INDEX, dev)
        _check_out("state_slots_out", state_slots_out, (B,), torch.int64, dev)
    BT = min(32, triton.next_power_of_2(T))
    grid = (B, triton.cdiv(T, BT))
    slots = state_slots if state_slots is not None else num_cached
    tree_layout_kernel[grid](
        parents, num_cached, tables, slots,
        forest.parents, forest.depth, forest.anc, forest.anc_bits, positions, kv_positions, slot_mapping,
        kv_index, mask.view(torch.int8), num_cached_out, state_slots_out if state_slots is not None else num_cached_out,
        T, L, bs, parents.stride(0), parents.stride(1), num_cached.stride(0), tables.stride(0), tables.stride(1),
        slots.stride(0), W,
        D=D, DP=triton.next_power_of_2(D), NW=W, HAS_SLOTS=state_slots is not None,
        BT=BT, BL=128, num_warps=4)
