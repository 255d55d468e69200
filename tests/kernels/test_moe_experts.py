"""The routed experts' kernel (kernels/moe_experts.py) against its twin (bole/ops/moe.py) and float64.

The routing step (pairs sorted by expert into blocks of BLOCK_M, no host read) is checked as a permutation
with homogeneous blocks; the two launches against the twin run in float64, on random and adversarial
routings: one expert taking every pair (runs crossing blocks), every expert used once, routing weights 0
and 1, identical (correlated) tokens, large activations, a top-k of all experts, widths that are not block
multiples. fp32 (IEEE products) and fp16 on the CPU interpreter; bf16 and a captured CUDA graph replayed on
new routings on the GPU.
"""

import pytest
import torch

from bole.ops.moe import moe_experts_ref
from kernels.moe_experts import BLOCK_M, _route, moe_experts


def weights(E, H, I, dtype, device, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H, generator=gen) * scale / H ** 0.5
    down = torch.randn(E, H, I, generator=gen) / I ** 0.5
    return gate_up.to(device, dtype), down.to(device, dtype)


def routing(N, E, k, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)]) if N else torch.zeros(0, k)
    w = torch.rand(N, k, generator=gen)
    return idx.long().to(device), (w / w.sum(1, keepdim=True).clamp_min(1e-9)).to(device)


def check(x, gate_up, down, idx, w, **kw):
    out = moe_experts(x, gate_up, down, idx, w, **kw)
    ref = moe_experts_ref(x.double(), gate_up.double(), down.double(), idx, w.double())
    assert out.shape == x.shape and out.dtype == x.dtype
    scale = float(ref.abs().max()) + 1e-12
    if x.dtype == torch.float32:  # IEEE products: summation order only
        assert float((out.double() - ref).abs().max()) <= 1e-5 * scale
    else:  # h rounded once to half, the sum once: a few half ulps of the largest output
        assert float((out.double() - ref).abs().max()) <= 8 * torch.finfo(x.dtype).eps * scale
    twin = moe_experts_ref(x, gate_up, down, idx, w.to(x.dtype))
    assert float((out.double() - twin.double()).abs().max()) <= (1e-5 if x.dtype == torch.float32 else 2e-2) * scale
    return out


def test_route_is_a_blocked_permutation():
    for N, E, k, seed in [(7, 5, 3, 0), (33, 4, 1, 1), (1, 9, 9, 2), (50, 64, 2, 3)]:
        idx, _ = routing(N, E, k, "cpu", seed)
        if seed == 1:
            idx[:] = 2  # one expert takes every pair: its run crosses blocks
        pairs, block_expert = _route(idx, E)
        P = N * k
        NB = -(-P // BLOCK_M) + min(E, P)
        assert pairs.shape == (NB * BLOCK_M,) and block_expert.shape == (NB,)
        real = pairs[pairs < P]
        assert sorted(real.tolist()) == list(range(P))  # every pair exactly once
        assert bool((pairs[pairs >= P] == P).all())
        flat = idx.reshape(-1)
        used = int((block_expert < E).sum())
        assert bool((block_expert[used:] == E).all()) and bool((pairs[used * BLOCK_M:] == P).all())
        for b in range(used):
            rows = pairs[b * BLOCK_M:(b + 1) * BLOCK_M]
            rows = rows[rows < P]
            assert rows.numel() and bool((flat[rows] == block_expert[b]).all())  # one expert a block
            assert torch.equal(rows, rows.sort().values)  # the pairs' order within an expert
        assert used == sum(-(-int((flat == e).sum()) // BLOCK_M) for e in range(E))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,E,k,H,I", [(1, 4, 2, 32, 16), (5, 9, 3, 48, 40), (37, 4, 2, 64, 32), (6, 3, 3, 32, 24)])
def test_matches_float64_and_twin(device, dtype, N, E, k, H, I):
    if device == "cuda" and dtype == torch.float16:
        dtype = torch.bfloat16
    gate_up, down = weights(E, H, I, dtype, device, seed=N)
    idx, w = routing(N, E, k, device, seed=N)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(N + 1)).to(device, dtype)
    check(x, gate_up, down, idx, w, block_n=16, block_k=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_adversarial_routings(device, dtype):
    if device == "cuda" and dtype == torch.float16:
        dtype = torch.bfloat16
    E, H, I = 6, 32, 32
    gate_up, down = weights(E, H, I, dtype, device, seed=3)
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(H, generator=gen)
    x = torch.stack([base + 1e-3 * torch.randn(H, generator=gen) for _ in range(35)])  # correlated tokens
    x[5] *= 8.0  # a large activation
    x = x.to(device, dtype)
    one = torch.full((35, 2), 1, dtype=torch.long, device=device)
    one[:, 1] = 4
    w01 = torch.zeros(35, 2, device=device)
    w01[:, 0] = 1.0  # routing weights exactly 1 and 0
    check(x, gate_up, down, one, w01, block_n=16, block_k=16)  # two experts take 35 pairs each: 3 blocks each
    every = torch.arange(6, device=device).view(1, 6).expand(35, 6).contiguous()  # top-k of all experts
    check(x, gate_up, down, every, torch.full((35, 6), 1 / 6, device=device), block_n=32, block_k=16)


def test_empty_inputs(device):
    gate_up, down = weights(3, 32, 16, torch.float32, device)
    x = torch.zeros(0, 32, device=device)
    idx = torch.zeros(0, 2, dtype=torch.long, device=device)
    out = moe_experts(x, gate_up, down, idx, torch.zeros(0, 2, device=device))
    assert out.shape == (0, 32) and torch.equal(out, moe_experts_ref(x, gate_up, down, idx, torch.zeros(0, 2)))


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.zeros(2, 3, 32)), "x must be a 2-d"),
    (dict(gate_up=torch.zeros(3, 15, 32)), "gate_up_proj must be"),
    (dict(down=torch.zeros(3, 32, 8)), "down_proj must be"),
    (dict(idx=torch.zeros(3, 2, dtype=torch.long)), "top_idx must be"),
    (dict(idx=torch.zeros(2, 4, dtype=torch.long)), "top_idx must be"),
    (dict(w=torch.zeros(2, 1)), "top_w"),
    (dict(idx=torch.zeros(2, 2)), "top_idx must be one of"),
    (dict(gate_up=torch.zeros(3, 32, 32, dtype=torch.float16)), "gate_up_proj must be one of"),
    (dict(block_n=24), "block_n"),
])
def test_bad_arguments_raise(change, match):
    args = dict(x=torch.zeros(2, 32), gate_up=torch.zeros(3, 32, 32), down=torch.zeros(3, 32, 16),
                idx=torch.zeros(2, 2, dtype=torch.long), w=torch.zeros(2, 2))
    kw = {"block_n": change.pop("block_n")} if "block_n" in change else {}
    args.update(change)
    with pytest.raises(ValueError, match=match):
        moe_experts(args["x"], args["gate_up"], args["down"], args["idx"], args["w"], **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [24, 1024])  # 192 pairs; 8192 (a prefill graph's: argsort's other algorithm)
def test_captured_graph_replays_new_routings_on_gpu(N):
    """The Qwen3.5-35B-A3B expert shapes (256 experts of 512, H 2048, top 8) in bf16: a CUDA graph captured
    once replays routings it never saw (a batch, then every pair on few experts), each equal to the twin."""
    dev, dtype = "cuda", torch.bfloat16
    E, H, I, k = 256, 2048, 512, 8
    gate_up, down = weights(E, H, I, dtype, dev, seed=1)
    x = torch.randn(N, H, device=dev, dtype=dtype)
    idx, w = routing(N, E, k, dev, seed=1)
    static = dict(x=x.clone(), idx=idx.clone(), w=w.clone())
    moe_experts(static["x"], gate_up, down, static["idx"], static["w"])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(static["x"], gate_up, down, static["idx"], static["w"])
    skewed = torch.stack([torch.randperm(12, device=dev)[:k] for _ in range(N)])  # every pair on 12 experts
    for new_idx, seed in ((routing(N, E, k, dev, seed=2)[0], 2), (skewed, 3)):
        new_x = torch.randn(N, H, device=dev, dtype=dtype, generator=torch.Generator(dev).manual_seed(seed))
        new_w = torch.rand(N, k, device=dev)
        static["x"].copy_(new_x)
        static["idx"].copy_(new_idx)
        static["w"].copy_(new_w)
        graph.replay()
        ref = moe_experts_ref(new_x.double(), gate_up.double(), down.double(), new_idx, new_w.double())
        err = float((out.double() - ref).abs().max()) / float(ref.abs().max())
        assert err <= 2e-2, err
