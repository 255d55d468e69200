"""One GDN layer's verify forward (bole/layers/gdn.py) on both backends against the composition it
replaced: torch gating, ``causal_conv1d_tree_ref``, the verifier, then the factors copied into the buffer.

The layer now writes the commit's factors in place (k and the conv inputs from the backend's
``tree_conv``, u and logP from ``tree_verify``); the factor buffers start NaN so an unwritten element
fails, and the conv / ssm pools must stay bitwise untouched. The torch backend must give the old
result exactly (fp32), the Triton kernels (interpreted on the CPU) to fp32 rounding.
"""

import types

import pytest
import torch
import torch.nn.functional as F

from bole.backend import resolve_backend
from bole.layers.gdn import GatedDeltaNet
from bole.models.context import TreeFactors
from bole.ops.conv import causal_conv1d_tree_ref
from bole.ops.gdn import gdn_tree_serial_ref, gdn_tree_verify_ref
from bole.spec.tree import PackedForest, random_tree
from kernels._checks import check_forest_inputs

CFG = types.SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=8, hidden_size=32, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                            num_gdn_layers=2, conv_dim=2 * 2 * 16 + 4 * 8)


def make_layer(backend: str, seed: int = 0) -> GatedDeltaNet:
    """GDN index 1 of two, random weights (the same for a seed on either backend), fused projections."""
    gen = torch.Generator().manual_seed(seed)
    layer = GatedDeltaNet(CFG, 1, resolve_backend(backend)).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.5))
    layer.fuse_projections()
    return layer


def make_ctx(forest, serial: bool, factor_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = types.SimpleNamespace(conv=torch.randn(2, 5, CFG.conv_dim, 3, generator=gen),
                                 ssm=torch.randn(2, 5, 4, 8, 16, generator=gen) * 0.2)
    factors = TreeFactors.allocate(CFG, forest.num_nodes, dtype=factor_dtype, snapshots=serial)
    for t in (factors.k, factors.u, factors.logp, factors.conv_x):
        t.fill_(float("nan"))
    slots = torch.tensor([3, 0, 4])
    # a ForwardContext's once-per-forward check of what the layer's kernels skip (the forest and slots)
    check = lambda: check_forest_inputs(forest, slots, forest.device)
    return types.SimpleNamespace(mode="verify", state_pool=pool, state_slots=slots, forest=forest,
                                 factors=factors, check_kernel_inputs=check)


def old_verify(layer, x, ctx):
    """The verify forward before the fused tree conv (the commit's factors copied in afterwards)."""
    N, i, f, pool = x.shape[0], layer.gdn_index, ctx.factors, ctx.state_pool
    mixed, z, b, a = layer.in_proj(x)
    z = z.view(N, layer.num_v_heads, layer.head_v_dim)
    beta = torch.sigmoid(b)
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    f.conv_x[i] = mixed
    y = causal_conv1d_tree_ref(mixed, layer.conv1d.weight[:, 0, :], None, pool.conv[i], ctx.state_slots, ctx.forest)
    kd = layer.key_dim
    q = y[:, :kd].view(N, layer.num_k_heads, -1)[None]
    k = y[:, kd:2 * kd].view(N, layer.num_k_heads, -1)[None]
    v = y[:, 2 * kd:].view(N, layer.num_v_heads, -1)[None]
    if f.snapshots is not None:
        o, f.snapshots[i] = gdn_tree_serial_ref(q, k, v, g[None], beta[None], ctx.forest, pool.ssm[i], ctx.state_slots,
                                            use_qk_l2norm=True)
    else:
        o, f.u[i], f.logp[i] = gdn_tree_verify_ref(q, k, v, g[None], beta[None], ctx.forest, pool.ssm[i],
                                               ctx.state_slots, use_qk_l2norm=True)
        f.k[i] = k[0]
    return layer.out_proj(layer.norm(o[0].to(x.dtype), z).reshape(N, layer.value_dim))


def rel_err(a, b):
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("serial", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_verify_layer_equals_the_old_composition(backend, serial):
    gen = torch.Generator().manual_seed(1)
    forest = PackedForest.from_trees([random_tree(n, 5, gen) for n in (9, 1, 14)])
    x = torch.randn(forest.num_nodes, CFG.hidden_size, generator=gen)
    layer, ref = make_layer(backend), make_layer("torch")
    ctx, ctx_ref = make_ctx(forest, serial), make_ctx(forest, serial)
    pools = (ctx.state_pool.conv.clone(), ctx.state_pool.ssm.clone())
    with torch.no_grad():
        y = layer(x, ctx)
        y_ref = old_verify(ref, x, ctx_ref)
    assert torch.equal(ctx.state_pool.conv, pools[0]) and torch.equal(ctx.state_pool.ssm, pools[1])
    f, f_ref = ctx.factors, ctx_ref.factors
    written = [("y", y, y_ref), ("conv_x", f.conv_x[1], f_ref.conv_x[1])]
    if serial:
        written.append(("snapshots", f.snapshots[1], f_ref.snapshots[1]))
    else:
        written += [("k", f.k[1], f_ref.k[1]), ("u", f.u[1], f_ref.u[1]), ("logp", f.logp[1], f_ref.logp[1])]
    for name, got, want in written:
        if backend == "torch":
            assert torch.equal(got, want), name
        else:
            assert rel_err(got, want) <= 1e-5, name
    assert torch.isnan(f.conv_x[0]).all() and torch.isnan(f.u[0]).all(), "another layer's factors were written"


def test_factor_buffer_of_another_dtype():
    """Factors kept in another dtype than the activations (a float64 buffer here): k is still stored,
    cast, and the verifier reads the activation-dtype keys."""
    gen = torch.Generator().manual_seed(2)
    forest = PackedForest.from_trees([random_tree(6, 4, gen), random_tree(3, 3, gen), random_tree(1, 1, gen)])
    x = torch.randn(forest.num_nodes, CFG.hidden_size, generator=gen)
    layer = make_layer("torch")
    ctx, ctx_ref = make_ctx(forest, False, torch.float64), make_ctx(forest, False)
    with torch.no_grad():
        y, y_ref = layer(x, ctx), layer(x, ctx_ref)
    assert torch.equal(y, y_ref)
    assert torch.equal(ctx.factors.k[1], ctx_ref.factors.k[1].double())
    assert torch.equal(ctx.factors.conv_x[1], ctx_ref.factors.conv_x[1].double())
