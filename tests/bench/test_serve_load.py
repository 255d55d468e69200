"""The serving benchmark (benchmarks/serve_load.py) runs as users run it, a subprocess with the
openai client, briefly against a real uvicorn server over an in-process engine (the tiny served
model): every request completes and is measured, multi-turn prompts grow and hit the prefix cache,
and failures are counted, not hidden."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "serve"))

from tiny_model import make_tiny_model  # noqa: E402
from uvicorn_thread import UvicornThread  # noqa: E402

from benchmarks.serve_load import arrival_gaps, make_plans  # noqa: E402


def test_plans_and_arrivals():
    prompts = ["a", "b", "c", "d"]
    plans = make_plans("mixed", 7, 3, prompts)
    assert [p.workload for p in plans] == ["heldout", "multiturn", "heldout", "multiturn"]
    assert sum(len(p.prompts) for p in plans) == 7
    gaps = arrival_gaps(200, 4.0, "poisson", seed=1)
    assert gaps[0] == 0 and gaps == arrival_gaps(200, 4.0, "poisson", seed=1)   # seeded
    assert abs(sum(gaps) / 199 - 0.25) < 0.08                                     # mean 1 / rate
    assert arrival_gaps(3, 2.0, "fixed", 0) == [0.0, 0.5, 0.5]
    with pytest.raises(ValueError):
        make_plans("chat", 3, 2, prompts)


def run_bench(url, tmp_path, *extra):
    out = tmp_path / "serve_load.json"
    cmd = [sys.executable, "benchmarks/serve_load.py", "--base-url", url + "/v1", "--out", str(out), *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    return last, json.loads(out.read_text()), r.stdout


def test_serve_load_against_an_in_process_server(tmp_path):
    for module in ("fastapi", "uvicorn", "openai"):   # the serving stack (absent on kernel-only machines)
        pytest.importorskip(module)
    from bole.engine.async_engine import AsyncEngine
    from bole.llm import build_engine
    from deployments.engine_client import LocalEngineClient
    from deployments.ingress import openai_app

    model = make_tiny_model(tmp_path / "model")
    engine = build_engine(model, mode="ar", num_blocks=1024, block_size=4, max_num_seqs=4,
                          calibration_table="calibration_tables/default.yaml")
    client = LocalEngineClient(AsyncEngine(engine))
    with UvicornThread(openai_app(client, "tiny", api_key="")) as srv:
        doc, file, table = run_bench(srv.url, tmp_path, "--workload", "mixed", "--num-requests", "8",
                                     "--turns", "3", "--request-rate", "20", "--max-tokens", "6", "--label", "ar")
        r = doc["result"]
        assert (r["requests"], r["completed"], r["failed"]) == (8, 8, 0)
        assert r["by_workload"] == {"heldout": 2, "multiturn": 6}
        assert r["output_tokens"] == 8 * 6 and r["output_tokens_per_s"] > 0 and r["request_throughput_per_s"] > 0
        for key in ("ttft", "tpot", "itl", "latency"):
            s = r[key]
            assert 0 < s["mean_ms"] and 0 < s["p50_ms"] <= s["p99_ms"], (key, s)
        assert r["ttft"]["p50_ms"] < r["latency"]["p50_ms"]
        assert "ttft" in table and "p99" in table
        assert file["runs"]["ar"]["result"] == r
        # multi-turn prompts carry the conversation: the engine served part of them from its prefix cache
        assert engine.metrics.prefix_hit_tokens > 0
        # failures are counted and reported, and a second label lands in the same file
        doc, file, _ = run_bench(srv.url, tmp_path, "--workload", "heldout", "--num-requests", "3",
                                 "--served-model", "nope", "--no-warmup", "--label", "bad")
        assert (doc["result"]["completed"], doc["result"]["failed"]) == (0, 3)
        assert "NotFoundError" in doc["result"]["failure_examples"][0]
        assert set(file["runs"]) == {"ar", "bad"}
