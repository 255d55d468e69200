"""A whole greedy speculative step as ONE CUDA graph: draft, verify forward, acceptance and commit.

``DraftGraphs`` and ``VerifyGraphs`` (bole.engine.spec_graphs) capture the draft and the verify
forward (with its tail) as separate graphs, with host work between them: the draft's output is
copied into the verify graph's inputs, and each replay is its own launch. On a small model at batch
1 the GPU idles in those gaps (the step is launch bound). Nothing in between needs the host: the tree
width Tc the verify graph is keyed by is bounded on the host before the draft runs (the budget, or the
depth-1 floor), so ``StepGraphs`` captures, per key (Bc, Tc, L),

    draft (catch-up, tree expansion, budget selection, compaction)
    -> the compacted drafts into the verify buffers (on the device)
    -> the verify forward -> the tail (greedy acceptance, commit of every layer, prefix checkpoints)

from the same closures the separate graphs capture (``DraftGraphs._make``, ``VerifyGraphs._make``),
over their static buffers. A step then makes its host-to-device copies (the draft's row, the verify
row, the checkpoint slots, the catch-up hiddens), replays once, and reads ``out_accept`` once.

L is one KV-length bucket for both parts (>= the longest committed prefix + the widest of the
draft's span and Tc): a larger bucket is exact, only more keys masked. The step's graph is used only
where the engine would not read the widest tree from the device anyway (``LLMEngine``), and only for
greedy steps (the tail's acceptance is the greedy walk).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from bole.engine.cuda_graphs import capture_graph, sizes_upto, smallest_at_least

logger = logging.getLogger(__name__)


@dataclass
class _SGraph:
    batch: int
    width: int
    kv_len: int
    run: Callable[[], None]
    graph: "torch.cuda.CUDAGraph | None" = None


class StepGraphs:
    """Whole-step graphs over one runner's ``DraftGraphs`` and ``VerifyGraphs`` (their buffers, padding
    rows and memory pool); ``capture=False`` runs the same closures uncaptured (CPU tests)."""

    def __init__(self, draft, verify, capture: bool = True):
        if verify.tail is None or not verify.tail:
            raise ValueError("StepGraphs needs VerifyGraphs built with its tail")
        if draft.batch_sizes != verify.batch_sizes:
            raise ValueError(f"draft and verify graphs must share batch sizes, got {draft.batch_sizes} and "
                             f"{verify.batch_sizes}")
        if draft.kv_lengths != verify.kv_lengths:
            raise ValueError(f"draft and verify graphs must share KV-length buckets, got {draft.kv_lengths} and "
                             f"{verify.kv_lengths}")
        self.draft, self.verify, self.capture = draft, verify, capture
        self.graphs: dict[tuple[int, int, int], _SGraph] = {}
        self.replays = 0

    @property
    def num_captured(self) -> int:
        return sum(g.graph is not None for g in self.graphs.values())

    def key(self, batch: int, width: int, max_cached: int) -> tuple[int, int, int]:
        Bc, Tc = self.verify._sizes(batch, width)
        return Bc, Tc, smallest_at_least(self.verify.kv_lengths, max_cached + max(Tc, self.draft.span))

    def supports(self, reqs, width: int) -> bool:
        """Both parts apply (``DraftGraphs.supports``, ``VerifyGraphs.supports`` for trees of <= ``width``
        nodes with the root), and the shared KV bucket exists in both."""
        if not (self.draft.supports(reqs) and self.verify.supports(reqs, width)):
            return False
        longest = max(r.num_computed for r in reqs)
        _, Tc = self.verify._sizes(len(reqs), width)
        need = longest + max(Tc, self.draft.span)
        return need <= self.verify.kv_lengths[-1] and need <= self.draft.kv_lengths[-1]

    def _build(self, Bc: int, Tc: int, L: int) -> _SGraph:
        draft_run = self.draft._make(Bc, L)
        fwd = self.verify._make(Bc, Tc, L)
        tail = fwd.tail
        w = min(Tc - 1, self.draft.t_max)
        d_tok, d_par = self.draft.out["tokens"][:Bc, :w], self.draft.out["parents"][:Bc, :w]
        v_tok, v_par = self.verify.draft_tokens[:Bc, 1:Tc], self.verify.draft_parents[:Bc, 1:Tc]

        def run():
            draft_run()
            # the compacted drafts below each root (local parent + 1; -1 / 0 for padding nodes)
            if w < Tc - 1:
                v_tok[:, w:].fill_(-1)
                v_par[:, w:].fill_(0)
            v_tok[:, :w].copy_(d_tok)
            v_par[:, :w].copy_(torch.where(d_tok >= 0, d_par + 1, 0))
            fwd.run()
            tail.run()

        g = _SGraph(Bc, Tc, L, run)
        if self.capture:
            self.draft._load([], Bc, L, 0)
            self.verify.load_padding(Bc, Tc, L)
            if self.verify.pool is None:
                self.verify.pool = torch.cuda.graph_pool_handle()
            g.graph = capture_graph(run, self.verify.pool, self.verify.runner.device)
            logger.info("captured step graph batch=%d width=%d kv_len=%d", Bc, Tc, L)
        self.graphs[Bc, Tc, L] = g
        return g

    @torch.inference_mode()
    def capture_all(self, max_batch: int | None = None, max_len: int | None = None,
                    max_width: int | None = None) -> int:
        """Build every graph steps of <= max_batch requests, trees of <= max_width nodes and <= max_len
        committed tokens can need (none inside a timed run); returns how many."""
        built = 0
        for Bc in sizes_upto(self.verify.batch_sizes, max_batch):
            for Tc in sizes_upto(self.verify.widths, max_width):
                span = max(Tc, self.draft.span)
                for L in sizes_upto(self.verify.kv_lengths, None if max_len is None else max_len + span):
                    if L >= span and (Bc, Tc, L) not in self.graphs:
                        self._build(Bc, Tc, L)
                        built += 1
        return built

    @torch.inference_mode()
    def run(self, reqs, b_ver: int, width: int, checkpoint_slots=None) -> list[list[int]]:
        """One greedy step of ``reqs`` (``supports(reqs, width)`` must hold): trees of <= ``width`` nodes
        with the root, ``b_ver`` nodes for the batch. Returns per request [accepted node, emitted count,
        D tokens, verified drafts] (``VerifyGraphs.run_tail``'s row); ``out_path_hidden`` then holds the
        accepted paths' hiddens. The requests' drafter bookkeeping is advanced (not num_computed)."""
        B = len(reqs)
        Bc, Tc, L = self.key(B, width, max(r.num_computed for r in reqs))
        g = self.graphs.get((Bc, Tc, L)) or self._build(Bc, Tc, L)
        self.draft.stage(reqs, Bc, L, b_ver)
        self.verify._load(reqs, Bc, L)
        self.verify.load_checkpoint_slots(Bc, checkpoint_slots)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.run()
        self.replays += 1
        self.draft.advance(reqs)
        return self.verify.out_accept[:B].tolist()
