"""CUDA-graph capture of the speculative step's MTP draft.

``DraftGraphs`` captures the whole MTP draft of a step (key (Bc, Lc)): the drafter's catch-up over the
positions the last step committed (at most depth + 1 per request: a chain forest of C = depth + 1
nodes, its padding positions written past everything committed), the root log-probabilities, and
every ``expand_tree`` level over a static forest of the frontier nodes so far, then the budget's
batch-shared selection (Algorithm 3, ``select_nodes``, with the step's B_ver from the calibration
table passed in the input row) and the compaction; its output is the step's ``DraftBatch``. A draft
whose catch-up is longer (the first one after a prefill) runs eagerly.

The forests are ``bole.engine.graphs.tree.StaticTree``'s; the tree growth is the eager draft's
(``bole.engine.drafting.grow_draft_tree``). ``capture=False`` runs the same static forward without
graphs (any device: CPU tests).
"""

from __future__ import annotations

from typing import Sequence

import torch

from bole.engine.drafting import empty_factors, grow_draft_tree
from bole.engine.graphs.base import Graph, GraphFamily, StaticRows, sizes_upto, smallest_at_least
from bole.engine.graphs.tree import StaticTree
from bole.spec.budget import GOODPUT_SLOTS, select_nodes
from bole.spec.drafter import DraftBatch, compact, frontier_sizes, tree_size

_MC, _NC, _NEW, _BVER, _CAP, _DTABLE = 0, 1, 2, 3, 4, 5  # columns of the draft graphs' host row: mtp_computed,
# num_computed, catch-up length, the step's budget B_ver and drafts-per-request cap (row 0), then the catch-up
# ids (C) and the block table


class DraftGraphs(GraphFamily):
    """Captured MTP drafts (catch-up + tree expansion) of one ``ModelRunner``; see the module docstring."""

    kind = "draft"

    def __init__(self, runner, batch_sizes: Sequence[int], depth: int, topk: int, beam: int,
                 pad_block: int, capture: bool = True, min_kv: int = 256, pool=None,
                 max_per_request: int | None = None, *, floor: str, goodput: bool = False):
        if runner.model.mtp is None:
            raise ValueError("draft graphs need a model with an MTP drafter")
        super().__init__(runner, batch_sizes, runner.mtp_cache, min_kv, capture, pool)
        self.mtp = runner.model.mtp
        self.depth, self.topk, self.beam = int(depth), int(topk), int(beam)
        self.pad_block = int(pad_block)
        V, H = self.mtp.vocab_width, self.model.config.hidden_size   # V: the drafter's scored columns
        self.t_max = tree_size(V, self.depth, self.topk, self.beam)
        self.catch_up = C = self.depth + 1   # the most positions a verify step commits
        dev = runner.device
        Bm = self.batch_sizes[-1]
        self.table_col = _DTABLE + C
        self.rows = StaticRows(Bm, self.table_col + self.max_blocks, dev)
        dtype = self.model.lm_head.weight.dtype
        self.hidden_in = torch.zeros(Bm, C, H, dtype=dtype, device=dev)   # target hiddens to catch up on
        T = self.t_max + 1
        z = lambda dtype: torch.zeros(Bm, T, dtype=dtype, device=dev)
        # the root and the selected, compacted drafts (``DraftBatch`` fields)
        self.out = dict(tokens=z(torch.long), parents=z(torch.long), depth=z(torch.long), rho=z(torch.float32),
                        source_index=z(torch.long), num_nodes=torch.zeros(Bm, dtype=torch.long, device=dev))
        self.max_per_request = max_per_request
        self.floor = floor   # the budget's fairness floor (select_nodes), fixed per graph family
        # the goodput rule (SpecConfig.budget_rule), fixed per family too: the step's (capacity, T_ver, drafts
        # per request) triples (``goodput_rows``), padded with capacity 0, uploaded beside the host row
        self.goodput = bool(goodput)
        self.costs = StaticRows(3, GOODPUT_SLOTS, dev, dtype=torch.float32) if self.goodput else None
        self.chosen = torch.zeros((), dtype=torch.long, device=dev) if self.goodput else None   # its capacity
        self._costs_loaded = None   # what the device buffer holds: uploaded again only when a step's differ

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

    def _levels(self) -> list[int]:
        """Frontier size evaluated at each expansion level (depth 2..D), as ``expand_tree`` forms them."""
        return frontier_sizes(self.mtp.vocab_width, self.depth, self.topk, self.beam)

    def _make(self, key: tuple[int, int]) -> Graph:
        """The draft of key (Bc, Lc) as a closure over static buffers (captured by ``capture``)."""
        Bc, Lc = key
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
                                max_per_request=inp[0, _CAP], floor=self.floor,
                                costs=None if self.costs is None else self.costs.device, chosen=self.chosen)
            # the root is the last catch-up token (the pending one)
            batch = compact(cand, keep, inp[:, _DTABLE:_DTABLE + C].gather(1, (n - 1)[:, None])[:, 0])
            for k, v in out.items():
                v.copy_(getattr(batch, k))

        return Graph(key, run)

    def _load_padding(self, g: Graph) -> None:
        self._load([], *g.key, 0, None, [(8, 1.0, 1)] if self.goodput else None)

    def _load(self, reqs, Bc: int, Lc: int, b_ver: int, cap: int | None, costs=None) -> None:
        """Per row: mtp_computed, num_computed, catch-up length and ids, block table (padding rows: one
        catch-up position at 0 with the pad block); the step's budget and cap (None: the graphs' own, else
        none) in row 0; the goodput rule's (capacity, T_ver, drafts per request) triples, which a goodput
        family requires."""
        if self.goodput != (costs is not None):
            raise ValueError(f"this draft graph family {'needs' if self.goodput else 'takes no'} goodput costs")
        if costs is not None and costs != self._costs_loaded:
            self._costs_loaded = costs
            c = self.costs.begin()
            c[:] = 0
            c[:, :len(costs)] = list(zip(*costs))
            self.costs.upload(3)
        h, nblk = self.rows.begin(), Lc // self.block_size
        h[:Bc, :self.table_col] = 0
        h[:Bc, _NEW] = 1
        h[:Bc, self.table_col:] = self.pad_block
        h[0, _BVER] = int(b_ver)
        cap = self.max_per_request if cap is None else cap
        h[0, _CAP] = self.t_max + 1 if cap is None else int(cap)   # t_max + 1: no request reaches it
        for b, r in enumerate(reqs):
            n = r.num_computed - r.mtp_computed
            h[b, _MC], h[b, _NC], h[b, _NEW] = r.mtp_computed, r.num_computed, n
            h[b, _DTABLE:_DTABLE + n] = r.all_token_ids[r.mtp_computed + 1:r.num_computed + 1]
            t = r.block_table[:nblk]
            h[b, self.table_col:self.table_col + len(t)] = t
        self.rows.upload(Bc)

    def _keys_upto(self, max_batch: int | None, max_len: int | None) -> list[tuple[int, int]]:
        return [(Bc, Lc) for Bc in sizes_upto(self.batch_sizes, max_batch)
                for Lc in sizes_upto(self.kv_lengths, None if max_len is None else max_len + self.span)]

    @torch.inference_mode()
    def run(self, reqs, b_ver: int, max_per_request: int | None = None, costs=None):
        """The draft of ``reqs`` (``supports`` must hold) with ``b_ver`` nodes selected for the batch, at
        most ``max_per_request`` per request (None: the graphs' ``max_per_request``):
        the compacted ``DraftBatch`` [B, 1 + T_max] (roots at node 0), views of the static outputs (valid until the next
        replay); the requests' drafter bookkeeping advanced."""
        B = len(reqs)
        g = self.graph(self.key(B, max(r.num_computed for r in reqs) + self.span))
        self.stage(reqs, *g.key, b_ver, max_per_request, costs)
        self.replay(g)
        self.advance(reqs)
        return DraftBatch(**{k: v[:B] for k, v in self.out.items()}, budget=self.chosen)

    def stage(self, reqs, Bc: int, Lc: int, b_ver: int, max_per_request: int | None = None, costs=None) -> None:
        """A step's inputs into the static buffers: the host row (one copy; the goodput costs another) and
        the catch-up hiddens."""
        self._load(reqs, Bc, Lc, b_ver, max_per_request, costs)
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
