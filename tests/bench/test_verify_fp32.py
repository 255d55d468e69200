"""benchmarks/verify_fp32.py runs end to end on the CPU (interpreter, one small tree): the serial_tree
kernel and every closed-form job are timed, and each closed-form job is validated against the float64
closed form first (fp32-grade: the interpreter runs 3xTF32 exactly)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import verify_fp32  # noqa: E402


def test_trees_have_the_engines_depth():
    import torch

    t = verify_fp32.tree(40, torch.Generator().manual_seed(0))
    assert t.num_nodes == 40 and t.depth == verify_fp32.DEPTH


def test_smoke_run(tmp_path):
    out = tmp_path / "fp32.json"
    res = verify_fp32.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    (row,) = res["rows"]
    assert row["tree_nodes"] == verify_fp32.DEPTH and row["batch"] == 1
    assert set(row["serial"]) == {"16", "32"} and row["serial_rel_err"] < 1e-5
    assert [e["job"] for e in row["closed"]] == [verify_fp32.label(kw) for kw in verify_fp32.closed_jobs(True)]
    for e in row["closed"]:
        assert e["us"] is not None and not e.get("rejected") and e["rel_err"] < 1e-5, e
