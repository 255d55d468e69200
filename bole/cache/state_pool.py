"""GDN state pools: the recurrent (ssm) state and the conv window of every GDN layer, per slot.

    ssm  [num_gdn_layers, slots, HV, V, K]   K contiguous (Sᵀ, as SGLang / vLLM store it), fp32 default
    conv [num_gdn_layers, slots, conv_dim, kernel - 1]   the last kernel-1 conv inputs, oldest first

A request holds one slot for its lifetime; ``allocate`` zeroes the slot so a fresh prompt starts
from the zero state (prefill never has to special-case "no previous state"). The verification step
only reads the pools; ``HybridForCausalLM.commit`` writes the accepted path's state.
"""

from __future__ import annotations

import torch


class StatePool:
    def __init__(self, num_layers: int, num_slots: int, num_v_heads: int, v_dim: int, k_dim: int,
                 conv_dim: int, conv_kernel: int, ssm_dtype: torch.dtype = torch.float32,
                 conv_dtype: torch.dtype = torch.bfloat16, device=None):
        if min(num_layers, num_slots, num_v_heads, v_dim, k_dim, conv_dim) < 1 or conv_kernel < 2:
            raise ValueError("state pool dimensions must be >= 1 and conv_kernel >= 2")
        self.num_layers, self.num_slots = num_layers, num_slots
        self.ssm = torch.zeros(num_layers, num_slots, num_v_heads, v_dim, k_dim, dtype=ssm_dtype,
                               device=device)
        self.conv = torch.zeros(num_layers, num_slots, conv_dim, conv_kernel - 1, dtype=conv_dtype,
                                device=device)
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @staticmethod
    def for_model(cfg, num_slots: int, ssm_dtype=torch.float32, conv_dtype=torch.bfloat16, device=None,
                  tp_size: int = 1) -> "StatePool":
        """A pool sized for a ``ModelConfig`` (local heads under tensor parallelism)."""
        return StatePool(cfg.num_gdn_layers, num_slots, cfg.linear_num_value_heads // tp_size,
                         cfg.linear_value_head_dim, cfg.linear_key_head_dim, cfg.conv_dim // tp_size,
                         cfg.linear_conv_kernel_dim, ssm_dtype, conv_dtype, device)

    @staticmethod
    def like(pool: "StatePool", num_slots: int) -> "StatePool":
        """An empty pool with ``pool``'s per-slot shapes, dtypes and device (e.g. a checkpoint pool)."""
        L, _, HV, V, K = pool.ssm.shape
        return StatePool(L, num_slots, HV, V, K, pool.conv.shape[2], pool.conv.shape[3] + 1, pool.ssm.dtype,
                         pool.conv.dtype, pool.ssm.device)

    def copy_slot(self, src: int, dst_pool: "StatePool", dst: int) -> None:
        """Copy slot ``src`` (ssm and conv, every layer) into ``dst_pool``'s slot ``dst``."""
        dst_pool.ssm[:, dst].copy_(self.ssm[:, src])
        dst_pool.conv[:, dst].copy_(self.conv[:, src])

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, zero: bool = True) -> int:
        """Take a free slot and zero its ssm and conv state in every layer (unless it is about to be
        overwritten: ``zero=False``)."""
        if not self._free:
            raise ValueError(f"no free state slot (all {self.num_slots} in use)")
        slot = self._free.pop()
        self._used.add(slot)
        if zero:
            self.ssm[:, slot].zero_()
            self.conv[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        slot = int(slot)
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not allocated (double free?)")
        self._used.remove(slot)
        self._free.append(slot)
