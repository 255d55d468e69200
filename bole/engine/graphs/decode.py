"""CUDA-graph capture of the target model's autoregressive decode forward (one token per request).

An eager decode step on a GPU is launch bound at small batches: ~15 kernels per layer, each issued by
Python, plus the host-side ``ForwardContext`` and the per-request attention loop. ``DecodeGraphs``
captures the whole step (embedding → layers → norm → lm_head) once per *graph key* and replays it:

    key = (Bc, Lc)   Bc: the smallest captured batch size >= the step's batch (``batch_sizes``,
                     e.g. 1, 2, 4, 8, 16, 32); larger batches run eagerly.
                     Lc: a KV-length bucket, the smallest of min_kv, 2·min_kv, ... (multiples of the
                     block size, up to the cache's capacity) >= the longest request's length + 1.
                     Attention in a graph reads Lc key positions per row (masked past each row's
                     length), so a short batch does not pay for the cache's full capacity.

Graphs are captured lazily, the first time a key is needed, into one shared memory pool.

Static inputs (``StaticRows``: one int64 device buffer [max_batch, 3 + max_blocks], written by ONE
host-to-device copy from a pinned host mirror per step): per row the token id, num_cached (the new
token's position), the GDN state slot and the block table (padded with the pad block). Everything
else is derived INSIDE the graph from them: positions, the new token's KV slot, the [Bc, Lc] key
slots and their validity mask (``bole.models.context.StaticDecode``). Padding rows (the step's batch
up to Bc) carry token 0 at position 0, the pad block and the pad state slot: a KV block and a GDN
slot the runner reserves for them, so padding never touches a request's cache. Outputs (hidden
states and logits) are copied in the graph into buffers allocated outside the graph pool.

Nothing in a captured forward reads a device value on the host: the context is built once per key
over the static buffers (``ForwardContext.static``), attention runs one batched SDPA call over padded
keys, the GDN layers use the batched one-token conv (``bole.ops.conv.causal_conv1d_decode``) and the
backend's ``decode`` (``bole.ops.gdn_chunk.gdn_decode``), the same ops the eager decode runs.

Not captured (eager fallback, decided per step by ``supports``): batches above the largest captured
size, MoE models on the torch backend (its expert loop reads the routed experts on the host;
kernels.moe_experts, the triton backend's, does not), tensor parallelism.

With ``capture=False`` the same static forward runs without a graph (any device): it tests the
padding and bucketing logic on CPU and gives the benchmark an "uncaptured static" reference.
"""

from __future__ import annotations

from typing import Sequence

import torch

from bole.engine.graphs.base import (
    _POS,
    _SLOT,
    _TABLE,
    _TOK,
    DEFAULT_BATCH_SIZES,
    DEFAULT_MIN_KV,
    Graph,
    GraphFamily,
    StaticRows,
    graphs_unsupported,
    sizes_upto,
    smallest_at_least,
)
from bole.models.context import ForwardContext, StaticDecode


class DecodeGraphs(GraphFamily):
    """Captured decode forwards of one ``ModelRunner``; see the module docstring."""

    kind = "decode"

    def __init__(self, runner, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, pad_block: int = 0,
                 pad_slot: int = 0, capture: bool = True, min_kv: int = DEFAULT_MIN_KV):
        super().__init__(runner, batch_sizes, runner.kv_cache, min_kv, capture)
        why = graphs_unsupported(runner.model)
        if why:
            raise ValueError(f"decode cannot be captured for this model: {why}")
        self.pad_block, self.pad_slot = int(pad_block), int(pad_slot)
        dev, Bm = runner.device, self.batch_sizes[-1]
        self.rows = StaticRows(Bm, _TABLE + self.max_blocks, dev)
        H, V = self.model.config.hidden_size, self.model.config.vocab_size
        dtype = self.model.lm_head.weight.dtype
        self.out_hidden = torch.zeros(Bm, H, dtype=dtype, device=dev)
        self.out_logits = torch.zeros(Bm, V, dtype=dtype, device=dev)

    # -- selection -------------------------------------------------------------------------------
    def supports(self, reqs) -> bool:
        """Whether this step can run from a graph (batch within the captured sizes, KV within the cache)."""
        return 0 < len(reqs) <= self.batch_sizes[-1] and \
            max(r.num_computed for r in reqs) < self.kv_lengths[-1]

    def key(self, batch: int, max_len: int) -> tuple[int, int]:
        """(Bc, Lc) for a step of ``batch`` requests whose longest has ``max_len`` keys (new token included)."""
        return smallest_at_least(self.batch_sizes, batch), smallest_at_least(self.kv_lengths, max_len)

    # -- building --------------------------------------------------------------------------------
    def _make(self, key: tuple[int, int]) -> Graph:
        (Bc, Lc), dev, bs, runner = key, self.runner.device, self.block_size, self.runner
        inp = self.rows.device[:Bc]
        tables = inp[:, _TABLE:_TABLE + Lc // bs]
        pos = torch.arange(Lc, device=dev)
        key_block, key_off = pos // bs, pos % bs
        ids = torch.zeros(Bc, dtype=torch.long, device=dev)
        positions = torch.zeros(Bc, dtype=torch.long, device=dev)
        slot_mapping = torch.zeros(Bc, dtype=torch.long, device=dev)
        state_slots = torch.zeros(Bc, dtype=torch.long, device=dev)
        static = StaticDecode(kv_index=torch.zeros(Bc, Lc, dtype=torch.long, device=dev),
                              kv_valid=torch.zeros(Bc, Lc, dtype=torch.bool, device=dev),
                              kv_len=torch.zeros(Bc, dtype=torch.long, device=dev))
        ctx = ForwardContext(
            mode="decode", cu_seqlens=torch.arange(Bc + 1, dtype=torch.int32, device=dev),
            num_cached=inp[:, _POS], positions=positions, kv_positions=positions, slot_mapping=slot_mapping,
            kv_slots=[], state_slots=state_slots, block_tables=[], cu_host=list(range(Bc + 1)),
            num_cached_host=[], kv_cache=runner.kv_cache, state_pool=runner.state_pool, static=static)
        model, out_h, out_l = self.model, self.out_hidden, self.out_logits

        def run():
            nc = inp[:, _POS]
            ids.copy_(inp[:, _TOK])
            state_slots.copy_(inp[:, _SLOT])
            positions.copy_(nc)
            block = tables.gather(1, (nc // bs)[:, None])[:, 0]
            slot_mapping.copy_(block * bs + nc % bs)
            static.kv_index.copy_(tables[:, key_block] * bs + key_off)
            static.kv_valid.copy_(pos[None, :] <= nc[:, None])
            static.kv_len.copy_(nc + 1)
            hidden = model(ids, ctx)
            out_h[:Bc].copy_(hidden)
            out_l[:Bc].copy_(model.compute_logits(hidden))

        return Graph(key, run, ctx)

    def _load_padding(self, g: Graph) -> None:
        self._load([], *g.key)

    def _load(self, reqs, Bc: int, Lc: int) -> None:
        """The step's rows (and padding rows) into the static inputs."""
        self.rows.fill_roots(reqs, Bc, Lc // self.block_size, self.pad_slot, self.pad_block)
        self.rows.upload(Bc)

    def _keys_upto(self, max_batch: int | None, max_len: int | None) -> list[tuple[int, int]]:
        return [(Bc, Lc) for Bc in sizes_upto(self.batch_sizes, max_batch)
                for Lc in sizes_upto(self.kv_lengths, max_len)]

    @torch.inference_mode()
    def prepare(self, reqs) -> Graph:
        """Load the step's inputs into the static buffers; return the graph to replay (captured if new)."""
        g = self.graph(self.key(len(reqs), max(r.num_computed for r in reqs) + 1))
        self._load(reqs, *g.key)
        return g

    @torch.inference_mode()
    def run(self, reqs) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode forward of ``reqs`` (state committed as in eager decode); returns (logits [B, V],
        hidden [B, H]) as views of the static outputs: valid until the next replay."""
        g = self.prepare(reqs)
        self.replay(g)
        B = len(reqs)
        return self.out_logits[:B], self.out_hidden[:B]
