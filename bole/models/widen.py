"""Widened models: a small Qwen3.5 hybrid checkpoint embedded in a larger text shape, same function.

    widen(src, dst, shape: ModelConfig) -> WidenReport       (scripts/widen_model.py is the CLI)
    widened_tensors(src, shape) -> (name, tensor), ...       (what widen writes, one tensor at a time)
    write_widened_config(src, dst, shape) -> WidenReport     (config.json alone: load_model(dst, tensors=...))
    widen_config(src_config, shape) -> WidenReport          (the config and norm ratios, no weights)
    copy_tokenizer_files(src, dst)                         (so the widened folder serves like the source)

The widened model is "<shape>-cost, embedded model's predictions": its layers, GEMMs, states and KV
cache and vocabulary are the shape's, its logits the source's up to rounding (padded tokens never win).
Per tensor (original channels keep their index in each widened axis; anything not listed is zero):

* Hidden stream: H -> H' holds k copies of the original channels (copy n of channel i at n·H + i), two
  constant channels (below), the rest zero. Writers (embedding, o_proj, out_proj, down_proj, experts,
  mtp.fc) write every copy; readers (all input projections, router, lm_head, mtp.fc) read each copy with
  weight / k, so W'x' = Wx.
* Norms. A norm whose input grows from d to d' channels by zeros or copies sees mean(x'²) = r·mean(x²)
  (r = k·H/H' for the hidden stream, d/d' for zero padding); with eps' = r·eps it is exact once its
  weights undo the change: (1 + w)·sqrt(r) (zero-centred; padded channels 0, stored -1). eps is one
  value, eps' = r_gdn·eps (the GDN norm has the smallest inputs): a zero-padded family f sees eps'/r_f
  for eps and its output's relative error is at most |eps'/r_f - eps| / (2·mean x²) (``eps_bounds``: 0
  when r_attention = r_gdn); the hidden norms are exact by the constant channels (below). In bf16 the
  rescaled norm weights round (2^-9): the embedded model's bf16 widening, run in fp32, moves its logits
  by ~1e-3 relative.
* Gated attention: head_dim D -> D' zero padded, r = D/D' for the q/k norms; the softmax scale 1/sqrt(D')
  is compensated by sqrt(D'/D) on q, so q_norm keeps (1 + w)·sqrt(r)·sqrt(D'/D) = (1 + w) and k_norm
  gets (1 + w)·sqrt(D/D'). Partial RoPE: the rotary dims R -> R' = D'·p' must be an integer multiple m of R;
  rope_theta stays the source's, and rotate-half pair (j, j + R/2) moves to (m·j, m·j + R'/2), whose
  frequency theta^(-2mj/R') is the original theta^(-2j/R) bit for bit; pass-through dims follow R'.
* Grouped heads (GQA, and GDN value heads per key head): with ratio r' >= r, original query (value) head
  h goes to (h // r)·r' + h % r and kv (key) heads keep their index; with r % r' == 0 query heads keep
  their index and each new kv head is a copy of the original one its queries read. Extra heads: zero.
* GDN: key dims K -> K' zero padded (q, k are L2-normalised: exact), value dims zero padded. The kernel's
  scale 1/sqrt(K') shrinks o by sqrt(K/K') and o only feeds the per-head gated norm, which removes a
  scale: its mean(o²) shrinks by r_gdn = (K/K')·(V/V') and its weight becomes w·sqrt(V/V'). conv1d: padded
  channels zero; extra heads: A_log 0, dt_bias 1 (their outputs are zero anyway).
* MLP / MoE: FFN width zero padded (down_proj columns zero); a MoE source's experts and router keep their
  count. A dense layer widened into a MoE one (a dense source at a MoE shape, e.g. qwen3.5-35b-a3b) splits
  its SwiGLU channels, which sum independently: the first S = min(I, I_shared') go to the shared expert,
  whose gate weight is 0 (sigmoid gives exactly ½) and down_proj is doubled; the other I - S (<= I_moe')
  go to every routed expert, all E identical. The router renormalises its top-k weights (Qwen3.5-MoE
  always does), so Σ_k w_k·expert(x) = expert(x) for any routing, and the router is random (a seeded
  N(0, 1/H) matrix read through the copies): tokens spread over the experts as a trained router's do,
  which is what sets the cost of a batch or a tree (the distinct experts whose weights are read).
  Pass-through layers of a MoE shape get such a router too (their experts are zero), not a zero one that
  would send every token to the same k experts.
* Layers: the source's layers keep their index (the target's layer-type pattern must start with the
  source's); extra layers are residual pass-throughs: all matrices zero (norms 1, dt_bias 1), so each
  adds exactly 0 to the residual stream.
* MTP: its layer is widened like a full-attention layer; fc reads both halves as readers, writes copies
  (and the constant, below).
* Constant channels and the vocabulary (V -> V', the target shape's). Two channels after the copies,
  j = k·H and j + 1, hold per token t the constant pair c·(cos θ_t, sin θ_t): the embedding writes it, no
  other writer touches it and no reader but lm_head and mtp.fc reads it, so every projection is
  unchanged. A hidden norm then sees mean'(x'²) = r_h·mean(x²) + c²/H' for every token, and with
  c² = (r_h·eps - eps')·H' its mean' + eps' = r_h·(mean + eps) exactly: the hidden norms are exact for
  any k, and ``k = (H' - 2) // H`` (the most copies: the largest c) makes r_h > eps'/eps (c > 0) in
  every usual widening. If r_h <= r_gdn anyway, c² = r_h·eps·H'/16: the hidden norms see (1 + 1/16)·eps
  (``eps_bounds``; eps' stays r_gdn·eps, as the GDN norm's small inputs need it), as does eps below.
  The final norm's weight at j is sqrt(r_h) (at j + 1: 0), so the target hidden holds
  v_t = c·cos θ_t / sqrt(m + eps) > 0 at j (m: the final residual's source mean x²), like every logit a
  1/rms quantity. lm_head row p >= V is real row p mod V (read through the copies) with -alpha at column
  j (real rows: 0 there), so logit_p = logit_(p mod V) - alpha·v_t: strictly below a real token's, never
  the greedy argmax, and sampled at most exp(-alpha·v_t / T) times as often as it (margin
  alpha·v_t >= alpha·c / sqrt(2(m + eps)), as cos θ_t >= 1/sqrt(2)). Embedding rows p >= V are real row
  p mod V's (never produced). In floating point the inequality needs a margin above the logits' rounding.
* MTP and the constant: fc writes copies only, so its residual would have 0 at j and padded rows would
  tie with their real rows in the drafter's top-k. θ_t makes it exact: with M = max_t mean(e_t²) over the
  source embedding, sin(θ_t + π/4) = sqrt((mean(e_t²) + eps) / (M + eps)) (θ_t in (-π/4, π/4]), the
  embedding norm's weight 1 at j, j + 1, and fc row j = a at both (a = sqrt(r_h·(M + eps)/2)), fc writes
  a·c·(cos θ_t + sin θ_t) / sqrt(r_h·(mean(e_t²) + eps)) = c at j for every token, nothing at j + 1:
  the drafter's residual holds the target's constant, its layer norms are exact, its final norm (weight
  sqrt(r_h) at j) gives c / sqrt(m_mtp + eps) > 0 and padded rows lose there by alpha times that. One norm
  is not exact: pre_fc_norm_hidden reads the target hidden (or, deeper in a draft, the drafter's), whose
  channel j is v_t, not c: it sees eps + β·(cos²θ_t / (m + eps) - 1) for eps, β = c²/(H'·r_h)
  (``WidenReport.hidden_input_bound``; eps - eps'/r_h < eps), so off by at most β·max(1, 1/(m + eps)).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from fractions import Fraction

import torch
from safetensors.torch import save_file

from bole.config import ModelConfig
from bole.models.loader import INDEX_FILE, CheckpointReader, build_plan, checkpoint_files, read_config, resolve_dtype

HIDDEN_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight", "mtp.norm.weight",
                "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")  # the others are per head
TARGET_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "partial_rotary_factor", "linear_num_key_heads",
                 "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "intermediate_size",
                 "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")  # set by a target shape
MOE_TYPES = {"qwen3_5_text": "qwen3_5_moe_text", "qwen3_5": "qwen3_5_moe"}  # a dense source at a MoE shape
_DENSE_MLP_RE = re.compile(r"^(.*\.mlp)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_RE = re.compile(r"^(model|mtp)\.layers\.(\d+)\.")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "token_frequencies.json")


ALPHA = 2.0 ** 15  # lm_head weight of a padded row at the constant channel (exact in bf16 and fp16)


@dataclass
class WidenReport:
    """The widened config, k copies of the hidden stream, its eps, r per norm family, per family
    |eps'/r - eps| (0: exact; over 2·mean x² it bounds the norm's relative error), the constant c of
    channels j, j + 1 (``channel`` = j), the padded rows' alpha, and eps - eps'/r_h, which bounds the
    eps error of mtp.pre_fc_norm_hidden (times max(1, 1/(m + eps)); module docstring)."""
    config: ModelConfig
    copies: int
    eps: float
    ratios: dict
    eps_bounds: dict
    constant: float
    channel: int
    alpha: float
    hidden_input_bound: float


@dataclass
class Axis:
    """One axis of a widened tensor, source size n -> size: per entry a source index, a destination
    index and a scale (1, or 1/k where a reader reads k copies)."""
    n: int
    size: int
    src: list
    dst: list
    scale: list

    def __add__(self, other: "Axis") -> "Axis":
        """Concatenated segments (q | k | v, gate | up, mtp.fc's two halves)."""
        return Axis(self.n + other.n, self.size + other.size, self.src + [i + self.n for i in other.src],
                    self.dst + [j + self.size for j in other.dst], self.scale + other.scale)


def pad(n: int, n2: int) -> Axis:
    if n2 < n:
        raise ValueError(f"cannot shrink an axis from {n} to {n2}")
    return Axis(n, n2, list(range(n)), list(range(n)), [1.0] * n)


def heads(pairs: list, dims: list, d: int, d2: int, n: int, n2: int) -> Axis:
    """Head-major axis [n heads x d] -> [n2 x d2]: ``pairs`` (source head, new head), ``dims`` (src, dst)."""
    src = [h * d + i for h, _ in pairs for i, _ in dims]
    dst = [g * d2 + j for _, g in pairs for _, j in dims]
    return Axis(n * d, n2 * d2, src, dst, [1.0] * len(src))


def group_pairs(nkv: int, nq: int, nkv2: int, nq2: int, what: str) -> tuple[list, list]:
    """(query-head pairs, kv-head pairs) keeping every query head on (a copy of) its original kv head."""
    r, r2 = nq // nkv, nq2 // nkv2
    if r2 >= r and nkv2 >= nkv:
        return [(h, (h // r) * r2 + h % r) for h in range(nq)], [(j, j) for j in range(nkv)]
    if r % r2 == 0 and nq2 >= nq:
        return [(h, h) for h in range(nq)], [((j * r2) // r, j) for j in range(nq // r2)]
    raise ValueError(f"{what}: {nq}/{nkv} heads cannot be grouped as {nq2}/{nkv2} (need r' >= r or r % r' == 0)")


def apply(t: torch.Tensor, dim: int, ax: Axis) -> torch.Tensor:
    if t.shape[dim] != ax.n:
        raise ValueError(f"axis {dim} of a {tuple(t.shape)} tensor is not {ax.n}")
    t = t.index_select(dim, torch.tensor(ax.src, dtype=torch.long))
    shape = [1] * t.dim()
    shape[dim] = -1
    t = t * torch.tensor(ax.scale, dtype=t.dtype).view(shape)
    out = t.new_zeros(t.shape[:dim] + (ax.size,) + t.shape[dim + 1:])
    return out.index_copy(dim, torch.tensor(ax.dst, dtype=torch.long), t)


def row_ms(t: torch.Tensor) -> torch.Tensor:
    """mean(e²) of each row (fp64): what the embedding norm of the token's row sees."""
    return t.double().pow(2).mean(1)


def norm_weight(w: torch.Tensor, ax: Axis, scale: float, centred: bool = True) -> torch.Tensor:
    """A norm's weight on axis ``ax`` times ``scale``; padded channels weight 0 (stored -1 if centred)."""
    return apply(w.float() + float(centred), 0, ax) * scale - float(centred)


class _Widener:
    """The axes of every widened tensor kind, from the source and target configs (module docstring)."""

    def __init__(self, s: ModelConfig, t: ModelConfig, alpha: float = ALPHA, embed_ms_max: float | None = None):
        """``embed_ms_max``: max over the source embedding's rows of mean(e²) (for mtp.fc; None: no weights)."""
        if not alpha >= 0:
            raise ValueError(f"alpha must be >= 0 (padded rows lose by alpha·v), got {alpha}")
        self.s, self.t, self.alpha, self.embed_ms_max = s, t, alpha, embed_ms_max
        D, D2, R, R2 = s.head_dim, t.head_dim, s.rotary_dim, t.rotary_dim
        if R2 % R or D2 - R2 < D - R:
            raise ValueError(f"rotary dims {R} -> {R2} (head_dim {D} -> {D2}): need a multiple, {D - R} pass dims")
        m = R2 // R
        self.attn_dims = ([(j, m * j) for j in range(R // 2)] + [(R // 2 + j, R2 // 2 + m * j) for j in range(R // 2)]
                          + [(j, R2 + j - R) for j in range(R, D)])
        self.q_pairs, self.kv_pairs = group_pairs(s.num_key_value_heads, s.num_attention_heads,
                                                  t.num_key_value_heads, t.num_attention_heads, "attention")
        self.v_pairs, self.k_pairs = group_pairs(s.linear_num_key_heads, s.linear_num_value_heads,
                                                 t.linear_num_key_heads, t.linear_num_value_heads, "GDN")
        K, K2, V, V2 = s.linear_key_head_dim, t.linear_key_head_dim, s.linear_value_head_dim, t.linear_value_head_dim
        r_attn, r_gdn = Fraction(D, D2), Fraction(K, K2) * Fraction(V, V2)
        H, H2, NV, NV2 = s.hidden_size, t.hidden_size, s.vocab_size, t.vocab_size
        if H2 < H + 2 or NV2 < NV:
            raise ValueError(f"hidden_size {H2} / vocab_size {NV2}: need >= {H + 2} (a copy and two constant "
                             f"channels) / >= {NV}")
        self.k = (H2 - 2) // H
        r_h = Fraction(self.k * H, H2)
        eps = Fraction(s.rms_norm_eps)
        c2 = (r_h - r_gdn) * eps * H2 if r_h > r_gdn else r_h * eps * H2 / 16  # c²: fills r_h·eps - eps' if it can
        eps_h = (eps * r_gdn + c2 / H2) / r_h  # what the hidden norms see for eps
        self.ratios = dict(hidden=float(r_h), attention=float(r_attn), gdn=float(r_gdn))
        self.eps, self.eps_h, self.c = float(eps * r_gdn), float(eps_h), math.sqrt(float(c2))
        self.bounds = dict(hidden=float(abs(eps_h - eps)), attention=float(abs(eps * r_gdn / r_attn - eps)), gdn=0.0)
        self.hidden_input_bound = float(c2 / (H2 * r_h))
        self.j = self.k * H
        self.vocab = torch.arange(NV2) % NV  # source row of each widened vocabulary row
        hid = [(i, c * H + i) for c in range(self.k) for i in range(H)]
        self.h_out = Axis(H, H2, [i for i, _ in hid], [j for _, j in hid], [1.0] * len(hid))
        self.h_in = Axis(H, H2, self.h_out.src, self.h_out.dst, [1.0 / self.k] * len(hid))
        HK, HK2, HV, HV2 = s.linear_num_key_heads, t.linear_num_key_heads, s.linear_num_value_heads, \
            t.linear_num_value_heads
        self.gdn_k = heads(self.k_pairs, [(i, i) for i in range(K)], K, K2, HK, HK2)
        self.gdn_v = heads(self.v_pairs, [(i, i) for i in range(V)], V, V2, HV, HV2)
        self.gdn_vh = heads(self.v_pairs, [(0, 0)], 1, 1, HV, HV2)
        Hq, Hq2, Hkv, Hkv2 = s.num_attention_heads, t.num_attention_heads, s.num_key_value_heads, t.num_key_value_heads
        gate_dims = self.attn_dims + [(D + i, D2 + j) for i, j in self.attn_dims]  # per head: D q rows, D gate rows
        self.q_rows, self.q_cols = (heads(self.q_pairs, gate_dims, 2 * D, 2 * D2, Hq, Hq2),
                                    heads(self.q_pairs, self.attn_dims, D, D2, Hq, Hq2))
        self.kv_rows = heads(self.kv_pairs, self.attn_dims, D, D2, Hkv, Hkv2)
        self.head_dims = heads([(0, 0)], self.attn_dims, D, D2, 1, 1)
        self._check_moe()

    def _check_moe(self) -> None:
        s, t = self.s, self.t
        kinds = [(s.is_moe_layer(i), t.is_moe_layer(i)) for i in range(s.num_hidden_layers)]
        kinds.append((s.is_moe_layer(s.num_hidden_layers), t.is_moe_layer(t.num_hidden_layers)))  # the MTP's
        if (True, False) in kinds:
            raise ValueError("a MoE layer cannot be widened into a dense one (the target shape's MLP kind)")
        if s.num_experts and (s.num_experts, s.num_experts_per_tok, s.norm_topk_prob) != (
                t.num_experts, t.num_experts_per_tok, t.norm_topk_prob):
            raise ValueError(f"a MoE source keeps its experts: {s.num_experts} experts, top-{s.num_experts_per_tok}, "
                             f"norm_topk_prob={s.norm_topk_prob} (the target asks {t.num_experts}, "
                             f"top-{t.num_experts_per_tok}, norm_topk_prob={t.norm_topk_prob})")
        if (False, True) in kinds:
            if not t.norm_topk_prob:
                raise ValueError("a dense layer widens into a MoE one only with norm_topk_prob (the routed "
                                 "weights must sum to one)")
            rest = (s.intermediate_size or 0) - min(s.intermediate_size or 0, t.shared_expert_intermediate_size)
            if rest > t.moe_intermediate_size:
                raise ValueError(f"intermediate_size {s.intermediate_size}: {rest} channels beyond the shared "
                                 f"expert's {t.shared_expert_intermediate_size} do not fit moe_intermediate_size "
                                 f"{t.moe_intermediate_size}")

    def to_moe(self, name: str) -> bool:
        """Whether ``name`` (a source tensor) sits in a dense layer that the target makes MoE."""
        m = _LAYER_RE.match(name)
        if m is None:
            return False
        i = int(m[2])
        return (not self.s.is_moe_layer(i + (self.s.num_hidden_layers if m[1] == "mtp" else 0))
                and self.t.is_moe_layer(i + (self.t.num_hidden_layers if m[1] == "mtp" else 0)))

    def router(self, prefix: str) -> torch.Tensor:
        """[E, H'] seeded N(0, 1/H) router of the MLP ``prefix``, read through the copies (module docstring)."""
        gen = torch.Generator().manual_seed(zlib.crc32(prefix.encode()))
        r = torch.randn(self.t.num_experts, self.s.hidden_size, generator=gen) / math.sqrt(self.s.hidden_size)
        return apply(r, 1, self.h_in)

    def dense_to_moe(self, prefix: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> dict:
        """A dense SwiGLU MLP ``prefix`` ([I, H] gate / up, [H, I] down) as the target's MoE block: shared
        expert on the first S channels (gate 0: sigmoid ½, down doubled), the rest in every routed expert
        (expanded views: identical experts), a random router."""
        t, m, hin, hout = self.t, self._mat, self.h_in, self.h_out
        n, E = gate.shape[0], t.num_experts
        S, S2, M2 = min(gate.shape[0], t.shared_expert_intermediate_size), t.shared_expert_intermediate_size, \
            t.moe_intermediate_size
        out = {f"{prefix}.gate.weight": self.router(prefix)}
        if S2:
            out.update({f"{prefix}.shared_expert.gate_proj.weight": m(gate[:S], pad(S, S2), hin),
                        f"{prefix}.shared_expert.up_proj.weight": m(up[:S], pad(S, S2), hin),
                        f"{prefix}.shared_expert.down_proj.weight": m(2 * down[:, :S], hout, pad(S, S2)),
                        f"{prefix}.shared_expert_gate.weight": gate.new_zeros(1, t.hidden_size)})
        routed = pad(n - S, M2)
        gate_up = torch.cat([m(gate[S:], routed, hin), m(up[S:], routed, hin)])
        out[f"{prefix}.experts.gate_up_proj"] = gate_up.expand(E, *gate_up.shape)
        expert_down = m(down[:, S:], hout, routed)
        out[f"{prefix}.experts.down_proj"] = expert_down.expand(E, *expert_down.shape)
        return out

    def _mat(self, t, rows: Axis | None, cols: Axis | None, rdim=0):  # rows on dim rdim, columns last
        t = t if rows is None else apply(t, rdim, rows)
        return t if cols is None else apply(t, t.dim() - 1, cols)

    def tensor(self, name: str, t: torch.Tensor) -> torch.Tensor:  # one source tensor (model naming)
        s, tg, hin, hout, m = self.s, self.t, self.h_in, self.h_out, self._mat
        if name.endswith(HIDDEN_NORMS):
            out, j = norm_weight(t, hout, math.sqrt(self.ratios["hidden"])), self.j
            if name.endswith(("model.norm.weight", "mtp.norm.weight")):  # weight sqrt(r_h) at j: v = c / rms
                out[j] = math.sqrt(self.ratios["hidden"]) - 1
            elif name.endswith("pre_fc_norm_embedding.weight"):  # weight 1 at j, j + 1: what mtp.fc reads
                out[j:j + 2] = 0.0
            return out
        if name.endswith(("A_log", "dt_bias")):  # extra heads: the layers' initial values
            out, keep = apply(t, 0, self.gdn_vh), torch.zeros(self.gdn_vh.size, dtype=torch.bool)
            keep[self.gdn_vh.dst] = True
            return out.masked_fill(~keep, 1.0 if name.endswith("dt_bias") else 0.0)
        qkv, V, V2 = self.gdn_k + self.gdn_k + self.gdn_v, s.linear_value_head_dim, tg.linear_value_head_dim
        shared = ".shared_expert." in name
        ffn = lambda: pad(*((s.shared_expert_intermediate_size, tg.shared_expert_intermediate_size) if shared else
                            (s.intermediate_size or 0, tg.intermediate_size or 0)))
        moe = lambda: pad(s.moe_intermediate_size, tg.moe_intermediate_size)
        rules = {  # name suffix -> the widened tensor
            "embed_tokens.weight": lambda: self._embedding(t), "lm_head.weight": lambda: self._lm_head(t),
            "mtp.fc.weight": lambda: self._mtp_fc(t),
            "self_attn.q_proj.weight": lambda: m(t, self.q_rows, hin),
            "self_attn.k_proj.weight": lambda: m(t, self.kv_rows, hin),
            "self_attn.v_proj.weight": lambda: m(t, self.kv_rows, hin),
            "self_attn.o_proj.weight": lambda: m(t, hout, self.q_cols),
            "self_attn.q_norm.weight": lambda: norm_weight(t, self.head_dims, 1.0),
            "self_attn.k_norm.weight": lambda: norm_weight(t, self.head_dims, math.sqrt(self.ratios["attention"])),
            "linear_attn.in_proj_qkv.weight": lambda: m(t, qkv, hin),
            "linear_attn.conv1d.weight": lambda: apply(t, 0, qkv),
            "linear_attn.in_proj_z.weight": lambda: m(t, self.gdn_v, hin),
            "linear_attn.in_proj_b.weight": lambda: m(t, self.gdn_vh, hin),
            "linear_attn.in_proj_a.weight": lambda: m(t, self.gdn_vh, hin),
            "linear_attn.norm.weight": lambda: norm_weight(t, pad(V, V2), math.sqrt(V / V2), centred=False),
            "linear_attn.out_proj.weight": lambda: m(t, hout, self.gdn_v),
            "experts.gate_up_proj": lambda: m(t, moe() + moe(), hin, rdim=1),
            "experts.down_proj": lambda: m(t, hout, moe(), rdim=1),
            "gate_proj.weight": lambda: m(t, ffn(), hin), "up_proj.weight": lambda: m(t, ffn(), hin),
            "down_proj.weight": lambda: m(t, hout, ffn()),
            "mlp.gate.weight": lambda: apply(t, 1, hin), "shared_expert_gate.weight": lambda: apply(t, 1, hin)}
        for suffix, rule in rules.items():
            if name.endswith(suffix):
                return rule()
        raise ValueError(f"no widening rule for {name}")

    def _embedding(self, t: torch.Tensor) -> torch.Tensor:
        """[V, H] -> [V', H']: copies of row p mod V, c·(cos θ, sin θ) of that row at j, j + 1."""
        if self.embed_ms_max is None:
            raise ValueError("the embedding needs embed_ms_max, the source embedding's max mean(e²)")
        s = ((row_ms(t) + self.eps_h) / (self.embed_ms_max + self.eps_h)).sqrt()
        theta = torch.asin(s.clamp(max=1.0)) - math.pi / 4
        out = apply(t[self.vocab], 1, self.h_out)
        out[:, self.j] = (self.c * torch.cos(theta))[self.vocab].to(out.dtype)
        out[:, self.j + 1] = (self.c * torch.sin(theta))[self.vocab].to(out.dtype)
        return out

    def _lm_head(self, t: torch.Tensor) -> torch.Tensor:
        """[V, H] -> [V', H']: row p reads row p mod V through the copies; padded rows -alpha at j."""
        out = apply(t[self.vocab], 1, self.h_in)
        out[self.s.vocab_size:, self.j] = -self.alpha
        return out

    def _mtp_fc(self, t: torch.Tensor) -> torch.Tensor:
        """[H, 2H] -> [H', 2H']: copies, plus row j = a at the normed embedding's j, j + 1 (writes c there)."""
        if self.embed_ms_max is None:
            raise ValueError("mtp.fc needs embed_ms_max, the source embedding's max mean(e²)")
        # x_j = a·c·(cos θ + sin θ) / sqrt(r_h·(ms + eps)) = c, as sqrt(2)·sin(θ + π/4) = sqrt((ms + eps) / (M + eps))
        out = self._mat(t, self.h_out, self.h_in + self.h_in)
        out[self.j, self.j:self.j + 2] = math.sqrt(
            self.ratios["hidden"] * (self.embed_ms_max + self.eps_h) / 2)
        return out


def widen_config(src: ModelConfig, shape: ModelConfig, alpha: float = ALPHA) -> WidenReport:
    """The widened model's config and norm ratios, without weights: the target shape's sizes and
    vocabulary, the source's rope_theta and MTP, eps' (module docstring), untied embeddings."""
    t = dataclasses.replace(src, **{f: getattr(shape, f) for f in TARGET_FIELDS}, tie_word_embeddings=False)
    if t.num_experts and not src.num_experts:
        t = dataclasses.replace(t, model_type=MOE_TYPES.get(src.model_type, src.model_type))
    if t.layer_types[:src.num_hidden_layers] != src.layer_types:
        raise ValueError("the target's layer types must start with the source's (same pattern)")
    w = _Widener(src, t, alpha)
    return WidenReport(dataclasses.replace(t, rms_norm_eps=w.eps), w.k, w.eps, w.ratios, w.bounds, w.c, w.j, alpha,
                       w.hidden_input_bound)


def widen(src: str, dst: str, shape: ModelConfig, dtype="auto", shard_bytes: int = 4 << 30,
          alpha: float = ALPHA) -> WidenReport:
    """Write the widened checkpoint of folder ``src`` to folder ``dst`` (config.json + model.safetensors).

    ``shape``: a ModelConfig with the target sizes (``TARGET_FIELDS``), e.g. ``shapes_config("qwen3.5-9b")``.
    ``dtype``: of the written tensors ("auto": the source config's); shards of at most ``shard_bytes``.
    ``alpha``: the padded lm_head rows' weight at the constant channel (> 0: they lose by alpha·v)."""
    _, s = read_config(src)
    report = widen_config(s, shape, alpha)  # an impossible widening is refused before anything is written
    os.makedirs(dst, exist_ok=True)
    shards = _Shards(dst, shard_bytes)
    for name, x in widened_tensors(src, shape, dtype, alpha):
        shards.add(name, x)
    shards.close()
    _write_config(src, dst, s, report.config)
    return report


def write_widened_config(src: str, dst: str, shape: ModelConfig, alpha: float = ALPHA) -> WidenReport:
    """Only the widened config.json of ``src`` in ``dst`` (``widen`` writes it after the weights): with
    ``widened_tensors`` held in memory, ``load_model(dst, tensors=...)`` loads a widening no disk holds."""
    _, s = read_config(src)
    report = widen_config(s, shape, alpha)
    os.makedirs(dst, exist_ok=True)
    _write_config(src, dst, s, report.config)
    return report


def widened_tensors(src: str, shape: ModelConfig, dtype="auto", alpha: float = ALPHA):
    """(checkpoint name, tensor) of the widened checkpoint of folder ``src``, one tensor at a time, in the
    order ``widen`` writes them; arguments as ``widen``'s."""
    _, s = read_config(src)
    t = widen_config(s, shape, alpha).config
    out_dtype = resolve_dtype(dtype, s)
    files = checkpoint_files(src)
    producers, _, _ = build_plan(list(files), s)
    if s.tie_word_embeddings:
        producers["lm_head.weight"] = producers["model.embed_tokens.weight"]
    with CheckpointReader(files) as reader, torch.no_grad():
        ms_max = row_ms(producers["model.embed_tokens.weight"](reader).float()).max().item()
        w = _Widener(s, t, alpha, ms_max)

        def widened(names):  # (target name, tensor) of the source tensors ``names``
            mlps = {}
            for name in names:
                if (m := _DENSE_MLP_RE.match(name)) and w.to_moe(name):
                    mlps.setdefault(m[1], {})[m[2]] = producers[name](reader).float()
                else:
                    yield name, w.tensor(name, producers[name](reader).float()).to(out_dtype)
            for prefix, mlp in mlps.items():
                for name, x in w.dense_to_moe(prefix, mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"]).items():
                    yield name, x.to(out_dtype)

        yield from widened(list(producers))
        for i in range(s.num_hidden_layers, t.num_hidden_layers):  # pass-through layers, a source layer's shapes
            j = next((j for j in range(s.num_hidden_layers) if s.layer_types[j] == t.layer_types[i]
                      and t.is_moe_layer(j) == t.is_moe_layer(i)), None)
            if j is None:
                raise ValueError(f"extra layer {i}: no source layer has its type and MLP kind")
            for name, x in widened([n for n in producers if n.startswith(f"model.layers.{j}.")]):
                new = name.replace(f"layers.{j}.", f"layers.{i}.", 1)
                if new.endswith("mlp.gate.weight"):  # a router spreading tokens as in the source layers
                    x = w.router(new.rsplit(".", 2)[0]).to(out_dtype)
                else:  # zero matrices, unit norms
                    ones = new.endswith(("dt_bias", "linear_attn.norm.weight"))
                    x = (torch.ones_like if ones else torch.zeros_like)(x)
                yield new, x


def copy_tokenizer_files(src: str, dst: str) -> list[str]:
    """Copy the tokenizer and generation files ``src`` has (``TOKENIZER_FILES``) to ``dst``; their names.

    The token frequency list (``bole.spec.draft_vocab``) is then extended to ``dst``'s vocabulary when
    ``dst`` holds a wider config: the padded ids never occur in the source's training data, so they
    follow its ranked ids with count 0 in id order, and a reduced draft vocabulary of any size up to the
    widened vocabulary can be asked for (its cost is then the shape's; its MAT the source's, since the
    padded rows never win)."""
    names = [n for n in TOKENIZER_FILES if os.path.exists(os.path.join(src, n))]
    for name in names:
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    freq = os.path.join(dst, "token_frequencies.json")
    if os.path.exists(freq) and os.path.exists(os.path.join(dst, "config.json")):
        _extend_frequencies(freq, read_config(dst)[1].vocab_size)
    return names


def _extend_frequencies(path: str, vocab_size: int) -> None:
    with open(path) as fh:
        doc = json.load(fh)
    ids, counts = doc.get("token_ids"), doc.get("counts")
    if not isinstance(ids, list) or len(ids) >= vocab_size:
        return
    seen = set(ids)
    extra = [t for t in range(vocab_size) if t not in seen]
    doc["token_ids"] = ids + extra
    if isinstance(counts, list) and len(counts) == len(ids):
        doc["counts"] = counts + [0] * len(extra)
    doc["widened"] = dict(vocab_size=vocab_size, ranked_ids=len(ids), zero_count_ids=len(extra))
    with open(path, "w") as fh:
        json.dump(doc, fh)


class _Shards:
    """safetensors shards of at most ``limit`` bytes each, with the index the loader reads."""

    def __init__(self, dst: str, limit: int):
        self.dst, self.limit, self.files, self.weight_map, self.pending, self.size = dst, limit, [], {}, {}, 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if self.pending and self.size + t.numel() * t.element_size() > self.limit:
            self._flush()
        self.pending[name] = t.contiguous()
        self.size += t.numel() * t.element_size()

    def _flush(self) -> None:
        file = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, os.path.join(self.dst, file), metadata={"format": "pt"})
        self.files.append(file)
        self.weight_map.update({n: file for n in self.pending})
        self.pending, self.size = {}, 0

    def close(self) -> None:
        if not self.files:  # one file
            return save_file(self.pending, os.path.join(self.dst, "model.safetensors"), metadata={"format": "pt"})
        self._flush()
        with open(os.path.join(self.dst, INDEX_FILE), "w") as fh:
            json.dump({"metadata": {}, "weight_map": self.weight_map}, fh, indent=1)


def _write_config(src: str, dst: str, s: ModelConfig, t: ModelConfig) -> None:
    with open(os.path.join(src, "config.json")) as fh:
        raw = json.load(fh)
    text, factor = raw.get("text_config", raw), t.rotary_dim / t.head_dim
    moe_only = () if t.num_experts else ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
    for f in TARGET_FIELDS:
        if f not in ("partial_rotary_factor",) + moe_only and (f in text or getattr(t, f)):
            text[f] = list(getattr(t, f)) if f == "layer_types" else getattr(t, f)
    text.update(rms_norm_eps=t.rms_norm_eps, tie_word_embeddings=False, partial_rotary_factor=factor)
    if t.model_type != s.model_type:  # a dense source at a MoE shape: the MoE model type and class
        text["model_type"] = t.model_type
        if raw is not text:
            raw["model_type"] = MOE_TYPES.get(raw.get("model_type"), raw.get("model_type"))
        raw["architectures"] = [a.replace("Qwen3_5", "Qwen3_5Moe") for a in raw.get("architectures", [])]
    raw["tie_word_embeddings"] = False
    rope = text.get("rope_parameters") or {}
    rope["partial_rotary_factor"] = factor
    if "mrope_section" in rope:  # text-only M-RoPE sections sum to R/2: scaled by m with the rotary dims
        rope["mrope_section"] = [t.rotary_dim // s.rotary_dim * x for x in rope["mrope_section"]]
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(raw, fh, indent=2)
