"""The static forest context the speculative graphs run over, and their tree widths.

``StaticTree`` is what the draft and verify graphs both build on: a verify-mode ``ForwardContext``
over fixed buffers for Bc trees of Tc nodes, and ``fill`` (inside the graph) deriving the forest,
positions, KV slots and the attention layout from num_cached, parents and block tables on the device.
"""

from __future__ import annotations

from typing import Callable

import torch

from bole.models.context import ForwardContext, PaddedAttention
from bole.ops.tree_layout import tree_layout_ref
from bole.spec.tree import PackedForest
from kernels.limits import LAYOUT_MAX_NODES


class StaticTree:
    """A verify-mode ``ForwardContext`` over static buffers: Bc trees of exactly Tc nodes, Lc keys per
    row, tree depth <= D. ``fill`` (graph-capturable: device ops only) lays out the step's trees."""

    def __init__(self, Bc: int, Tc: int, Lc: int, D: int, kv_cache, state_pool, factors, device,
                 layout: Callable | None = None):
        N = Bc * Tc
        self.Bc, self.Tc, self.Lc, self.D = Bc, Tc, Lc, D
        self.block_size = kv_cache.block_size
        dev = torch.device(device)
        z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=dev)
        self.forest = PackedForest.full_padded(torch.full((Bc, Tc), -1, dtype=torch.long, device=dev), D)
        self.positions, self.kv_positions, self.slot_mapping = z(N), z(N), z(N)
        self.state_slots, self.num_cached = z(Bc), z(Bc)
        self.pa = PaddedAttention(kv_index=z(Bc, Lc), mask=z(Bc, 1, Tc, Lc, dtype=torch.bool),
                                  rows=torch.arange(N, device=dev), tq=Tc)
        self.ctx = ForwardContext(
            mode="verify", cu_seqlens=self.forest.cu_seqlens, num_cached=self.num_cached,
            positions=self.positions, kv_positions=self.kv_positions, slot_mapping=self.slot_mapping,
            kv_slots=[], state_slots=self.state_slots, block_tables=[], cu_host=list(range(0, N + 1, Tc)),
            num_cached_host=[], kv_cache=kv_cache, state_pool=state_pool, forest=self.forest, factors=factors)
        self.ctx._memo["padded"] = self.pa
        # the backend's layout (kernels.tree_layout on the GPU: one launch) within its tree-size limit
        self.layout = layout if layout is not None and Tc <= LAYOUT_MAX_NODES else tree_layout_ref

    def fill(self, num_cached: torch.Tensor, parents: torch.Tensor, tables: torch.Tensor,
             state_slots: torch.Tensor | None = None) -> ForwardContext:
        """num_cached [Bc], parents [Bc, Tc] local (-1 = root), tables [Bc, >= Lc / block size] block ids;
        the layout is ``bole.ops.tree_layout.tree_layout_ref``'s (forest, positions, KV slots, mask)."""
        self.layout(parents, num_cached, tables, self.block_size, forest=self.forest, positions=self.positions,
                    kv_positions=self.kv_positions, slot_mapping=self.slot_mapping, kv_index=self.pa.kv_index,
                    mask=self.pa.mask, num_cached_out=self.num_cached, state_slots=state_slots,
                    state_slots_out=self.state_slots)
        return self.ctx
