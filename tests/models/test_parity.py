"""Parity with transformers on tiny random checkpoints (fp32): prefill, chunked prefill, incremental
decode, greedy generation. Dense Qwen3.5, Qwen3.5-MoE and Qwen3-Next (fused GDN projections)."""

import pytest
import torch
from conftest import Runner, hf_logits, rel_err

from bole.models.loader import load_model

KINDS = ["dense", "moe", "next"]
TOL = 1e-4


@pytest.fixture(scope="module")
def models(checkpoints):
    cache = {}

    def get(kind):
        if kind not in cache:
            ck = checkpoints(kind)
            cache[kind] = (ck, load_model(ck.path, dtype="float32", backend="torch"))
        return cache[kind]
    return get


def _tokens(n, seed):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_batch_matches_transformers(models, kind):
    ck, model = models(kind)
    prompts = {0: _tokens(70, 1), 1: _tokens(23, 2)}  # 70 > one GDN chunk of 64
    r = Runner(model)
    for rid in prompts:
        r.add(rid)
    logits, _ = r.step("prefill", prompts)
    assert rel_err(logits[:70], hf_logits(ck.hf, prompts[0])) <= TOL
    assert rel_err(logits[70:], hf_logits(ck.hf, prompts[1])) <= TOL


@pytest.mark.parametrize("kind", ["dense", "next"])
def test_chunked_prefill_continues_from_cache(models, kind):
    ck, model = models(kind)
    prompt = _tokens(41, 3)
    r = Runner(model)
    r.add(0)
    parts = [r.step("prefill", {0: prompt[a:b]})[0] for a, b in ((0, 17), (17, 18), (18, 41))]
    assert rel_err(torch.cat(parts), hf_logits(ck.hf, prompt)) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_decode_20_steps(models, kind):
    """Two requests decoding in one batch against transformers' own cached decode."""
    ck, model = models(kind)
    prompts = {0: _tokens(19, 4), 1: _tokens(6, 5)}
    steps = {0: _tokens(20, 6), 1: _tokens(20, 7)}
    r = Runner(model)
    for rid in prompts:
        r.add(rid)
    r.step("prefill", prompts)
    hf_cache = {}
    with torch.no_grad():
        for rid, p in prompts.items():
            out = ck.hf(torch.tensor([p]), use_cache=True)
            hf_cache[rid] = out.past_key_values
        for t in range(20):
            logits, _ = r.step("decode", {rid: [steps[rid][t]] for rid in prompts})
            for j, rid in enumerate(prompts):
                out = ck.hf(torch.tensor([[steps[rid][t]]]), past_key_values=hf_cache[rid], use_cache=True)
                hf_cache[rid] = out.past_key_values
                assert rel_err(logits[j], out.logits[0, -1]) <= TOL, (kind, t, rid)


def greedy(model, prompt, n):
    r = Runner(model)
    r.add(0)
    logits, _ = r.step("prefill", {0: prompt})
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        logits, _ = r.step("decode", {0: [out[-1]]})
        out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_32_tokens_identical_to_generate(models, kind):
    ck, model = models(kind)
    prompt = _tokens(12, 8)
    with torch.no_grad():
        ref = ck.hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy(model, prompt, 32) == ref
