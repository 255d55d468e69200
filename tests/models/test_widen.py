"""Widened models (bole.models.widen): the widened checkpoint computes the source model's function.

Tiny random checkpoints (hidden 64, 4 layers, vocab 128, one MTP layer) are widened to hidden 128 or 256
(1 or 3 copies of the hidden stream and two constant channels), vocab 1000 (872 padded rows), 8 layers
(4 pass-throughs), attention heads 4/2 -> 6/3, head_dim 16 -> 32 (rotary dims 4 -> 8), GDN heads 2/4 -> 3/6,
key head dim 16 -> 32, FFN / expert widths x2; the real-token logits of prefill and decode steps, the MTP
drafter's logits and greedy generation through bole.LLM must match the source model's, and every padded
row's logit must lie strictly below the real row it copies, in both heads (alpha = 0 ties them). The
trained embedded model is checked too (widened in fp32, and through scripts/widen_model.py at a small
shape of the Qwen3.5 family), and its config at the project's shapes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
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
from bole.models.widen import ALPHA, widen, widen_config, widened_tensors, write_widened_config

TOL = 1e-4
VOCAB = 1000  # widened vocabulary: 7 full copies of the 128 real rows and a partial one
_CLI = importlib.util.spec_from_file_location("widen_model", os.path.join(REPO_ROOT, "scripts", "widen_model.py"))
widen_model = importlib.util.module_from_spec(_CLI)
_CLI.loader.exec_module(widen_model)


def target_shape(cfg, hidden=128, **overrides):
    return dataclasses.replace(cfg, **{
        **dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=8, layer_types=cfg.layer_types * 2,
               num_attention_heads=6, num_key_value_heads=3, head_dim=32, linear_num_key_heads=3,
               linear_num_value_heads=6, linear_key_head_dim=32,
               intermediate_size=2 * (cfg.intermediate_size or 0) or None,
               moe_intermediate_size=2 * cfg.moe_intermediate_size,
               shared_expert_intermediate_size=2 * cfg.shared_expert_intermediate_size), **overrides})


@pytest.fixture(scope="module")
def widened(checkpoints, tmp_path_factory):
    cache = {}

    def get(kind, hidden=128, alpha=ALPHA, **overrides):
        key = (kind, hidden, alpha, tuple(sorted(overrides.items())))
        if key not in cache:
            src = checkpoints(kind).path
            _, cfg = read_config(src)
            dst = str(tmp_path_factory.mktemp(f"widened_{kind}_{hidden}"))
            report = widen(src, dst, target_shape(cfg, hidden, **overrides), dtype="float32", alpha=alpha)
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


def padded_margin(logits, vocab):
    """min over rows and padded tokens p of logit(p mod vocab) - logit(p): > 0 iff every padded row loses."""
    copied = logits[:, torch.arange(vocab, logits.shape[1]) % vocab]
    return float((copied - logits[:, vocab:]).min())


PROMPTS = [[1, 2, 3], [5, 17, 99, 4, 4, 60, 2, 7, 11, 3, 8], list(range(30, 60))]
DENSE_TO_MOE = dict(intermediate_size=None, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                    shared_expert_intermediate_size=64)  # the dense 96 channels: 64 shared, 32 in every expert


@pytest.mark.parametrize("kind,hidden", [("dense", 128), ("dense", 256), ("moe", 128), ("dense_to_moe", 256)])
def test_widened_logits_equal(widened, kind, hidden):
    """Real-token logits are the source's; padded rows lose to the row they copy by a wide margin. At hidden
    128 (1 copy: r_h = r_gdn = 1/2) the constant cannot fill r_h·eps - eps' = 0: the hidden norms see 17/16·eps
    (relative error up to eps/16 / (2·mean x²), not the 1e-4 of the exact widenings). dense_to_moe: a dense
    source at a MoE shape (every layer a MoE block)."""
    src, dst, report = widened("dense", hidden, **DENSE_TO_MOE) if kind == "dense_to_moe" else widened(kind, hidden)
    eps = read_config(src)[1].rms_norm_eps
    assert report.copies == (hidden - 2) // 64 and report.constant > 0 and report.channel == 64 * report.copies
    assert report.eps_bounds == dict(hidden=pytest.approx(eps / 16 if hidden == 128 else 0.0), attention=0.0, gdn=0.0)
    a, b = (load_model(p, dtype="float32", backend="torch") for p in (src, dst))
    assert (b.config.vocab_size, b.config.hidden_size, b.config.num_hidden_layers, b.config.head_dim,
            b.config.rotary_dim) == (VOCAB, hidden, 8, 32, 8)
    for prompt in PROMPTS:
        (la, _), (lb, _) = step_logits(a, prompt), step_logits(b, prompt)
        assert lb.shape == (la.shape[0], VOCAB) and rel_err(lb[:, :128], la) <= (1e-3 if hidden == 128 else TOL)
        assert padded_margin(lb, 128) > 2 * (la.max() - la.min())  # padded tokens below every real one


@pytest.mark.parametrize("kind", ["dense", "moe", "dense_to_moe"])
@torch.no_grad()
def test_widened_mtp_logits_equal(widened, kind):
    """The drafter's real-token logits and top-k are the source's; mtp.fc writes the constant c at channel j
    (nothing at j + 1) for every token, so padded rows lose in the drafter's head too. dense_to_moe: a dense
    source at a MoE shape, whose MTP layer is a MoE block."""
    if kind == "dense_to_moe":
        src, dst, report = widened("dense", 256, **DENSE_TO_MOE)
    else:
        src, dst, report = widened(kind, 256 if kind == "dense" else 128)
    outs, fc_out = [], []
    for path in (src, dst):
        model = load_model(path, dtype="float32", backend="torch")
        if path == dst:
            model.mtp.fc.register_forward_hook(lambda mod, inp, o: fc_out.append(o[:, report.channel:][:, :2]))
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
    assert outs[1].shape[1] == VOCAB and rel_err(outs[1][:, :128], outs[0]) <= TOL
    assert padded_margin(outs[1], 128) > 2 * (outs[0].max() - outs[0].min())
    assert torch.equal(outs[1].topk(4).indices, outs[0].topk(4).indices)  # the drafter's top-k is the source's
    const = torch.cat(fc_out)
    assert torch.allclose(const[:, 0], torch.full_like(const[:, 0], report.constant), rtol=1e-5, atol=0)
    assert not const[:, 1].any()


def routed_experts(model, prompt):
    """{layer: distinct experts chosen} over a prefill of ``prompt`` (the routers' top-k)."""
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        k = layer.mlp.top_k
        hooks.append(layer.mlp.gate.register_forward_hook(
            lambda mod, inp, out, i=i, k=k: seen.setdefault(i, set()).update(out.topk(k).indices.flatten().tolist())))
    step_logits(model, prompt, steps=())
    for h in hooks:
        h.remove()
    return seen


@torch.no_grad()
def test_dense_widened_into_moe_computes_the_source(widened):
    """A dense source at a MoE shape (8 experts, top 2, a shared expert): every layer, the 4 pass-throughs and
    the MTP's included, is a MoE block; the target's and the drafter's logits are the source's; the random
    routers spread a prompt's tokens over the experts in every layer, pass-throughs included."""
    src, dst, report = widened("dense", 128, **DENSE_TO_MOE)
    a, b = (load_model(p, dtype="float32", backend="torch") for p in (src, dst))
    cfg = b.config
    assert cfg.model_type == "qwen3_5_moe_text" and report.config.model_type == cfg.model_type
    assert all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers + 1)) and cfg.num_experts == 8
    assert type(b.mtp.layers[0].mlp).__name__ == "SparseMoE"
    for prompt in PROMPTS:
        (la, _), (lb, _) = step_logits(a, prompt), step_logits(b, prompt)
        assert rel_err(lb[:, :128], la) <= 1e-3  # hidden 128: one copy, the hidden norms see 17/16·eps
        assert padded_margin(lb, 128) > 2 * (la.max() - la.min())
    seen = routed_experts(b, PROMPTS[2])
    assert len(seen) == 8 and all(len(e) >= 6 for e in seen.values()), seen  # 30 tokens x top 2 of 8
    experts = b.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj[0], experts.gate_up_proj[7]) and experts.gate_up_proj.abs().sum() > 0
    assert not b.model.layers[5].mlp.experts.down_proj.any()  # a pass-through: zero experts, a random router
    assert b.model.layers[5].mlp.gate.weight.abs().sum() > 0


@pytest.mark.parametrize("kind,overrides", [("dense", {}), ("dense_to_moe", DENSE_TO_MOE)])
def test_widening_held_in_memory_loads_as_written(widened, kind, tmp_path, overrides):
    """widened_tensors yields what widen writes (names and values, pass-throughs and routed experts
    included), and load_model(tensors=...) over a folder holding only write_widened_config's config.json
    builds the same model as the written checkpoint: a widening no disk holds (the 71 GB MoE shape)."""
    from safetensors.torch import load_file

    src, dst, _ = widened(kind.split("_")[0], 128, **overrides)
    shape = read_config(dst)[1]
    tensors = dict(widened_tensors(src, target_shape(read_config(src)[1], 128, **overrides), dtype="float32"))
    written = {}
    for f in sorted(os.listdir(dst)):
        if f.endswith(".safetensors"):
            written.update(load_file(os.path.join(dst, f)))
    assert tensors.keys() == written.keys() and all(torch.equal(tensors[n], written[n]) for n in written)
    config_only = str(tmp_path / "config_only")
    write_widened_config(src, config_only, target_shape(read_config(src)[1], 128, **overrides))
    assert os.listdir(config_only) == ["config.json"] and read_config(config_only)[1] == shape
    a = load_model(dst, dtype="float32", backend="torch")
    b = load_model(config_only, dtype="float32", backend="torch", tensors=tensors)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)
    with pytest.raises(ValueError, match=r"missing tensors \(1\): model.norm.weight"):  # named as from files
        load_model(config_only, dtype="float32", backend="torch",
                   tensors={n: t for n, t in tensors.items() if n != "model.norm.weight"})


@pytest.mark.parametrize("alpha", [ALPHA, 0.0])
@pytest.mark.parametrize("scale", [1e-4, 1e-2, 1.0, 1e3])
@torch.no_grad()
def test_padded_rows_lose_on_adversarial_hidden_states(widened, alpha, scale):
    """Final-norm inputs of any rms, random or pushing every real logit far negative, as the widened model
    holds them (copies, the constant pair at j, j + 1 with the extreme angles θ = ±π/4; the drafter's
    residual: c at j): each padded logit is strictly below its real row's in both heads, the real logits
    the source's. alpha = 0 leaves the rows tied (the check is not vacuous)."""
    src, dst, report = widened("dense", 256, alpha=alpha)
    a, b = (load_model(p, dtype="float32", backend="torch") for p in (src, dst))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen)
    x[3:] -= 4 * a.lm_head.weight.sum(0)  # every real logit very negative
    x = scale * x / x.pow(2).mean(1, keepdim=True).sqrt()
    j, c, k = report.channel, report.constant, report.copies
    target = [(c * math.cos(t), c * math.sin(t)) for t in (math.pi / 4, -math.pi / 4 + 1e-3)]
    for src_head, wide_head, pairs in ((a, b, target), (a.mtp, b.mtp, [(c, 0.0)])):
        src_norm, wide_norm = (a.model.norm, b.model.norm) if src_head is a else (a.mtp.norm, b.mtp.norm)
        for pair in pairs:
            xw = torch.zeros(6, 256)
            xw[:, :64 * k] = x.repeat(1, k)
            xw[:, j:j + 2] = torch.tensor(pair)
            ref, out = src_head.compute_logits(src_norm(x)), wide_head.compute_logits(wide_norm(xw))
            assert rel_err(out[:, :128], ref) <= TOL
            if alpha:
                assert padded_margin(out, 128) > 0 and int(out.argmax(1).max()) < 128
            else:
                assert abs(padded_margin(out, 128)) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("kind", ["dense", "dense_to_moe"])
@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_widened_greedy_generation_identical(widened, mode, kind):
    src, dst, _ = widened("dense", 256, **(DENSE_TO_MOE if kind == "dense_to_moe" else {}))
    opts = dict(mode=mode, device="cpu", dtype="float32", depth=3, topk=2, beam=2, num_blocks=128, block_size=16,
                max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [p[:12] for p in PROMPTS]
    ref, out = ([o.token_ids for o in LLM(p, **opts).generate(prompts, sp)] for p in (src, dst))
    assert out == ref and any(len(set(t)) > 1 for t in ref)


def test_target_vocabulary_and_source_rope_theta(widened):
    src, dst, report = widened("dense", 256)
    with open(os.path.join(dst, "config.json")) as f_dst:
        b = json.load(f_dst)
    assert b["vocab_size"] == VOCAB and report.config.vocab_size == VOCAB
    eps = read_config(src)[1].rms_norm_eps
    assert report.config.rope_theta == read_config(src)[1].rope_theta
    assert report.config.rms_norm_eps == pytest.approx(eps / 2)
    # c² = (r_h·eps - eps')·H': the hidden norms' mean' + eps' = r_h·(mean + eps)
    assert report.constant ** 2 == pytest.approx((0.75 * eps - eps / 2) * 256)
    assert report.hidden_input_bound == pytest.approx(eps / 3)


def test_unequal_norm_ratios_are_reported(widened):
    """head_dim 16 -> 64 (r_attention 1/4) beside r_gdn 1/2: eps' = r_gdn·eps, so the q/k norms see 2·eps
    (bound eps); the hidden norms (64 -> 96, one copy) stay exact by the constant; the logits stay close."""
    src, dst, report = widened("dense", 96, head_dim=64)
    eps = read_config(src)[1].rms_norm_eps
    assert report.copies == 1 and report.eps_bounds == dict(hidden=0.0, attention=pytest.approx(eps), gdn=0.0)
    a, b = (load_model(p, dtype="float32", backend="torch") for p in (src, dst))
    assert rel_err(step_logits(b, PROMPTS[1])[0][:, :128], step_logits(a, PROMPTS[1])[0]) <= 1e-3


@pytest.mark.parametrize("overrides,match", [
    (dict(num_attention_heads=8, num_key_value_heads=1), "cannot be grouped"),   # 2 kv heads -> 1
    (dict(head_dim=24), "rotary dims"),                                           # 4 -> 6 rotary dims
    (dict(num_hidden_layers=5, layer_types=("full_attention",) + ("linear_attention",) * 4), "layer types"),
    (dict(hidden_size=65), "two constant"),                                       # no room for the constant
    (dict(vocab_size=100), "vocab_size"),                                         # 128 -> 100 rows
    (dict(alpha=-1.0), "alpha"),                                                  # padded rows would win
    (dict(DENSE_TO_MOE, moe_intermediate_size=16), "moe_intermediate_size"),     # 32 routed channels > 16
    (dict(DENSE_TO_MOE, norm_topk_prob=False), "norm_topk_prob"),               # routed weights not summing to 1
])
def test_impossible_widenings_refused(checkpoints, tmp_path, overrides, match):
    src = checkpoints("dense").path
    shape = target_shape(read_config(src)[1], **{k: v for k, v in overrides.items() if k != "alpha"})
    with pytest.raises(ValueError, match=match):
        widen(src, str(tmp_path), shape, alpha=overrides.get("alpha", ALPHA))


@pytest.mark.parametrize("change", [dict(num_experts=16), dict(num_experts_per_tok=3), dict(norm_topk_prob=False)])
def test_moe_source_keeps_its_experts(checkpoints, tmp_path, change):
    src = checkpoints("moe").path
    shape = target_shape(read_config(src)[1], **change)
    with pytest.raises(ValueError, match="keeps its experts"):
        widen(src, str(tmp_path), shape)


def test_group_copies_keep_each_query_on_its_kv_head(widened):
    """Fewer query heads per kv head (2 -> 1): each new kv head is a copy of the one its queries read."""
    src, dst, _ = widened("dense", 128, num_attention_heads=4, num_key_value_heads=4)
    a, b = (load_model(p, dtype="float32", backend="torch") for p in (src, dst))
    assert rel_err(step_logits(b, PROMPTS[1])[0][:, :128], step_logits(a, PROMPTS[1])[0]) <= TOL


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_embedded_model_widens_exactly_to_the_project_shapes(shape):
    """models/bole-tiny-coder at the Qwen3.5 shapes (config only: the weights are GBs): every norm exact
    (hidden copies 9 / 15 / 19 and the constant), rotary dims 16 -> 64 on the source's frequencies, the
    shape's vocabulary (248,320 rows: the tokenizer's 8,192 and padded ones)."""
    _, cfg = read_config(resolve_repo_path("models/bole-tiny-coder"))
    report = widen_config(cfg, shapes_config(shape))
    assert set(report.eps_bounds.values()) == {0.0} and report.copies == {
        "qwen3.5-4b": 9, "qwen3.5-9b": 15, "qwen3.5-27b": 19, "qwen3.5-35b-a3b": 7}[shape]
    assert report.constant > 0.03 and report.eps == cfg.rms_norm_eps / 4
    t = report.config
    assert (t.hidden_size, t.num_hidden_layers, t.rotary_dim, t.vocab_size, t.rope_theta) == (
        SHAPES[shape]["hidden_size"], SHAPES[shape]["num_hidden_layers"], 64, 248320, cfg.rope_theta)
    moe = SHAPES[shape].get("num_experts", 0)  # the MoE shape: every layer and the MTP's, the MoE model type
    assert t.num_experts == moe and all(t.is_moe_layer(i) == bool(moe) for i in range(t.num_hidden_layers + 1))
    assert t.model_type == ("qwen3_5_moe_text" if moe else cfg.model_type)


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
    256 / 128, rotary factor 0.25; vocabulary 32,768 beside the tokenizer's 8,192, padded as the 248,320
    rows are): the folder serves text like the source (engine, sampler and detokenizer take the padded
    vocabulary), with the source's logits."""
    monkeypatch.setitem(SHAPES, "mini", dict(hidden_size=1024, num_hidden_layers=20, linear_num_key_heads=4,
                                             linear_num_value_heads=8, num_attention_heads=4, num_key_value_heads=2,
                                             intermediate_size=1024, vocab_size=32768))
    src, dst = resolve_repo_path("models/bole-tiny-coder"), str(tmp_path / "mini")
    widen_model.main(["--model", src, "--shape", "mini", "--out", dst, "--dtype", "float32"])
    a, b = (load_model(p, dtype="float32", backend="torch") for p in (src, dst))
    assert b.config.head_dim == 256 and b.config.linear_key_head_dim == 128 and b.config.vocab_size == 32768
    prompt = list(range(100, 130))
    (la, _), (lb, _) = step_logits(a, prompt, steps=()), step_logits(b, prompt, steps=())
    assert rel_err(lb[:, :8192], la) <= TOL and padded_margin(lb, 8192) > 2 * (la.max() - la.min())
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    opts = dict(mode="ar", device="cpu", dtype="float32", num_blocks=64, block_size=16, max_num_seqs=2)
    texts = [LLM(p, **opts).generate("def add(a, b):", sp)[0].text for p in (src, dst)]
    assert texts[0] == texts[1] and texts[0]
    # the frequency list covers the widened vocabulary: the source's ranking, then the padded ids (count 0),
    # so a reduced draft vocabulary larger than the source's 8,192 ids serves, with ar's tokens
    fa, fb = (json.load(open(os.path.join(p, "token_frequencies.json"))) for p in (src, dst))
    assert fb["token_ids"][:8192] == fa["token_ids"] and sorted(fb["token_ids"]) == list(range(32768))
    assert fb["counts"][8192:] == [0] * (32768 - 8192) and fb["widened"]["zero_count_ids"] == 32768 - 8192
    bole = LLM(dst, **{**opts, "mode": "bole", "draft_vocab": 12000, "depth": 2, "topk": 2, "beam": 2})
    assert bole.engine.model.mtp.vocab_ids.numel() == 12000
    assert bole.generate("def add(a, b):", sp)[0].text == texts[0]
