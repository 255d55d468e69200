"""CUDA-graph capture of prefill forwards of up to 256 tokens by default (a request's first step, in every mode).

On a small model a short prefill is host bound: the embedded model's 13-token prompt issues ~330
launches from Python, 16.8 ms of wall time for 1.5 ms of GPU work on the H200 (``profile_step.py
--cases ar_tiny_prefill``), a sixth of an ``ar`` request and a quarter of a ``bole`` one.
``PrefillGraphs`` captures the target's prefill forward (embedding -> layers -> norm, plus the
logits of each row's last token) per key

    (Bc, Nc, Lc)   Bc: the smallest captured batch size >= the step's chunks (DecodeGraphs' sizes)
                   Nc: the smallest token bucket (16, 32, 64, 128, 256) >= the chunks' tokens + Bc - B + 1
                   Lc: the smallest KV-length bucket >= every row's keys (committed prefix + chunk) and Nc

over Bc + 1 rows: the step's B chunks first, their tokens packed in order, then padding rows B .. Bc,
each of B .. Bc-1 one token and row Bc the rest of the Nc tokens, so no row is empty. Padding rows
start at position 0 and run over the pad KV block (every block-table entry) and the pad GDN slot the
runner reserves: they read and write garbage there and nowhere else, and no real row reads them.

The captured forward reads no device value on the host: its context is ``sync_free``, so on the
"triton" backend the conv is ``kernels.causal_conv1d``, the recurrence ``kernels.gdn_recurrent`` (the
backend's ``prefill_sync_free``, whatever the length) and the attention ``kernels.tree_attention`` with
causal rows, each over the device offsets. So capture needs that backend. Eager prefills of 65 tokens
and more take fla's chunked kernels, which plan on the host (a device read per forward) and launch
several kernels per layer from Python: a 9B-cost prefill of 65-200 tokens took 80-90 ms eagerly, against
~10 ms for a captured one of up to 64 tokens (H100, 2026-12-05 served trace). The recurrence is serial in
a sequence's tokens, so the buckets stop at 256 by default (``EngineConfig.cuda_graph_prefill_tokens``,
at most ``MAX_TOKENS``); longer steps run eagerly, through fla, or (``cuda_graph_prefill_split``) as
several graphed forwards (``ModelRunner.prefill_waves``). Per GDN layer at the 9B shape (bf16, one
sequence, H100, ``prefill_fp32.py --shape qwen3.5-9b --dtype bfloat16 --op-only``) the recurrence took
104 / 203 / 407 / 787 / 1608 us at 64 / 128 / 256 / 512 / 1024 tokens and fla's eager call ~1250-1490 us
at each: a 512-token bucket would beat fla's call per layer, 1024 would not; whether 512 pays served
(the padded GEMM rows, start time, graph memory) is not measured.

Static inputs (``StaticRows``, one pinned host-to-device copy each): per row its token count, its
committed length, its GDN slot, its prefix-cache checkpoint (tokens to it, 0: none, and its slot, with
``enable_checkpoints``) and its block table; the packed token ids. Everything else is derived
inside the graph: offsets, positions, KV slots, the rows' key slots, each row's last token.

With ``capture=False`` the same static forward runs without a graph (any device, any backend): the
context's host lists are refilled each step, so the torch twins, which loop over host offsets, see
the step's real layout (CPU tests of the padding and bucketing).
"""

from __future__ import annotations

from typing import Sequence

import torch

from bole.config import PREFILL_GRAPH_MAX_TOKENS as MAX_TOKENS
from bole.config import token_buckets
from bole.engine.graphs import base
from bole.models.context import ForwardContext, PrefillCheckpoints

DEFAULT_TOKEN_SIZES = token_buckets(256)
_CNT, _POS, _SLOT, _CKEND, _CKSLOT, _TABLE = 0, 1, 2, 3, 4, 5  # columns of the per-row input buffer


def prefill_graphs_unsupported(model) -> str | None:
    """Why the model's short prefill cannot be captured (None: it can)."""
    why = base.graphs_unsupported(model)
    if why:
        return why
    backend = getattr(model, "backend", None)
    if (getattr(backend, "name", None) != "triton" or backend.tree_attention is None
            or backend.prefill_sync_free is None):
        return f"the {getattr(backend, 'name', None)!r} backend's prefill reads offsets on the host"
    return None


class PrefillGraphs(base.GraphFamily):
    """Captured short prefill forwards of one ``ModelRunner``; see the module docstring."""

    kind = "prefill"

    def __init__(self, runner, batch_sizes: Sequence[int] = base.DEFAULT_BATCH_SIZES, pad_block: int = 0,
                 pad_slot: int = 0, capture: bool = True, min_kv: int = base.DEFAULT_MIN_KV,
                 token_sizes: Sequence[int] = DEFAULT_TOKEN_SIZES, pool=None, capture_stream=None):
        super().__init__(runner, batch_sizes, runner.kv_cache, min_kv, capture, pool, capture_stream)
        tokens = sorted({int(n) for n in token_sizes})
        if not tokens or tokens[0] < 2 or tokens[-1] > MAX_TOKENS:
            raise ValueError(f"token sizes must be ints in [2, {MAX_TOKENS}], got {list(token_sizes)}")
        sizes = [b for b in self.batch_sizes if b < tokens[-1]]  # Bc + 1 rows of >= 1 token each fit the largest bucket
        if not sizes:
            raise ValueError(f"no batch size in {list(batch_sizes)} fits {tokens[-1]} tokens with its padding row")
        why = prefill_graphs_unsupported(runner.model) if capture else base.graphs_unsupported(runner.model)
        if why:
            raise ValueError(f"prefill cannot be captured for this model: {why}")
        self.batch_sizes, self.token_sizes = sizes, tokens
        self.pad_block, self.pad_slot = int(pad_block), int(pad_slot)
        dev = runner.device
        self.rows = base.StaticRows(sizes[-1] + 1, _TABLE + self.max_blocks, dev)
        self.ids = base.StaticRows(1, tokens[-1], dev)
        H, V = self.model.config.hidden_size, self.model.config.vocab_size
        dtype = self.model.lm_head.weight.dtype
        self.out_hidden = torch.zeros(tokens[-1], H, dtype=dtype, device=dev)
        self.out_logits = torch.zeros(sizes[-1] + 1, V, dtype=dtype, device=dev)
        self.checkpoints = None   # the prefix cache's checkpoint pool (``enable_checkpoints``)

    def enable_checkpoints(self, pool) -> None:
        """Let the captured prefills write prefix-cache checkpoints into ``pool`` (``ModelRunner.prefill``'s
        ``checkpoints``): before any graph is built, as every graph then carries them."""
        if self.graphs:
            raise ValueError("enable_checkpoints must precede the first graph")
        self.checkpoints = pool

    # -- selection -------------------------------------------------------------------------------
    def key(self, chunks) -> tuple[int, int, int] | None:
        """(Bc, Nc, Lc) for a prefill step of ``chunks`` [(request, tokens)], or None when no graph fits."""
        B = len(chunks)
        if not 0 < B <= self.batch_sizes[-1] or any(n < 1 for _, n in chunks):
            return None  # (an empty chunk: the eager path's context rejects it)
        Bc = base.smallest_at_least(self.batch_sizes, B)
        need = sum(n for _, n in chunks) + Bc - B + 1  # the padding rows' tokens: one each, >= 1 in the last
        if need > self.token_sizes[-1]:
            return None
        Nc = base.smallest_at_least(self.token_sizes, need)
        longest = max(max(r.num_computed + n for r, n in chunks), Nc)
        if longest > self.kv_lengths[-1]:
            return None
        return Bc, Nc, base.smallest_at_least(self.kv_lengths, longest)

    def supports(self, chunks) -> bool:
        return self.key(chunks) is not None

    # -- building --------------------------------------------------------------------------------
    def _make(self, key: tuple[int, int, int]) -> base.Graph:
        (Bc, Nc, Lc), dev, bs, runner = key, self.runner.device, self.block_size, self.runner
        R = Bc + 1
        inp, tok = self.rows.device[:R], self.ids.device[0, :Nc]
        tables = inp[:, _TABLE:_TABLE + Lc // bs]
        key_pos = torch.arange(Lc, device=dev)
        key_block, key_off = key_pos // bs, key_pos % bs
        t = torch.arange(Nc, device=dev)
        z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=dev)
        ids, positions, slot_mapping = z(Nc), z(Nc), z(Nc)
        cu, num_cached, state_slots, kv_index = z(R + 1, dtype=torch.int32), z(R), z(R), z(R, Lc)
        ctx = ForwardContext(
            mode="prefill", cu_seqlens=cu, num_cached=num_cached, positions=positions, kv_positions=positions,
            slot_mapping=slot_mapping, kv_slots=[], state_slots=state_slots, block_tables=[],
            cu_host=[0] * R + [Nc], num_cached_host=[0] * R, kv_cache=runner.kv_cache,
            state_pool=runner.state_pool, state_slots_host=[self.pad_slot] * R, sync_free=True)
        if self.checkpoints is not None:   # rows with an end of 0 (padding among them) write nothing
            ctx.checkpoints = PrefillCheckpoints(self.checkpoints, z(R, dtype=torch.int32), z(R, dtype=torch.int32))
        ctx._memo["keys"] = kv_index  # the rows' key slots (``ForwardContext.key_index``), laid out below
        model, out_h, out_l = self.model, self.out_hidden, self.out_logits

        def run():
            cnt, nc = inp[:, _CNT], inp[:, _POS]
            end = cnt.cumsum(0)
            cu[1:].copy_(end)
            row = torch.searchsorted(end, t, right=True)         # each token's row
            pos = nc[row] + t - (end - cnt)[row]
            positions.copy_(pos)
            slot_mapping.copy_(tables[row, pos // bs] * bs + pos % bs)
            num_cached.copy_(nc)
            state_slots.copy_(inp[:, _SLOT])
            kv_index.copy_(tables[:, key_block] * bs + key_off)
            if ctx.checkpoints is not None:
                ctx.checkpoints.ends.copy_(inp[:, _CKEND])
                ctx.checkpoints.slots.copy_(inp[:, _CKSLOT])
            ids.copy_(tok)
            hidden = model(ids, ctx)
            out_h[:Nc].copy_(hidden)
            out_l[:R].copy_(model.compute_logits(hidden[end - 1]))

        return base.Graph(key, run, ctx)

    def _load_padding(self, g: base.Graph) -> None:
        self._load([], g)

    def _load(self, chunks, g: base.Graph, checkpoints=None) -> None:
        """The step's rows, then the padding rows, into the static inputs (and, uncaptured, the
        context's host lists); ``checkpoints``: per chunk (tokens to its checkpoint, slot), 0 for none."""
        Bc, Nc, Lc = g.key
        R, nb = Bc + 1, Lc // self.block_size
        h, ids = self.rows.begin(), self.ids.begin()
        h[:R, _CNT] = 1
        h[:R, _POS] = 0
        h[:R, _SLOT] = self.pad_slot
        h[:R, _CKEND] = h[:R, _CKSLOT] = 0
        h[:R, _TABLE:] = self.pad_block
        at = 0
        for b, (r, n) in enumerate(chunks):
            h[b, _CNT], h[b, _POS], h[b, _SLOT] = n, r.num_computed, r.state_slot
            if checkpoints is not None:
                h[b, _CKEND], h[b, _CKSLOT] = checkpoints[b]
            tbl = r.block_table[:nb]
            h[b, _TABLE:_TABLE + len(tbl)] = tbl
            ids[0, at:at + n] = r.all_token_ids[r.num_computed:r.num_computed + n]
            at += n
        pad = Nc - at - (Bc - len(chunks))  # the last padding row's tokens (>= 1 by ``key``)
        h[Bc, _CNT] = pad
        ids[0, at:Nc] = 0
        self.rows.upload(R)
        self.ids.upload(1)
        if not self.capturing:
            self._host_lists(g.ctx, h[:R], Lc)

    def _host_lists(self, ctx: ForwardContext, h, Lc: int) -> None:
        """The uncaptured forward's host copies of the layout (what the torch twins read)."""
        cnt, nc = [int(x) for x in h[:, _CNT]], [int(x) for x in h[:, _POS]]
        for b in range(len(cnt)):
            ctx.cu_host[b + 1] = ctx.cu_host[b] + cnt[b]
        ctx.num_cached_host[:] = nc
        ctx.state_slots_host[:] = [int(x) for x in h[:, _SLOT]]
        tables = [[int(x) for x in row[_TABLE:_TABLE + Lc // self.block_size]] for row in h]
        ctx.block_tables[:] = tables
        cache, dev = self.runner.kv_cache, self.runner.device
        ctx.kv_slots[:] = [cache.slots_for(tbl, torch.arange(c + n)).to(dev)
                           for tbl, c, n in zip(tables, nc, cnt, strict=True)]

    def _keys_upto(self, max_batch: int | None, max_len: int | None) -> list[tuple[int, int, int]]:
        return [(Bc, Nc, Lc) for Bc in base.sizes_upto(self.batch_sizes, max_batch) for Nc in self.token_sizes
                if Nc >= Bc + 1
                for Lc in base.sizes_upto(self.kv_lengths, None if max_len is None else max(Nc, max_len)) if Lc >= Nc]

    @torch.inference_mode()
    def run(self, chunks, checkpoints=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill forward of ``chunks`` (``supports(chunks)`` must hold): K/V written, GDN states
        and conv windows advanced as in the eager prefill (num_computed is not advanced), and with
        ``checkpoints`` (per chunk: tokens to its checkpoint, 0 for none, and its slot) the states there
        written to the checkpoint pool. Returns (hidden [N, H] of the chunks' packed tokens, logits
        [B, V] of each chunk's last token), copies."""
        if checkpoints is not None and self.checkpoints is None:
            raise ValueError("these prefill graphs write no checkpoints (enable_checkpoints)")
        g = self.graph(self.key(chunks))
        self._load(chunks, g, checkpoints)
        self.replay(g)
        N = sum(n for _, n in chunks)
        return self.out_hidden[:N].clone(), self.out_logits[:len(chunks)].clone()
