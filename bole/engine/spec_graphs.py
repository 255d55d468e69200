"""CUDA-graph capture of the speculative step's forwards: the MTP draft and the target's verification.

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

``DraftGraphs`` captures the whole MTP draft of a step (key (Bc, Lc)): the drafter's catch-up over the
positions the last step committed (at most depth + 1 per request: a chain forest of C = depth + 1
nodes, its padding positions written past everything committed), the root log-probabilities, and
every ``expand_tree`` level over a static forest of the frontier nodes so far, then the budget's
batch-shared selection (Algorithm 3, ``select_nodes``, with the step's B_ver from the calibration
table passed in the input row) and the compaction; its output is the step's ``DraftBatch``. A draft
whose catch-up is longer (the first one after a prefill) runs eagerly.

``StaticTree`` is what both build on: a verify-mode ``ForwardContext`` over fixed buffers for Bc
trees of Tc nodes, and ``fill`` (inside the graph) deriving the forest, positions, KV slots and the
attention layout from num_cached, parents and block tables on the device.

``capture=False`` runs the same static forwards without graphs (any device: CPU tests).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from bole.cache.prefix_cache import boundary_cut
from bole.engine.cuda_graphs import (
    _POS,
    _SLOT,
    _TABLE,
    _TOK,
    StaticRows,
    capture_graph,
    kv_layout,
    sizes_upto,
    smallest_at_least,
)
from bole.engine.drafting import empty_factors, grow_draft_tree
from bole.models.context import ForwardContext, PaddedAttention
from bole.ops.tree_layout import LAYOUT_MAX_NODES, tree_layout_ref
from bole.spec.budget import select_nodes
from bole.spec.drafter import DraftBatch, compact, frontier_sizes, tree_size
from bole.spec.sampling import accept_tree, counter_uniforms
from bole.spec.tree import PackedForest, path_prefixes

logger = logging.getLogger(__name__)

DEFAULT_TREE_SIZES = (8, 16, 32, 64, 128, 256)


def tree_widths(lookahead: int, sizes: Sequence[int] = DEFAULT_TREE_SIZES) -> list[int]:
    """The captured tree widths (nodes per request, root included): ``sizes`` up to the lookahead, and
    the lookahead itself (the widest tree the engine can verify)."""
    out = sorted({int(t) for t in sizes if 2 <= int(t) < lookahead} | {int(lookahead)})
    return out


class StaticTree:
    """A verify-mode ``ForwardContext`` over static buffers: Bc trees of exactly Tc nodes, Lc keys per
    row, tree depth <= D. ``fill`` (graph-capturable: device ops only) lays out the step's trees."""

    def __init__(self, Bc: int, Tc: int, Lc: int, D: int, kv_cache, state_pool, factors, device,
                 layout: Callable | None = None):
        N = Bc * Tc
        self.Bc, self.Tc, self.Lc, self.D = Bc, Tc, Lc, D
        self.block_size = kv_cache.block_size
        dev = torch.device(device)
        z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=dev)
        self.forest = PackedForest.full_padded(torch.full((Bc, Tc), -1, dtype=torch.long, device=dev), D)
        self.positions, self.kv_positions, self.slot_mapping = z(N), z(N), z(N)
        self.state_slots, self.num_cached = z(Bc), z(Bc)
        self.pa = PaddedAttention(kv_index=z(Bc, Lc), mask=z(Bc, 1, Tc, Lc, dtype=torch.bool),
                                  rows=torch.arange(N, device=dev), tq=Tc)
        self.ctx = ForwardContext(
            mode="verify", cu_seqlens=self.forest.cu_seqlens, num_cached=self.num_cached,
            positions=self.positions, kv_positions=self.kv_positions, slot_mapping=self.slot_mapping,
            kv_slots=[], state_slots=self.state_slots, block_tables=[], cu_host=list(range(0, N + 1, Tc)),
            num_cached_host=[], kv_cache=kv_cache, state_pool=state_pool, forest=self.forest, factors=factors)
        self.ctx._memo["padded"] = self.pa
        # the backend's layout (kernels.tree_layout on the GPU: one launch) within its tree-size limit
        self.layout = layout if layout is not None and Tc <= LAYOUT_MAX_NODES else tree_layout_ref

    def fill(self, num_cached: torch.Tensor, parents: torch.Tensor, tables: torch.Tensor,
             state_slots: torch.Tensor | None = None) -> ForwardContext:
        """num_cached [Bc], parents [Bc, Tc] local (-1 = root), tables [Bc, >= Lc / block size] block ids;
        the layout is ``bole.ops.tree_layout.tree_layout_ref``'s (forest, positions, KV slots, mask)."""
        self.layout(parents, num_cached, tables, self.block_size, forest=self.forest, positions=self.positions,
                    kv_positions=self.kv_positions, slot_mapping=self.slot_mapping, kv_index=self.pa.kv_index,
                    mask=self.pa.mask, num_cached_out=self.num_cached, state_slots=state_slots,
                    state_slots_out=self.state_slots)
        return self.ctx


@dataclass
class _VGraph:
    batch: int
    width: int
    kv_len: int
    ctx: ForwardContext
    run: Callable[[], None]
    graph: "torch.cuda.CUDAGraph | None" = None
    tail: "_VGraph | None" = None   # the greedy acceptance + commit after this forward (``run_tail``)
    sampled_tail: "_VGraph | None" = None  # the same with the sampled acceptance (``sampled_tail=True``)


class VerifyGraphs:
    """Captured verify forwards of one ``ModelRunner``; see the module docstring."""

    def __init__(self, runner, batch_sizes: Sequence[int], tree_sizes: Sequence[int], max_depth: int,
                 pad_block: int, pad_slot: int, capture: bool = True, min_kv: int = 256, pool=None,
                 tail: bool = True, sampled_tail: bool = False):
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
        self.tail, self.sampled_tail = tail, tail and sampled_tail
        self.pad_block, self.pad_slot = int(pad_block), int(pad_slot)
        self.block_size, self.kv_lengths, self.max_blocks = kv_layout(runner.kv_cache, min_kv)
        dev = runner.device
        Bm, Tm = sizes[-1], widths[-1]
        self.rows = StaticRows(Bm, _TABLE + self.max_blocks, dev)
        self.draft_tokens = torch.full((Bm, Tm), -1, dtype=torch.long, device=dev)  # -1: padding node
        self.draft_parents = torch.zeros(Bm, Tm, dtype=torch.long, device=dev)
        self.draft_parents[:, 0] = -1  # column 0 is the root of every tree, never overwritten
        H, V = self.model.config.hidden_size, self.model.config.vocab_size
        dtype = self.model.lm_head.weight.dtype
        self.out_hidden = torch.zeros(Bm * Tm, H, dtype=dtype, device=dev)
        self.out_logits = torch.zeros(Bm * Tm, V, dtype=dtype, device=dev)
        # the tail's outputs: per row accepted node, emitted count, the emitted tokens (one host read),
        # and the target hiddens along the accepted path (the drafter's next catch-up inputs)
        self.out_accept = torch.zeros(Bm, 3 + self.max_depth, dtype=torch.long, device=dev)
        self.out_path_hidden = torch.zeros(Bm, self.max_depth, H, dtype=dtype, device=dev)
        # the sampled tail's per-row parameters: (temperature, top_p) and (top_k, seed)
        self.sample_floats = StaticRows(Bm, 2, dev, dtype=torch.float32)
        self.sample_ints = StaticRows(Bm, 2, dev)
        self.graphs: dict[tuple[int, int, int], _VGraph] = {}
        self.pool = pool
        self.replays = self.tail_replays = 0
        self.checkpoints = None   # (StatePool, interval, ckpt slot rows): ``enable_checkpoints``

    # -- selection -------------------------------------------------------------------------------
    def supports(self, reqs, width: int) -> bool:
        """Whether a step of ``reqs`` with trees of <= ``width`` nodes (root included) has a graph: batch
        and width within the captured sizes, keys within the cache, the factor buffer large enough."""
        if not 0 < len(reqs) <= self.batch_sizes[-1] or width > self.widths[-1]:
            return False
        Bc, Tc = self._sizes(len(reqs), width)
        return max(r.num_computed for r in reqs) + Tc <= self.kv_lengths[-1] and \
            Bc * Tc <= self.runner.factors.k.shape[1]

    def _sizes(self, batch: int, width: int) -> tuple[int, int]:
        return smallest_at_least(self.batch_sizes, batch), smallest_at_least(self.widths, width)

    def key(self, batch: int, width: int, max_cached: int) -> tuple[int, int, int]:
        """(Bc, Tc, Lc) for ``batch`` trees of <= ``width`` nodes whose longest committed prefix has
        ``max_cached`` tokens (the keys: that prefix and the Tc padded tree nodes)."""
        Bc, Tc = self._sizes(batch, width)
        return Bc, Tc, smallest_at_least(self.kv_lengths, max_cached + Tc)

    @property
    def num_captured(self) -> int:
        return sum(g.graph is not None for g in self.graphs.values())

    # -- building --------------------------------------------------------------------------------
    def _make(self, Bc: int, Tc: int, Lc: int) -> _VGraph:
        """The forward of key (Bc, Tc, Lc) and its tail as closures over static buffers (not captured;
        ``_build`` captures them)."""
        runner, bs, D = self.runner, self.block_size, self.max_depth
        N = Bc * Tc
        inp = self.rows.device[:Bc]
        tables = inp[:, _TABLE:_TABLE + Lc // bs]
        draft_tok, draft_par = self.draft_tokens[:Bc, :Tc], self.draft_parents[:Bc, :Tc]
        st = StaticTree(Bc, Tc, Lc, D, runner.kv_cache, runner.state_pool, runner.factors.narrow(N),
                        runner.device, self.model.backend.tree_layout)
        ctx = st.ctx
        model, out_h, out_l = self.model, self.out_hidden[:N], self.out_logits[:N]

        def run():
            tok = draft_tok.clamp(min=0)  # padding nodes (-1) verify token 0 and are never accepted
            tok[:, 0] = inp[:, _TOK]
            st.fill(inp[:, _POS], draft_par, tables, inp[:, _SLOT])
            hidden = model(tok.reshape(-1), ctx)
            out_h.copy_(hidden)
            out_l.copy_(model.compute_logits(hidden))

        g = _VGraph(Bc, Tc, Lc, ctx, run)
        if self.tail:
            g.tail = self._make_tail(g)
        if self.sampled_tail:
            g.sampled_tail = self._make_tail(g, sampled=True)
        return g

    def load_padding(self, Bc: int, Tc: int, Lc: int) -> None:
        """Every row a padding row, every node a padding node: what a capture's warm-up runs on (it
        touches the pad block and pad slot only, and commits nothing)."""
        self._load([], Bc, Lc)
        self.draft_tokens[:Bc, :Tc].fill_(-1)
        self.draft_parents[:Bc, 1:Tc].fill_(0)
        if self.checkpoints is not None:
            self.checkpoints[2].device[:Bc].fill_(self.checkpoints[3])
        self.load_sampling(Bc, None)

    def _build(self, Bc: int, Tc: int, Lc: int) -> _VGraph:
        g = self._make(Bc, Tc, Lc)
        if self.capture:
            self.load_padding(Bc, Tc, Lc)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g.graph = capture_graph(g.run, self.pool, self.runner.device)
            logger.info("captured verify graph batch=%d width=%d kv_len=%d", Bc, Tc, Lc)
            for tail in (g.tail, g.sampled_tail):
                if tail is not None:
                    tail.graph = capture_graph(tail.run, self.pool, self.runner.device)
            logger.info("captured verify tail graphs batch=%d width=%d kv_len=%d", Bc, Tc, Lc)
        self.graphs[Bc, Tc, Lc] = g
        return g

    def _load(self, reqs, Bc: int, Lc: int) -> None:
        self.rows.fill_roots(reqs, Bc, Lc // self.block_size, self.pad_slot, self.pad_block)
        self.rows.upload(Bc)

    @torch.inference_mode()
    def capture_all(self, max_batch: int | None = None, max_len: int | None = None,
                    max_width: int | None = None) -> int:
        """Build ahead of time every graph a step of <= max_batch requests, trees of <= max_width nodes
        and <= max_len keys can need, so no capture happens inside a timed run; returns how many."""
        built = 0
        for Bc in sizes_upto(self.batch_sizes, max_batch):
            for Tc in sizes_upto(self.widths, max_width):
                for Lc in sizes_upto(self.kv_lengths, None if max_len is None else max_len + Tc):
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
        Bc, Tc, Lc = self.key(B, T + 1, max(r.num_computed for r in reqs))
        g = self.graphs.get((Bc, Tc, Lc)) or self._build(Bc, Tc, Lc)
        self._load(reqs, Bc, Lc)
        tok, par = self.draft_tokens[:Bc, :Tc], self.draft_parents[:Bc, :Tc]
        tok.fill_(-1)
        par[:, 1:].fill_(0)  # padding nodes: children of the root
        if T:
            tok[:B, 1:T + 1] = batch.tokens
            par[:B, 1:T + 1] = torch.where(batch.tokens >= 0, batch.parents + 1, 0)
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
        return logits, self.out_hidden[:Bc * Tc], ctx, g

    def enable_checkpoints(self, pool, interval: int, scratch_slot: int) -> None:
        """Prefix-cache checkpoints inside the tail (before any graph is built): a row whose accepted
        path jumps over a multiple of ``interval`` tokens gets the state at that boundary committed into
        ``pool`` at the slot ``run_tail`` names for it (the host reserved it: ``PrefixCache``). A row
        whose path does not cross writes nothing there; rows without a slot name ``scratch_slot``."""
        if self.graphs:
            raise ValueError("enable_checkpoints must precede the first graph")
        self.checkpoints = (pool, int(interval), StaticRows(self.batch_sizes[-1], 1, self.runner.device),
                            int(scratch_slot))

    # -- the tail: greedy acceptance and the commit, after a replayed forward ----------------------------
    def _make_tail(self, g: _VGraph, sampled: bool = False) -> _VGraph:
        """The greedy ``accept_tree`` walk over the forward's logits and the commit of the accepted paths
        (``commit_paths``: GDN state, conv windows, K/V), writing the host's one read (``out_accept``)
        and the path's hiddens (``out_path_hidden``); captured by ``_build``.

        ``sampled``: the lossless sampled walk instead (``accept_tree`` over the processed logits, each
        row's parameters from ``load_sampling``), with the uniforms the eager step draws: request b's
        ``counter_uniforms(seed, num_computed + 1, depth + 1)``, target row r taking its depth's."""
        Bc, Tc, D = g.batch, g.width, self.max_depth
        V = self.out_logits.shape[1]
        logits, hidden = self.out_logits[:Bc * Tc].view(Bc, Tc, V), self.out_hidden[:Bc * Tc]
        drafts, parents = self.draft_tokens[:Bc, 1:Tc], self.draft_parents[:Bc, 1:Tc]
        inp, out, out_h = self.rows.device[:Bc], self.out_accept[:Bc], self.out_path_hidden[:Bc]
        model, forest, ctx = self.model, g.ctx.forest, g.ctx
        accept = model.backend.greedy_accept   # accept_tree's greedy walk (kernels.greedy_accept on the GPU)
        if sampled:
            fl, it = self.sample_floats.device[:Bc], self.sample_ints.device[:Bc]

            def accept(drafts, parents, logits, max_depth):
                row_depth = (forest.depth.view(Bc, Tc).long() - 1).clamp(0, max_depth)  # the root 0, drafts theirs
                u = counter_uniforms(it[:, 1], inp[:, _POS] + 1, max_depth + 1).gather(1, row_depth)
                # the native logits: process_logits upcasts only the rows the walk visits, to the values the
                # eager step's fp32 copy holds (no [Bc, Tc, V] fp32 copy kept in the graph's pool)
                return accept_tree(drafts, parents, u, logits=logits, temperature=fl[:, 0], top_k=it[:, 0],
                                   top_p=fl[:, 1], max_depth=max_depth)

        ckpt = self.checkpoints

        def run():
            acc = accept(drafts, parents - 1, logits, max_depth=D - 1)
            # padding rows (the pad state slot) commit nothing; a real row always keeps its root
            real = inp[:, _SLOT] != self.pad_slot
            local = torch.where(real, acc.accepted_node + 1, -1)
            paths = forest.accepted_path_nodes(local)                          # [Bc, D] global ids
            if ckpt is not None:
                # the path prefix up to the last checkpoint boundary strictly inside the commit of
                # [start, start + n) (PrefixCache.path_cut), committed into the row's checkpoint slot
                pool_c, interval, slots_c = ckpt[0], ckpt[1], ckpt[2].device[:Bc, 0]
                cut = torch.where(real, boundary_cut(inp[:, _POS], acc.num_emitted, interval), 0)
                model.commit_paths(ctx, path_prefixes(paths, cut), out=(pool_c, slots_c))
            model.commit_paths(ctx, paths)
            out_h.copy_(hidden[paths.clamp(min=0).long()])
            out[:, 0] = acc.accepted_node
            out[:, 1] = acc.num_emitted
            out[:, 2:2 + D] = acc.tokens
            out[:, 2 + D] = (drafts >= 0).sum(1)  # verified drafts (the step's statistics)

        return _VGraph(Bc, Tc, g.kv_len, ctx, run)

    def load_checkpoint_slots(self, Bc: int, checkpoint_slots: Sequence[int | None] | None) -> None:
        """The tail's per-row checkpoint slot (the scratch slot where None), one host-to-device copy."""
        if self.checkpoints is not None:
            rows, dummy = self.checkpoints[2], self.checkpoints[3]
            h = rows.begin()
            h[:Bc, 0] = dummy
            for b, slot in enumerate(checkpoint_slots or ()):
                if slot is not None:
                    h[b, 0] = slot
            rows.upload(Bc)

    def load_sampling(self, Bc: int, params: Sequence[tuple[float, int, float, int]] | None) -> None:
        """The sampled tail's per-row (temperature, top_k, top_p, seed); padding rows greedy."""
        fl, it = self.sample_floats.begin(), self.sample_ints.begin()
        fl[:Bc, 0], fl[:Bc, 1], it[:Bc] = 0.0, 1.0, 0
        for b, (temp, top_k, top_p, seed) in enumerate(params or ()):
            fl[b] = temp, top_p
            it[b] = top_k, seed
        self.sample_floats.upload(Bc)
        self.sample_ints.upload(Bc)

    @torch.inference_mode()
    def run_tail(self, g: _VGraph, batch: int, checkpoint_slots: Sequence[int | None] | None = None,
                 sampling: Sequence[tuple[float, int, float, int]] | None = None) -> list[list[int]]:
        """After ``run`` returned ``g``: accept and commit in the captured tail; per request [accepted
        node, emitted count, D tokens (padded), verified drafts] (the step's one device-to-host read).
        ``out_path_hidden`` then holds each request's accepted-path hiddens, valid until the next tail.
        ``checkpoint_slots`` (with ``enable_checkpoints``): per request the checkpoint slot its path's
        boundary state goes to, None for a request whose path cannot cross a boundary this step.
        ``sampling``: per request (temperature, top_k, top_p, seed) for the sampled tail (``sampled_tail``);
        None: every request greedy, the greedy tail."""
        tail = g.tail if sampling is None else g.sampled_tail
        if tail is None:
            raise ValueError("this VerifyGraphs was built without that tail (tail=False or sampled_tail=False)")
        if sampling is not None:
            self.load_sampling(g.batch, sampling)
        self.load_checkpoint_slots(g.batch, checkpoint_slots)
        if tail.graph is not None:
            tail.graph.replay()
        else:
            tail.run()
        self.tail_replays += 1
        return self.out_accept[:batch].tolist()


# -------------------------------------------------------------------------------------------- draft
_MC, _NC, _NEW, _BVER, _DTABLE = 0, 1, 2, 3, 4  # columns of the draft graphs' host row: mtp_computed,
# num_computed, catch-up length, the step's budget B_ver (row 0), then the catch-up ids (C) and the block table


@dataclass
class _DGraph:
    batch: int
    kv_len: int
    run: Callable[[], None]
    graph: "torch.cuda.CUDAGraph | None" = None


class DraftGraphs:
    """Captured MTP drafts (catch-up + tree expansion) of one ``ModelRunner``; see the module docstring."""

    def __init__(self, runner, batch_sizes: Sequence[int], depth: int, topk: int, beam: int,
                 pad_block: int, capture: bool = True, min_kv: int = 256, pool=None,
                 max_per_request: int | None = None):
        sizes = sorted({int(b) for b in batch_sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch sizes must be ints >= 1, got {list(batch_sizes)}")
        if capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the runner is on {runner.device}")
        if runner.model.mtp is None:
            raise ValueError("draft graphs need a model with an MTP drafter")
        self.runner, self.model, self.mtp = runner, runner.model, runner.model.mtp
        self.batch_sizes, self.capture = sizes, capture
        self.depth, self.topk, self.beam = int(depth), int(topk), int(beam)
        self.pad_block = int(pad_block)
        V, H = self.model.config.vocab_size, self.model.config.hidden_size
        self.t_max = tree_size(V, self.depth, self.topk, self.beam)
        self.catch_up = C = self.depth + 1   # the most positions a verify step commits
        self.block_size, self.kv_lengths, self.max_blocks = kv_layout(runner.mtp_cache, min_kv)
        dev = runner.device
        Bm = sizes[-1]
        self.table_col = _DTABLE + C
        self.rows = StaticRows(Bm, self.table_col + self.max_blocks, dev)
        dtype = self.model.lm_head.weight.dtype
        self.hidden_in = torch.zeros(Bm, C, H, dtype=dtype, device=dev)   # target hiddens to catch up on
        T = self.t_max
        z = lambda dtype: torch.zeros(Bm, T, dtype=dtype, device=dev)
        # the selected, compacted drafts (``DraftBatch`` fields)
        self.out = dict(tokens=z(torch.long), parents=z(torch.long), depth=z(torch.long), rho=z(torch.float32),
                        source_index=z(torch.long), num_nodes=torch.zeros(Bm, dtype=torch.long, device=dev))
        self.max_per_request = max_per_request
        self.graphs: dict[tuple[int, int], _DGraph] = {}
        self.pool = pool
        self.replays = 0

    def supports(self, reqs) -> bool:
        """A graph exists for this draft: batch within the captured sizes, every request's catch-up
        within depth + 1 positions (with its target hiddens pending), keys within the cache."""
        if not 0 < len(reqs) <= self.batch_sizes[-1]:
            return False
        for r in reqs:
            n = r.num_computed - r.mtp_computed
            if not 1 <= n <= self.catch_up or r.pending_hidden is None or r.pending_hidden.shape[0] < n:
                return False
        return max(r.num_computed for r in reqs) + self.span <= self.kv_lengths[-1]

    def key(self, batch: int, max_len: int) -> tuple[int, int]:
        return smallest_at_least(self.batch_sizes, batch), smallest_at_least(self.kv_lengths, max_len)

    @property
    def num_captured(self) -> int:
        return sum(g.graph is not None for g in self.graphs.values())

    def _levels(self) -> list[int]:
        """Frontier size evaluated at each expansion level (depth 2..D), as ``expand_tree`` forms them."""
        return frontier_sizes(self.model.config.vocab_size, self.depth, self.topk, self.beam)

    def _make(self, Bc: int, Lc: int) -> Callable[[], None]:
        """The draft of key (Bc, Lc) as a closure over static buffers (captured by ``_build``)."""
        runner, dev, C, bs = self.runner, self.runner.device, self.catch_up, self.block_size
        mtp, cache = self.mtp, runner.mtp_cache
        inp = self.rows.device[:Bc]
        tables = inp[:, self.table_col:self.table_col + Lc // bs]
        H = self.hidden_in.shape[-1]
        hidden_in = self.hidden_in[:Bc]
        chain = (torch.arange(C, device=dev) - 1)[None].expand(Bc, C)
        layout = self.model.backend.tree_layout
        catch = StaticTree(Bc, C, Lc, C, cache, None, empty_factors(Bc * C, dev), dev, layout)
        levels, trees, S = self._levels(), [], 0
        for M in levels:
            S += M
            trees.append(StaticTree(Bc, S, Lc, len(trees) + 1, cache, None, empty_factors(Bc * S, dev), dev,
                                    layout))
        out = {k: v[:Bc] for k, v in self.out.items()}

        def run():
            nc, n = inp[:, _NC], inp[:, _NEW]
            ctx = catch.fill(inp[:, _MC], chain, tables)
            h = mtp(inp[:, _DTABLE:_DTABLE + C].reshape(-1), hidden_in.reshape(-1, H), ctx).view(Bc, C, H)
            h_root = h[torch.arange(Bc, device=dev), n - 1]                       # [Bc, H]
            cand = grow_draft_tree(mtp, h_root, self.depth, self.topk, self.beam,
                                   lambda par, d: trees[d - 1].fill(nc, par, tables))
            # padding rows (num_computed 0) draft too, but take none of the batch's budget
            valid = cand.valid & (nc > 0)[:, None]
            keep = select_nodes(cand.rho, cand.parents, valid, cand.depth, inp[0, _BVER],
                                max_per_request=self.max_per_request)
            batch = compact(cand, keep)
            for k, v in out.items():
                v.copy_(getattr(batch, k))

        return run

    def _build(self, Bc: int, Lc: int) -> _DGraph:
        g = _DGraph(Bc, Lc, self._make(Bc, Lc))
        if self.capture:
            self._load([], Bc, Lc, 0)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g.graph = capture_graph(g.run, self.pool, self.runner.device)
            logger.info("captured draft graph batch=%d kv_len=%d", Bc, Lc)
        self.graphs[Bc, Lc] = g
        return g

    def _load(self, reqs, Bc: int, Lc: int, b_ver: int) -> None:
        """Per row: mtp_computed, num_computed, catch-up length and ids, block table (padding rows: one
        catch-up position at 0 with the pad block); the step's budget in row 0."""
        h, nblk = self.rows.begin(), Lc // self.block_size
        h[:Bc, :self.table_col] = 0
        h[:Bc, _NEW] = 1
        h[:Bc, self.table_col:] = self.pad_block
        h[0, _BVER] = int(b_ver)
        for b, r in enumerate(reqs):
            n = r.num_computed - r.mtp_computed
            h[b, _MC], h[b, _NC], h[b, _NEW] = r.mtp_computed, r.num_computed, n
            h[b, _DTABLE:_DTABLE + n] = r.all_token_ids[r.mtp_computed + 1:r.num_computed + 1]
            t = r.block_table[:nblk]
            h[b, self.table_col:self.table_col + len(t)] = t
        self.rows.upload(Bc)

    @torch.inference_mode()
    def capture_all(self, max_batch: int | None = None, max_len: int | None = None) -> int:
        built = 0
        for Bc in sizes_upto(self.batch_sizes, max_batch):
            for Lc in sizes_upto(self.kv_lengths, None if max_len is None else max_len + self.span):
                if (Bc, Lc) not in self.graphs:
                    self._build(Bc, Lc)
                    built += 1
        return built

    @torch.inference_mode()
    def run(self, reqs, b_ver: int):
        """The draft of ``reqs`` (``supports`` must hold) with ``b_ver`` nodes selected for the batch:
        the compacted ``DraftBatch`` [B, T_max], views of the static outputs (valid until the next
        replay); the requests' drafter bookkeeping advanced."""
        B = len(reqs)
        Bc, Lc = self.key(B, max(r.num_computed for r in reqs) + self.span)
        g = self.graphs.get((Bc, Lc)) or self._build(Bc, Lc)
        self.stage(reqs, Bc, Lc, b_ver)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.run()
        self.replays += 1
        self.advance(reqs)
        return DraftBatch(**{k: v[:B] for k, v in self.out.items()})

    def stage(self, reqs, Bc: int, Lc: int, b_ver: int) -> None:
        """A step's inputs into the static buffers: the host row (one copy) and the catch-up hiddens."""
        self._load(reqs, Bc, Lc, b_ver)
        for b, r in enumerate(reqs):
            n = r.num_computed - r.mtp_computed
            self.hidden_in[b, :n] = r.pending_hidden[-n:]

    @staticmethod
    def advance(reqs) -> None:
        """After a replay: the drafter has seen every committed position of ``reqs``."""
        for r in reqs:
            r.mtp_computed = r.num_computed
            r.pending_hidden = None

    @property
    def span(self) -> int:
        """Keys past the longest committed prefix a draft writes (its catch-up or its widest tree)."""
        return max(self.t_max, self.catch_up)
