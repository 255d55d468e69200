"""The drafter's lm_head kernel (kernels/few_rows_linear.py) against its twin (bole/ops/linear.py) and float64.

Shapes the drafter passes ([B, H] at the root, [B, M, H] strided frontier slices per level), row counts
on both sides of the 64-row tile, widths and K that are not multiples of the blocks, adversarial rows
(large, correlated, one hot): the kernel's fp32 accumulation is held to fp16 output rounding against the
float64 product. fp16 on the CPU (the interpreter's bf16 dots are unreliable), bf16 on the GPU.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from bole.backend import half_precision_only
from bole.ops.linear import few_rows_linear_ref
from kernels.few_rows_linear import few_rows_linear


def half(device):
    return torch.bfloat16 if device == "cuda" else torch.float16


def check(x, w, **kw):
    out = few_rows_linear(x, w, **kw)
    ref = (x.double() @ w.double().T)
    assert out.shape == (*x.shape[:-1], w.shape[0]) and out.dtype == x.dtype
    # one rounding of the fp32 sum to the output dtype, plus fp32 accumulation over K exact products
    eps = torch.finfo(x.dtype).eps
    tol = eps * ref.abs() + x.shape[-1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert ((out.double() - ref).abs() <= tol).all(), (out.double() - ref).abs().max()
    twin = few_rows_linear_ref(x, w)
    torch.testing.assert_close(out.float(), twin.float(), rtol=2 * eps, atol=2 * eps * float(ref.abs().max()))


@pytest.mark.parametrize("M,N,K", [(1, 100, 64), (4, 300, 96), (16, 257, 128), (33, 129, 80), (70, 64, 48)])
def test_matches_float64_and_twin(device, M, N, K):
    gen = torch.Generator().manual_seed(M * 7 + N)
    x = torch.randn(M, K, generator=gen).to(device, half(device))
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(device, half(device))
    check(x, w, block_n=64, block_k=32)


def test_drafter_shapes_strided_frontier(device):
    # the per-level call: h[:, S0:] of a [B, S, H] forest output (non-contiguous rows)
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(3, 12, 64, generator=gen).to(device, half(device))
    w = torch.randn(200, 64, generator=gen).to(device, half(device))
    check(h[:, 8:], w, block_n=64, block_k=32)
    check(h[:, -1], w, block_n=64, block_k=32)


def test_adversarial_rows(device):
    gen = torch.Generator().manual_seed(9)
    K, N = 64, 128
    base = torch.randn(K, generator=gen)
    x = torch.stack([base * 40, base * 40 + 1e-3 * torch.randn(K, generator=gen),   # large, correlated
                     torch.nn.functional.one_hot(torch.tensor(7), K).float() * 100,  # one hot
                     torch.zeros(K)]).to(device, half(device))
    w = torch.randn(N, K, generator=gen).to(device, half(device))
    w[3] = w[5]                                                                      # tied rows: tied logits
    out = few_rows_linear(x, w, block_n=64, block_k=16)
    check(x, w, block_n=64, block_k=16)
    assert torch.equal(out[:, 3], out[:, 5]) and (out[3] == 0).all()


def test_backend_entry_routes_fp32_and_strided_weights_to_the_twin(device):
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(1)).to(device)
    w = torch.randn(40, 32, generator=torch.Generator().manual_seed(2)).to(device)
    entry = half_precision_only(few_rows_linear)
    assert torch.equal(entry(x, w), few_rows_linear_ref(x, w))
    with pytest.raises(ValueError, match="weight must be one of"):
        few_rows_linear(x, w)
    xh, wt = x.to(half(device)), w.to(half(device)).T.contiguous().T   # [40, 32] with strides (1, 40)
    assert torch.equal(entry(xh, wt), few_rows_linear_ref(xh, wt))


def test_empty_shapes_match_the_twin(device):
    for M, N, K in [(0, 8, 16), (3, 0, 16), (3, 8, 0)]:
        x, w = torch.ones(M, K, dtype=half(device), device=device), torch.ones(N, K, dtype=half(device), device=device)
        out = few_rows_linear(x, w)
        assert out.shape == (M, N) and torch.equal(out, few_rows_linear_ref(x, w))


def test_bad_arguments_raise():
    x = torch.zeros(2, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="does not match"):
        few_rows_linear(x, torch.zeros(8, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="share a dtype"):
        few_rows_linear(x, torch.zeros(8, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unit last stride"):
        few_rows_linear(x, torch.zeros(32, 8, dtype=torch.float16).T)
    with pytest.raises(ValueError, match="block_n must be"):
        few_rows_linear(x, torch.zeros(8, 32, dtype=torch.float16), block_n=48)
    with pytest.raises(ValueError, match="x must be a tensor"):
        few_rows_linear([1.0], torch.zeros(8, 32, dtype=torch.float16))


def test_drafter_lm_head_through_the_kernel_keeps_ar_tokens(device):
    # the engine's drafter with the kernel as its lm_head entry (as profile_step's bole_phases_few_rows
    # installs it), half precision, a reduced draft vocabulary: drafts only propose, so greedy output is ar's
    from bole import LLM, SamplingParams

    root = Path(__file__).resolve().parents[2]
    prompts = [json.loads(line)["prompt"] for line in open(root / "benchmarks" / "data" / "heldout_prompts.jsonl")][:2]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    opts = dict(device=device, dtype="float16", num_blocks=256)
    model = str(root / "models" / "bole-tiny-coder")
    ar = LLM(model, mode="ar", **opts).generate(prompts, sp)
    llm = LLM(model, mode="bole", depth=2, topk=2, beam=2, draft_vocab=1000, **opts)
    mtp, calls = llm.engine.runner.model.mtp, []

    def kernel(x, w):  # the kernel itself (half_precision_only's half branch), checked against the twin
        y = few_rows_linear(x, w)
        torch.testing.assert_close(y.float(), few_rows_linear_ref(x, w).float(), rtol=2e-3, atol=2e-3)
        calls.append(tuple(x.shape))
        return y
    mtp.backend = dataclasses.replace(mtp.backend, few_rows_linear=half_precision_only(kernel))
    out = llm.generate(prompts, sp)
    assert len(calls) >= 2 and all(c[-1] == mtp._vocab_weight.shape[1] for c in calls)  # every level's drafts
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]


@pytest.mark.gpu
def test_bf16_drafter_sizes_on_gpu():
    # the 9B-cost drafter's reduced vocabulary at a batch of 16 x topk 4, and the root's 16 rows
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(32768, 4096, generator=gen) / 64).to("cuda", torch.bfloat16)
    for M in (16, 64, 100):
        x = torch.randn(M, 4096, generator=gen).to("cuda", torch.bfloat16)
        check(x, w)
