"""The acceptance benchmark runs end to end on a random checkpoint with the embedded tokenizer, and
its built-in exactness check (every chain / tree config emits the ar tokens) passes."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_acceptance_harness_smoke(tmp_path):
    out = tmp_path / "acc.json"
    r = subprocess.run([sys.executable, "benchmarks/acceptance.py", "--random-tiny", "--num-prompts", "2",
                        "--max-tokens", "8", "--batch", "2", "--device", "cpu", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [row["config"] for row in res["rows"]][:2] == ["ar", "chain-d1"]
    assert all(row["mat"] >= 1.0 for row in res["rows"])
    tree = next(row for row in res["rows"] if row["config"] == "tree-d8-k4")
    assert tree["mean_tree_nodes"] <= 2 * (64 + 1)  # budget: 64 drafts + the root per request
