"""The one place where GDN compute backends are chosen (STYLE item 4).

A ``GDNBackend`` bundles the sequence/tree operations a GDN layer needs, all with the
signatures of the naive twins in ``bole.ops`` (flash-linear-attention conventions, states stored
transposed [.., V, K]):

    prefill(q, k, v, g, beta, scale, initial_state, state_indices, cu_seqlens, use_qk_l2norm)
        -> (o [1, N, HV, V], final_state [B, HV, V, K])              (reads the pool, never writes)
    decode_step(q, k, v, a, b, A_log, dt_bias, ssm_state, state_indices)
        -> o [N, HV, V]; the pool updated in place                    one token per sequence, batched,
                                                                      gating (g, beta) from the raw a / b
                                                                      projections; no host sync
    conv_update(x, weight, conv_state, state_indices) -> y [N, C]    the decode conv (state in place)
    tree_verify(q, k, v, g, beta, forest, initial_state, state_indices, scale, use_qk_l2norm,
                u_out, logp_out)
        -> (o, u [N, HV, V], logp [N, HV])                            closed form, read only; u / logp
                                                                      into the given out buffers
    tree_conv(x, weight, conv_state, state_indices, forest, a, b, A_log, dt_bias, bias, activation,
              out, x_copy) -> (y or out, g, beta)                     verify's conv along the tree paths
                                                                      (pool read only; y split into the
                                                                      given q | k | v buffers, x copied
                                                                      into x_copy) and its gating
    commit(state_pool, k, u, logp, accepted_nodes, state_indices, use_qk_l2norm)
        -> state_pool, updated in place for all layers at once        eq. (10)

Registered backends:
    "torch":  bole.ops twins; chunked WY prefill (bole.ops.gdn_chunk), batched single-step decode
              (bole.ops.gdn_decode), torch norms, attention prologue and gated activations, a loop over the
              routed experts of MoE blocks (bole.ops.moe: it reads the expert list on the host).
    "triton": kernels.gdn_tree_verify / kernels.gdn_commit (and kernels.gdn_tree_serial for the
              serial_tree baseline); verify's conv and gating with kernels.gdn_tree_conv; prefill with
              kernels.gdn_recurrent below 65 tokens (and in fp32 when fla is taken) and at any length in
              captured prefills (``prefill_sync_free``), else flash-linear-attention's
              chunk_gated_delta_rule when importable (else the torch chunk), its conv with
              kernels.causal_conv1d;
              decode and its conv with kernels.gdn_decode; norms with kernels.rmsnorm; the graphed
              decode's attention with kernels.paged_decode_attention (keys read in place from the
              paged cache); the attention prologue (q / k norms, RoPE, KV store) with
              kernels.qk_norm_rope; x · silu / sigmoid(gate) (MLP, MoE, attention output gate) with
              kernels.act_mul; verify-mode tree attention (the target's verify forward and the drafter's
              forwards over the frontier forest; keys read in place, split over the prefix) with
              kernels.tree_attention; the graphed speculative step's forest layouts with kernels.tree_layout and its
              greedy acceptance with kernels.greedy_accept; the drafter's per-level top-k of log-softmax with
              kernels.logits_topk; a MoE block's routed experts with kernels.moe_experts (no host read: graphs
              capture MoE models). The lm_heads stay torch's GEMM: on a contiguous 2D input cuBLAS reads the
              weight once (benchmarks/draft_logits.py).
    "auto":   "triton" on CUDA when the kernels import, else "torch". Resolved once, logged.

The "triton" backend's per-layer kernels whose arguments include what every layer of a forward shares
(state slots, positions, KV slots, forest, token offsets, key layouts and lengths: tree_conv, tree_verify,
conv_update, decode_step, qk_norm_rope_store, prefill_conv, the recurrent prefill, decode_attention,
tree_attention) are taken with ``checked=True`` (``context_checked``): the layers' ``ForwardContext``
checks those once per forward (``ForwardContext.check_kernel_inputs``), and each launch checks only its
own tensors. Called directly, the kernels check everything.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from bole.ops.accept import greedy_accept_ref
from bole.ops.activation import act_mul_ref
from bole.ops.conv import causal_conv1d_varlen_ref, gdn_tree_conv_ref
from bole.ops.gdn import gdn_commit_ref, gdn_tree_serial_ref, gdn_tree_verify_ref
from bole.ops.gdn_chunk import gdn_chunk
from bole.ops.gdn_decode import causal_conv1d_update_ref, gdn_decode_step_ref
from bole.ops.moe import moe_experts_ref
from bole.ops.rope import qk_norm_rope_store_ref
from bole.ops.topk import log_softmax_topk_ref
from bole.ops.tree_layout import tree_layout_ref
from bole.spec.sampling import TreeAcceptance

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GDNBackend:
    name: str
    prefill: Callable
    decode_step: Callable
    conv_update: Callable
    tree_verify: Callable
    commit: Callable
    tree_serial: Callable = gdn_tree_serial_ref  # the serial_tree baseline (per-node snapshots)
    tree_conv: Callable = gdn_tree_conv_ref   # verify's conv along the tree paths + gating (kernels.gdn_tree_conv)
    prefill_conv: Callable = causal_conv1d_varlen_ref  # prefill's conv over packed sequences (kernels.causal_conv1d)
    rms_norm: Callable | None = None          # fused norms (kernels.rmsnorm); None: the torch twins
    gated_rms_norm: Callable | None = None
    decode_attention: Callable | None = None  # paged decode attention (kernels.paged_decode_attention)
    tree_attention: Callable | None = None    # verify-mode attention, target and drafter (kernels.tree_attention)
    qk_norm_rope_store: Callable = qk_norm_rope_store_ref  # attention prologue (kernels.qk_norm_rope)
    act_mul: Callable = act_mul_ref            # x · silu / sigmoid(gate): MLP, MoE, attention output gate
    tree_layout: Callable = tree_layout_ref   # a graphed step's forest layout (kernels.tree_layout)
    greedy_accept: Callable = greedy_accept_ref  # the verify tail's greedy tree walk (kernels.greedy_accept)
    log_softmax_topk: Callable = log_softmax_topk_ref  # the drafter's children per level (kernels.logits_topk)
    moe_experts: Callable = moe_experts_ref   # a MoE block's routed experts (kernels.moe_experts: no host read)
    # a prefill at any length that reads no device value on the host (kernels.gdn_recurrent), what the
    # captured prefills take (``ForwardContext.sync_free``); None: ``prefill`` (the twins, run uncaptured)
    prefill_sync_free: Callable | None = None


_REGISTRY: dict[str, Callable[[], GDNBackend]] = {}


def register_backend(name: str):
    def deco(factory: Callable[[], GDNBackend]):
        _REGISTRY[name] = factory
        return factory
    return deco


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


@register_backend("torch")
def _torch_backend() -> GDNBackend:
    return GDNBackend("torch", prefill=gdn_chunk, decode_step=gdn_decode_step_ref,
                      conv_update=causal_conv1d_update_ref, tree_verify=gdn_tree_verify_ref,
                      commit=gdn_commit_ref)


def fla_prefill():
    """Wrap fla's chunk_gated_delta_rule (state [N, H, K, V], no slot indices) into our signature."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    # fla plans a varlen call's chunks on the host (prepare_chunk_indices / _offsets: a device read each)
    # and memoises the plans by the identity of ``cu_seqlens``. Every GDN layer of a forward gets the
    # context's one int32 tensor; its int64 copy is made once per forward here, so fla plans once per
    # forward, not once per layer (24 syncs at 9B; ``test_fla_prefill_plans_once_per_forward``).
    memo: dict = {}

    def long_offsets(cu: torch.Tensor) -> torch.Tensor:
        if memo.get("src") is not cu:
            memo["src"], memo["long"] = cu, cu.long()
        return memo["long"]

    def prefill(q, k, v, g, beta, scale=None, initial_state=None, state_indices=None, cu_seqlens=None,
                use_qk_l2norm=False):
        HK, HV = q.shape[2], v.shape[2]
        if HV != HK:  # fla versions differ in GQA support; expand keys to value heads ourselves
            q = q.repeat_interleave(HV // HK, dim=2)
            k = k.repeat_interleave(HV // HK, dim=2)
        B = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
        init = None
        if initial_state is not None:
            idx = torch.arange(B, device=q.device) if state_indices is None else state_indices.long()
            init = initial_state[idx].transpose(-1, -2).float().contiguous()  # [B, HV, K, V]
        o, final = chunk_gated_delta_rule(
            q, k, v, g.float(), beta, scale=scale, initial_state=init, output_final_state=True,
            cu_seqlens=None if cu_seqlens is None else long_offsets(cu_seqlens),
            use_qk_l2norm_in_kernel=use_qk_l2norm)
        return o, final.transpose(-1, -2)
    return prefill


def context_checked(kernel: Callable, **kw) -> Callable:
    """``kernel`` with ``checked=True``: for the layers, whose forward context checked the shared arguments
    (see the module docstring)."""
    return functools.partial(kernel, checked=True, **kw)


def tree_acceptance(kernel: Callable) -> Callable:
    """``kernel`` (kernels.greedy_accept, which returns TreeAcceptance's fields as a tuple) with the
    twin's result type."""
    @functools.wraps(kernel)
    def accept(*args, **kw) -> TreeAcceptance:
        return TreeAcceptance(*kernel(*args, **kw))
    return accept


def topk_within(kernel: Callable, max_v: int, max_k: int) -> Callable:
    """``kernel`` (kernels.logits_topk) for rows of at most ``max_v`` logits and k <= ``max_k``, the
    twin past them (rows that do not fit the kernel's tile); malformed arguments reach the kernel's
    checks."""
    @functools.wraps(kernel)
    def topk(logits, k):
        if (isinstance(logits, torch.Tensor) and logits.dim() >= 1 and isinstance(k, int)
                and (logits.shape[-1] > max_v or max_k < k <= logits.shape[-1])):
            return log_softmax_topk_ref(logits, k)
        return kernel(logits, k)
    return topk


FLA_MIN_TOKENS = 65


def short_to_recurrent(long_prefill, min_tokens: int = FLA_MIN_TOKENS, fp32_to_recurrent: bool = True,
                       recurrent: Callable | None = None):
    """Prefills of fewer than ``min_tokens`` tokens (in the whole batch), those that write prefix-cache
    checkpoints (``ckpt_state``: fla's chunk keeps no state inside a sequence), and with ``fp32_to_recurrent``
    (``long_prefill`` is fla's) every prefill of fp32 activations, through the Triton recurrence
    (``kernels.gdn_recurrent``, one launch per layer); the others through ``long_prefill``. For short
    prefills the launch count decides: fla's chunk (many kernels behind its compile guards) measured
    62 ms and the torch chunk 33 ms for a 13-token prompt of the embedded model on the H200, both
    host-bound (first engine step of ``profile_step.py --cases ar_tiny_generate``). The crossover to
    fla was not measured. fp32: fla's chunk takes TF32 products for fp32 inputs, and put our fp32
    model 1.5e-2 (max-relative logits) from transformers' fp32 forward on the CPU after a 70-token
    prefill on the H200 (2026-12-02, tests/models/test_gpu.py); the recurrence is fp32 throughout.
    ``recurrent``: the backend's checked recurrence (its ``prefill_sync_free``); None builds it. The layers
    route short prefills to ``prefill_sync_free`` themselves (``ForwardContext.sync_free``, set by the
    same ``FLA_MIN_TOKENS``): the length test here serves direct callers (benchmarks, tests)."""
    if recurrent is None:
        from kernels.gdn_recurrent import gdn_recurrent
        recurrent = context_checked(gdn_recurrent)   # the layers' prefill: offsets and slots checked per forward

    def prefill(q, k, v, g, beta, **kw):
        if q.shape[1] < min_tokens or (fp32_to_recurrent and q.dtype == torch.float32) \
                or kw.get("ckpt_state") is not None:   # checkpoints inside a sequence: the recurrence's
            return recurrent(q, k, v, g, beta, **kw)
        return long_prefill(q, k, v, g, beta, **kw)
    return prefill


@register_backend("triton")
def _triton_backend() -> GDNBackend:
    from kernels._checks import interpreting
    from kernels.act_mul import act_mul
    from kernels.causal_conv1d import causal_conv1d_varlen
    from kernels.gdn_commit import gdn_commit as triton_commit
    from kernels.gdn_decode import causal_conv1d_update, gdn_decode_step
    from kernels.gdn_recurrent import gdn_recurrent
    from kernels.gdn_tree_conv import gdn_tree_conv
    from kernels.gdn_tree_serial import gdn_tree_serial as triton_serial
    from kernels.gdn_tree_verify import gdn_tree_verify as triton_verify
    from kernels.greedy_accept import greedy_accept
    from kernels.logits_topk import MAX_K, MAX_V, log_softmax_topk
    from kernels.moe_experts import moe_experts
    from kernels.paged_decode_attention import paged_decode_attention
    from kernels.qk_norm_rope import qk_norm_rope_store
    from kernels.rmsnorm import gated_rms_norm, rms_norm
    from kernels.tree_attention import tree_attention
    from kernels.tree_layout import tree_layout

    long_prefill, prefill_name = gdn_chunk, "torch chunk"
    # fla's kernels need a GPU driver: under the Triton interpreter (CPU tests) the torch chunk
    if torch.cuda.is_available() and not interpreting():
        try:
            long_prefill, prefill_name = fla_prefill(), "fla.chunk_gated_delta_rule"
        except Exception as e:  # absent, or an fla that does not import against this torch / triton
            logger.warning("GDN triton backend: flash-linear-attention unavailable (%s); torch chunk prefill", e)
    # the torch chunk (CPU tests) is exact in fp32: only fla's TF32 products send fp32 to the recurrence
    fla = long_prefill is not gdn_chunk
    # one checked recurrence: the short / fp32 prefills' and the captured prefills' (prefill_sync_free)
    recurrent = context_checked(gdn_recurrent)
    prefill = short_to_recurrent(long_prefill, fp32_to_recurrent=fla, recurrent=recurrent)
    logger.info("GDN triton backend: prefill via kernels.gdn_recurrent below %d tokens%s, else %s",
                FLA_MIN_TOKENS, " or in fp32" if fla else "", prefill_name)
    # the measured per-shape launch tables (kernels.gdn_tree_verify_launch.TUNED_LOWP for half-precision q/k,
    # TUNED_FP32 for fp32)
    tree_verify = context_checked(triton_verify, tuned=True)
    return GDNBackend("triton", prefill=prefill, decode_step=context_checked(gdn_decode_step),
                      conv_update=context_checked(causal_conv1d_update), tree_verify=tree_verify,
                      prefill_conv=context_checked(causal_conv1d_varlen), commit=triton_commit,
                      tree_serial=triton_serial, tree_conv=context_checked(gdn_tree_conv), rms_norm=rms_norm,
                      gated_rms_norm=gated_rms_norm, decode_attention=context_checked(paged_decode_attention),
                      tree_attention=context_checked(tree_attention),
                      qk_norm_rope_store=context_checked(qk_norm_rope_store), act_mul=act_mul, tree_layout=tree_layout,
                      greedy_accept=tree_acceptance(greedy_accept),
                      log_softmax_topk=topk_within(log_softmax_topk, MAX_V, MAX_K), moe_experts=moe_experts,
                      prefill_sync_free=recurrent)


def resolve_backend(name: str = "auto", device: torch.device | str | None = None) -> GDNBackend:
    """Resolve a backend name ("auto" picks by device) once; log the choice."""
    if name == "auto":
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        if dev.type == "cuda":
            try:
                backend = _REGISTRY["triton"]()
            except ImportError as e:
                logger.warning("GDN backend auto: triton kernels unavailable (%s); using torch twins", e)
                backend = _REGISTRY["torch"]()
        else:
            backend = _REGISTRY["torch"]()
        logger.info("GDN backend auto -> %s (device %s)", backend.name, dev)
        return backend
    if name not in _REGISTRY:
        raise ValueError(f"unknown GDN backend {name!r}; available: {available_backends() + ['auto']}")
    backend = _REGISTRY[name]()
    logger.info("GDN backend %s", backend.name)
    return backend
