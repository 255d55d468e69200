"""The GDN verification benchmark harness runs end to end on CPU (tiny shapes, interpreter).

The Triton kernel is stood in for by the naive twin (wrapped to the kernel's signature), so this
checks the harness, not the kernel: rows carry every field, the floor and memory columns follow
their formulas, the best config is reported and rel_err compares like with like.
"""

import sys
from argparse import Namespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import gdn_verify  # noqa: E402
from benchmarks.peers import sglang_available  # noqa: E402
from bole.ops.gdn import gdn_tree_verify  # noqa: E402


def fake_kernel(q, k, v, g, beta, forest, initial_state, state_indices=None, scale=None,
                use_qk_l2norm=False, u_out=None, logp_out=None, o_out=None, block_v=16,
                input_precision="ieee"):
    if block_v == 3:
        raise ValueError("block_v must be a power of two")
    o, u, logp = gdn_tree_verify(q, k, v, g, beta, forest, initial_state, state_indices, scale,
                                 use_qk_l2norm)
    o_out.copy_(o), u_out.copy_(u), logp_out.copy_(logp)
    return o_out, u_out, logp_out


def test_row_fields_and_formulas():
    args = Namespace(smoke=True, seed=0, torch_max_batch=8, bandwidth_bps=1e10, sweep="auto",
                     deadline=float("inf"))
    notes = []
    configs = [{"block_v": 3}, {"block_v": 8, "input_precision": "ieee"}]
    bole = gdn_verify.BoleKernel(fake_kernel, configs=configs)
    row = gdn_verify.run_row("tiny", 2, 8, "cpu", args, bole, notes)
    s = gdn_verify.SHAPES["tiny"]
    assert set(row) >= {"model", "batch", "tree_nodes", "depth", "sglang_tree_us", "torch_closed_us",
                        "bole_us", "bole_config", "floor_us", "snapshot_bytes", "factor_bytes", "rel_err"}
    assert row["snapshot_bytes"] == 8 * s["HV"] * s["V"] * s["K"] * 4
    assert row["factor_bytes"] == 8 * (s["HV"] * s["V"] * 4 + s["HK"] * s["K"] * 2 + s["HV"] * 4)
    assert row["bole_config"] == "block_v=8,input_precision=ieee"
    assert len(notes) == 1 and "block_v must be a power of two" in notes[0]
    assert row["bole_us"] > 0 and row["torch_closed_us"] > 0 and 1 <= row["depth"] <= 8
    assert row["rel_err"] < 1e-2  # bf16 O vs bf16 O (SGLang's if fetched, else the torch closed form)
    assert row["rel_err_ref"] == ("sglang" if sglang_available() else "torch_closed")
    assert row["rel_err_u"] < 1e-6 and row["rel_err_logp"] < 1e-6
    assert bole.ranked[("tiny", 8)] == ["block_v=8,input_precision=ieee"]
    x = gdn_verify.make_inputs("tiny", 2, 8, "cpu", seed=0)
    N, HV, V, K = 16, s["HV"], s["V"], s["K"]
    expect = (2 * HV * V * K * 4 + 2 * N * s["HK"] * K * 2 + N * HV * V * 2 + 2 * N * HV * 4
              + N * HV * V * (2 + 4) + N * HV * 4)
    assert gdn_verify.floor_bytes(x) == expect
    assert abs(row["floor_us"] - expect / 1e10 * 1e6) < 1e-9


def test_inputs_are_realistic():
    x = gdn_verify.make_inputs("tiny", 3, 16, "cpu", seed=1)
    assert x["q"].dtype == torch.bfloat16 and x["pool"].dtype == torch.float32
    assert (x["g"] < 0).all() and ((x["beta"] > 0) & (x["beta"] < 1)).all()
    cu = x["forest"].cu_seqlens.tolist()
    assert cu == [0, 16, 32, 48] and int(x["forest"].depth.max()) <= gdn_verify.MAX_DEPTH
    trees = [x["forest"].tree(b).parents for b in range(3)]
    assert len(set(trees)) > 1, "a different tree per request"
    assert len(set(x["state_indices"].tolist())) == 3
