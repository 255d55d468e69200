"""Logprobs, prompt logprobs and penalties through the engine in every mode, against transformers and a
naive reference; eager and graph code paths (the graphs' static forwards run uncaptured on the CPU)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_checkpoint
from engine_helpers import default_table, reference_penalty

from bole.config import EngineConfig
from bole.engine.engine import LLMEngine
from bole.models.loader import load_model
from bole.sampling_params import SamplingParams
from bole.spec.tree import MAX_TREE_NODES, tree_widths

MODES = ("ar", "serial_tree", "bole")
# the third prompt (21 tokens) spans two prefill chunks of max_num_batched_tokens=16
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]]
TOL = 1e-4
PENALTIES = dict(repetition_penalty=1.8, frequency_penalty=0.6, presence_penalty=0.9)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("lp_dense")
    return str(path), make_checkpoint(path, "dense", 16)


def engine(path, mode, **opts):
    opts = {"num_blocks": 96, "block_size": 4, "depth": 3, "topk": 3, "beam": 3, "max_num_seqs": 4,
            "max_num_batched_tokens": 16, **opts}
    cfg = EngineConfig.from_options(mode=mode, calibration_table=default_table(), **opts)
    return LLMEngine(load_model(path, dtype="float32", device=cfg.device), cfg)


def run(eng, prompts, params):
    """Requests arriving one per step; per request (tokens, logprob entries, prompt logprobs, finish reason)."""
    pending, ids, got = list(zip(prompts, params)), [], {}
    while pending or eng.has_unfinished():
        if pending:
            ids.append(eng.add_request(*pending.pop(0)))
        for o in eng.step():
            g = got.setdefault(o.request_id, {"lp": [], "prompt": None})
            assert o.logprobs is None or len(o.logprobs) == len(o.new_token_ids)
            g["lp"] += o.logprobs or []
            if o.prompt_logprobs is not None:
                assert g["prompt"] is None, "prompt logprobs sent twice"
                g["prompt"] = o.prompt_logprobs
            if o.finished:
                g["tokens"], g["reason"] = o.output_token_ids, o.finish_reason
    return [got[i] for i in ids]


@torch.no_grad()
def hf_logprobs(hf, ids):
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def check_against_hf(hf, prompt, g, k, kp):
    """Generated tokens' logprobs and top-k, and the prompt's, equal transformers' log-softmax."""
    ref = hf_logprobs(hf, prompt + g["tokens"])
    for j, (t, e) in enumerate(zip(g["tokens"], g["lp"], strict=True)):
        row = ref[len(prompt) - 1 + j]
        assert e.token_id == t and abs(e.logprob - float(row[t])) <= TOL, (j, e.logprob, float(row[t]))
        top = row.topk(k)
        assert [i for i, _ in e.top] == top.indices.tolist()
        assert max(abs(a - b) for (_, a), b in zip(e.top, top.values.tolist())) <= TOL
    if kp is not None:
        assert g["prompt"][0] is None and len(g["prompt"]) == len(prompt)
        for j in range(1, len(prompt)):
            e = g["prompt"][j]
            assert e.token_id == prompt[j] and abs(e.logprob - float(ref[j - 1, prompt[j]])) <= TOL
            assert [i for i, _ in e.top] == ref[j - 1].topk(kp).indices.tolist()


def test_greedy_logprobs_equal_transformers_in_every_mode(ckpt):
    path, hf = ckpt
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3, prompt_logprobs=p)
              for n, p in ((9, 2), (6, None), (11, 1))]
    outs = {m: run(engine(path, m), PROMPTS, params) for m in MODES}
    assert [g["tokens"] for g in outs["ar"]] == [g["tokens"] for g in outs["bole"]] == \
        [g["tokens"] for g in outs["serial_tree"]]
    for m in MODES:
        for prompt, sp, g in zip(PROMPTS, params, outs[m]):
            check_against_hf(hf, prompt, g, 3, sp.prompt_logprobs)
        assert outs[m][1]["prompt"] is None


def test_prompt_logprobs_bypass_the_prefix_cache_and_max_tokens_zero(ckpt):
    """lm-eval's loglikelihood request (max_tokens 0, prompt logprobs) for a prompt the prefix cache holds:
    every position is still scored (the request takes no cache hit) and nothing is generated."""
    path, hf = ckpt
    eng = engine(path, "bole")
    prompt = PROMPTS[2]
    run(eng, [prompt], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])
    assert eng.prefix_cache.num_cached_blocks >= len(prompt) // 4
    g = run(eng, [prompt], [SamplingParams(max_tokens=0, prompt_logprobs=2)])[0]
    assert g["tokens"] == [] and g["reason"] == "length" and g["lp"] == []
    check_against_hf(hf, prompt, g, 2, 2)


@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_prompt_logprobs_survive_preemption(ckpt, mode):
    """Preempted requests are prefilled again: their prompt logprobs are sent once, complete and right."""
    path, hf = ckpt
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=1, logprobs=1)
              for n in (12, 9, 14)]
    eng = engine(path, mode, num_blocks=12 if mode == "ar" else 24)
    outs = run(eng, PROMPTS, params)
    assert eng.metrics.preemptions > 0
    for prompt, g in zip(PROMPTS, outs):
        check_against_hf(hf, prompt, g, 1, 1)


def hf_penalised_greedy(hf, prompt, n, rep, freq, pres):
    """Greedy decoding with the naive penalty rule on transformers' full forward at every step."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            row = hf(torch.tensor([prompt + out])).logits[0, -1].tolist()
            out.append(int(reference_penalty(row, out, prompt, rep, freq, pres).argmax()))
    return out


def test_penalties_greedy_identical_across_modes_and_reference(ckpt):
    path, hf = ckpt
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, **PENALTIES),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=-1.5),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=0.6,
                             frequency_penalty=1.2, logprobs=2)]
    outs = {m: run(engine(path, m), PROMPTS, params) for m in MODES}
    tokens = {m: [g["tokens"] for g in outs[m]] for m in MODES}
    assert tokens["ar"] == tokens["serial_tree"] == tokens["bole"]
    plain = [g["tokens"] for g in run(engine(path, "ar"), PROMPTS, [
        SamplingParams(temperature=0, max_tokens=sp.max_tokens, ignore_eos=True) for sp in params])]
    for prompt, sp, got, unpenalised in zip(PROMPTS, params, tokens["ar"], plain):
        ref = hf_penalised_greedy(hf, prompt, sp.max_tokens, sp.repetition_penalty, sp.frequency_penalty,
                                  sp.presence_penalty)
        assert got == ref
        assert got != unpenalised  # the penalties changed the output: the test is not vacuous
    # the penalised logprobs are the log-softmax of the penalised logits
    sp, g, prompt = params[2], outs["bole"][2], PROMPTS[2]
    with torch.no_grad():
        for j, e in enumerate(g["lp"]):
            row = hf(torch.tensor([prompt + g["tokens"][:j]])).logits[0, -1].tolist()
            lp = torch.log_softmax(reference_penalty(row, g["tokens"][:j], prompt, sp.repetition_penalty,
                                                     sp.frequency_penalty, sp.presence_penalty), -1)
            assert abs(e.logprob - float(lp[e.token_id])) <= TOL


def test_penalised_speculation_accepts_drafts(ckpt):
    """The penalised rows verified in trees do accept drafts (the path-dependent rule is exercised)."""
    path, _ = ckpt
    eng = engine(path, "bole")
    run(eng, PROMPTS, [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)] * 3)
    assert eng.metrics.snapshot()["mat"] > 1.2


def test_penalties_seeded_sampling_identical_across_modes(ckpt):
    path, _ = ckpt
    params = [SamplingParams(temperature=0.9, top_k=8, max_tokens=12, ignore_eos=True, seed=s, logprobs=1,
                             **PENALTIES) for s in range(3)]
    outs = {m: run(engine(path, m), PROMPTS, params) for m in MODES}
    assert [g["tokens"] for g in outs["ar"]] == [g["tokens"] for g in outs["serial_tree"]] == \
        [g["tokens"] for g in outs["bole"]]
    for m in ("serial_tree", "bole"):
        for a, b in zip(outs["ar"], outs[m]):
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a["lp"], b["lp"])) <= TOL
    # top-k 8: the emitted tokens' processed logprobs are finite and their alternatives sorted
    assert all(e.logprob > float("-inf") and e.top[0][1] >= e.logprob for g in outs["ar"] for e in g["lp"])


def _graph_engine(path, mode):
    """An engine whose graphs' static forwards and tails run uncaptured (the CPU form of the GPU path)."""
    eng = engine(path, mode, num_blocks=128, enable_prefix_cache=False)
    if mode == "ar":
        eng.runner.enable_cuda_graphs((1, 2, 4), capture=False, min_kv=8)
        return eng, eng.runner.graphs
    spec = eng.config.spec
    vg = eng.runner.enable_verify_graphs((1, 2, 4), tree_widths(eng.lookahead), spec.depth + 1, capture=False,
                                         min_kv=8, sampled_tail=True)
    eng.runner.enable_draft_graphs((1, 2, 4), spec.depth, spec.topk, spec.beam, capture=False, min_kv=8,
                                   max_per_request=MAX_TREE_NODES - 1,
                                   floor=spec.budget_floor)
    return eng, vg


@pytest.mark.parametrize("mode", MODES)
def test_graph_paths_logprobs_and_penalties_cpu(ckpt, mode):
    """Greedy and seeded requests with logprobs take the graphs' tails (logprobs read from the verify graph's
    logits); penalised ones accept eagerly after the graphed verify forward. Tokens and logprobs equal the
    eager engine's."""
    path, _ = ckpt
    plain = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=4, logprobs=0)]
    penal = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1, **PENALTIES),
             SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True, seed=9, **PENALTIES)]
    eager = engine(path, mode, num_blocks=128, enable_prefix_cache=False)
    eng, g = _graph_engine(path, mode)
    for params in (plain, penal):
        before = (g.replays, getattr(g, "tail_replays", 0))
        want, got = run(eager, PROMPTS[:2], params), run(eng, PROMPTS[:2], params)
        for a, b in zip(want, got):
            assert a["tokens"] == b["tokens"]
            assert [e.token_id for e in a["lp"]] == [e.token_id for e in b["lp"]]
            assert max((abs(x.logprob - y.logprob) for x, y in zip(a["lp"], b["lp"])), default=0) <= 1e-5
            assert [i for e in a["lp"] for i, _ in e.top] == [i for e in b["lp"] for i, _ in e.top]
        assert g.replays > before[0]
        if mode != "ar":
            tails = g.tail_replays - before[1]
            # every plain step accepts in a tail; penalised steps (both requests penalised) never do
            assert tails == g.replays - before[0] if params is plain else tails == 0


@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_prefill_graph_keeps_prompt_logits_cpu(ckpt, mode):
    """Short prefills through the prefill graphs' static forward (uncaptured): prompt logprobs from its
    per-position hiddens, and penalised first tokens, equal the eager prefill's."""
    path, hf = ckpt
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=2, logprobs=2,
                             **PENALTIES), SamplingParams(max_tokens=0, prompt_logprobs=0)]
    eng = engine(path, mode, max_num_batched_tokens=64)
    eng.runner.enable_prefill_graphs((1, 2, 4), capture=False, min_kv=8)
    got = run(eng, PROMPTS[:2], params)
    assert eng.runner.prefill_graphs.replays > 0
    want = run(engine(path, mode, max_num_batched_tokens=64), PROMPTS[:2], params)
    for a, b, prompt in zip(want, got, PROMPTS):
        assert a["tokens"] == b["tokens"]
        assert [e.token_id for e in a["lp"]] == [e.token_id for e in b["lp"]]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a["prompt"][1:], b["prompt"][1:])) <= 1e-5
        ref = hf_logprobs(hf, prompt)
        assert max(abs(e.logprob - float(ref[j, prompt[j + 1]])) for j, e in enumerate(b["prompt"][1:])) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_captured_graphs_logprobs_and_penalties_cuda(ckpt, mode):
    """The same on a GPU with every graph captured: tokens equal the eager engine's, logprobs close."""
    path, _ = ckpt
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=4, logprobs=1),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1, **PENALTIES)]
    want = run(engine(path, mode, device="cuda"), PROMPTS, params)
    graphed = engine(path, mode, device="cuda", enable_cuda_graphs=True)
    got = run(graphed, PROMPTS, params)
    assert graphed.runner.all_graphs()
    for a, b in zip(want, got):
        assert a["tokens"] == b["tokens"]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a["lp"], b["lp"], strict=True)) <= 1e-3
