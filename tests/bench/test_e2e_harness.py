"""The end-to-end benchmark (benchmarks/e2e.py) runs every section at tiny shapes on the CPU (--smoke)
and writes the documented JSON schema; its state-bytes rows agree with gdn_verify's per-layer formula."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_e2e_smoke_schema(tmp_path):
    out, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    r = subprocess.run([sys.executable, "benchmarks/e2e.py", "--smoke", "--out", str(out), "--png", str(png)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["elapsed_s"] > 0  # a wall time is recorded (no bound: timings belong to benchmarks, not tests)
    for key in ("gpu", "date", "command"):
        assert isinstance(doc[key], str) and doc[key]
    assert not doc["skipped"]
    tiny = [t for t in doc["throughput"] if t["source"] == "engine"]
    assert {(t["mode"], t["batch"]) for t in tiny} == {(m, b) for m in ("ar", "serial_tree", "bole") for b in (1, 2)}
    for t in doc["throughput"]:
        assert {"model", "mode", "batch", "tokens_per_s", "mat"} <= set(t) and t["tokens_per_s"] > 0
        assert t["mat"] >= 1.0
    assert all(t["exact_vs_ar"] for t in tiny)  # greedy speculative runs emit the ar tokens
    assert {(d["batch"], d["mode"]) for d in doc["decode_floor"]} == {
        (b, m) for b in (1, 2) for m in ("eager", "static_uncaptured")}
    for d in doc["decode_floor"]:
        assert {"model", "batch", "step_ms", "floor_ms"} <= set(d) and d["step_ms"] > 0 and d["floor_ms"] > 0
    static = [d for d in doc["decode_floor"] if d["mode"] == "static_uncaptured"]
    assert all(d["graph_vs_eager_logits_rel_err"] < 2e-2 for d in static)  # bf16
    share = doc["gdn_share"]
    assert {(s["mode"], s["batch"], s["tree_nodes"]) for s in share} == {
        (m, b, t) for m in ("serial_tree", "bole") for b in (1, 2) for t in (4, 8)}
    assert all(s["verify_ms"] > 0 and s["gdn_share"] < 1 and s["recurrence_share"] < 1 for s in share)
    assert len(doc["step_latency"]) == len(share) and all(s["decode_ms"] for s in doc["step_latency"])
    # state bytes: the engine's buffers give gdn_verify's per-layer figures times the GDN layer count
    row = next(s for s in doc["state_bytes"] if s["model"] == "qwen3.5-9b" and s["tree_nodes"] == 100)
    HK, HV, K, V, L = 16, 32, 128, 128, 24
    assert row["snapshot_bytes"] == L * 100 * HV * V * K * 4
    assert row["factor_bytes"] == L * 100 * (HV * V * 4 + HK * K * 2 + HV * 4)
    assert row["ratio"] == 101.76
    assert {s["model"] for s in doc["state_bytes"]} == {"qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-122b-a10b"}
    assert doc["plot"] == str(png) and png.stat().st_size > 0
