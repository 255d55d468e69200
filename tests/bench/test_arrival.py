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
        [(m, o) for m in ("ar", "bole") for o in ("off", "on", "main", "hold") if (m, o) != ("ar", "hold")]
    for c in doc["cells"]:
        assert "error" not in c, c
        counted = c["ttft_ms"]["n"]
        assert counted + c["excluded_for_captures"] == 4 and counted == sum(c["admitted"].values())
        assert c["admitted"]["beside"] == 0   # no prefill stream on the CPU
        assert c["background_left"] == 2      # every arrival met the whole batch
        # without the option ar admits at a step's start only (bole between its draft and verify too)
        if c["option"] == "off" and c["mode"] == "ar":
            assert c["admitted"]["mid_step"] == 0
        assert 0 < c["prefill_ms"]["mean"] <= c["ttft_ms"]["mean"] and c["idle_ttft_ms"]["n"] >= 2
        # the background's greedy tokens, whatever the mode, the option and the arrivals, are ar's (fp32)
        t = c["tokens"]
        assert t["against"] == "ar/off" and t["compared"] > 2 * 4 and t["mismatched"] == 0, t
        m = c["tokens_in_mode"]
        assert m["against"] == f"{c['mode']}/off" and m["compared"] > 2 * 4 and m["mismatched"] == 0, m


def test_token_check_finds_the_first_difference():
    t = arrival.token_check([[1, 2, 3], [4, 5], [7]], [[1, 2, 3, 9], [4, 6, 6], []], "ar/off")
    assert t == dict(against="ar/off", compared=5, mismatched=1, first_mismatch={1: 1})


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


def test_hold_polls_the_admission_until_the_draft_is_done(monkeypatch):
    """``hold``: the speculative step's between-admission is called until the draft's event is done
    (each call may admit), then the verify goes on; ``during`` passes through; no between stays none."""
    import torch

    class Event:
        def __init__(self):
            self.queries = 0

        def record(self, stream):
            pass

        def query(self):
            self.queries += 1
            return self.queries >= 3
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    seen = []

    class Step:
        def run(self, reqs, stats, calibration, between=None, during=None):
            seen.append((between is None, during))
            if between is not None:
                between()
            return "ran"
    eng = type("E", (), {"spec_step": Step(), "runner": type("R", (), {"device": "cuda"})()})()
    arrival.hold_verify(eng)
    calls = []
    assert eng.spec_step.run([], None, None, between=lambda: calls.append(1), during="d") == "ran"
    assert calls == [1, 1, 1] and seen == [(False, "d")]
    assert eng.spec_step.run([], None, None) == "ran" and seen[-1] == (True, None)
