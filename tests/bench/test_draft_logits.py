"""benchmarks/draft_logits.py's harness on the CPU (Triton interpreter, fp16, tiny shapes): every row and
sweep entry is written with its times and the kernel's error against float64 no worse than cuBLAS's
output rounding allows."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import draft_logits  # noqa: E402


def test_smoke_writes_rows_and_sweep(tmp_path):
    out = tmp_path / "d.json"
    draft_logits.main(["--smoke", "--sweep", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["gpu"] == "cpu" and len(res["sweep"]) == 2 * len(draft_logits.CONFIGS)
    assert [(r["M"], r["N"], r["K"]) for r in res["rows"]] == [(1, 256, 64), (16, 256, 64)]
    for r in res["rows"]:
        assert r["kernel_ms"] > 0 and r["cublas_ms"] > 0 and r["wxt_ms"] > 0
        assert r["kernel_max_err"] <= 2 * r["cublas_max_err"] + 1e-3
        assert r["wxt_max_err"] <= 2 * r["cublas_max_err"] + 1e-3
    for r in res["sweep"]:  # every launch configuration, not only the default
        assert r["max_err"] <= 2 * r["cublas_max_err"] + 1e-3
    assert res["command"].startswith("draft_logits.py --smoke")
