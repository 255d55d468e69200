"""Widened models (bole.models.widen): the widened checkpoint computes the source model's function.

Tiny random checkpoints (hidden 64, 4 layers, vocab 128, one MTP layer) are widened to hidden 128 or 256
(1 or 2 copies of the hidden stream), 8 layers (4 pass-throughs), attention heads 4/2 -> 6/3, head_dim
16 -> 32 (rotary dims 4 -> 8), GDN heads 2/4 -> 3/6, key head dim 16 -> 32, FFN / expert widths x2; the
logits of prefill and decode steps, the MTP drafter's logits and greedy generation through bole.LLM
must match the source model's. The trained embedded model is checked too (widened in fp32, and through
scripts/widen_model.py at a small shape of the Qwen3.5 family), and its config at the project's shapes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import Runner, rel_err

from bole import LLM, SamplingParams
from bole.cache.kv_cache import PagedKVCache
from bole.calibrate_sweep import SHAPES, shapes_config
from bole.llm import REPO_ROOT, resolve_repo_path
from bole.models.context import ForwardContext
from bole.models.loader import load_model, read_config
from bole.models.widen import widen, widen_config

TOL = 1e-4
_CLI = importlib.util.spec_from_file_location("widen_model", os.path.join(REPO_ROOT, "scripts", "widen_model.py"))
widen_model = importlib.util.module_from_spec(_CLI)
_CLI.loader.exec_module(widen_model)


def target_shape(cfg, hidden=128, **overrides):
    return dataclasses.replace(cfg, **{
        **dict(hidden_size=hidden, num_hidden_layers=8, layer_types=cfg.layer_types * 2, num_attention_heads=6,
               num_key_value_heads=3, head_dim=32, linear_num_key_heads=3, linear_num_value_heads=6,
               linear_key_head_dim=32, intermediate_size=2 * (cfg.intermediate_size or 0) or None,
               moe_intermediate_size=2 * cfg.moe_intermediate_size,
               shared_expert_intermediate_size=2 * cfg.shared_expert_intermediate_size), **overrides})


@pytest.fixture(scope="module")
def widened(checkpoints, tmp_path_factory):
    cache = {}

    def get(kind, hidden=128, **overrides):
        key = (kind, hidden, tuple(sorted(overrides.items())))
        if key not in cache:
            src = checkpoints(kind).path
            _, cfg = read_config(src)
            dst = str(tmp_path_factory.mktemp(f"widened_{kind}_{hidden}"))
            report = widen(src, dst, target_shape(cfg, hidden, **overrides), dtype="float32")
            cache[key] = (src, dst, report)
        return cache[key]
    return get


def step_logits(model, prompt, steps=(5, 7)):
    """Logits of a prefill of ``prompt`` then decode steps, and the final hidden states of the prefill."""
    r = Runner(model)
    r.add(0)
    logits, hidden = r.step("prefill", {0: prompt})
    out = [logits]
    for t in steps:
        out.append(r.step("decode", {0: [t]})[0])
    return torch.cat(out), hidden


PROMPTS = [[1, 2, 3], [5, 17, 99, 4, 4, 60, 2, 7, 11, 3, 8], list(range(30, 60))]


@pytest.mark.parametrize("kind,hidden", [("dense", 128), ("dense", 256), ("moe", 128)])
def test_widened_logits_equal(widened, kind, hidden):
    src, dst, report = widened(kind, hidden)
    assert report.copies == hidden // 128 and set(report.eps_bounds.values()) == {0.0}  # every norm exact
    a, b = (load_model(p, dtype="float32", backend="torch") for p in (src, dst))
    assert (b.config.hidden_size, b.config.num_hidden_layers, b.config.head_dim, b.config.rotary_dim) == \
        (hidden, 8, 32, 8)
    for prompt in PROMPTS:
        (la, _), (lb, _) = step_logits(a, prompt), step_logits(b, prompt)
        assert lb.shape == la.shape and rel_err(lb, la) <= TOL


@pytest.mark.parametrize("kind", ["dense", "moe"])
@torch.no_grad()
def test_widened_mtp_logits_equal(widened, kind):
    src, dst, _ = widened(kind, 256 if kind == "dense" else 128)
    outs = []
    for path in (src, dst):
        model = load_model(path, dtype="float32", backend="torch")
        _, hidden = step_logits(model, PROMPTS[2], steps=())
        cfg = model.config
        kv = PagedKVCache(1, 16, 4, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float32)
        blocks = kv.allocator.allocate(8)
        ids = torch.tensor(PROMPTS[2][1:] + [3])
        ctx = ForwardContext.build("prefill", [20], [0], [0], [blocks], kv, None)
        out = [model.mtp.compute_logits(model.mtp(ids[:20], hidden[:20], ctx))]
        for t in range(20, len(ids)):
            ctx = ForwardContext.build("decode", [1], [t], [0], [blocks], kv, None)
            out.append(model.mtp.compute_logits(model.mtp(ids[t:t + 1], hidden[t:t + 1], ctx)))
        outs.append(torch.cat(out))
    assert rel_err(outs[1], outs[0]) <= TOL


@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_widened_greedy_generation_identical(widened, mode):
    src, dst, _ = widened("dense", 256)
    opts = dict(mode=mode, device="cpu", dtype="float32", depth=3, topk=2, beam=2, num_blocks=128, block_size=16,
                max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [p[:12] for p in PROMPTS]
    ref, out = ([o.token_ids for o in LLM(p, **opts).generate(prompts, sp)] for p in (src, dst))
    assert out == ref and any(len(set(t)) > 1 for t in ref)


def test_vocabulary_and_rope_theta_kept(widened):
    src, dst, report = widened("dense", 128)
    with open(os.path.join(src, "config.json")) as f_src, open(os.path.join(dst, "config.json")) as f_dst:
        a, b = json.load(f_src), json.load(f_dst)
    assert b["vocab_size"] == a["vocab_size"] and report.config.vocab_size == a["vocab_size"]
    assert report.config.rope_theta == read_config(src)[1].rope_theta
    assert report.config.rms_norm_eps == pytest.approx(read_config(src)[1].rms_norm_eps / 2)


def test_unequal_norm_ratios_are_reported(widened):
    """Hidden 64 -> 96 cannot give the hidden norms the ratio 1/2 of the others: eps is then inexact for
    them, the report says by how much, and the logits stay close (the bound is ~eps'/r / mean x²)."""
    src, dst, report = widened("dense", 96)
    assert report.copies == 1 and report.eps_bounds["hidden"] > 0 == report.eps_bounds["gdn"]
    a, b = (load_model(p, dtype="float32", backend="torch") for p in (src, dst))
    assert rel_err(step_logits(b, PROMPTS[1])[0], step_logits(a, PROMPTS[1])[0]) <= 1e-3


@pytest.mark.parametrize("overrides,match", [
    (dict(num_attention_heads=8, num_key_value_heads=1), "cannot be grouped"),   # 2 kv heads -> 1
    (dict(head_dim=24), "rotary dims"),                                           # 4 -> 6 rotary dims
    (dict(num_hidden_layers=5, layer_types=("full_attention",) + ("linear_attention",) * 4), "layer types"),
])
def test_impossible_widenings_refused(checkpoints, tmp_path, overrides, match):
    src = checkpoints("dense").path
    with pytest.raises(ValueError, match=match):
        widen(src, str(tmp_path), target_shape(read_config(src)[1], **overrides))


def test_group_copies_keep_each_query_on_its_kv_head(widened):
    """Fewer query heads per kv head (2 -> 1): each new kv head is a copy of the one its queries read."""
    src, dst, _ = widened("dense", 128, num_attention_heads=4, num_key_value_heads=4)
    a, b = (load_model(p, dtype="float32", backend="torch") for p in (src, dst))
    assert rel_err(step_logits(b, PROMPTS[1])[0], step_logits(a, PROMPTS[1])[0]) <= TOL


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_embedded_model_widens_exactly_to_the_project_shapes(shape):
    """models/bole-tiny-coder at the Qwen3.5 shapes (config only: the weights are GBs): every norm's ratio
    equal (hidden copies 4 / 5), rotary dims 16 -> 64 on the source's frequencies, vocabulary kept."""
    _, cfg = read_config(resolve_repo_path("models/bole-tiny-coder"))
    report = widen_config(cfg, shapes_config(shape))
    assert set(report.eps_bounds.values()) == {0.0} and report.copies == {"qwen3.5-9b": 4, "qwen3.5-27b": 5}[shape]
    t = report.config
    assert (t.hidden_size, t.num_hidden_layers, t.rotary_dim, t.vocab_size, t.rope_theta) == (
        SHAPES[shape]["hidden_size"], SHAPES[shape]["num_hidden_layers"], 64, cfg.vocab_size, cfg.rope_theta)


def test_cli_help():
    out = subprocess.run([sys.executable, "scripts/widen_model.py", "--help"], capture_output=True, text=True,
                         cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT}, check=True).stdout
    assert "--shape" in out and "qwen3.5-9b" in out


@pytest.mark.skipif(not os.path.exists(resolve_repo_path("models/bole-tiny-coder/model.safetensors")),
                    reason="the embedded model's weights are not checked out")
def test_embedded_model_widened_logits_equal(tmp_path):
    """The trained embedded model (real weight statistics), widened x4 in hidden size (2 copies), heads x2,
    head dims x2, 16 -> 20 layers, in fp32: the logits of a 40-token prefill are the source's."""
    src = resolve_repo_path("models/bole-tiny-coder")
    _, cfg = read_config(src)
    shape = dataclasses.replace(cfg, hidden_size=1024, num_hidden_layers=20, layer_types=(cfg.layer_types * 2)[:20],
                                num_attention_heads=8, num_key_value_heads=4, head_dim=128, linear_num_key_heads=8,
                                linear_num_value_heads=16, linear_key_head_dim=128, intermediate_size=1536)
    widen(src, str(tmp_path), shape, dtype="float32")
    a, b = (load_model(p, dtype="float32", backend="torch") for p in (src, str(tmp_path)))
    prompt = list(range(100, 140))
    assert rel_err(step_logits(b, prompt, steps=(7,))[0], step_logits(a, prompt, steps=(7,))[0]) <= TOL


@pytest.mark.skipif(not os.path.exists(resolve_repo_path("models/bole-tiny-coder/model.safetensors")),
                    reason="the embedded model's weights are not checked out")
def test_cli_widens_the_embedded_model(tmp_path, monkeypatch):
    """scripts/widen_model.py on the embedded model at a small shape of the Qwen3.5 family (its head dims
    256 / 128, rotary factor 0.25): the folder serves text like the source, with the source's logits."""
    monkeypatch.setitem(SHAPES, "mini", dict(hidden_size=1024, num_hidden_layers=20, linear_num_key_heads=4,
                                             linear_num_value_heads=8, num_attention_heads=4, num_key_value_heads=2,
                                             intermediate_size=1024))
    src, dst = resolve_repo_path("models/bole-tiny-coder"), str(tmp_path / "mini")
    widen_model.main(["--model", src, "--shape", "mini", "--out", dst, "--dtype", "float32"])
    a, b = (load_model(p, dtype="float32", backend="torch") for p in (src, dst))
    assert b.config.head_dim == 256 and b.config.linear_key_head_dim == 128
    prompt = list(range(100, 130))
    assert rel_err(step_logits(b, prompt, steps=())[0], step_logits(a, prompt, steps=())[0]) <= TOL
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    opts = dict(mode="ar", device="cpu", dtype="float32", num_blocks=64, block_size=16, max_num_seqs=2)
    texts = [LLM(p, **opts).generate("def add(a, b):", sp)[0].text for p in (src, dst)]
    assert texts[0] == texts[1] and texts[0]
