"""CUDA-graph capture of the target's tree-verification forward (the speculative modes' big forward).

The verify forward of a speculative step is launch bound on a GPU exactly like an eager decode step
(~90 kernels per layer at batch 1), and it is the step's largest forward. ``VerifyGraphs`` captures it
once per graph key and replays it:

    key = (Bc, Tc, Lc)   Bc: the smallest captured batch size >= the step's batch;
                         Tc: the smallest captured tree width >= 1 + the widest tree's drafts (every
                             request's tree is padded to Tc nodes: extra children of the root that
                             carry token 0 and are never accepted, ``accept_tree`` seeing them as
                             padding);
                         Lc: a KV-length bucket >= the longest request's committed length + Tc.

Static inputs: the decode graphs' pinned-host → device row buffer (root token, num_cached, GDN
state slot, block table per row, ONE host-to-device copy per step) plus two device buffers the step's
``DraftBatch`` is copied into on the device (draft tokens and parents, no host round trip). Inside
the graph, from those: the flat node tokens, the forest layout (``PackedForest.full_padded``: depths,
ancestor chains and bitmasks), positions, KV write slots, the [Bc, Lc] key slots and the
[Bc, 1, Tc, Lc] prefix + ancestor-or-self mask (``PaddedAttention``); then the model and the lm_head.
The GDN layers run the same tree conv and closed-form verifier as eagerly (their launches take only
shapes and device pointers), and store the commit factors in the runner's factor buffer.

Padding rows (Bc > B) use the runner's pad KV block and pad state slot, like the decode graphs, and
are never committed (their accepted node is -1). A real request's padding nodes write K/V at
num_cached + local index (< num_cached + lookahead, past everything committed) and are overwritten
by later steps, as rejected nodes are.

The tree depth bound Dc (``max_depth``, the drafter's depth + 1 with the root) is fixed per graph, so
the verifier runs Dc Neumann rounds whatever the step's trees look like (exact either way).

``capture=False`` runs the same static forward without a graph (any device: CPU tests).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from bole.engine.cuda_graphs import _POS, _SLOT, _TABLE, _TOK, kv_buckets
from bole.models.context import ForwardContext, PaddedAttention
from bole.spec.tree import PackedForest

logger = logging.getLogger(__name__)

DEFAULT_TREE_SIZES = (8, 16, 32, 64, 128)


def tree_widths(lookahead: int, sizes: Sequence[int] = DEFAULT_TREE_SIZES) -> list[int]:
    """The captured tree widths (nodes per request, root included): ``sizes`` up to the lookahead, and
    the lookahead itself (the widest tree the engine can verify)."""
    out = sorted({int(t) for t in sizes if 2 <= int(t) < lookahead} | {int(lookahead)})
    return out


@dataclass
class _VGraph:
    batch: int
    width: int
    kv_len: int
    ctx: ForwardContext
    run: Callable[[], None]
    graph: "torch.cuda.CUDAGraph | None" = None


class VerifyGraphs:
    """Captured verify forwards of one ``ModelRunner``; see the module docstring."""

    def __init__(self, runner, batch_sizes: Sequence[int], tree_sizes: Sequence[int], max_depth: int,
                 pad_block: int, pad_slot: int, capture: bool = True, min_kv: int = 256, pool=None):
        sizes = sorted({int(b) for b in batch_sizes})
        widths = sorted({int(t) for t in tree_sizes})
        if not sizes or sizes[0] < 1 or not widths or widths[0] < 2:
            raise ValueError(f"batch sizes must be >= 1 and tree widths >= 2, got {list(batch_sizes)}, "
                             f"{list(tree_sizes)}")
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2 (root + one draft level), got {max_depth}")
        if capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the runner is on {runner.device}")
        self.runner, self.model = runner, runner.model
        self.batch_sizes, self.widths, self.max_depth, self.capture = sizes, widths, int(max_depth), capture
        self.pad_block, self.pad_slot = int(pad_block), int(pad_slot)
        kv = runner.kv_cache
        self.block_size = bs = kv.block_size
        self.kv_lengths = kv_buckets(min_kv, kv.num_blocks * bs, bs)
        self.max_blocks = self.kv_lengths[-1] // bs
        dev = runner.device
        Bm, Tm = sizes[-1], widths[-1]
        width = _TABLE + self.max_blocks
        self.inputs = torch.zeros(Bm, width, dtype=torch.long, device=dev)
        self.host = torch.zeros(Bm, width, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._host_np = self.host.numpy()
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        self.draft_tokens = torch.zeros(Bm, Tm, dtype=torch.long, device=dev)
        self.draft_parents = torch.zeros(Bm, Tm, dtype=torch.long, device=dev)
        self.draft_parents[:, 0] = -1  # column 0 is the root of every tree, never overwritten
        H, V = self.model.config.hidden_size, self.model.config.vocab_size
        dtype = self.model.lm_head.weight.dtype
        self.out_hidden = torch.zeros(Bm * Tm, H, dtype=dtype, device=dev)
        self.out_logits = torch.zeros(Bm * Tm, V, dtype=dtype, device=dev)
        self.graphs: dict[tuple[int, int, int], _VGraph] = {}
        self.pool = pool
        self.replays = 0

    # -- selection -------------------------------------------------------------------------------
    def supports(self, reqs, width: int) -> bool:
        """Whether a step of ``reqs`` with trees of <= ``width`` nodes (root included) has a graph: batch
        and width within the captured sizes, keys within the cache, the factor buffer large enough."""
        if not 0 < len(reqs) <= self.batch_sizes[-1] or width > self.widths[-1]:
            return False
        Bc, Tc, _ = self.key(len(reqs), width, 1)
        return max(r.num_computed for r in reqs) + Tc <= self.kv_lengths[-1] and \
            Bc * Tc <= self.runner.factors.k.shape[1]

    def key(self, batch: int, width: int, max_len: int) -> tuple[int, int, int]:
        Bc = next(b for b in self.batch_sizes if b >= batch)
        Tc = next(t for t in self.widths if t >= width)
        Lc = next(L for L in self.kv_lengths if L >= max_len)
        return Bc, Tc, Lc

    @property
    def num_captured(self) -> int:
        return sum(g.graph is not None for g in self.graphs.values())

    # -- building --------------------------------------------------------------------------------
    def _build(self, Bc: int, Tc: int, Lc: int) -> _VGraph:
        runner, dev, bs, D = self.runner, self.runner.device, self.block_size, self.max_depth
        N = Bc * Tc
        inp = self.inputs[:Bc]
        tables = inp[:, _TABLE:_TABLE + Lc // bs]
        draft_tok, draft_par = self.draft_tokens[:Bc, :Tc], self.draft_parents[:Bc, :Tc]
        pos = torch.arange(Lc, device=dev)
        key_block, key_off = pos // bs, pos % bs
        local = torch.arange(Tc, device=dev)
        forest = PackedForest.full_padded(torch.full((Bc, Tc), -1, dtype=torch.long, device=dev), D)
        ids = torch.zeros(N, dtype=torch.long, device=dev)
        positions = torch.zeros(N, dtype=torch.long, device=dev)
        kv_positions = torch.zeros(N, dtype=torch.long, device=dev)
        slot_mapping = torch.zeros(N, dtype=torch.long, device=dev)
        state_slots = torch.zeros(Bc, dtype=torch.long, device=dev)
        pa = PaddedAttention(kv_index=torch.zeros(Bc, Lc, dtype=torch.long, device=dev),
                             mask=torch.zeros(Bc, 1, Tc, Lc, dtype=torch.bool, device=dev),
                             rows=torch.arange(N, device=dev), tq=Tc)
        ctx = ForwardContext(
            mode="verify", cu_seqlens=forest.cu_seqlens, num_cached=inp[:, _POS], positions=positions,
            kv_positions=kv_positions, slot_mapping=slot_mapping, kv_slots=[], state_slots=state_slots,
            block_tables=[], cu_host=list(range(0, N + 1, Tc)), num_cached_host=[],
            kv_cache=runner.kv_cache, state_pool=runner.state_pool, forest=forest,
            factors=runner.factors.narrow(N))
        ctx._memo["padded"] = pa
        model, out_h, out_l = self.model, self.out_hidden[:N], self.out_logits[:N]
        tree_rows = torch.arange(N, device=dev)[:, None].expand(N, D)
        true = torch.ones((), dtype=torch.bool, device=dev)

        def run():
            nc = inp[:, _POS]
            tok = draft_tok.clone()
            tok[:, 0] = inp[:, _TOK]
            ids.copy_(tok.reshape(-1))
            PackedForest.full_padded(draft_par, D, out=forest)
            depth = forest.depth.view(Bc, Tc).long()
            positions.copy_((nc[:, None] + depth - 1).reshape(-1))
            kvp = nc[:, None] + local[None]
            kv_positions.copy_(kvp.reshape(-1))
            slot_mapping.copy_((tables.gather(1, kvp // bs) * bs + kvp % bs).reshape(-1))
            state_slots.copy_(inp[:, _SLOT])
            pa.kv_index.copy_(tables[:, key_block] * bs + key_off)
            anc = forest.anc.long()                                                  # [N, D] local
            tree = torch.zeros(N, Tc + 1, dtype=torch.bool, device=dev)
            tree.index_put_((tree_rows, torch.where(anc >= 0, anc, Tc)), true)  # no host scalar
            tree = tree[:, :Tc].reshape(Bc, Tc, Tc)
            rel = pos[None, None, :] - nc[:, None, None]                              # [Bc, 1, Lc]
            new = tree.gather(2, rel.clamp(0, Tc - 1).expand(Bc, Tc, Lc)) & (rel >= 0) & (rel < Tc)
            pa.mask.copy_(((rel < 0) | new)[:, None])
            hidden = model(ids, ctx)
            out_h.copy_(hidden)
            out_l.copy_(model.compute_logits(hidden))

        g = _VGraph(Bc, Tc, Lc, ctx, run)
        if self.capture:
            self._fill([], Bc, Lc)  # capture-time warm-up touches the pad block and pad slot only
            self._upload(Bc)
            draft_tok.zero_()
            draft_par[:, 1:].fill_(0)
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    run()
            torch.cuda.current_stream(dev).wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.graph, pool=self.pool):
                run()
            logger.info("captured verify graph batch=%d width=%d kv_len=%d", Bc, Tc, Lc)
        self.graphs[Bc, Tc, Lc] = g
        return g

    def _fill(self, reqs, Bc: int, Lc: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffer
        h, nblk = self._host_np, Lc // self.block_size
        h[:Bc, _TOK] = 0
        h[:Bc, _POS] = 0
        h[:Bc, _SLOT] = self.pad_slot
        h[:Bc, _TABLE:] = self.pad_block
        for b, r in enumerate(reqs):
            h[b, _TOK] = r.all_token_ids[r.num_computed]
            h[b, _POS] = r.num_computed
            h[b, _SLOT] = r.state_slot
            t = r.block_table[:nblk]
            h[b, _TABLE:_TABLE + len(t)] = t

    def _upload(self, Bc: int) -> None:
        self.inputs[:Bc].copy_(self.host[:Bc], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    @torch.inference_mode()
    def capture_all(self, max_batch: int | None = None, max_len: int | None = None,
                    max_width: int | None = None) -> int:
        """Build ahead of time every graph a step of <= max_batch requests, trees of <= max_width nodes
        and <= max_len keys can need, so no capture happens inside a timed run; returns how many."""
        pick = lambda vals, lim: vals if lim is None else [v for v in vals if v < lim] + \
            [next((v for v in vals if v >= lim), vals[-1])]
        built = 0
        for Bc in pick(self.batch_sizes, max_batch):
            for Tc in pick(self.widths, max_width):
                for Lc in pick(self.kv_lengths, None if max_len is None else max_len + Tc):
                    if (Bc, Tc, Lc) not in self.graphs:
                        self._build(Bc, Tc, Lc)
                        built += 1
        return built

    # -- a step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, reqs, batch):
        """The verify forward of ``reqs`` over ``batch`` (a trimmed ``DraftBatch``: [B, T] drafts);
        returns (logits [B, 1 + T, V] and hidden [Bc * Tc, H] views of the static outputs, valid until
        the next replay; the context ``commit`` takes, with this step's host lists)."""
        B, T = batch.tokens.shape
        Bc, Tc, Lc = self.key(B, T + 1, max(r.num_computed for r in reqs) + T + 1)
        Lc = max(Lc, next(L for L in self.kv_lengths if L >= max(r.num_computed for r in reqs) + Tc))
        g = self.graphs.get((Bc, Tc, Lc)) or self._build(Bc, Tc, Lc)
        self._fill(reqs, Bc, Lc)
        self._upload(Bc)
        tok, par = self.draft_tokens[:Bc, :Tc], self.draft_parents[:Bc, :Tc]
        tok.zero_()
        par[:, 1:].fill_(0)  # padding nodes: children of the root
        if T:
            drafts = batch.tokens >= 0
            tok[:B, 1:T + 1] = batch.tokens.clamp(min=0)
            par[:B, 1:T + 1] = torch.where(drafts, batch.parents + 1, 0)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.run()
        self.replays += 1
        V = self.out_logits.shape[1]
        logits = self.out_logits[:Bc * Tc].view(Bc, Tc, V)[:B, :T + 1]
        ctx = dataclasses.replace(g.ctx, num_cached_host=[r.num_computed for r in reqs] + [0] * (Bc - B),
                                  block_tables=[list(r.block_table) for r in reqs] +
                                  [[self.pad_block]] * (Bc - B))
        return logits, self.out_hidden[:Bc * Tc], ctx
