"""Naive torch twins of the fused GDN decode kernels (kernels/gdn_decode.py).

Each twin is the composition the GDN layer runs in decode mode (bole/layers/gdn.py), so a kernel
that matches its twin matches the layer:

    causal_conv1d_update_ref = causal_conv1d_decode without bias (conv window, fp32 sum, silu,
                               conv state shifted in place)
    gdn_decode_step_ref      = g / beta as the layer makes them, gdn_decode (l2norm, scale, one
                               recurrence step in fp32), then pool[slots] = final.to(pool dtype)

Shapes: x [N, C]; q, k [N, HK, K]; v [N, HV, V]; a, b [N, HV]; ssm_state [slots, HV, V, K].
"""

from __future__ import annotations

from bole.ops.conv import causal_conv1d_decode
from bole.ops.gdn import gdn_gating
from bole.ops.gdn_chunk import gdn_decode


def causal_conv1d_update_ref(x, weight, conv_state, state_indices, activation="silu", out=None):
    """One-token depthwise causal conv; conv_state[state_indices[n]] is shifted in place.

    Returns y [N, C] in x's dtype (written into ``out`` when given).
    """
    y = causal_conv1d_decode(x, weight, None, conv_state, state_indices, activation)
    if out is None:
        return y
    return out.copy_(y)


def gdn_decode_step_ref(q, k, v, a, b, A_log, dt_bias, ssm_state, state_indices, scale=None,
                        use_qk_l2norm=True, out=None):
    """One gated delta rule step per row from pool slot ``state_indices[n]``; the pool is updated in place.

    g = -exp(A_log) softplus(a + dt_bias) in fp32; beta = sigmoid(b) in b's dtype (the layer's rounding).
    Returns o [N, HV, V] in v's dtype (written into ``out`` when given).
    """
    g, beta = gdn_gating(a, b, A_log, dt_bias)
    o, final = gdn_decode(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                          initial_state=ssm_state, state_indices=state_indices,
                          use_qk_l2norm=use_qk_l2norm)
    ssm_state[state_indices.long()] = final.to(ssm_state.dtype)
    if out is None:
        return o[0]
    return out.copy_(o[0])
