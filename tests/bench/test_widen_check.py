"""benchmarks/widen_check.py end to end on the CPU at its small smoke shape: the widened model's fp32
greedy tokens equal the embedded model's, and the result file says so."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import widen_check  # noqa: E402


def test_smoke_widened_greedy_equals_embedded(tmp_path):
    out = tmp_path / "w.json"
    widen_check.main(["--smoke", "--widened", str(tmp_path / "w"), "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["label"] == "smoke-cost, embedded model's predictions"
    fp32 = res["results"]["float32"]
    assert fp32["identical"] and fp32["prompts_identical"] == res["prompts"] == 2
    assert fp32["widened_params"] > 3 * fp32["embedded_params"]


def test_compare_reports_first_divergence():
    assert widen_check.compare([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5]]) == dict(
        identical=False, prompts_identical=1, first_divergence=[1, None])
    assert widen_check.compare([[1, 2]], [[1, 2, 3]])["first_divergence"] == [2]
