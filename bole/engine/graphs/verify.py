"""CUDA-graph capture of the speculative step's verification: the target's verify forward and its tails.

The verify forward of a speculative step is launch bound on a GPU exactly like an eager decode step
(~90 kernels per layer at batch 1), and it is the step's largest forward. ``VerifyGraphs`` captures it
once per graph key and replays it:

    key = (Bc, Tc, Lc)   Bc: the smallest captured batch size >= the step's batch;
                         Tc: the smallest captured tree width >= the widest tree (root included; every
                             request's tree is padded to Tc nodes: extra children of the root that
                             carry token 0 and are never accepted, ``accept_tree`` seeing them as
                             padding);
                         Lc: a KV-length bucket >= the longest request's committed length + Tc.

Static inputs: the decode graphs' pinned-host → device row buffer (root token, num_cached, GDN
state slot, block table per row, ONE host-to-device copy per step) plus two device buffers the step's
``DraftBatch`` is copied into on the device (node tokens and parents, root at node 0 as in the
batch, no host round trip). Inside
the graph, from those: the flat node tokens, the forest layout (``PackedForest.full_padded``: depths,
ancestor chains and bitmasks), positions, KV write slots, the [Bc, Lc] key slots and the
[Bc, 1, Tc, Lc] prefix + ancestor-or-self mask (``PaddedAttention``); then the model and the lm_head.
The GDN layers run the same tree conv and closed-form verifier as eagerly (their launches take only
shapes and device pointers), and store the commit factors in the runner's factor buffer.

Padding rows (Bc > B) use the runner's pad KV block and pad state slot, like the decode graphs, and
are never committed (their accepted node is -1: no path). A real request's padding nodes write K/V at
num_cached + local index (< num_cached + lookahead, past everything committed) and are overwritten
by later steps, as rejected nodes are.

The tree depth bound Dc (``max_depth``, the drafter's depth + 1 with the root) is fixed per graph, so
the verifier runs Dc Neumann rounds whatever the step's trees look like (exact either way).

Each graph has a tail (``run_tail``, captured after it over its outputs): the step's acceptance and
commit, ``bole.engine.acceptance.accept_and_commit`` (the eager step's too), greedy or, with
``sampled_tail``, sampled, prefix-cache checkpoints included. The forest context is
``bole.engine.graphs.tree.StaticTree``'s.

``capture=False`` runs the same static forwards without graphs (any device: CPU tests).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from bole.engine.acceptance import accept_and_commit
from bole.engine.graphs.base import (
    _POS,
    _SLOT,
    _TABLE,
    Graph,
    GraphFamily,
    StaticRows,
    capture_graph,
    sizes_upto,
    smallest_at_least,
)
from bole.engine.graphs.tree import StaticTree
from bole.engine.sampler import SamplingTensors


@dataclass
class VerifyGraph(Graph):
    """A verify forward's graph and its tails (each a ``Graph`` over this one's outputs)."""
    tail: Graph | None = None          # the greedy acceptance + commit after this forward (``run_tail``)
    sampled_tail: Graph | None = None  # the same with the sampled acceptance (``sampled_tail=True``)


class VerifyGraphs(GraphFamily):
    """Captured verify forwards of one ``ModelRunner``; see the module docstring."""

    kind = "verify"

    def __init__(self, runner, batch_sizes: Sequence[int], tree_sizes: Sequence[int], max_depth: int,
                 pad_block: int, pad_slot: int, capture: bool = True, min_kv: int = 256, pool=None,
                 tail: bool = True, sampled_tail: bool = False):
        super().__init__(runner, batch_sizes, runner.kv_cache, min_kv, capture, pool)
        widths = sorted({int(t) for t in tree_sizes})
        if not widths or widths[0] < 2:
            raise ValueError(f"tree widths must be ints >= 2, got {list(tree_sizes)}")
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2 (root + one draft level), got {max_depth}")
        self.widths, self.max_depth = widths, int(max_depth)
        self.tail, self.sampled_tail = tail, tail and sampled_tail
        self.pad_block, self.pad_slot = int(pad_block), int(pad_slot)
        dev = runner.device
        Bm, Tm = self.batch_sizes[-1], widths[-1]
        self.rows = StaticRows(Bm, _TABLE + self.max_blocks, dev)
        # the step's trees (``DraftBatch``: node 0 the root); a padding row's root carries -1 (token 0)
        self.draft_tokens = torch.full((Bm, Tm), -1, dtype=torch.long, device=dev)  # -1: padding node
        self.draft_parents = torch.zeros(Bm, Tm, dtype=torch.long, device=dev)
        self.draft_parents[:, 0] = -1  # column 0 is the root of every tree
        H, V = self.model.config.hidden_size, self.model.config.vocab_size
        dtype = self.model.lm_head.weight.dtype
        # a key's Bc * Tc rows are at most the factor buffer's nodes (the engine's verify rows): no larger
        # forward is built, and the static outputs hold that many rows
        self.max_rows = min(Bm * Tm, runner.factors.k.shape[1])
        self.out_hidden = torch.zeros(self.max_rows, H, dtype=dtype, device=dev)
        self.out_logits = torch.zeros(self.max_rows, V, dtype=dtype, device=dev)
        # the tail's outputs: per row accepted node, emitted count, the emitted tokens (one host read),
        # and the target hiddens along the accepted path (the drafter's next catch-up inputs)
        self.out_accept = torch.zeros(Bm, 3 + self.max_depth, dtype=torch.long, device=dev)
        self.out_path_hidden = torch.zeros(Bm, self.max_depth, H, dtype=dtype, device=dev)
        # the sampled tail's per-row parameters (``SamplingTensors``): (temperature, top_p) and (top_k, seed)
        self.sample_floats = StaticRows(Bm, 2, dev, dtype=torch.float32)
        self.sample_ints = StaticRows(Bm, 2, dev)
        self.tail_replays = 0
        self.checkpoints = None   # (StatePool, interval, ckpt slot rows): ``enable_checkpoints``

    # -- selection -------------------------------------------------------------------------------
    def supports(self, reqs, width: int) -> bool:
        """Whether a step of ``reqs`` with trees of <= ``width`` nodes (root included) has a graph: batch
        and width within the captured sizes, keys within the cache, the factor buffer large enough."""
        if not 0 < len(reqs) <= self.batch_sizes[-1] or width > self.widths[-1]:
            return False
        Bc, Tc = self._sizes(len(reqs), width)
        return max(r.num_computed for r in reqs) + Tc <= self.kv_lengths[-1] and Bc * Tc <= self.max_rows

    def _sizes(self, batch: int, width: int) -> tuple[int, int]:
        return smallest_at_least(self.batch_sizes, batch), smallest_at_least(self.widths, width)

    def key(self, batch: int, width: int, max_cached: int) -> tuple[int, int, int]:
        """(Bc, Tc, Lc) for ``batch`` trees of <= ``width`` nodes whose longest committed prefix has
        ``max_cached`` tokens (the keys: that prefix and the Tc padded tree nodes)."""
        Bc, Tc = self._sizes(batch, width)
        return Bc, Tc, smallest_at_least(self.kv_lengths, max_cached + Tc)

    # -- building --------------------------------------------------------------------------------
    def _make(self, key: tuple[int, int, int]) -> VerifyGraph:
        """The forward of key (Bc, Tc, Lc) and its tails as closures over static buffers (not captured;
        ``capture`` captures them)."""
        (Bc, Tc, Lc), runner, bs, D = key, self.runner, self.block_size, self.max_depth
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
            st.fill(inp[:, _POS], draft_par, tables, inp[:, _SLOT])
            hidden = model(tok.reshape(-1), ctx)
            out_h.copy_(hidden)
            out_l.copy_(model.compute_logits(hidden))

        g = VerifyGraph(key, run, ctx)
        if self.tail:
            g.tail = self._make_tail(g)
        if self.sampled_tail:
            g.sampled_tail = self._make_tail(g, sampled=True)
        return g

    def _load_padding(self, g: Graph) -> None:
        """Every row a padding row, every node a padding node: what a capture's warm-up runs on (it
        touches the pad block and pad slot only, and commits nothing)."""
        Bc, Tc, Lc = g.key
        self._load([], Bc, Lc)
        self.draft_tokens[:Bc, :Tc].fill_(-1)
        self.draft_parents[:Bc, 1:Tc].fill_(0)
        if self.checkpoints is not None:
            self.checkpoints[2].device[:Bc].fill_(self.checkpoints[3])
        self.load_sampling(Bc, None)

    def _capture_more(self, g: VerifyGraph) -> None:
        for tail in (g.tail, g.sampled_tail):
            if tail is not None:
                tail.graph = capture_graph(tail.run, self.pool, self.runner.device, self.capture_stream)

    def _load(self, reqs, Bc: int, Lc: int) -> None:
        self.rows.fill_roots(reqs, Bc, Lc // self.block_size, self.pad_slot, self.pad_block)
        self.rows.upload(Bc)

    def _keys_upto(self, max_batch: int | None, max_len: int | None,
                   max_width: int | None = None) -> list[tuple[int, int, int]]:
        """Trees of <= ``max_width`` nodes too (all widths when None)."""
        return [(Bc, Tc, Lc) for Bc in sizes_upto(self.batch_sizes, max_batch)
                for Tc in sizes_upto(self.widths, max_width) if Bc * Tc <= self.max_rows
                for Lc in sizes_upto(self.kv_lengths, None if max_len is None else max_len + Tc)]

    # -- a step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, reqs, batch):
        """The verify forward of ``reqs`` over ``batch`` (a trimmed ``DraftBatch``: [B, T] nodes, root
        first); returns (logits [B, T, V] and hidden [Bc * Tc, H] views of the static outputs, valid
        until the next replay; the context ``commit`` takes, with this step's host lists)."""
        B, T = batch.tokens.shape
        g = self.graph(self.key(B, T, max(r.num_computed for r in reqs)))
        Bc, Tc, Lc = g.key
        self._load(reqs, Bc, Lc)
        tok, par = self.draft_tokens[:Bc, :Tc], self.draft_parents[:Bc, :Tc]
        tok.fill_(-1)
        par[:, 1:].fill_(0)  # padding nodes: children of the root
        tok[:B, :T] = batch.tokens
        par[:B, :T] = torch.where(batch.tokens >= 0, batch.parents, 0)  # the root's parent stays -1
        self.replay(g)
        V = self.out_logits.shape[1]
        logits = self.out_logits[:Bc * Tc].view(Bc, Tc, V)[:B, :T]
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

    # -- the tail: acceptance and the commit, after a replayed forward ---------------------------------
    def _make_tail(self, g: VerifyGraph, sampled: bool = False) -> Graph:
        """``bole.engine.acceptance.accept_and_commit`` over the forward's static outputs (greedy, or
        with ``sampled`` each row's parameters from ``load_sampling``), writing the host's one read
        (``out_accept``) and the path's hiddens (``out_path_hidden``); captured by ``capture``."""
        (Bc, Tc, _), D = g.key, self.max_depth
        V = self.out_logits.shape[1]
        logits, hidden = self.out_logits[:Bc * Tc].view(Bc, Tc, V), self.out_hidden[:Bc * Tc]
        tokens, parents = self.draft_tokens[:Bc, :Tc], self.draft_parents[:Bc, :Tc]
        inp, out, out_h = self.rows.device[:Bc], self.out_accept[:Bc], self.out_path_hidden[:Bc]
        model, forest, ctx = self.model, g.ctx.forest, g.ctx
        st = self._sampling(Bc) if sampled else None
        ck = self.checkpoints
        ckpt = None if ck is None else (ck[0], ck[1], ck[2].device[:Bc, 0])

        def run():
            # the forest counts levels (the root 1): node depths for the sampled uniforms
            depth = forest.depth.view(Bc, Tc) - 1 if sampled else None
            # padding rows (the pad state slot) commit nothing; a real row always keeps its root
            accept_and_commit(model, ctx, logits, hidden, tokens, parents, depth, inp[:, _SLOT] != self.pad_slot,
                              inp[:, _POS], D - 1, sampling=st, checkpoint=ckpt, out=out, out_hidden=out_h)

        return Graph(g.key, run, ctx)

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

    def _sampling(self, Bc: int) -> SamplingTensors:
        """The sampled tail's parameters: views of its first ``Bc`` static rows."""
        fl, it = self.sample_floats.device[:Bc], self.sample_ints.device[:Bc]
        return SamplingTensors(temperature=fl[:, 0], top_k=it[:, 0], top_p=fl[:, 1], seed=it[:, 1])

    def load_sampling(self, Bc: int, params: SamplingTensors | None) -> None:
        """The sampled tail's per-row parameters (``params`` on the host); padding rows greedy."""
        fl, it = self.sample_floats.begin(), self.sample_ints.begin()
        fl[:Bc, 0], fl[:Bc, 1], it[:Bc] = 0.0, 1.0, 0
        if params is not None:
            B = len(params)
            fl[:B, 0], fl[:B, 1] = params.temperature.numpy(), params.top_p.numpy()
            it[:B, 0], it[:B, 1] = params.top_k.numpy(), params.seed.numpy()
        self.sample_floats.upload(Bc)
        self.sample_ints.upload(Bc)

    @torch.inference_mode()
    def run_tail(self, g: VerifyGraph, batch: int, checkpoint_slots: Sequence[int | None] | None = None,
                 sampling: SamplingTensors | None = None) -> list[list[int]]:
        """After ``run`` returned ``g``: accept and commit in the captured tail; per request [accepted
        node (0: the root only), emitted count, D tokens (padded), verified nodes] (the step's one
        device-to-host read).
        ``out_path_hidden`` then holds each request's accepted-path hiddens, valid until the next tail.
        ``checkpoint_slots`` (with ``enable_checkpoints``): per request the checkpoint slot its path's
        boundary state goes to, None for a request whose path cannot cross a boundary this step.
        ``sampling``: the requests' ``SamplingTensors`` (on the host) for the sampled tail (``sampled_tail``);
        None: every request greedy, the greedy tail."""
        tail = g.tail if sampling is None else g.sampled_tail
        if tail is None:
            raise ValueError("this VerifyGraphs was built without that tail (tail=False or sampled_tail=False)")
        if sampling is not None:
            self.load_sampling(g.key[0], sampling)
        self.load_checkpoint_slots(g.key[0], checkpoint_slots)
        tail.replay()
        self.tail_replays += 1
        return self.out_accept[:batch].tolist()
