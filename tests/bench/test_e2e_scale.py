"""The scale benchmark (``benchmarks/e2e.py --scale``, benchmarks/e2e_scale.py) on the CPU: a tiny widening of
the embedded model through a worker subprocess, every cell's schema, exactness against ar, the ratios
the worker computed, reuse of the widened checkpoint, and the cells it records instead of crashing."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import e2e_scale

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("ar", "serial_tree", "bole")


def run_scale(*flags, timeout=300):
    r = subprocess.run([sys.executable, "benchmarks/e2e.py", "--scale", "--smoke", *flags], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale")
    out, png, wd = d / "s.json", d / "s.png", d / "widened"
    run_scale("--out", str(out), "--png", str(png), "--widen-dir", str(wd))
    return json.loads(out.read_text()), png, wd


def test_scale_smoke_rows(smoke):
    doc, png, _ = smoke
    assert doc["command"].startswith("python benchmarks/e2e.py --scale") and doc["elapsed_s"] > 0
    assert not doc["notes"] and not doc["skipped"] and doc["settings"]["cuda_graph_prefill_split"] is True
    rows = doc["rows"]
    assert sorted((r["mode"], r["batch"]) for r in rows) == sorted((m, b) for m in MODES for b in (1, 2))
    for r in rows:
        assert r["model"] == "smoke-cost, embedded model's predictions" and r["status"] == "ok"
        assert r["cuda_graph_prefill_split"] is True   # the engine's default
        assert r["tokens_per_s"] > 0 and len(r["tokens_per_s_runs"]) == 3 and r["mat"] >= 1.0
        assert sorted(r["tokens_per_s_runs"])[1] == r["tokens_per_s"]  # the median of the 3 runs
        ph = r["phases"]
        assert 0 < ph["verify_time_share"] <= 1 and ph["other_time_share"] == pytest.approx(
            1 - ph["verify_time_share"], abs=1e-3)
        assert ph["wall_ms_per_step"] > 0 and ph["mean_ttft_s"] > 0 and r["steps"] > 0
        # the CPU captures no graph: every timed step's parts are counted eager, none captured mid-run
        eager = ph["eager_steps"]
        assert ph["graphs_captured_in_runs"] == 0
        assert 0 < eager["prefill"] <= r["steps"] and 0 < eager["forward"] <= r["steps"]
        assert (eager["draft"], eager["tail"]) == ((0, 0) if r["mode"] == "ar" else (eager["forward"],) * 2)
        if r["mode"] == "ar":
            assert r["exact_vs_ar"] is None and r["mat"] == 1.0
        else:
            assert r["exact_vs_ar"] is True  # greedy speculative cells emit the ar cell's tokens
    (m,) = doc["models"]
    assert m["shape"] == "smoke" and not m["reused"] and m["weight_bytes"] > 0
    assert doc["plot"] == str(png) and png.stat().st_size > 0


def test_scale_smoke_ratios_are_the_workers(smoke):
    doc, _, _ = smoke
    rat = doc["ratios"]["smoke-cost, embedded model's predictions"]
    tps = {(r["mode"], r["batch"]): r["tokens_per_s"] for r in doc["rows"]}
    assert isinstance(rat["pid"], int) and [d["batch"] for d in rat["per_batch"]] == [1, 2]
    for d in rat["per_batch"]:
        assert d["all_exact_vs_ar"] is True
        for num, den in e2e_scale.RATIOS:
            assert d[f"{num}/{den}"] == round(tps[num, d["batch"]] / tps[den, d["batch"]], 3)
    for key, g in rat["geomean_batches_1_16"].items():
        xs = [d[key] for d in rat["per_batch"]]
        assert g["batches"] == [1, 2] and g["value"] == pytest.approx(math.sqrt(xs[0] * xs[1]), abs=2e-3)


def test_widened_checkpoint_is_reused(smoke):
    _, _, wd = smoke
    path, record = e2e_scale.widened(os.path.join(ROOT, "models", "bole-tiny-coder"), "smoke", str(wd))
    assert record["reused"] and path == str(wd / "smoke") and os.path.exists(os.path.join(path, "tokenizer.json"))


def test_a_widening_larger_than_the_disk_is_refused_before_writing(tmp_path, monkeypatch):
    """The MoE shape (~71 GB in bf16) on a disk with less room: a ValueError naming the sizes and the way out,
    nothing written; the default model list is the dense shapes (the MoE one runs when named)."""
    cfg = e2e_scale.shape_config("qwen3.5-35b-a3b")
    assert 70e9 < e2e_scale.widened_bytes(cfg) < 72e9
    monkeypatch.setattr(e2e_scale, "free_bytes", lambda path: 10 << 30)
    stale = tmp_path / "w" / "qwen3.5-35b-a3b"  # an older widening: replaced, its room counted once deleted
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"0" * 1024)
    with pytest.raises(e2e_scale.NoRoom, match=r"35b-a3b writes 66\.\d GiB, .* 10\.0 GiB free: pass --widen-dir"):
        e2e_scale.widened(os.path.join(ROOT, "models", "bole-tiny-coder"), "qwen3.5-35b-a3b", str(tmp_path / "w"))
    assert not any((tmp_path / "w").iterdir())  # nothing written, the stale folder gone
    assert e2e_scale.parse_args([]).models == ["qwen3.5-27b", "qwen3.5-4b", "qwen3.5-9b"]
    assert e2e_scale.parse_args(["--models", "qwen3.5-35b-a3b"]).models == ["qwen3.5-35b-a3b"]


def test_widened_in_memory_runs_with_no_weights_on_disk(tmp_path, monkeypatch):
    """--widen-in-memory: --widen-dir gets the config and tokenizer files only, the worker widens into memory
    and its cells run (the speculative one token-identical to ar); the MoE shape is refused before anything
    is written where the host's memory cannot hold it."""
    out, wd = tmp_path / "m.json", tmp_path / "w"
    run_scale("--out", str(out), "--png", "none", "--widen-dir", str(wd), "--widen-in-memory", "--batches", "1",
              "--modes", "ar", "bole", "--no-prefill-split", "--max-num-batched-tokens", "256",
              "--gpu-memory-utilization", "0.95")
    doc = json.loads(out.read_text())
    assert not doc["notes"] and [(r["mode"], r["status"], r["exact_vs_ar"]) for r in doc["rows"]] == [
        ("ar", "ok", None), ("bole", "ok", True)]
    # --no-prefill-split reaches every cell's engine (on the CPU prefills run eagerly whatever it says)
    assert doc["settings"]["cuda_graph_prefill_split"] is False
    assert not any(r["cuda_graph_prefill_split"] for r in doc["rows"])
    # --max-num-batched-tokens too (the MoE shape's cells on an 80 GB card)
    assert doc["settings"]["max_num_batched_tokens"] == 256
    assert [r["max_num_batched_tokens"] for r in doc["rows"]] == [256, 256]
    assert doc["settings"]["gpu_memory_utilization"] == 0.95   # and --gpu-memory-utilization
    assert [r["gpu_memory_utilization"] for r in doc["rows"]] == [0.95, 0.95]
    assert [r.get("budget_rule") for r in doc["rows"]] == [None, "epsilon"]   # "auto", as a dense engine fixed it
    (m,) = doc["models"]
    assert m["in_memory"] and m["weight_bytes"] == e2e_scale.widened_bytes(e2e_scale.shape_config("smoke"))
    files = sorted(p.name for p in wd.rglob("*") if p.is_file())
    assert "config.json" in files and "tokenizer.json" in files and not [f for f in files if "safetensors" in f]
    monkeypatch.setattr(e2e_scale, "available_memory", lambda: 32 << 30)
    with pytest.raises(e2e_scale.NoRoom, match=r"into memory holds 66\.\d GiB, the host has 32\.0 GiB"):
        e2e_scale.widened_in_memory(os.path.join(ROOT, "models", "bole-tiny-coder"), "qwen3.5-35b-a3b", str(wd))
    assert not (wd / "qwen3.5-35b-a3b.config").exists()


def test_ratios_geomean_over_batches_up_to_16():
    rows = [dict(mode=m, batch=b, status="ok", tokens_per_s=t, exact_vs_ar=None if m == "ar" else True)
            for m, b, t in [("ar", 1, 10.0), ("bole", 1, 20.0), ("ar", 16, 40.0), ("bole", 16, 160.0),
                            ("ar", 32, 50.0), ("bole", 32, 500.0), ("serial_tree", 1, 5.0)]]
    rows.append(dict(mode="serial_tree", batch=16, status="oom", exact_vs_ar=None))
    got = e2e_scale.ratios(rows)
    g = got["geomean_batches_1_16"]
    assert g["bole/ar"] == dict(value=round(math.sqrt(2.0 * 4.0), 3), batches=[1, 16])  # batch 32 left out
    assert g["bole/serial_tree"] == dict(value=4.0, batches=[1])                       # oom cell left out
    assert [d.get("bole/ar") for d in got["per_batch"]] == [2.0, 4.0, 10.0]
    # an option cell against the same cell without the option
    rows += [dict(mode=m, batch=1, status="ok", tokens_per_s=t, exact_vs_ar=True)
             for m, t in [("bole-wcap", 30.0), ("bole-wcap-best1", 36.0)]]
    per = e2e_scale.ratios(rows)["per_batch"][0]
    assert per["bole-wcap/bole"] == 1.5 and per["bole-wcap-best1/bole"] == 1.8 and per["bole-wcap/ar"] == 3.0
    per = e2e_scale.ratios(rows + [dict(mode="bole-gp", batch=1, status="ok", tokens_per_s=25.0,
                                        exact_vs_ar=True)])["per_batch"][0]
    assert per["bole-gp/bole"] == 1.25 and per["bole-gp/ar"] == 2.5   # the goodput budget against eq. 12's
    per = e2e_scale.ratios(rows + [dict(mode="bole-eq12", batch=1, status="ok", tokens_per_s=15.0,
                                        exact_vs_ar=True)])["per_batch"][0]
    assert per["bole-eq12/bole"] == 0.75 and per["bole-eq12/ar"] == 1.5   # eq. 12's against the engine's rule
    # a reduced-vocabulary bole cell against serial_tree with the same drafter, where that cell ran
    assert "bole_fr64/serial_tree_fr64" not in e2e_scale.ratios(rows + [
        dict(mode="bole_fr64", batch=1, status="ok", tokens_per_s=30.0, exact_vs_ar=True)])["geomean_batches_1_16"]
    rows += [dict(mode=m, batch=1, status="ok", tokens_per_s=t, exact_vs_ar=True)
             for m, t in [("bole_fr64", 30.0), ("serial_tree_fr64", 12.0)]]
    per = e2e_scale.ratios(rows)["per_batch"][0]
    assert per["bole_fr64/serial_tree_fr64"] == 2.5 and per["bole_fr64/ar"] == 3.0
    assert not [k for k in per if k.startswith(("ar/", "serial_tree/serial"))]   # no pair the wrong way round
    # only pairs whose cells both ran (run G's cells are all _fr: no bole/ar entry)
    only_fr = [r for r in rows if r["mode"] in ("ar", "bole_fr64")]
    assert list(e2e_scale.ratios(only_fr)["geomean_batches_1_16"]) == ["bole_fr64/ar"]


def _spec(smoke, **kw):
    _, _, wd = smoke
    return dict(shape="smoke", path=str(wd / "smoke"), device="cpu", max_tokens=2, repeats=1, depth=2, topk=2,
                beam=2, calibration_table="calibration_tables/default.yaml", cell_budget_s=30.0, **kw)


def test_refused_and_oom_cells_are_recorded(smoke, monkeypatch):
    prompts = [json.loads(line) for line in open(os.path.join(ROOT, "benchmarks/data/heldout_prompts.jsonl"))][:1]
    row, toks = e2e_scale.run_cell(dict(_spec(smoke), depth=16), "bole", 1, prompts)  # SpecConfig refuses it
    assert row["status"] == "refused" and "depth" in row["error"] and toks is None

    def oom(*a, **k):  # a GPU's allocator failure, which a CPU cannot produce
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr("benchmarks.engine_modes.time_llm", oom)
    row, toks = e2e_scale.run_cell(_spec(smoke), "ar", 1, prompts)
    assert row["status"] == "oom" and "out of memory" in row["error"] and toks is None


def test_a_cells_run_budget_excludes_its_construction(smoke, monkeypatch):
    """run_cell hands time_llm the whole cell budget for the timed runs however long the engine took to
    build (a process's first cell pays the compiles there; it once left a 27B cell one run of three)."""
    import time

    from bole import LLM

    prompts = [json.loads(line) for line in open(os.path.join(ROOT, "benchmarks/data/heldout_prompts.jsonl"))][:1]
    seen = []
    real_init = LLM.__init__

    def slow_init(self, *a, **k):   # an engine whose construction outlasts the cell budget
        real_init(self, *a, **k)
        time.sleep(1.2)

    def record(llm, batch, prompts, max_tokens, repeats, budget_s=None):
        seen.append(budget_s)
        raise torch.cuda.OutOfMemoryError("stop here")

    monkeypatch.setattr(LLM, "__init__", slow_init)
    monkeypatch.setattr("benchmarks.engine_modes.time_llm", record)
    row, _ = e2e_scale.run_cell(dict(_spec(smoke), cell_budget_s=1.0), "ar", 1, prompts,
                                on_timing=lambda: seen.append("timing"))
    # the watchdog's clock restarts after the model's load and again before the runs
    assert row["status"] == "oom" and seen == ["timing", "timing", 1.0]


def test_the_watchdog_times_construction_and_runs_apart():
    spec, grace = dict(deadline=1000.0, cell_budget_s=60.0), 40.0   # a phase may take 2 x 60 + 40 = 160 s
    cell = dict(cell={"mode": "ar"}, cell_t0=0.0, clock_t0=0.0)
    assert e2e_scale.past_budget(cell, 150.0, spec, grace) is None
    assert e2e_scale.past_budget(cell, 161.0, spec, grace) == "cell budget"   # construction hung
    timed = dict(cell, clock_t0=130.0)   # built in 130 s (a first cell's compiles), then the runs
    assert e2e_scale.past_budget(timed, 200.0, spec, grace) is None
    assert e2e_scale.past_budget(timed, 291.0, spec, grace) == "cell budget"
    assert e2e_scale.past_budget(dict(timed, cell=None), 291.0, spec, grace) is None   # between cells
    assert e2e_scale.past_budget(timed, 1041.0, spec, grace) == "total budget"


def test_a_cell_past_its_budget_is_recorded_as_timeout(smoke, tmp_path):
    _, _, wd = smoke
    out = tmp_path / "t.json"
    run_scale("--out", str(out), "--png", "none", "--widen-dir", str(wd), "--batches", "1", "--modes", "ar", "bole",
              "--cell-budget-s", "0", "--grace-s", "0.5")
    doc = json.loads(out.read_text())
    assert doc["models"][0]["reused"]
    assert [(r["mode"], r["status"]) for r in doc["rows"]] == [("ar", "timeout"), ("bole", "not_run")]
    assert "killed: cell budget" in doc["notes"][0]


def test_draft_vocab_cells(smoke, tmp_path):
    # a bole_fr<N> cell per --draft-vocab N: bole with the reduced draft vocabulary, exact against ar,
    # with its tokens/s ratio to ar (the reused widening carries the source's token_frequencies.json)
    _, _, wd = smoke
    out = tmp_path / "fr.json"
    run_scale("--out", str(out), "--png", "none", "--widen-dir", str(wd), "--batches", "1", "--modes", "ar",
              "--draft-vocab", "512", "--also-spec", "3,2,1")
    doc = json.loads(out.read_text())
    assert doc["settings"]["draft_vocab"] == [512] and not doc["notes"]
    ar, fr, deep = doc["rows"]
    assert (ar["mode"], fr["mode"], fr["status"], fr["draft_vocab"]) == ("ar", "bole_fr512", "ok", 512)
    assert fr["exact_vs_ar"] is True and fr["mat"] >= 1.0
    # --also-spec: the speculative cell again with depth 3, topk 2, beam 1 (the run's is 2 / 2 / 2)
    assert deep["mode"] == "bole_fr512-d3k2b1" and deep["status"] == "ok" and deep["exact_vs_ar"] is True
    assert (deep["depth"], deep["topk"], deep["beam"], deep["draft_vocab"]) == (3, 2, 1, 512)
    (d,) = doc["ratios"]["smoke-cost, embedded model's predictions"]["per_batch"]
    assert d["bole_fr512/ar"] == round(fr["tokens_per_s"] / ar["tokens_per_s"], 3)
    assert d["bole_fr512-d3k2b1/ar"] == round(deep["tokens_per_s"] / ar["tokens_per_s"], 3)
    assert e2e_scale.engine_mode("bole_fr512") == ("bole", {"draft_vocab": 512})
    assert e2e_scale.engine_mode("serial_tree") == ("serial_tree", {})


def test_cell_names():
    em = e2e_scale.engine_mode
    assert em("bole_fr2048@default-d8k2b2") == ("bole", dict(
        depth=8, topk=2, beam=2, calibration_table="calibration_tables/default.yaml", draft_vocab=2048))
    assert em("serial_tree-d6k3b3") == ("serial_tree", dict(depth=6, topk=3, beam=3))
    assert em("bole_fr64-d8k2b2-e0.5") == ("bole", dict(draft_vocab=64, depth=8, topk=2, beam=2, budget_epsilon=0.5))
    assert em("bole-e2") == ("bole", dict(budget_epsilon=2.0))
    assert em("bole_fr64-e0.5-wcap") == ("bole", dict(draft_vocab=64, budget_epsilon=0.5, cap_tree_width=True))
    assert e2e_scale.base_mode("serial_tree-d8k2b2-wcap") == "serial_tree"
    assert em("serial_tree_fr32768-nocap") == ("serial_tree", dict(draft_vocab=32768, cap_tree_width=False))
    for bad in ("ar_fr64", "bole_frx", "tree_fr64"):
        with pytest.raises(ValueError, match=bad):
            em(bad)
    assert em("bole-wcap-best1") == ("bole", dict(cap_tree_width=True, budget_floor="best_child"))
    assert em("bole_fr64-nocap-kids") == ("bole", dict(draft_vocab=64, cap_tree_width=False, budget_floor="children"))
    assert e2e_scale.base_mode("serial_tree-nocap-kids") == "serial_tree"
    assert e2e_scale.base_mode("bole_fr64-e0.5-wcap-best1") == "bole_fr64"
    assert e2e_scale.base_mode("bole_fr64-d8k2b2-e0.5") == "bole_fr64"
    assert em("bole_fr64-nocap-r1024") == ("bole", dict(draft_vocab=64, cap_tree_width=False, max_verify_rows=1024))
    assert em("bole-r256") == ("bole", dict(max_verify_rows=256))
    assert e2e_scale.base_mode("bole_fr64-r256") == "bole_fr64"
    assert em("bole_fr64-r256-gp") == ("bole", dict(draft_vocab=64, max_verify_rows=256, budget_rule="goodput"))
    assert em("bole-gp") == ("bole", dict(budget_rule="goodput"))
    assert em("bole_fr64-r256-eq12") == ("bole", dict(draft_vocab=64, max_verify_rows=256, budget_rule="epsilon"))
    for bad in ("ar-d8k2b2", "bole_frx", "tree", "bole-d8k2", "ar-e0.5", "bole-e0.5-d8k2b2", "ar-best1",
                "bole-best1-wcap", "bole-kids-nocap", "bole-capno", "ar-r1024", "bole-r1024-wcap", "bole-r",
                "ar-gp", "bole-gp-r256", "ar-eq12", "bole-eq12-gp", "bole-eq"):
        with pytest.raises(ValueError, match="not MODE"):
            em(bad)
    a = e2e_scale.parse_args(["--modes", "ar", "serial_tree", "bole", "--draft-vocab", "64", "--also-spec", "8,2,2"])
    assert a.modes == ["ar", "serial_tree", "bole", "bole_fr64", "serial_tree-d8k2b2", "bole-d8k2b2",
                       "bole_fr64-d8k2b2"]
    with pytest.raises(SystemExit):
        e2e_scale.parse_args(["--also-spec", "8,2"])
    a = e2e_scale.parse_args(["--modes", "ar", "serial_tree", "bole", "--draft-vocab", "64", "--also-epsilon", "0.5"])
    assert a.modes == ["ar", "serial_tree", "bole", "bole_fr64", "bole-e0.5", "bole_fr64-e0.5"]
    with pytest.raises(SystemExit):
        e2e_scale.parse_args(["--also-epsilon", "-1"])
    a = e2e_scale.parse_args(["--modes", "ar", "serial_tree", "bole", "--draft-vocab", "64", "--also-paper"])
    assert a.modes == ["ar", "serial_tree", "bole", "bole_fr64", "serial_tree-nocap-kids", "bole-nocap-kids",
                       "bole_fr64-nocap-kids"]
    a = e2e_scale.parse_args(["--modes", "ar", "--draft-vocab", "64", "--also-cell", "bole_fr64-wcap-best1", "ar"])
    assert a.modes == ["ar", "bole_fr64", "bole_fr64-wcap-best1"]
    with pytest.raises(SystemExit):
        e2e_scale.parse_args(["--also-cell", "bole-best1-wcap"])
    # each drafting suffix's bole cell is compared with its serial_tree cell, every other cell with ar
    rows = [dict(mode=m, batch=1, status="ok", tokens_per_s=t, exact_vs_ar=None)
            for m, t in (("ar", 100.0), ("serial_tree-d8k2b2", 150.0), ("bole-d8k2b2", 300.0))]
    (d,) = e2e_scale.ratios(rows)["per_batch"]
    assert d == {"batch": 1, "serial_tree-d8k2b2/ar": 1.5, "bole-d8k2b2/ar": 3.0,
                 "bole-d8k2b2/serial_tree-d8k2b2": 2.0, "all_exact_vs_ar": True}
    # a verify-rows cell is compared with ar and with the same cell unbounded
    rows = [dict(mode=m, batch=1, status="ok", tokens_per_s=t, exact_vs_ar=None)
            for m, t in (("ar", 100.0), ("bole", 300.0), ("bole-r1024", 330.0))]
    (d,) = e2e_scale.ratios(rows)["per_batch"]
    assert d["bole-r1024/ar"] == 3.3 and d["bole-r1024/bole"] == 1.1


def test_first_divergence_names_each_differing_request():
    from benchmarks.e2e_scale import first_divergence
    assert first_divergence([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 7], [6, 8]]) == [
        dict(request=1, position=1, token=5, ar_token=7), dict(request=2, position=1, token=None, ar_token=8)]


def test_time_llm_budget_counts_the_timed_runs_only(monkeypatch):
    """A cell's run budget starts at its first timed run: the captures and the warm-up before it (the
    compiles a process's first cell pays) leave every repeat to run."""
    import time

    from benchmarks.engine_modes import time_llm
    from bole import LLM

    llm = LLM(os.path.join(ROOT, "models", "bole-tiny-coder"), mode="ar", device="cpu", dtype="float32")

    class SlowCapture:   # stands in for a graph family whose captures outlast the budget
        num_captured, capture_seconds = 0, 0.0   # what the engine's stats read of a family

        def capture_all(self, batch, longest):
            time.sleep(2.5)

    monkeypatch.setattr(llm.engine.runner, "all_graphs", lambda: [SlowCapture()])
    row, outs = time_llm(llm, 1, ["def add(a, b):"], max_tokens=2, repeats=3, budget_s=2.0)
    assert len(row["tokens_per_s_runs"]) == 3 and len(outs[0]) == 2
    # the budget still ends the runs: none starts once it has passed (at least one runs)
    row, _ = time_llm(llm, 1, ["def add(a, b):"], max_tokens=2, repeats=3, budget_s=0.0)
    assert len(row["tokens_per_s_runs"]) == 1
