"""Fused projections (bole/layers/linear.py) and the fused residual norms: the same numbers as the
separate projections and the unfused residual adds."""

import torch
from conftest import Runner
from torch import nn

from bole.layers.linear import FusedLinear
from bole.layers.norm import RMSNorm
from bole.models.loader import load_model


def test_fused_linear_matches_separate_projections():
    torch.manual_seed(0)
    lins = [nn.Linear(24, n, bias=True) for n in (7, 13, 3)]
    x = torch.randn(5, 24)
    want = [lin(x) for lin in lins]
    fused = FusedLinear(lins)
    for a, b in zip(fused(x), want, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    # the linears now view rows of the one matrix: same values, no copies, names unchanged
    base = fused.weight.data_ptr()
    for lin, b in zip(lins, want, strict=True):
        assert base <= lin.weight.data_ptr() < base + fused.weight.numel() * 4
        assert torch.allclose(lin(x), b, atol=1e-6)


def test_fused_linear_rejects_mismatched_inputs():
    import pytest

    with pytest.raises(ValueError, match="input size"):
        FusedLinear([nn.Linear(4, 2), nn.Linear(5, 2)])
    with pytest.raises(ValueError, match="bias"):
        FusedLinear([nn.Linear(4, 2), nn.Linear(4, 2, bias=False)])


def test_rms_norm_residual_is_add_then_norm():
    torch.manual_seed(1)
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.normal_()
    x, r = torch.randn(3, 4, 16), torch.randn(3, 4, 16)
    y, s = norm(x, r)
    assert torch.equal(s, x + r) and torch.equal(y, norm(x + r))


def test_loaded_model_is_fused_and_matches_the_unfused_forward(checkpoints):
    ck = checkpoints("next")  # attention, GDN, dense MLP and a MoE shared expert
    fused = load_model(ck.path, dtype="float32", backend="torch")
    gdn = next(m for m in fused.modules() if hasattr(m, "in_proj"))
    assert gdn.in_proj is not None
    plain = load_model(ck.path, dtype="float32", backend="torch")
    for m in plain.modules():  # back to separate projections
        for attr in ("in_proj", "gate_up", "qkv_proj"):
            if getattr(m, attr, None) is not None:
                setattr(m, attr, None)
    ids = torch.randint(0, 128, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    outs = []
    for model in (fused, plain):
        r = Runner(model)
        r.add(0)
        outs.append(r.step("prefill", {0: ids})[0])
    a, b = outs
    assert float((a - b).abs().max()) <= 1e-4
