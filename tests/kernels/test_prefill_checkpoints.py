"""Prefix-cache checkpoints written from inside a prefill (``ckpt_*`` arguments): the recurrence kernel
(kernels/gdn_recurrent.py), its twin, the torch chunk (bole.ops.gdn_chunk, which splits the sequence
there) and the conv kernel (kernels/causal_conv1d.py) and its twin all store, for each sequence with an
end, the state / window after its first ``end`` tokens, which must equal what running that prefix alone
leaves; rows without an end, and every other checkpoint slot, stay untouched; the forward's own outputs
and final states do not change. Random and hard inputs (correlated keys, β -> 1, decay -> 1), ends at
the first token, at the sequence's last but one, inside the conv window's reach and past a token block;
a float64 property check of the kernel's states."""

import pytest
import torch

from bole.ops.conv import causal_conv1d
from bole.ops.gdn import gdn_recurrent_ref
from bole.ops.gdn_chunk import gdn_chunk
from bole.ops.gdn_inputs import correlated
from kernels.causal_conv1d import causal_conv1d_varlen
from kernels.gdn_recurrent import gdn_recurrent

LENGTHS, ENDS = [9, 1, 40, 5], [1, 0, 37, 4]   # an end at a sequence's first token and at its last but one
HK, HV, K, V = 2, 4, 16, 32


def gdn_case(kind: str, seed: int, device, lengths=LENGTHS):
    gen = torch.Generator().manual_seed(seed)
    N, B = sum(lengths), len(lengths)
    r = lambda *s: torch.randn(*s, generator=gen)
    if kind == "hard":   # correlated keys and queries, beta -> 1, decay -> 1
        k, q = correlated(N, HK, K, 0.9, gen)[None], correlated(N, HK, K, 0.9, gen)[None]
        beta = 1 - 1e-4 * torch.rand(1, N, HV, generator=gen)
        g = -1e-6 * torch.rand(1, N, HV, generator=gen)
    else:
        q, k = r(1, N, HK, K), r(1, N, HK, K)
        beta = torch.sigmoid(r(1, N, HV))
        g = -torch.nn.functional.softplus(r(1, N, HV))
    v = r(1, N, HV, V)
    pool = 0.1 * r(B + 2, HV, V, K)
    idx = torch.randperm(B + 2, generator=gen)[:B]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    to = lambda t: t.to(device)
    return [to(t) for t in (q, k, v, g, beta)], to(pool), to(idx), to(cu)


def prefix_states(x, pool, idx, cu, ends):
    """The twin's final states over each sequence's first ``ends[b]`` tokens alone (float64)."""
    cu_h = [int(c) for c in cu]
    rows = [b for b, e in enumerate(ends) if e]
    take = torch.cat([torch.arange(cu_h[b], cu_h[b] + ends[b]) for b in rows]).to(x[0].device)
    sub = [t.double()[:, take] for t in x]
    sub_cu = torch.tensor([0] + torch.tensor([ends[b] for b in rows]).cumsum(0).tolist(), dtype=torch.int32)
    _, final = gdn_recurrent_ref(*sub, initial_state=pool.double(), state_indices=idx[rows], cu_seqlens=sub_cu,
                                 use_qk_l2norm=True)
    return dict(zip(rows, final))


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("kind", ["random", "hard"])
@pytest.mark.parametrize("impl", ["kernel", "twin", "chunk"])
def test_gdn_checkpoint_is_the_prefix_state(device, kind, impl):
    x, pool, idx, cu = gdn_case(kind, seed=3, device=device)
    B = len(LENGTHS)
    fn = {"kernel": gdn_recurrent, "twin": gdn_recurrent_ref, "chunk": gdn_chunk}[impl]
    ck = torch.full((B + 3, HV, V, K), float("nan"), device=device)
    ck_slots = torch.tensor([4, 0, 1, 2], dtype=torch.int32, device=device)   # row 1 has no end: slot 0 stays NaN
    ends = torch.tensor(ENDS, dtype=torch.int32, device=device)
    kw = dict(initial_state=pool, state_indices=idx, cu_seqlens=cu, use_qk_l2norm=True)
    o, final = fn(*x, ckpt_state=ck, ckpt_ends=ends, ckpt_slots=ck_slots, **kw)
    o0, final0 = fn(*x, **kw)
    # the forward's outputs are those of the same call without checkpoints (the kernel's bit for bit)
    same = torch.equal if impl != "chunk" else (lambda a, b: rel(a, b) < 1e-5)   # the chunk splits
    assert same(o, o0) and same(final, final0)
    want = prefix_states(x, pool, idx, cu, ENDS)
    for b, s in want.items():
        assert rel(ck[int(ck_slots[b])], s) < 1e-5, (b, impl)
    untouched = [i for i in range(B + 3) if i not in {int(ck_slots[b]) for b in want}]
    assert torch.isnan(ck[untouched]).all()


def test_gdn_checkpoint_property_against_float64(device):
    # random end per sequence, random lengths, bf16 checkpoint pool: the kernel's fp32 state, stored,
    # within bf16 rounding of the float64 prefix state
    gen = torch.Generator().manual_seed(11)
    for trial in range(4):
        lengths = torch.randint(1, 24, (3,), generator=gen).tolist()
        ends = [int(torch.randint(0, n, (1,), generator=gen)) for n in lengths]
        x, pool, idx, cu = gdn_case("hard" if trial % 2 else "random", seed=20 + trial, device=device,
                                    lengths=lengths)
        ck = torch.zeros(4, HV, V, K, dtype=torch.bfloat16, device=device)
        slots = torch.tensor([1, 2, 3], dtype=torch.int32, device=device)
        gdn_recurrent(*x, initial_state=pool, state_indices=idx, cu_seqlens=cu, use_qk_l2norm=True, ckpt_state=ck,
                      ckpt_ends=torch.tensor(ends, dtype=torch.int32, device=device), ckpt_slots=slots)
        if not any(ends):
            continue
        for b, s in prefix_states(x, pool, idx, cu, ends).items():
            assert rel(ck[b + 1], s) < 2 ** -7, (trial, b, ends, lengths)


@pytest.mark.parametrize("impl", ["kernel", "twin"])
def test_conv_checkpoint_is_the_prefix_window(device, impl):
    # ends inside the committed window's reach (1, 2 < W - 1 = 3) and past the first token block (37 > 8)
    C, W = 24, 4
    gen = torch.Generator().manual_seed(5)
    lengths, ends = [9, 2, 40, 6], [2, 0, 37, 1]
    N, B = sum(lengths), len(lengths)
    x = torch.randn(N, C, generator=gen).to(device)
    w = torch.randn(C, W, generator=gen).to(device)
    state = torch.randn(B + 2, C, W - 1, generator=gen).to(device)
    slots = torch.tensor([5, 0, 2, 3], device=device)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    committed = state.clone()
    ck = torch.full((B + 2, C, W - 1), float("nan"), device=device)
    ck_slots = torch.tensor([1, 0, 4, 5], dtype=torch.int32, device=device)
    ck_ends = torch.tensor(ends, dtype=torch.int32, device=device)
    y0 = causal_conv1d(x, w, None, state.clone(), slots, cu)
    if impl == "kernel":
        y = causal_conv1d_varlen(x, w, state, slots, cu, ckpt_conv=ck, ckpt_ends=ck_ends, ckpt_slots=ck_slots,
                                 block_t=8, block_c=16)
    else:
        y = causal_conv1d(x, w, None, state, slots, cu, ckpt_conv=ck, ckpt_ends=ck_ends, ckpt_slots=ck_slots)
    assert rel(y, y0) < 1e-6
    cu_h = cu.tolist()
    for b, e in enumerate(ends):
        if not e:
            continue
        # the window at the boundary: what the conv over the prefix alone leaves in a copy of the slot
        alone = committed.clone()
        causal_conv1d(x[cu_h[b]:cu_h[b] + e], w, None, alone, slots[b:b + 1])
        assert torch.equal(ck[int(ck_slots[b])], alone[int(slots[b])]), (impl, b)
    assert torch.isnan(ck[[0, 3]]).all()   # rows without an end and slots nobody named


def test_bad_checkpoint_arguments_raise(device):
    x, pool, idx, cu = gdn_case("random", seed=1, device=device)
    B = len(LENGTHS)
    ends = torch.tensor(ENDS, dtype=torch.int32, device=device)
    ok = torch.zeros(B, HV, V, K, device=device)
    with pytest.raises(ValueError, match="checkpoint pool must be"):
        gdn_recurrent(*x, initial_state=pool, state_indices=idx, cu_seqlens=cu, ckpt_state=ok[:, :1],
                      ckpt_ends=ends, ckpt_slots=ends)
    with pytest.raises(ValueError, match="needs ckpt_ends"):
        gdn_recurrent(*x, initial_state=pool, state_indices=idx, cu_seqlens=cu, ckpt_state=ok)
    with pytest.raises(ValueError, match="ckpt_slots must be"):
        gdn_recurrent(*x, initial_state=pool, state_indices=idx, cu_seqlens=cu, ckpt_state=ok, ckpt_ends=ends,
                      ckpt_slots=ends[:2])
    C, W = 8, 4
    xs = torch.randn(sum(LENGTHS), C, device=device)
    with pytest.raises(ValueError, match="checkpoint pool must be"):
        causal_conv1d_varlen(xs, torch.randn(C, W, device=device), torch.zeros(B, C, W - 1, device=device),
                             idx, cu, ckpt_conv=torch.zeros(B, C, W, device=device), ckpt_ends=ends, ckpt_slots=ends)


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_qwen_shapes_bf16(pool_dtype):
    # Qwen3.5-9B's GDN (HK=16, HV=32, K=V=128), bf16 activations, a prompt of 135 tokens checkpointed at 128
    # beside one of 40 without: the kernel's checkpoint against the float64 prefix state, its outputs
    # bit-equal to the same launch without checkpoints
    hk, hv, kd, vd, dev = 16, 32, 128, 128, "cuda"
    gen = torch.Generator().manual_seed(0)
    lengths, ends = [135, 40], [128, 0]
    N = sum(lengths)
    q, k = (correlated(N, hk, kd, 0.5, gen)[None].to(dev, torch.bfloat16) for _ in range(2))
    v = torch.randn(1, N, hv, vd, generator=gen).to(dev, torch.bfloat16)
    g = (-torch.nn.functional.softplus(torch.randn(1, N, hv, generator=gen)) * 0.1).to(dev)
    beta = torch.sigmoid(torch.randn(1, N, hv, generator=gen) + 2).to(dev, torch.bfloat16)
    pool = (0.05 * torch.randn(3, hv, vd, kd, generator=gen)).to(dev, pool_dtype)
    idx = torch.tensor([2, 0], device=dev)
    cu = torch.tensor([0, 135, 175], dtype=torch.int32, device=dev)
    ck = torch.zeros(2, hv, vd, kd, dtype=pool_dtype, device=dev)
    kw = dict(initial_state=pool, state_indices=idx, cu_seqlens=cu, use_qk_l2norm=True)
    o, final = gdn_recurrent(q, k, v, g, beta, ckpt_state=ck, ckpt_ends=torch.tensor(ends, dtype=torch.int32,
                             device=dev), ckpt_slots=torch.tensor([1, 0], dtype=torch.int32, device=dev), **kw)
    o0, final0 = gdn_recurrent(q, k, v, g, beta, **kw)
    assert torch.equal(o, o0) and torch.equal(final, final0)
    want = prefix_states([q, k, v, g, beta], pool, idx, cu, ends)[0]
    assert rel(ck[1], want) < (1e-5 if pool_dtype == torch.float32 else 2 ** -7)
    assert not ck[0].any()
