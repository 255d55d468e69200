"""Paged KV cache for the full-attention layers, and its block allocator.

Layout: one tensor ``kv`` [2, num_attn_layers, num_blocks, block_size, num_kv_heads, head_dim]
(k = kv[0], v = kv[1]); ``k(layer)`` / ``v(layer)`` are the per-layer views [num_blocks, block_size,
H, D] kernels index. A request owns a *block table* (list of block ids); its token at position p
lives in block ``table[p // block_size]`` at offset ``p % block_size``, i.e. at the flat slot
``table[p // block_size] * block_size + p % block_size`` of the [num_blocks * block_size, H, D] view.

Keeping all layers in one tensor lets the verification commit move the accepted nodes' entries of
every layer with one gather and one scatter (``move``).

``BlockAllocator`` is the free list the scheduler uses (``can_allocate`` before ``allocate``).
"""

from __future__ import annotations

from typing import Sequence

import torch


class BlockAllocator:
    """A LIFO free list of block ids [0, num_blocks)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise ValueError(f"cannot allocate {n} blocks: {len(self._free)} free of {self.num_blocks}")
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            b = int(b)
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated (double free?)")
            self._used.remove(b)
            self._free.append(b)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class PagedKVCache:
    """K/V storage for ``num_layers`` attention layers in fixed-size blocks."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.bfloat16, device=None):
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) < 1:
            raise ValueError("all KV cache dimensions must be >= 1")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.kv = torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                              dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks)

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def k(self, layer: int) -> torch.Tensor:
        return self.kv[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.kv[1, layer]

    def _flat(self) -> torch.Tensor:
        """[2, L, num_blocks * block_size, H, D] view."""
        return self.kv.view(2, self.num_layers, self.num_blocks * self.block_size,
                            self.num_kv_heads, self.head_dim)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, H, D] at flat slots [N]."""
        flat = self._flat()
        flat[0, layer, slots] = k.to(self.dtype)
        flat[1, layer, slots] = v.to(self.dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [n, H, D] at flat slots [n]."""
        flat = self._flat()
        return flat[0, layer, slots], flat[1, layer, slots]

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy every layer's entries at src to dst (gathered first, so overlaps are safe)."""
        if src_slots.numel() == 0:
            return
        flat = self._flat()
        flat[:, :, dst_slots] = flat[:, :, src_slots].clone()

    def slots_for(self, block_table: Sequence[int] | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot of each position of one request: table[p // bs] * bs + p % bs."""
        table = torch.as_tensor(block_table, dtype=torch.long, device=positions.device)
        positions = positions.long()
        block = positions // self.block_size
        if positions.numel() and int(block.max()) >= table.numel():
            raise ValueError(f"position {int(positions.max())} is past the request's "
                             f"{table.numel()} blocks of {self.block_size}")
        return table[block] * self.block_size + positions % self.block_size
