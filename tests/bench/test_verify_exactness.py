"""The exactness table's harness runs on CPU (interpreter, tiny heads): every row carries every
contender's error against float64 or a note saying why not, and the reference agrees with the float64
serial recurrence."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import verify_exactness  # noqa: E402


def test_smoke(tmp_path):
    out = tmp_path / "exact.json"
    report = verify_exactness.main(["--smoke", "--cos", "0.0", "0.99", "--gates", "one", "--trees", "chain32",
                                    "random64d16", "--out", str(out)])
    assert out.exists() and len(report["rows"]) == 4
    for row in report["rows"]:
        assert row["reference_vs_serial64"] < 1e-10
        for name in report["contenders"]:
            assert row[name] is not None or f"{name}_note" in row, (name, row)
        assert row["bole_fp32"] < 1e-5 and row["bole_bf16"] < 3e-3  # fp16 on the CPU
    assert report["rows"][-1]["measured_cos"] > 0.95
