"""benchmarks/budget_options.py's harness on the CPU (--smoke): every option set runs, writes its row, and
emits ar's tokens; the width cap never pads more rows than the paper's selection."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import budget_options  # noqa: E402


def test_smoke_rows(tmp_path):
    out = tmp_path / "b.json"
    budget_options.main(["--smoke", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["option"] for r in rows] == list(budget_options.OPTIONS)
    assert all(r["exact_vs_ar"] and r["mat"] >= 1.0 and r["steps"] > 0 for r in rows)
    by = {r["option"]: r for r in rows}
    # at this smoke's budget the cap binds: fewer padded rows than the uncapped selection
    assert by["cap"]["rows_per_step"] < by["paper"]["rows_per_step"]
    assert by["best_child+cap"]["rows_per_step"] < by["best_child"]["rows_per_step"]
