"""The gated activation kernel (kernels/act_mul.py) against its twin (bole/ops/activation.py).

Inputs are the views the layers pass: the gate and up halves of one fused gate|up GEMM output (MLP,
MoE experts), the attention's per-head gate interleaved with q, a broadcast [N, 1] gate (MoE shared
expert); outputs NaN-poisoned. Half results within one ulp of the twin (only exp / division precision
differ); bf16 is a GPU test (the interpreter truncates fp32 -> bf16 casts).
"""

import pytest
import torch
import torch.nn.functional as F
from test_rmsnorm import check

from bole.ops.activation import act_mul_ref
from kernels.act_mul import act_mul


def rand(*shape, dtype, gen, device, scale=3.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)


def run_both(x, gate, activation, max_ulps=1):
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
    y = act_mul(x, gate, activation, out=out)
    assert y is out
    check(y, act_mul_ref(x, gate, activation), max_ulps)
    check(act_mul(x, gate, activation), act_mul_ref(x, gate, activation), max_ulps)
    return y


def test_twin_is_the_layers_math():
    gen = torch.Generator().manual_seed(0)
    g, u = rand(5, 24, dtype=torch.bfloat16, gen=gen, device="cpu"), rand(5, 24, dtype=torch.bfloat16, gen=gen,
                                                                          device="cpu")
    assert torch.equal(act_mul_ref(u, g, "silu"), F.silu(g) * u)
    assert torch.equal(act_mul_ref(u, g, "sigmoid"), u * torch.sigmoid(g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,I", [(1, 768), (3, 100), (17, 63), (2, 3000)])
def test_silu_mul_fused_gate_up(device, dtype, N, I):
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        gate, up = rand(N, 2 * I + 1, dtype=dtype, gen=gen, device=device)[:, 1:].split(I, dim=-1)
        run_both(up, gate, "silu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,H,D", [(1, 4, 64), (3, 16, 256), (5, 3, 40), (2, 1, 7)])
def test_sigmoid_mul_attention_gate(device, dtype, N, H, D):
    gen = torch.Generator().manual_seed(N * H)
    qg = rand(N, H, 2 * D, dtype=dtype, gen=gen, device=device)
    _, gate = qg.chunk(2, dim=-1)                        # strided per head, as in the q projection
    o = rand(N, H, D, dtype=dtype, gen=gen, device=device)
    y = run_both(o, gate, "sigmoid")
    assert y.is_contiguous()
    # o itself strided (a transposed attention output), and in place
    o_t = rand(H, N, D, dtype=dtype, gen=gen, device=device).transpose(0, 1)
    run_both(o_t, gate, "sigmoid")
    o2, want = o.clone(), act_mul_ref(o, gate, "sigmoid")
    assert act_mul(o2, gate, "sigmoid", out=o2) is o2
    check(o2, want)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(100) = inf, as torch: act -> 0
def test_broadcast_gate_and_extremes(device):
    gen = torch.Generator().manual_seed(4)
    s = rand(6, 48, dtype=torch.float32, gen=gen, device=device)
    g = rand(6, 1, dtype=torch.float32, gen=gen, device=device)
    run_both(s, g.expand_as(s), "sigmoid")              # the MoE shared expert's [N, 1] gate
    assert torch.equal(act_mul_ref(s, g.expand_as(s), "sigmoid"), torch.sigmoid(g) * s)
    gate = torch.tensor([[-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, float("inf")]], device=device)
    x = torch.ones_like(gate)
    for act in ("silu", "sigmoid"):
        check(act_mul(x[:, :-1], gate[:, :-1], act), act_mul_ref(x[:, :-1], gate[:, :-1], act))
    assert act_mul(x, gate, "sigmoid")[0, -1] == 1
    assert act_mul(s[:0], s[:0], "silu").shape == (0, 48)


def test_batch_invariant(device):
    gen = torch.Generator().manual_seed(5)
    x, g = (rand(9, 1500, dtype=torch.float16, gen=gen, device=device) for _ in range(2))
    y = act_mul(x, g, "silu")
    for i in (0, 4, 8):
        assert torch.equal(act_mul(x[i:i + 1], g[i:i + 1], "silu"), y[i:i + 1])


@pytest.mark.parametrize("case", ["x_rank", "x_dtype", "x_int", "gate_shape", "gate_dtype", "activation",
                                  "out_shape", "out_dtype", "out_stride", "device"])
def test_bad_inputs_raise(device, case):
    x = torch.zeros(3, 16, device=device)
    kw = dict(x=x, gate=torch.zeros(3, 16, device=device), activation="silu")
    kw.update({
        "x_rank": dict(x=x[0], gate=x[0]), "x_dtype": dict(x=x.double(), gate=x.double()),
        "x_int": dict(x=x.int(), gate=x.int()), "gate_shape": dict(gate=torch.zeros(3, 8, device=device)),
        "gate_dtype": dict(gate=x.half()), "activation": dict(activation="gelu"),
        "out_shape": dict(out=torch.zeros(3, 8, device=device)), "out_dtype": dict(out=x.half()),
        "out_stride": dict(out=torch.zeros(16, 3, device=device).t()),
        "device": dict(gate=torch.zeros(3, 16, device="meta")),
    }[case])
    with pytest.raises(ValueError):
        act_mul(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 64])
def test_gpu_bf16(device, N):
    gen = torch.Generator().manual_seed(N)
    gate, up = rand(N, 2 * 12288, dtype=torch.bfloat16, gen=gen, device=device).split(12288, dim=-1)
    run_both(up, gate, "silu")
    o = rand(N, 16, 256, dtype=torch.bfloat16, gen=gen, device=device)
    _, g = rand(N, 16, 512, dtype=torch.bfloat16, gen=gen, device=device).chunk(2, dim=-1)
    run_both(o, g, "sigmoid")
