"""benchmarks/serve_modes.py (what benchmarks/run_gpu_agent.sh runs) end to end on the CPU: a real
``deployments.launch --no-ray`` server per mode on the tiny served model, serve_load.py's multi-turn
workload through the openai client, the server's /metrics differenced per phase."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "serve"))

from tiny_model import make_tiny_model  # noqa: E402

from benchmarks.serve_modes import overlay, parse_args, prompt_slices, server_delta, split_mode  # noqa: E402


def test_prompt_slices_and_deltas():
    slices, overlap = prompt_slices(list("abcde"), [2, 2])
    assert slices == [["a", "b"], ["c", "d"]] and not overlap
    slices, overlap = prompt_slices(list("abc"), [2, 2])
    assert slices == [["a", "b"], ["c", "a"]] and overlap
    before = {"bole_engine_preemptions": 1, "bole_prefix_cache_hit_tokens": 10, "bole_engine_prompt_tokens": 100,
              "bole_request_mean_accepted_tokens_sum": 2.0, "bole_request_mean_accepted_tokens_count": 1}
    after = {"bole_engine_preemptions": 3, "bole_prefix_cache_hit_tokens": 40, "bole_engine_prompt_tokens": 160,
             "bole_request_mean_accepted_tokens_sum": 11.0, "bole_request_mean_accepted_tokens_count": 4}
    d = server_delta(before, after)
    assert (d["preemptions"], d["prefix_hit_tokens"], d["prompt_tokens"]) == (2, 30, 60)
    assert d["prefix_hit_rate"] == 0.5 and d["mean_mat"] == 3.0 and d["mean_queue_wait_ms"] is None
    assert d["mean_engine_queue_ms"] is None
    assert d["mean_step_ms"] is None and d["eager_forward_share"] is None   # no steps in the interval
    assert d["mean_prefill_ms"] is None and d["eager_prefill_share"] is None
    before.update(bole_engine_steps=10, bole_engine_step_seconds=1.0, bole_engine_decode_steps=8,
                  bole_engine_decode_seconds=0.5,
                  bole_engine_eager_forwards=8, bole_engine_eager_drafts=0, bole_engine_eager_tails=2,
                  bole_engine_graph_captures=40, bole_engine_capture_seconds=30.0,
                  bole_engine_prefill_steps=4, bole_engine_prefill_seconds=0.2, bole_engine_eager_prefills=1,
                  bole_engine_first_token_steps=3, bole_engine_mid_step_admissions=2,
                  bole_engine_beside_admissions=1, bole_queue_wait_seconds_sum=0.5, bole_queue_wait_seconds_count=4,
                  bole_engine_queue_seconds_sum=0.25, bole_engine_queue_seconds_count=4)
    after.update(bole_engine_steps=30, bole_engine_step_seconds=1.5, bole_engine_decode_steps=18,
                 bole_engine_decode_seconds=0.7,
                 bole_engine_eager_forwards=8, bole_engine_eager_drafts=5, bole_engine_eager_tails=4,
                 bole_engine_graph_captures=43, bole_engine_capture_seconds=30.25,
                 bole_engine_prefill_steps=8, bole_engine_prefill_seconds=0.25, bole_engine_eager_prefills=2,
                 bole_engine_first_token_steps=5, bole_engine_mid_step_admissions=9,
                 bole_engine_beside_admissions=5, bole_queue_wait_seconds_sum=0.6, bole_queue_wait_seconds_count=8,
                 bole_engine_queue_seconds_sum=0.27, bole_engine_queue_seconds_count=8)
    d = server_delta(before, after)
    assert (d["steps"], d["mean_step_ms"], d["engine_step_s"], d["mean_decode_ms"]) == (20, 25.0, 0.5, 20.0)
    assert (d["eager_forward_share"], d["eager_draft_share"], d["eager_tail_share"]) == (0.0, 0.5, 0.2)
    assert (d["graph_captures"], d["capture_s"]) == (3, 0.25)   # captured inside this phase's steps
    assert (d["prefill_steps"], d["mean_prefill_ms"], d["eager_prefill_share"]) == (4, 25.0, 0.25)
    assert (d["mid_step_admissions"], d["beside_admissions"]) == (7, 4)
    assert (d["mean_queue_wait_ms"], d["mean_engine_queue_ms"]) == (25.0, 5.0)


def test_serve_modes_on_the_cpu(tmp_path):
    for module in ("fastapi", "uvicorn", "openai"):   # the serving stack (absent on kernel-only machines)
        pytest.importorskip(module)
    model = make_tiny_model(tmp_path / "model")
    out = tmp_path / "serve_modes.json"
    cmd = [sys.executable, "benchmarks/serve_modes.py", "--model", model, "--device", "cpu",
           "--modes", "ar+max_num_batched_tokens=512",
           "--rates", "8", "--num-requests", "4", "--warmup-requests", "2", "--turns", "2", "--max-tokens", "6",
           "--num-blocks", "256", "--max-num-seqs", "4", "--calibration-table", "calibration_tables/default.yaml",
           "--engine-option", "block_size=4", "--log-dir", str(tmp_path / "logs"), "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == doc
    rec = doc["modes"]["ar+max_num_batched_tokens=512"]   # a mode with an option of its own
    assert "error" not in rec and rec["exit_code"] == 0, rec
    assert rec["engine_options"]["mode"] == "ar" and rec["engine_options"]["block_size"] == 4
    assert rec["engine_options"]["max_num_batched_tokens"] == 512
    (warm,) = rec["warmup"]   # one warm-up phase per rate
    assert warm["client"]["completed"] == 2 and warm["rate"] == 8
    (row,) = rec["rates"]
    c, s = row["client"], row["server"]
    assert (c["requests"], c["completed"], c["failed"]) == (4, 4, 0)
    # the server counted what the clients sent: every generated token, every prompt token
    assert s["generation_tokens"] == c["output_tokens"] == 4 * 6
    assert s["prompt_tokens"] == c["prompt_tokens"]
    # the second turn of a conversation re-sends the first: served from the prefix cache
    assert s["prefix_hit_tokens"] > 0 and 0 < s["prefix_hit_rate"] < 1
    assert s["preemptions"] == 0 and s["mean_mat"] == 1.0
    # the engine's own time over the phase, from /metrics: on the CPU every decode step runs eagerly
    assert s["steps"] > 0 and s["mean_step_ms"] > 0 and s["eager_forward_share"] == 1.0
    assert (s["graph_captures"], s["capture_s"]) == (0, 0.0)   # and nothing is captured
    assert 0 < s["mean_decode_ms"] and s["engine_step_s"] > 0
    (summary,) = doc["summary"]
    for key in ("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms"):
        assert summary[key] > 0, key
    assert summary["req_per_s"] > 0 and not doc["settings"]["prompt_slices_overlap"]
    assert (tmp_path / "logs" / "server_ar_max_num_batched_tokens_512.log").exists()
    # the distributions behind the summaries, and their CDF plot beside the JSON
    assert len(c["samples_ms"]["ttft"]) == 4 and c["samples_ms"]["ttft"] == sorted(c["samples_ms"]["ttft"])
    assert (tmp_path / "serve_modes.png").stat().st_size > 0


def test_modes_carry_options_of_their_own():
    """``MODE+KEY=VALUE[,KEY=VALUE]``: the engine mode and options of its own (YAML values), applied after
    ``--engine-option``; anything else is refused naming the label."""
    assert split_mode("bole") == ("bole", {})
    assert split_mode("bole+admit_during_forward=true,depth=4") == ("bole", {"admit_during_forward": True, "depth": 4})
    args = parse_args(["--modes", "ar", "ar+depth=4", "--engine-option", "depth=8", "--engine-option", "topk=4"])
    opts = overlay(args, "ar+depth=4", 1234)["applications"][0]["args"]["groups"][0]["engine_options"]
    assert (opts["mode"], opts["depth"], opts["topk"]) == ("ar", 4, 4)
    assert overlay(args, "ar", 1234)["applications"][0]["args"]["groups"][0]["engine_options"]["depth"] == 8
    for bad, why in (("fast", "must be one of"), ("bole+", "no KEY=VALUE"), ("bole+depth", "is not KEY=VALUE")):
        with pytest.raises(ValueError, match=why):
            split_mode(bad)
        with pytest.raises(SystemExit):
            parse_args(["--modes", bad])
    with pytest.raises(SystemExit):
        parse_args(["--modes", "ar", "ar"])
