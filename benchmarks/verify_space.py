"""The launch configurations the tuning sweeps try for kernels/gdn_tree_verify.py (gdn_verify.py and
kernel_sweep.py); the kernel keeps only the measured tables the engine launches."""

from __future__ import annotations

import dataclasses

import triton

from kernels.gdn_tree_verify_launch import VerifyConfig

# Every configuration the benchmark may sweep (filtered per shape by `configs_for`).
CONFIGS = [VerifyConfig(bk, bv, w, s) for bk in (32, 64, 128) for bv in (16, 32, 64, 128)
           for w in (4, 8) for s in (1, 2, 3)]
SMEM_BUDGET = 160 * 1024  # bytes of pipelined K-chunk operands per program (H200: 228 KB/SM)


def configs_for(K: int, V: int, BC: int) -> list[VerifyConfig]:
    """The configurations worth trying for one shape: BV ≤ V, BK ≤ K (rounded up), a K loop long enough
    for the stages, q/k/S_pre chunks (fp32 worst case) within shared memory, 8 warps at BC = 64 (a
    [64, 64] fp32 tile is 32 registers a thread in 4 warps and a program holds several)."""
    vmax = triton.next_power_of_2(V)
    kmax = max(16, triton.next_power_of_2(K))
    smem = lambda c: c.num_stages * (2 * BC * c.block_k + c.block_v * c.block_k) * 4
    out: list[VerifyConfig] = []
    for c in CONFIGS:
        c = dataclasses.replace(c, block_k=min(c.block_k, kmax))
        if (c.block_v <= vmax and (c.num_stages == 1 or c.num_stages <= kmax // c.block_k)
                and smem(c) <= SMEM_BUDGET and c not in out):
            out.append(c)
    return out
