"""Roofline model of the target forwards, for hardware that cannot be measured here.

``forward_time_ms(cfg, hw, a, tokens_per_request, kv_len, depth, verify)`` models one target forward
(the engine's ``ModelRunner.verify`` over a forest, or ``decode`` with one token per request) as a
sum over components, each bound by compute or by memory, plus the engine's fixed overheads:

    time = Σ_c max(flops_c / (peak · η_compute), bytes_c / (bandwidth · η_memory))
           + fixed + per_layer · layers + per_request_attn · B · attn_layers + per_node · nodes (verify)

components (T = Σ_b t_b tokens, t_b = 1 + drafts of request b in verify, 1 in decode; P = kv_len):
  linear     every projection / MLP / lm_head: flops 2·T·params; bytes = weights read ONCE per
             forward + inputs and outputs of each projection (T·(in+out) activations); MoE layers
             read the experts that T tokens touch in expectation, E·(1 − (1 − k/E)^T).
  attention  per request and attention layer: flops 4·t_b·(P+t_b)·Hq·D; bytes: its K/V (P+t_b
             positions, Hkv heads, k and v) + q and output.
  gdn        per request and GDN layer: the recurrent state is read once (fp32 HV·V·K; decode also
             writes it back), conv window; verify adds the closed-form tree work of DESIGN.md §2
             (Q S_pre and K S_pre 4·t·K·V, Neumann rounds 2·d·t²·V, G and C 4·t²·K, C U 2·t²·V per
             value head) and writes the per-node factors (k, u, logp, conv inputs).

The overhead terms stand for what an eager forward pays besides the arithmetic: host-side
ForwardContext and forest construction, kernel launches per layer, the per-request attention loop
(the measured tables they are fitted on are eager sweeps; a graphed forward pays less of them).
Their defaults are guesses; ``fit_overheads`` estimates them from a measured table (least squares on
the residual, non-negative) so a model calibrated on one GPU can be carried to another. Every
assumption is written into the table (``provenance.assumptions``) and ``model_error`` compares the
model, evaluated with the measured GPU's datasheet figures, against that measurement.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from statistics import median

from bole.hardware import SPECS, HardwareSpec
from bole.spec.budget import CalibrationTable, select_b_ver
from bole.spec.tree import feasible_capacities

_OVERHEAD_FIELDS = ("fixed_us", "per_layer_us", "per_request_attn_us", "per_node_us")


@dataclass(frozen=True)
class RooflineAssumptions:
    compute_efficiency: float = 0.6     # fraction of the datasheet dense bf16 peak GEMMs reach
    memory_efficiency: float = 0.8      # fraction of the datasheet bandwidth streaming reads reach
    fixed_us: float = 400.0             # per forward: context / forest building, host syncs
    per_layer_us: float = 150.0         # per decoder layer: eager kernel launches
    per_request_attn_us: float = 40.0   # per request and attention layer: the per-request SDPA loop
    per_node_us: float = 2.0            # per verified node: host tree packing, logits scatter
    state_bytes: int = 4                # GDN recurrent state dtype (fp32 pool)
    fitted_on: str = ""                 # table id the overhead terms were fitted on, if any

    def to_dict(self) -> dict:
        return asdict(self)


def _components(cfg, tokens: list[int], kv_len: int, depth: int, verify: bool, wb: int, sb: int):
    """[(name, flops, bytes)] of one forward; ``tokens[b]`` new tokens of request b."""
    H, T = cfg.hidden_size, sum(tokens)
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    HK, HV, K, V = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim)
    # (in, out) of every projection
    attn_proj = [(H, 2 * Hq * D), (H, Hkv * D), (H, Hkv * D), (Hq * D, H)]
    gdn_proj = [(H, cfg.conv_dim), (H, HV * V), (H, HV), (H, HV), (HV * V, H)]
    flops = bytes_ = 0.0
    for layer, kind in enumerate(cfg.layer_types):
        projs = list(attn_proj if kind == "full_attention" else gdn_proj)
        if cfg.is_moe_layer(layer):
            E, k, Im, Is = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                            cfg.shared_expert_intermediate_size)
            touched = E * (1 - (1 - k / E) ** T)
            flops += 2 * T * (3 * H * Im * k + 3 * H * Is + H * E)
            bytes_ += (touched * 3 * H * Im + 3 * H * Is + H * E) * wb + T * (k + 1) * (2 * H + 3 * Im) * wb
        else:
            I = cfg.intermediate_size
            projs += [(H, I), (H, I), (I, H)]
        for i, o in projs:
            flops += 2 * T * i * o
            bytes_ += i * o * wb + T * (i + o) * wb
    flops += 2 * T * H * cfg.vocab_size                       # lm_head over every token
    bytes_ += H * cfg.vocab_size * wb + T * (H + cfg.vocab_size) * wb + T * H * wb
    out = [("linear", flops, bytes_)]

    a_fl = a_by = 0.0
    for t in tokens:
        a_fl += 4 * t * (kv_len + t) * Hq * D
        a_by += (kv_len + t) * Hkv * D * 2 * wb + 2 * t * Hq * D * wb
    out.append(("attention", a_fl * cfg.num_attn_layers, a_by * cfg.num_attn_layers))

    g_fl = g_by = 0.0
    state = HV * V * K * sb
    conv = cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * wb
    for t in tokens:
        if verify:
            d = min(depth, t)
            g_fl += HV * (4 * t * K * V + 2 * d * t * t * V + 4 * t * t * K + 2 * t * t * V)
            g_by += state + conv + t * (HK * K * wb + HV * V * 4 + HV * 4 + cfg.conv_dim * wb)
        else:
            g_fl += HV * 6 * K * V
            g_by += 2 * state + 2 * conv
    out.append(("gdn", g_fl * cfg.num_gdn_layers, g_by * cfg.num_gdn_layers))
    return out


def _overhead_features(cfg, tokens: list[int], verify: bool) -> list[float]:
    """Multipliers of (fixed_us, per_layer_us, per_request_attn_us, per_node_us)."""
    return [1.0, float(cfg.num_hidden_layers), float(len(tokens) * cfg.num_attn_layers),
            float(sum(tokens)) if verify else 0.0]


def roofline_ms(cfg, hw: HardwareSpec, a: RooflineAssumptions, tokens: list[int], kv_len: int, depth: int,
                verify: bool, dtype_bytes: int = 2) -> float:
    """The arithmetic / memory part of the model (no overheads), in ms."""
    peak = hw.bf16_tflops * 1e12 * a.compute_efficiency
    bw = hw.bandwidth_tbs * 1e12 * a.memory_efficiency
    comps = _components(cfg, tokens, kv_len, depth, verify, dtype_bytes, a.state_bytes)
    return 1e3 * sum(max(f / peak, b / bw) for _, f, b in comps)


def forward_time_ms(cfg, hw: HardwareSpec, a: RooflineAssumptions, tokens: list[int], kv_len: int, depth: int,
                    verify: bool, dtype_bytes: int = 2) -> float:
    feats = _overhead_features(cfg, tokens, verify)
    over = sum(c * getattr(a, f) for c, f in zip(feats, _OVERHEAD_FIELDS, strict=True))
    return roofline_ms(cfg, hw, a, tokens, kv_len, depth, verify, dtype_bytes) + over * 1e-3


def split_nodes(num_drafts: int, batch: int) -> list[int]:
    """Tokens per request of a verify forest: the root plus an even share of the drafts."""
    return [1 + num_drafts // batch + (b < num_drafts % batch) for b in range(batch)]


def model_point(cfg, hw: HardwareSpec, a: RooflineAssumptions, batch: int, kv_len: int, depth: int,
                capture_set, dtype_bytes: int = 2) -> tuple[float, dict[int, float]]:
    """(T_dec ms, {N: T_ver ms}) at one bucket point (depth = tree depth with its root)."""
    t_dec = forward_time_ms(cfg, hw, a, [1] * batch, kv_len, depth, False, dtype_bytes)
    t_ver = {n: forward_time_ms(cfg, hw, a, split_nodes(n, batch), kv_len, depth, True, dtype_bytes)
             for n in feasible_capacities(capture_set, batch)}
    return t_dec, t_ver


def _bucket_points(table: CalibrationTable):
    """Where each bucket was measured: provenance.raw[i].at, else its upper edges (the sweep's rule)."""
    raw = table.provenance.get("raw") or []
    return [tuple(raw[i]["at"]) if i < len(raw) and "at" in raw[i] else (b.batch[1], b.kv[1], b.depth[1])
            for i, b in enumerate(table.buckets)]


def fit_overheads(cfg, measured: CalibrationTable, a: RooflineAssumptions = RooflineAssumptions(),
                  dtype_bytes: int = 2) -> RooflineAssumptions:
    """Least-squares non-negative overhead terms from a measured table's T_dec and T_ver."""
    import numpy as np

    hw = SPECS[measured.hardware]
    rows, resid = [], []
    for b, (B, kv, d) in zip(measured.buckets, _bucket_points(measured), strict=True):
        rows.append(_overhead_features(cfg, [1] * B, False))
        resid.append(b.t_dec_ms - roofline_ms(cfg, hw, a, [1] * B, kv, d, False, dtype_bytes))
        for n, t in b.t_ver_ms.items():
            tok = split_nodes(n, B)
            rows.append(_overhead_features(cfg, tok, True))
            resid.append(t - roofline_ms(cfg, hw, a, tok, kv, d, True, dtype_bytes))
    X, y = np.array(rows), np.array(resid) * 1e3  # us
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while active:  # drop negative coefficients one at a time (a small active-set NNLS)
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    fitted = {f: float(round(c, 3)) for f, c in zip(_OVERHEAD_FIELDS, coef, strict=True)}
    return replace(a, fitted_on=measured.table_id, **fitted)


def model_error(cfg, measured: CalibrationTable, a: RooflineAssumptions, dtype_bytes: int = 2) -> dict:
    """The model, with the measured hardware's datasheet figures, against a measured table."""
    hw = SPECS[measured.hardware]
    ver_err, dec_err, bver_log2, agree = [], [], [], 0
    for b, (B, kv, d) in zip(measured.buckets, _bucket_points(measured), strict=True):
        t_dec, t_ver = model_point(cfg, hw, a, B, kv, d, sorted(b.t_ver_ms), dtype_bytes)
        dec_err.append(abs(t_dec - b.t_dec_ms) / b.t_dec_ms)
        ver_err += [abs(t_ver[n] - t) / t for n, t in b.t_ver_ms.items()]
        bv = select_b_ver(t_ver, t_dec, measured.epsilon)
        agree += bv == b.b_ver
        bver_log2.append(abs(math.log2(bv / b.b_ver)))
    r = lambda x: float(round(x, 4))
    return {"against": measured.table_id, "hardware": measured.hardware,
            "in_sample": a.fitted_on == measured.table_id, "buckets": len(measured.buckets),
            "t_ver_rel_err_median": r(median(ver_err)), "t_ver_rel_err_max": r(max(ver_err)),
            "t_dec_rel_err_median": r(median(dec_err)), "t_dec_rel_err_max": r(max(dec_err)),
            "b_ver_exact_fraction": r(agree / len(measured.buckets)),
            "b_ver_abs_log2_err_mean": r(sum(bver_log2) / len(bver_log2))}
