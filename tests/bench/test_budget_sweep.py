"""The budget sweep (Fig. 11) runs end to end on CPU: schema of its JSON, a PNG, and the forced budget
really reaches the engine (the verified draft nodes per step follow B, down to the fairness floor and
up to the tree size) without changing the greedy tokens."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import budget_sweep  # noqa: E402


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_fixed_table_and_recorded_choice():
    t = budget_sweep.fixed_table(24)
    assert t.lookup(1, 0, 1)[1] == 24 and t.lookup(1000, 10**9, 16)[1] == 24
    rec = budget_sweep.RecordingTable(t)
    assert rec.lookup(3, 50, 5) == (0, 24) and rec.queries == [(3, 50, 5)] and rec.table_id == t.table_id
    # the choice counts only lookups made with the full batch, the most frequent B_ver wins
    assert budget_sweep.b_ver_choice(t, [(2, 5, 5), (1, 5, 5)], 2) == (24, {"24": 1.0})


def test_budget_sweep_smoke(tmp_path, one_thread):
    out = tmp_path / "sweep.json"
    res = budget_sweep.main(["--smoke", "--device", "cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    for key in ("device", "hardware", "date", "command", "versions", "model", "dtype", "config", "calibration",
                "points", "per_batch"):
        assert key in res, key
    assert res["versions"]["torch"] == torch.__version__ and "--smoke" in res["command"]
    assert [(p["batch"], p["budget"]) for p in res["points"]] == [(b, n) for b in (1, 2) for n in (2, 8, 32)]
    for p in res["points"]:
        assert p["tokens_per_s"] > 0 and p["mat"] >= 1.0 and p["mean_b_ver"] == p["budget"]
        assert p["match_reference"] == 1.0          # greedy tokens do not depend on the budget
    drafts = {(p["batch"], p["budget"]): p["mean_draft_nodes"] for p in res["points"]}
    # depth 3, top-k 4, beam 4: floor 4 per request, trees of 36; batch 1 verifies exactly max(4, B)
    assert [drafts[1, n] for n in (2, 8, 32)] == [4.0, 8.0, 32.0]
    assert drafts[2, 2] == drafts[2, 8] < drafts[2, 32] <= 32.0
    assert res["config"]["tree_max"] == 36
    for pb in res["per_batch"]:
        pts = [p for p in res["points"] if p["batch"] == pb["batch"]]
        assert pb["peak_budget"] == max(pts, key=lambda p: p["tokens_per_s"])["budget"]
        assert pb["b_ver"] in res["config"]["budgets"]       # in-process table: capacities = budgets
        assert sum(pb["b_ver_share"].values()) == pytest.approx(1.0, abs=1e-2)
        assert pb["calibrated_run"]["match_reference"] == 1.0
    assert res["calibration"]["source"] == "measured" and res["calibration"]["matches_model"]
    assert out.with_suffix(".png").stat().st_size > 1000
