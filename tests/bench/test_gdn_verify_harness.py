"""The GDN verification benchmark harness runs end to end on CPU (tiny shapes, interpreter).

The Triton kernel is stood in for by the naive twin (wrapped to the kernel's signature), so this
checks the harness, not the kernel: rows carry every field, the floor and memory columns follow
their formulas, the best config is reported, every contender is checked against the float64
reference before it is timed, and the --peers-only path fills the peer columns (with a reason where
a peer's files are absent).
"""

import math
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import gdn_verify  # noqa: E402
from bole.ops.gdn import gdn_tree_verify_ref  # noqa: E402


def fake_kernel(q, k, v, g, beta, forest, initial_state, state_indices=None, scale=None,
                use_qk_l2norm=False, u_out=None, logp_out=None, o_out=None, block_v=16,
                input_precision="ieee"):
    if block_v == 3:
        raise ValueError("block_v must be a power of two")
    o, u, logp = gdn_tree_verify_ref(q, k, v, g, beta, forest, initial_state, state_indices, scale,
                                 use_qk_l2norm)
    o_out.copy_(o), u_out.copy_(u), logp_out.copy_(logp)
    return o_out, u_out, logp_out


def _args(**kw):
    base = dict(smoke=True, seed=0, torch_max_batch=8, bandwidth_bps=1e10, sweep="auto", deadline=float("inf"),
                dtype="bf16", adversarial=False, key_cos=0.9, max_depth=gdn_verify.MAX_DEPTH, peers_only=False)
    return Namespace(**(base | kw))


def test_row_fields_and_formulas():
    args = _args()
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
    assert row["rel_err"] < 1e-2  # bf16 O against the float64 recurrence on the same bf16 inputs
    assert row["rel_err_ref"] == "float64_serial"
    assert row["rel_err_u"] < 1e-5 and row["rel_err_logp"] < 1e-6  # fp32 closed form vs float64
    assert row["torch_closed_rel_err"] < 1e-2 and row["torch_closed_note"] is None
    for p in gdn_verify.PEERS:  # timed only when present and validated; else a reason
        assert (row[f"{p}_us"] is None) == (row[f"{p}_note"] is not None)
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


def test_peers_only_row():
    """--peers-only: only the SGLang peers and the reference; absent peers say so (CI has none)."""
    notes = []
    row = gdn_verify.run_row("tiny", 2, 8, "cpu", _args(peers_only=True, dtype="fp16"), None, notes)
    assert row["bole_us"] is None and row["torch_closed_us"] is None
    assert row["torch_closed_note"] == "--peers-only" and notes == []
    for p in gdn_verify.PEERS:
        absent = gdn_verify.peer_absent(p)
        if absent:
            assert row[f"{p}_note"] == absent and row[f"{p}_us"] is None and "absent" in absent
        else:  # fp16 inputs; fp16 (chunk, fused) or the inputs' dtype O against float64
            assert row[f"{p}_note"] is None and row[f"{p}_us"] > 0 and row[f"{p}_rel_err"] < 3e-3, p
    timed = {p: row[f"{p}_us"] for p in gdn_verify.PEERS if row[f"{p}_us"]}
    assert row["best_peer"] == (min(timed, key=timed.get) if timed else None)


def test_contenders_are_validated_before_timing():
    x = gdn_verify.make_inputs("tiny", 1, 8, "cpu", seed=0, dtype=torch.float32)
    ref = gdn_verify.reference_f64(x)[0]
    row = {}

    def refuse():
        raise ValueError("T too large")

    assert gdn_verify.run_contender("a", refuse, ref, row, smoke=True) is None
    assert row == {"a_note": "refused: T too large"}
    gdn_verify.run_contender("b", lambda: (lambda: 2 * ref), ref, row, smoke=True)
    assert row["b_rel_err"] == pytest.approx(1.0) and "b_us" not in row and row["b_note"].startswith("not timed")
    gdn_verify.run_contender("c", lambda: (lambda: ref.float()), ref, row, smoke=True)
    assert row["c_rel_err"] < 1e-7 and row["c_us"] > 0 and "c_note" not in row


def test_reference_f64_matches_the_closed_form():
    """O, U and logP of the float64 serial recurrence are those of our closed form in float64."""
    x = gdn_verify.make_inputs("tiny", 3, 16, "cpu", seed=4, dtype=torch.float32)
    o, u, logp = gdn_verify.reference_f64(x)
    d = {n: x[n].double() for n in ("q", "k", "v", "g", "beta")}
    o2, u2, logp2 = gdn_tree_verify_ref(d["q"], d["k"], d["v"], d["g"], d["beta"], x["forest"], x["pool"].double(),
                                    x["state_indices"], use_qk_l2norm=True)
    for a, b in ((o, o2), (u, u2), (logp, logp2)):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_adversarial_inputs():
    x = gdn_verify.make_inputs("tiny", 2, 64, "cpu", seed=0, adversarial=True, key_cos=0.9)
    for name in ("q", "k"):
        t = x[name][0, :, 0].double()
        t = t / t.norm(dim=-1, keepdim=True)
        cos = float(((t @ t.T).sum() - t.shape[0]) / (t.shape[0] * (t.shape[0] - 1)))
        assert 0.8 < cos < 0.97, (name, cos)
    assert 0.85 < float(x["beta"].mean()) < 0.95
    assert (x["g"] < 0).all() and float(x["g"].min()) > -0.02 * (math.log(2) + 6)


def test_grid_has_the_issue_23_sizes():
    full = gdn_verify.grid(Namespace(smoke=False, models=None, quick=False, trees=None, batches=None))
    assert {T for _, _, T in full} == {8, 16, 32, 64, 128, 256} and {b for _, b, _ in full} == {1, 4, 8, 16, 32}
    quick = gdn_verify.grid(Namespace(smoke=False, models=None, quick=True, trees=None, batches=None))
    assert {T for _, _, T in quick} == {16, 32, 64, 128, 256} and {b for _, b, _ in quick} == {1, 16, 32}
