"""Naive torch twin of the forest layout a graphed speculative step derives on the device
(kernels/tree_layout.py): the executable specification of ``StaticTree.fill``.

For B trees of exactly T nodes (parents [B, T] local, -1 = child of the request's root; padded trees
carry extra children of the root) at committed lengths num_cached [B], over block tables [B, nb]:

    forest.parents  [B*T] int32      the parents, flattened
    forest.depth    [B*T] int32      nodes on the path root..node (a child of the root: 1), capped at D
    forest.anc      [B*T, D] int32   the ancestor-or-self chain, root first, -1 padded
    forest.anc_bits [B*T, W] int64   the same set as bits (W = ceil(T / 64) words)
    positions       [B*T] int64      num_cached + depth - 1 (the token position of the node)
    kv_positions    [B*T] int64      num_cached + local index (where the node's K/V are written)
    slot_mapping    [B*T] int64      the paged KV slot of kv_positions (block table lookup)
    kv_index        [B, L] int64     the paged KV slot of key position p = 0..L-1 of each row
    mask            [B, 1, T, L]     key p is visible to node t: p < num_cached (the committed prefix),
                                     or p - num_cached is an ancestor-or-self of t

All outputs are written in place (static buffers of a CUDA graph); nothing is read back to the host.
The caller guarantees parents precede their children, depths stay within D and num_cached + T <= L
(no validation here: it would read device values on the host).
"""

from __future__ import annotations

import torch

from bole.spec.tree import PackedForest


def tree_layout_ref(parents, num_cached, tables, block_size: int, *, forest, positions, kv_positions,
                    slot_mapping, kv_index, mask, num_cached_out, state_slots=None, state_slots_out=None):
    """Write the layout of ``parents`` [B, T] into the output buffers (see the module docstring)."""
    B, T = parents.shape
    L, D, bs = kv_index.shape[1], forest.anc.shape[1], int(block_size)
    dev = parents.device
    nc = num_cached.long()
    num_cached_out.copy_(nc)
    if state_slots is not None:
        state_slots_out.copy_(state_slots)
    PackedForest.full_padded(parents, D, out=forest)
    depth, anc = forest.depth.view(B, T).long(), forest.anc.long()
    positions.copy_((nc[:, None] + depth - 1).reshape(-1))
    kvp = nc[:, None] + torch.arange(T, device=dev)[None]
    tables = tables.long()
    kv_positions.copy_(kvp.reshape(-1))
    slot_mapping.copy_((tables.gather(1, kvp // bs) * bs + kvp % bs).reshape(-1))
    pos = torch.arange(L, device=dev)
    kv_index.copy_(tables[:, pos // bs] * bs + pos % bs)
    rows = torch.arange(B * T, device=dev)[:, None].expand(B * T, D)
    tree = torch.zeros(B * T, T + 1, dtype=torch.bool, device=dev)
    tree.index_put_((rows, torch.where(anc >= 0, anc, T)),
                    torch.ones((), dtype=torch.bool, device=dev))    # a device scalar: no host sync
    tree = tree[:, :T].reshape(B, T, T)
    rel = pos[None, None, :] - nc[:, None, None]                       # [B, 1, L]
    new = tree.gather(2, rel.clamp(0, T - 1).expand(B, T, L)) & (rel >= 0) & (rel < T)
    mask.copy_(((rel < 0) | new)[:, None])
