"""benchmarks/arrival.py on the CPU (the embedded model, small): every cell times its counted arrivals,
each admitted at a step's start or inside a step, and the arrival is handed to the engine only once its
moment has passed."""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import arrival  # noqa: E402


def test_smoke_times_every_counted_arrival(tmp_path):
    out = tmp_path / "a.json"
    arrival.main(["--smoke", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["batch"] == 2
    assert [(c["mode"], c["option"]) for c in doc["cells"]] == \
        [(m, o) for m in ("ar", "bole") for o in ("off", "on", "main")]
    for c in doc["cells"]:
        counted = c["ttft_ms"]["n"]
        assert counted + c["excluded_for_captures"] == 4 and counted == sum(c["admitted"].values())
        assert c["admitted"]["beside"] == 0   # no prefill stream on the CPU
        # without the option ar admits at a step's start only (bole between its draft and verify too)
        if c["option"] == "off" and c["mode"] == "ar":
            assert c["admitted"]["mid_step"] == 0
        assert 0 < c["prefill_ms"]["mean"] <= c["ttft_ms"]["mean"] and c["idle_ttft_ms"]["n"] >= 2


class FakeEngine:
    def __init__(self):
        self.added = []

    def add_request(self, tokens, params, request_id):
        self.added.append((request_id, tokens, params.max_tokens))


def test_an_arrival_is_added_once_and_not_before_its_moment():
    eng = FakeEngine()
    a = arrival.Arrival(eng, [5, 6], "x", time.perf_counter() + 0.05)
    assert a.admit() == 0 and not eng.added
    time.sleep(0.06)
    assert a.admit() == 1 and a.admit() == 0 and eng.added == [("x", [5, 6], 2)]
    a.emitted([type("O", (), {"request_id": "y"})()])
    assert a.first is None
    a.emitted([type("O", (), {"request_id": "x"})()])
    assert a.first >= a.added >= a.at
