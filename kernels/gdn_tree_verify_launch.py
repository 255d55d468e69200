"""Launch tables and tile planning of the closed-form verifier (kernels/gdn_tree_verify.py): the launch
configuration, the chunk tile, the default and the measured (tuned) configurations, and the plan of the
diagonal solve (the methods are described in that module's docstring)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

METHODS = ("horner", "blocked")


@dataclass(frozen=True)
class VerifyConfig:
    """Launch configuration: K chunk, value tile, warps and pipeline stages of one program, and whether
    the gate / v loads are issued before the K-loop."""

    block_k: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 1
    early_loads: bool = False


# Defaults keyed by the chunk tile BC: (block_k, widest block_v, num_warps); K and V clamp them. The
# sweeps' configurations are in benchmarks/verify_space.py.
DEFAULT_TILES = {16: (64, 64, 4), 32: (64, 128, 8), 64: (32, 128, 8)}


def chunk_tile(max_nodes: int) -> tuple[int, int]:
    """(BC, NC): rows per chunk and chunks for trees of ``max_nodes`` nodes."""
    BT = max(16, triton.next_power_of_2(max_nodes))
    BC = min(BT, 64)
    return BC, BT // BC


def default_config(K: int, V: int, BC: int, num_heads_x_requests: int | None = None,
                   block_v: int | None = None) -> VerifyConfig:
    """A launch configuration for chunk tile BC: the table's widest value tile, halved down to 16 while
    the grid would have fewer than ~2 programs per SM (batch 1 at Qwen3.5-9B has 32 (request, head)
    pairs for 132 SMs)."""
    vmax = triton.next_power_of_2(V)
    kmax = max(16, triton.next_power_of_2(K))
    bk, bv_max, num_warps = DEFAULT_TILES[BC]
    if block_v is None:
        block_v = max(16, min(vmax, bv_max))
        if num_heads_x_requests is not None and torch.cuda.is_available():
            target = 2 * torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            while block_v > 16 and num_heads_x_requests * triton.cdiv(V, block_v) < target:
                block_v //= 2
    bk = min(bk, kmax)
    return VerifyConfig(block_k=bk, block_v=block_v, num_warps=num_warps, num_stages=2 if K > bk else 1)


# The engine's dispatch for half-precision q/k (``gdn_tree_verify(..., tuned=True)``): per tree tile BT
# and grid size (requests x value heads), (max requests x heads, config, method, input_precision),
# measured on the H200 at Qwen3.5-9B shapes (HV=32, K=V=128, bf16 q/k, fp32 pool) by
# benchmarks/gdn_verify.py (results/gdn_verify_h200.json, ``bole_by_method``). tf32 products err by
# ~2^-11 relative, below the bf16 rounding of q/k/v themselves (2^-9).
TUNED_LOWP = {
    16: [(128, VerifyConfig(64, 32, 4, 2), "horner", "tf32"), (None, VerifyConfig(64, 64, 4, 2), "blocked", "tf32")],
    32: [(128, VerifyConfig(64, 16, 4, 2), "horner", "tf32"), (None, VerifyConfig(64, 64, 8, 2), "blocked", "tf32")],
    64: [(32, VerifyConfig(32, 32, 4, 3, early_loads=True), "blocked", "tf32"),
         (256, VerifyConfig(32, 128, 8, 3, early_loads=True), "blocked", "tf32"),
         (None, VerifyConfig(32, 128, 8, 3), "blocked", "tf32")],
    128: [(32, VerifyConfig(32, 32, 8, 2), "horner", "tf32"), (None, VerifyConfig(32, 128, 8, 3), "blocked", "tf32")],
    256: [(32, VerifyConfig(32, 32, 8, 2), "blocked", "tf32"), (None, VerifyConfig(32, 128, 8, 3), "blocked", "tf32")],
}

# The dispatch for fp32 q/k (the embedded model's engine): "tf32x3" products (3xTF32, on tensor cores),
# fp32-grade (rel_err ~1e-6 against float64), measured at the embedded model's shapes (HK=4, HV=8,
# K=V=64) by benchmarks/verify_fp32.py (results/verify_fp32_h200.json).
TUNED_FP32 = {
    16: [(None, VerifyConfig(64, 32, 4, 1), "blocked", "tf32x3")],
    32: [(32, VerifyConfig(64, 16, 4, 1), "blocked", "tf32x3"),
         (None, VerifyConfig(64, 64, 4, 1), "blocked", "tf32x3")],
    64: [(32, VerifyConfig(64, 16, 4, 1), "horner", "tf32x3"),
         (None, VerifyConfig(64, 32, 4, 1), "horner", "tf32x3")],
    128: [(None, VerifyConfig(64, 32, 8, 1), "blocked", "tf32x3")],
    256: [(None, VerifyConfig(64, 32, 8, 1), "blocked", "tf32x3")],
}


def tuned_launch(BT: int, num_heads_x_requests: int, K: int, V: int,
                 table: dict | None = None) -> tuple[VerifyConfig, str, str]:
    """(config, method, input_precision) from ``table`` (default ``TUNED_LOWP``, for half-precision q/k;
    ``TUNED_FP32`` for fp32); tiles clamped to K and V."""
    rows = (TUNED_LOWP if table is None else table)[BT]
    _, cfg, method, precision = next(row for row in rows if row[0] is None or num_heads_x_requests <= row[0])
    vmax, kmax = max(16, triton.next_power_of_2(V)), max(16, triton.next_power_of_2(K))
    bk = min(cfg.block_k, kmax)
    return dataclasses.replace(cfg, block_k=bk, block_v=min(cfg.block_v, vmax),
                               num_stages=cfg.num_stages if K > bk else 1), method, precision


def _block_rows(depth: int, BC: int) -> int:
    """The blocked method's diagonal block BS: least T×T products, (min(d, BS) − 1) level steps plus two
    per doubling merge; ties go to the larger block."""
    best = None
    bs = BC
    while bs >= 1:
        cost = (min(depth, bs) - 1) + 2 * (BC // bs).bit_length() - 2
        if best is None or cost < best[0]:
            best = (cost, bs)
        bs //= 2
    return best[1]


def solve_plan(method: str, max_depth: int, BC: int) -> tuple[int, int, int]:
    """(BS, level steps, merges) of the diagonal solve for forests of depth ``max_depth``."""
    d = min(int(max_depth), BC)
    if method == "horner":
        return BC, d - 1, 0
    bs = _block_rows(d, BC)
    return bs, min(d, bs) - 1, (BC // bs).bit_length() - 1
