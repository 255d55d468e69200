"""Gated DeltaNet layer (Qwen3.5 projections; Qwen3-Next's fused ones are split by the loader).

    [q | k | v] = conv1d_causal(in_proj_qkv x) then silu       (depthwise, kernel W, state W-1)
    z = in_proj_z x;  beta = sigmoid(in_proj_b x);  g = -exp(A_log) · softplus(in_proj_a x + dt_bias)
    o = GDN(l2norm(q)/√K, l2norm(k), v, g, beta)                (eq. 1; GQA: HV = r·HK)
    y = out_proj(GatedRMSNorm(o) · silu(z))                     (per value head)

Modes (``ctx.mode``):
    prefill: conv over each request's new tokens continuing from the conv pool (updated in place);
        GDN from the ssm pool slot through the backend's prefill (its ``prefill_sync_free`` in a
        ``sync_free`` context: captured prefills); final state written back.
    decode (eager, or over a static context ``ctx.static`` for CUDA graphs): one token per request,
        the backend's ``conv_update`` and ``decode_step`` (gating, q/k norm, one recurrence step, the
        pool slot updated in place), neither of which reads a device value on the host.
    verify: tree conv and closed-form tree GDN reading the committed pools only, through the
        backend's ``tree_conv`` (conv along the tree paths and gating, one launch on the GPU) and
        ``tree_verify``; the commit factors (raw k, u, logP, conv inputs) are written in place into
        ``ctx.factors`` at the layer's GDN index by those two calls (no copies).

Tensor parallel: the q/k/v segments of in_proj_qkv (and the conv channels with them), in_proj_z,
in_proj_b, in_proj_a, A_log, dt_bias are split by heads (column parallel), out_proj is row parallel.
Value heads must divide over the ranks; with fewer key heads than ranks each rank holds the one
(replicated) key head its value heads read (``bole.parallel.head_range``).
"""

from __future__ import annotations

import torch
from torch import nn

from bole.layers.linear import FusedLinear
from bole.layers.norm import GatedRMSNorm
from bole.ops.gdn import gdn_gating
from bole.parallel import local_heads, split_heads


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg, gdn_index: int, backend, tp_size: int = 1):
        super().__init__()
        self.gdn_index, self.backend = gdn_index, backend
        self.num_k_heads = local_heads(cfg.linear_num_key_heads, tp_size)
        self.num_v_heads = split_heads(cfg.linear_num_value_heads, tp_size, "GDN value")
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        H, W = cfg.hidden_size, cfg.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(H, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, W, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)
        self.in_proj: FusedLinear | None = None

    def fuse_projections(self) -> None:
        """One GEMM for in_proj_qkv | in_proj_z | in_proj_b | in_proj_a (``bole.layers.linear``)."""
        self.in_proj = FusedLinear([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        N = x.shape[0]
        ctx.check_kernel_inputs()  # the shared slots / forest, once per forward (the kernels skip them)
        if self.in_proj is not None:
            mixed, z, b, a = self.in_proj(x)  # column views of one [N, conv_dim + value_dim + 2 HV] GEMM
        else:
            mixed, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        z = z.view(N, self.num_v_heads, self.head_v_dim)
        pool, i = ctx.state_pool, self.gdn_index
        weight = self.conv1d.weight[:, 0, :]
        split = lambda y: (y[:, :self.key_dim].view(N, self.num_k_heads, self.head_k_dim),
                           y[:, self.key_dim:2 * self.key_dim].view(N, self.num_k_heads, self.head_k_dim),
                           y[:, 2 * self.key_dim:].view(N, self.num_v_heads, self.head_v_dim))
        if ctx.mode == "decode":
            # one token per request, batched, no host sync (eager or graphed): the conv window update
            # and one recurrence step with its gating, each one launch on the GPU (kernels.gdn_decode)
            q, k, v = split(self.backend.conv_update(mixed, weight, pool.conv[i], ctx.state_slots))
            o = self.backend.decode_step(q, k, v, a, b, self.A_log, self.dt_bias, pool.ssm[i], ctx.state_slots)
            return self.out_proj(self.norm(o.to(x.dtype), z).reshape(N, self.value_dim))

        if ctx.mode == "verify":
            o = self._verify(mixed, a, b, weight, ctx)
        else:
            g, beta = gdn_gating(a, b, self.A_log, self.dt_bias)
            ck = ctx.checkpoints   # the prefix cache's boundary states, written from inside the conv and recurrence
            # one launch on "triton" (kernels.causal_conv1d); the twin loops over the sequences on the host,
            # with the context's host copies of the offsets and slots (no device read)
            y = self.backend.prefill_conv(mixed, weight, pool.conv[i], ctx.state_slots, ctx.cu_seqlens,
                                          cu_host=ctx.cu_host, slots_host=ctx.state_slots_host,
                                          **(ck.conv_args(i) if ck is not None else {}))
            q, k, v = (t[None] for t in split(y))
            # a checkpointing prefill takes the recurrence at any length (fla's chunk keeps no state inside a
            # sequence); the engine sends it long eager prefills only as a chunk and then a tail
            sync_free = (ctx.sync_free or ck is not None) and self.backend.prefill_sync_free is not None
            prefill = self.backend.prefill_sync_free if sync_free else self.backend.prefill
            o, final = prefill(q, k, v, g[None], beta[None], initial_state=pool.ssm[i],
                               state_indices=ctx.state_slots, cu_seqlens=ctx.cu_seqlens, use_qk_l2norm=True,
                               **(ck.ssm_args(i) if ck is not None else {}))
            pool.ssm[i, ctx.state_slots] = final.to(pool.ssm.dtype)
        o = self.norm(o[0].to(x.dtype), z)
        return self.out_proj(o.reshape(N, self.value_dim))

    def _verify(self, mixed, a, b, weight, ctx) -> torch.Tensor:
        """Verify mode, o [1, N, HV, V]: the pools are read only, the commit's factors written in place.

        The backend's ``tree_conv`` (one launch on the GPU) convolves along the tree paths straight into
        q, k, v buffers as the verifiers read them (contiguous; k is this layer's slice of the factor
        buffer), computes the gating and copies the conv inputs into ``factors.conv_x``; the closed-form
        verifier writes u and logP into the factor buffer, so no factor is copied afterwards.
        """
        N, i, f, pool = mixed.shape[0], self.gdn_index, ctx.factors, ctx.state_pool
        q = mixed.new_empty(N, self.num_k_heads, self.head_k_dim)
        v = mixed.new_empty(N, self.num_v_heads, self.head_v_dim)
        k = f.k[i] if f.k.dtype == mixed.dtype else torch.empty_like(q)  # a factor buffer of another dtype: copy
        _, g, beta = self.backend.tree_conv(mixed, weight, pool.conv[i], ctx.state_slots, ctx.forest, a, b,
                                            self.A_log, self.dt_bias, out=(q.view(N, -1), k.view(N, -1), v.view(N, -1)),
                                            x_copy=f.conv_x[i])
        if f.k.dtype != mixed.dtype:
            f.k[i] = k
        q, k, v, g, beta = q[None], k[None], v[None], g[None], beta[None]
        if f.snapshots is not None:
            # serial_tree baseline: per-node state snapshots, committed by copy
            o, snaps = self.backend.tree_serial(q, k, v, g, beta, ctx.forest, pool.ssm[i], ctx.state_slots,
                                                use_qk_l2norm=True)
            f.snapshots[i] = snaps
            return o
        o, _, _ = self.backend.tree_verify(q, k, v, g, beta, ctx.forest, pool.ssm[i], ctx.state_slots,
                                           use_qk_l2norm=True, u_out=f.u[i], logp_out=f.logp[i])
        return o
