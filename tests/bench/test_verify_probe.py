"""benchmarks/verify_probe.py runs end to end on the CPU (interpreter, tiny shapes): every candidate is
validated against the reference before it is timed, labels round-trip to launch arguments, and the
fastest candidate per family is written for the ncu pass."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import verify_probe  # noqa: E402
from kernels.gdn_tree_verify import VerifyConfig  # noqa: E402


def test_labels_round_trip():
    cfg = VerifyConfig(32, 64, 8, 2, 2, 4)
    lab = verify_probe.label("grouped", cfg, "tf32")
    assert verify_probe.parse_label(lab) == dict(method="grouped", config=cfg, input_precision="tf32")
    assert all(verify_probe.parse_label(c)["method"] in ("neumann", "inverse", "grouped")
               for c in verify_probe.candidates(smoke=False))


def test_smoke_run(tmp_path):
    out, cases = tmp_path / "probe.json", tmp_path / "cases.txt"
    verify_probe.main(verify_probe.parse_args(["--smoke", "--out", str(out), "--ncu-cases-out", str(cases)]))
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["rows"]] == [1, 2]
    for row in res["rows"]:
        assert len(row["candidates"]) == len(verify_probe.candidates(smoke=True))
        for c in row["candidates"]:
            assert c["us"] is not None and not c.get("rejected"), c
            assert c["rel_err"] < verify_probe.REL_TOL and c["rel_err_u"] < 1e-5
    lines = [line.split(" ", 1) for line in cases.read_text().splitlines()]
    assert {b for b, _ in lines} == {"1", "2"} and {lab.split(":")[0] for _, lab in lines} == {"inverse", "grouped"}
