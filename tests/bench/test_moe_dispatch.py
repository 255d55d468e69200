"""benchmarks/moe_dispatch.py's harness on the CPU (Triton interpreter, fp16, tiny shapes): a row per token
count with every path's time, the routing's distinct experts and floor, and the kernel's error against the
float64 twin no worse than the loop's rounding allows."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import moe_dispatch  # noqa: E402


def test_smoke_writes_rows(tmp_path):
    out = tmp_path / "m.json"
    moe_dispatch.main(["--smoke", "--sweep", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [(r["tokens"], r["block_n"]) for r in res["sweep"]] == [
        (n, c["block_n"]) for n in (4, 16) for c in moe_dispatch.CONFIGS]
    assert all(r["kernel_graph_ms"] > 0 for r in res["sweep"])
    assert res["gpu"] == "cpu" and res["shape"]["experts"] == 8 and res["copy_gb_s"] > 0
    assert [r["tokens"] for r in res["rows"]] == [1, 5]
    for r in res["rows"]:
        assert 1 <= r["distinct_experts"] <= min(8, 2 * r["tokens"]) and r["floor_ms"] > 0
        assert r["loop_ms"] > 0 and r["kernel_ms"] > 0 and r["kernel_graph_ms"] > 0
        assert r["kernel_rel_err"] <= 2 * r["loop_rel_err"] + 2e-3
    assert res["command"].startswith("moe_dispatch.py --smoke --sweep")
