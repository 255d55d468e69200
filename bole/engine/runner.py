"""Model runner: owns the model and its caches and turns scheduled requests into forward passes.

Three kinds of forward per step (DESIGN.md §2), all batched over requests:

* ``prefill(chunks)``: runs known tokens (chunked), returns the last logits of requests whose
  prefill completed. Target hiddens are kept for the MTP drafter. With the prefix cache's checkpoint
  pool (``enable_prefill_checkpoints``) a chunk may name a checkpoint inside it: the GDN layers write
  the state there from inside the forward (``ForwardContext.checkpoints``).
* ``decode(reqs)``: autoregressive mode: one forward over every request's pending root token; on a
  GPU with ``cuda_graph_batch_sizes`` it replays a captured CUDA graph (``bole.engine.graphs.decode``:
  the runner then reserves one extra KV block and one GDN state slot for the graphs' padding rows).
  Prefills that fit the token buckets ``prefill_graph_tokens`` (with the padding; to 256 by default)
  replay captured graphs too (``prefill_graph_sizes``: ``bole.engine.graphs.prefill``), in every mode.
* ``draft(reqs)`` + ``verify(reqs, batch)``: speculative modes. The MTP drafter first catches up
  on the committed positions it has not seen, then grows each request's candidate tree
  (``bole.spec.drafter.expand_tree``); the budget (``select_nodes``) keeps at most B_ver nodes for
  the whole batch; the target verifies every request's tree in ONE forward: node 0 of each tree is
  the pending root token, the kept drafts hang below it (``DraftBatch``: one node list to the commit).
  ``accept_commit`` (eager) or ``accept_commit_in_graph`` (the verify graph's tail) then accept and
  materialise the accepted path, both through ``bole.engine.acceptance.accept_and_commit``
  (factorized GDN commit for all layers in one launch, conv windows, K/V moved into place).

The drafter's forward at each depth runs its new frontier only, in the target's verify mode over the
forest so far (``ForwardContext.suffix``): every node attends to the committed prefix, its ancestors
(whose K/V their own level wrote) and itself.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from bole.cache.kv_cache import PagedKVCache
from bole.cache.state_pool import StatePool
from bole.engine.acceptance import accept_and_commit
from bole.engine.drafting import empty_factors, grow_draft_tree
from bole.engine.graphs.base import graphs_unsupported, own_stream, smallest_at_least
from bole.engine.graphs.decode import DecodeGraphs
from bole.engine.graphs.draft import DraftGraphs
from bole.engine.graphs.prefill import DEFAULT_TOKEN_SIZES, PrefillGraphs, prefill_graphs_unsupported
from bole.engine.graphs.verify import VerifyGraphs
from bole.engine.sampler import SamplingTensors
from bole.engine.sequence import Request
from bole.models.context import ForwardContext, TreeFactors
from bole.spec.budget import select_nodes
from bole.spec.drafter import DraftBatch, compact
from bole.spec.tree import PackedForest

logger = logging.getLogger(__name__)

# the most tokens an eager prefill forward writes checkpoints inside (``ModelRunner.checkpoints_in_forward``)
INLINE_CHECKPOINT_TOKENS = 512

@dataclass
class VerifyResult:
    logits: torch.Tensor          # [B, T, V]: row i tree node i (0: the root)
    ctx: ForwardContext
    hidden: torch.Tensor          # [N, H] flat over the forest
    forest: PackedForest
    graph: object = None          # the verify graph replayed (``VerifyGraphs``), None when eager
    tree: DraftBatch | None = None  # the trees verified (node 0 the root)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, num_state_slots: int,
                 max_batch_nodes: int, kv_dtype: torch.dtype, device, snapshot_verify: bool = False,
                 cuda_graph_batch_sizes: Sequence[int] | None = None, verify_graph_spec: dict | None = None,
                 draft_graph_spec: dict | None = None, prefill_graph_sizes: Sequence[int] | None = None,
                 prefill_graph_tokens: Sequence[int] = DEFAULT_TOKEN_SIZES, prefill_beside: bool = False):
        cfg = getattr(model, "local_config", model.config)  # this TP rank's head counts (bole.parallel)
        self.model, self.cfg, self.device = model, cfg, torch.device(device)
        self.block_size = block_size
        graphs = bool(cuda_graph_batch_sizes or verify_graph_spec or draft_graph_spec or prefill_graph_sizes) and \
            self.device.type == "cuda"
        if graphs and graphs_unsupported(model):
            logger.warning("CUDA graphs off: %s; decode and verify run eagerly", graphs_unsupported(model))
            graphs = False
        spare = int(graphs)  # the graphs' padding rows get their own KV block and state slot
        self.kv_cache = PagedKVCache(cfg.num_attn_layers, num_blocks + spare, block_size,
                                     cfg.num_key_value_heads, cfg.head_dim, kv_dtype, device)
        self.mtp_cache = None
        if model.mtp is not None:
            self.mtp_cache = PagedKVCache(len(model.mtp.layers), num_blocks + spare, block_size,
                                          cfg.num_key_value_heads, cfg.head_dim, kv_dtype, device)
        # conv inputs are activations of the model dtype, so a pool of that dtype stores them exactly
        self.state_pool = StatePool.for_model(cfg, num_state_slots + spare, conv_dtype=kv_dtype, device=device)
        # one factor buffer for every GDN layer and every node of a step's forest
        self.factors = TreeFactors.allocate(cfg, max_batch_nodes, dtype=kv_dtype, device=device,
                                            snapshots=snapshot_verify)
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        self.draft_graphs: DraftGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.checkpoint_pool: StatePool | None = None   # the prefix cache's (``enable_prefill_checkpoints``)
        # whether the last decode_forward / draft_batch / prefill replayed a graph
        self.decode_graphed = self.draft_graphed = self.prefill_graphed = False
        self._pad: tuple[int, int] | None = None
        # ``prefill_beside``: a stream of the device's highest priority, this runner's own, for prefills run
        # while a decode / verify forward is in flight (``beside``); the prefill graphs then get a memory
        # pool of their own and are captured on it
        self.prefill_stream = None
        if prefill_beside and self.device.type == "cuda":
            self.prefill_stream = own_stream(self, self.device)
            if self.prefill_stream is None:
                raise ValueError("admit_during_forward needs a stream of the highest priority of its own: every one "
                                 "is held by a live engine in this process")
        self._capture_stream: torch.cuda.Stream | bool | None = None   # ``graph_capture_stream``
        self._beside: torch.cuda.Stream | None = None   # the stream a ``beside`` block left (its kept hiddens')
        if graphs and cuda_graph_batch_sizes:
            self.enable_cuda_graphs(cuda_graph_batch_sizes)
        if graphs and verify_graph_spec:
            self.enable_verify_graphs(**verify_graph_spec)
        if graphs and draft_graph_spec and model.mtp is not None:
            self.enable_draft_graphs(**draft_graph_spec)
        if graphs and prefill_graph_sizes:
            why = prefill_graphs_unsupported(model)
            if why:
                logger.warning("prefill graphs off: %s; prefills run eagerly", why)
            else:
                self.enable_prefill_graphs(prefill_graph_sizes, token_sizes=prefill_graph_tokens)

    def graph_capture_stream(self) -> "torch.cuda.Stream | None":
        """The stream this runner's graph families capture on (``own_stream``; taken when the first family
        is built; None: none was free, torch's default capture stream); the prefill graphs beside the
        forwards capture on the prefill stream instead. Replacing a family on a live runner destroys
        graphs captured on this stream, which frees the workspace the others use: the engine never does."""
        if self._capture_stream is None and self.device.type == "cuda":
            self._capture_stream = own_stream(self, self.device) or False   # False: asked, none was free
        return self._capture_stream or None

    def enable_cuda_graphs(self, batch_sizes: Sequence[int], capture: bool = True, **kw) -> DecodeGraphs:
        """Route ``decode`` through ``DecodeGraphs``; takes one KV block and one state slot for padding
        (the constructor sizes the pools one larger when it is asked for graphs). ``capture=False`` runs
        the same static forward without graphs (any device; tests)."""
        self.graphs = DecodeGraphs(self, batch_sizes, *self.padding(), capture=capture, **kw)
        return self.graphs

    def enable_verify_graphs(self, batch_sizes: Sequence[int], tree_sizes: Sequence[int], max_depth: int,
                             capture: bool = True, **kw) -> VerifyGraphs:
        """Route ``verify`` through ``VerifyGraphs`` (trees of <= max(tree_sizes) nodes, root included,
        and depth <= max_depth); shares the decode graphs' padding block and slot and memory pool."""
        pool = self.graphs.pool if self.graphs is not None else None
        self.verify_graphs = VerifyGraphs(self, batch_sizes, tree_sizes, max_depth, *self.padding(),
                                          capture=capture, pool=pool, **kw)
        return self.verify_graphs

    def enable_draft_graphs(self, batch_sizes: Sequence[int], depth: int, topk: int, beam: int,
                            capture: bool = True, **kw) -> DraftGraphs:
        """Route ``draft_batch`` through ``DraftGraphs`` for these drafting settings (other settings, and
        catch-ups longer than depth + 1, run eagerly); ``max_per_request`` in kw: the cap of a step that
        passes none."""
        pool = next((g.pool for g in (self.graphs, self.verify_graphs) if g is not None), None)
        self.draft_graphs = DraftGraphs(self, batch_sizes, depth, topk, beam, self.padding()[0],
                                        capture=capture, pool=pool, **kw)
        return self.draft_graphs

    def enable_prefill_graphs(self, batch_sizes: Sequence[int], capture: bool = True, **kw) -> PrefillGraphs:
        """Route short ``prefill`` steps through ``PrefillGraphs``; shares the padding block and slot and
        (unless prefills may run ``beside`` the other graphs) the decode graphs' memory pool and capture
        stream; beside them, a pool and a capture stream of their own (``base.capture_graph``: the
        stream fixes each graph's cuBLAS workspace)."""
        pool = next((g.pool for g in (self.graphs, self.verify_graphs, self.draft_graphs) if g is not None), None)
        if self.prefill_stream is not None:   # replayed while a verify / draft / decode graph runs
            pool = None
            # the prefill stream itself (``own_stream``: no other runner's, nor the verify / decode graphs'),
            # as prefill work never overlaps prefill work
            kw.setdefault("capture_stream", self.prefill_stream if capture else None)
        self.prefill_graphs = PrefillGraphs(self, batch_sizes, *self.padding(), capture=capture, pool=pool, **kw)
        if self.checkpoint_pool is not None:
            self.prefill_graphs.enable_checkpoints(self.checkpoint_pool)
        return self.prefill_graphs

    def enable_prefill_checkpoints(self, pool: StatePool) -> None:
        """Let prefills write prefix-cache checkpoints into ``pool`` (the prefix cache's checkpoint pool),
        eagerly and in the prefill graphs (before any graph is captured)."""
        self.checkpoint_pool = pool
        if self.prefill_graphs is not None:
            self.prefill_graphs.enable_checkpoints(pool)

    @contextlib.contextmanager
    def beside(self, fence: "torch.cuda.Event"):
        """Run the block's GPU work (an admission's prefills) on ``prefill_stream`` while the current stream
        runs a forward already launched: it starts after ``fence`` (recorded on the current stream before
        that forward, so it never meets the work queued earlier) and, with the device's highest priority,
        ahead of the forward's blocks not yet scheduled; the current stream's later work waits for it.
        Safe beside a draft / verify / decode forward: those touch only their own requests' KV blocks and
        state slots, the verify factors and their graphs' pool and buffers, none of which a prefill reads
        or writes (its graphs have their own pool, and their own capture stream, so their own cuBLAS
        workspace; padding rows write garbage into the shared padding block either way). Kept hiddens are
        marked used by the current stream (the caching allocator keeps them from the prefill stream's next
        allocation until that stream's work is done)."""
        main = torch.cuda.current_stream(self.device)
        side = self.prefill_stream
        side.wait_event(fence)
        self._beside = main
        try:
            with torch.cuda.stream(side):
                yield
        finally:
            self._beside = None
            main.wait_stream(side)

    def checkpoints_in_forward(self, chunks: list[tuple[Request, int]]) -> bool:
        """Whether one prefill forward of ``chunks`` can write checkpoints inside them, at the speed of a
        chunk and then its tail: a captured prefill fits them (the engine asks per graphed wave), or,
        without prefill graphs, they total at most ``INLINE_CHECKPOINT_TOKENS`` (eager: the checkpointing
        GDN layers take the recurrence, which outran fla's chunk per layer to 512 tokens at the 9B shape,
        ``bole.engine.graphs.prefill``). With graphs on, a forward no graph fits keeps the chunk and tail:
        an eager 9B-cost prefill took 80-90 ms against ~10 ms captured."""
        if self.checkpoint_pool is None or not chunks:
            return False
        if self.prefill_graphs is not None:
            return self.prefill_graphs.supports(chunks)
        return sum(n for _, n in chunks) <= INLINE_CHECKPOINT_TOKENS

    def all_graphs(self) -> list:
        """The runner's graph families (those enabled), for ``capture_all`` before a timed run."""
        return [g for g in (self.graphs, self.verify_graphs, self.draft_graphs, self.prefill_graphs) if g is not None]

    def graph_captures(self) -> tuple[int, float]:
        """CUDA graphs every family captured so far (at start or when a step first needed one), and the
        host seconds those captures took."""
        fams = self.all_graphs()
        return sum(g.num_captured for g in fams), sum(g.capture_seconds for g in fams)

    def padding(self) -> tuple[int, int]:
        """The KV block and GDN state slot that graphs' padding rows use (reserved once)."""
        if self._pad is None:
            self._pad = (self.allocator.allocate(1)[0], self.state_pool.allocate())
        return self._pad

    @property
    def allocator(self):
        return self.kv_cache.allocator

    # -- target forwards -------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, chunks: list[tuple[Request, int]], keep_hidden: bool,
                position_logits: dict[str, torch.Tensor] | None = None,
                checkpoints: Sequence[tuple[int, int] | None] | None = None) -> dict[str, torch.Tensor]:
        """Run each request's next chunk; return {request_id: last logits [V]} for completed prefills.
        From a captured graph when the runner has prefill graphs and one fits (its largest token bucket).
        ``position_logits``: when given, the logits of every position of the chunk [n, V] of each
        request that ``needs_prompt_logits`` go there (the lm_head runs on those rows only).
        ``checkpoints``: per chunk, None or (tokens of the chunk up to the checkpoint, checkpoint slot):
        the GDN state there goes to that slot of ``checkpoint_pool``."""
        cu = [0]
        for _, n in chunks:
            cu.append(cu[-1] + n)
        ck = None
        if checkpoints is not None and any(c is not None for c in checkpoints):
            if self.checkpoint_pool is None or len(checkpoints) != len(chunks):
                raise ValueError(f"{len(checkpoints)} checkpoints for {len(chunks)} chunks, checkpoint pool "
                                 f"{'set' if self.checkpoint_pool is not None else 'not set'}")
            ck = [c if c is not None else (0, 0) for c in checkpoints]
        pg = self.prefill_graphs
        self.prefill_graphed = pg is not None and pg.supports(chunks)
        if self.prefill_graphed:
            hidden, last = pg.run(chunks, ck)
            logits_of = lambda b: last[b]
        else:
            ids = torch.cat([torch.tensor(r.all_token_ids[r.num_computed:r.num_computed + n]) for r, n in chunks])
            ctx = ForwardContext.build("prefill", [n for _, n in chunks], [r.num_computed for r, _ in chunks],
                                       [r.state_slot for r, _ in chunks], [r.block_table for r, _ in chunks],
                                       self.kv_cache, self.state_pool, device=self.device,
                                       checkpoints=None if ck is None else
                                       (self.checkpoint_pool, [e for e, _ in ck], [s for _, s in ck]))
            hidden = self.model(ids.to(self.device), ctx)
            logits_of = lambda b: self.model.compute_logits(hidden[cu[b + 1] - 1:cu[b + 1]])[0]
        out = {}
        for b, (req, n) in enumerate(chunks):
            if position_logits is not None and req.needs_prompt_logits:
                position_logits[req.request_id] = self.model.compute_logits(hidden[cu[b]:cu[b + 1]])
            if keep_hidden:
                req.queue_hidden(hidden[cu[b]:cu[b + 1]])
                if self._beside is not None:   # read by the drafter on the main stream (``beside``)
                    req.pending_hidden.record_stream(self._beside)
            req.num_computed += n
            if req.num_computed == req.num_tokens:
                out[req.request_id] = logits_of(b)
        return out

    def prefill_waves(self, chunks: list[tuple[Request, int]]) -> list[list[tuple[Request, int]]]:
        """``chunks`` as consecutive forwards that each replay a captured prefill graph, for a step whose
        prefill fits none whole (``EngineConfig.cuda_graph_prefill_split``): waves filled in order up to
        the largest token bucket with its padding rows, a chunk that overflows a wave cut there and
        continued in the next (a request's part in a later wave starts where its earlier one ended, as a
        chunked prefill does across steps). ``[chunks]`` (one eager forward, as before) without prefill
        graphs, when they fit one graph already, or when a chunk's keys reach past the graphs' KV lengths
        (checked at each chunk's end: a later part's start is past the request's ``num_computed``)."""
        pg = self.prefill_graphs
        if pg is None or not chunks or pg.supports(chunks) \
                or max(r.num_computed + n for r, n in chunks) > pg.kv_lengths[-1]:   # a later part's keys
            return [chunks]
        tokens, sizes = pg.token_sizes[-1], pg.batch_sizes
        waves, wave, used, todo = [], [], 0, list(chunks)
        while todo:
            req, n = todo.pop(0)
            b = len(wave) + 1
            Bc = next((s for s in sizes if s >= b), None)
            room = 0 if Bc is None else tokens - (Bc - b + 1) - used   # less the padding rows' tokens
            if room <= 0:           # this wave is full (b > 1 here: one chunk alone always has room)
                waves.append(wave)
                wave, used = [], 0
                todo.insert(0, (req, n))
                continue
            k = min(n, room)
            wave.append((req, k))
            used += k
            if k < n:               # the rest goes on in the next wave
                todo.insert(0, (req, n - k))
                waves.append(wave)
                wave, used = [], 0
        if wave:
            waves.append(wave)
        return waves if all(pg.supports(w) for w in waves) else [chunks]   # (holds by construction: a guard)

    @torch.inference_mode()
    def warm_up(self, row_lengths: Sequence[Sequence[int]], drafter: bool = True) -> None:
        """Run one eager prefill forward per entry of ``row_lengths`` (the token count of each row), the
        target's and (with ``drafter``) the drafter's, over one scratch KV block and GDN state slot taken and
        given back: the kernels a prefill first launches (fla's autotuned chunk kernels, the conv) compile
        now rather than inside a served step. Every row starts at position 0 and runs over the same block
        (its table repeats it), so the rows write garbage there only; the slot is zeroed when a request
        next takes it. Call before any request holds memory."""
        (block,), slot = self.allocator.allocate(1), self.state_pool.allocate()
        # eager checkpointing prefills (no prefill graphs): their kernels' variants too, writing checkpoint
        # slot 0 (no checkpoint exists yet)
        ckpt = [False] + ([True] if self.checkpoint_pool is not None and self.prefill_graphs is None else [])
        try:
            for rows, ck in ((rows, ck) for rows in row_lengths for ck in ckpt):
                rows = [int(n) for n in rows]
                if ck and (max(rows) < 2 or sum(rows) > INLINE_CHECKPOINT_TOKENS):
                    continue
                table = [block] * -(-max(rows) // self.block_size)
                ends = [1 if n == max(rows) and ck else 0 for n in rows]
                ctx = ForwardContext.build("prefill", rows, [0] * len(rows), [slot] * len(rows), [table] * len(rows),
                                           self.kv_cache, self.state_pool, device=self.device,
                                           checkpoints=(self.checkpoint_pool, ends, [0] * len(rows)) if ck else None)
                ids = torch.zeros(sum(rows), dtype=torch.long, device=self.device)
                hidden = self.model(ids, ctx)   # (the lm_head is a cuBLAS GEMM: nothing to compile)
                if drafter and self.model.mtp is not None and not ck:   # (the drafter has no GDN layer)
                    mctx = ForwardContext.build("prefill", rows, [0] * len(rows), [0] * len(rows), [table] * len(rows),
                                                self.mtp_cache, None, device=self.device)
                    self.model.mtp(ids, hidden, mctx)
        finally:
            self.allocator.free([block])
            self.state_pool.free(slot)

    @torch.inference_mode()
    def decode_forward(self, reqs: list[Request], use_graphs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode forward of ``reqs`` at their pending root tokens, without advancing them (the new
        K/V is written and the GDN state stepped); returns (logits [B, V], hidden [B, H]). From a CUDA
        graph when the runner has graphs for this batch and ``use_graphs``, else eagerly."""
        self.decode_graphed = use_graphs and self.graphs is not None and self.graphs.supports(reqs)
        if self.decode_graphed:
            logits, hidden = self.graphs.run(reqs)
            return logits.clone(), hidden.clone()  # the static outputs are overwritten by the next replay
        ids = torch.tensor([r.all_token_ids[r.num_computed] for r in reqs], device=self.device)
        ctx = ForwardContext.build("decode", [1] * len(reqs), [r.num_computed for r in reqs],
                                   [r.state_slot for r in reqs], [r.block_table for r in reqs],
                                   self.kv_cache, self.state_pool, device=self.device)
        hidden = self.model(ids, ctx)
        return self.model.compute_logits(hidden), hidden

    @torch.inference_mode()
    def decode(self, reqs: list[Request], keep_hidden: bool) -> torch.Tensor:
        """One token per request (the pending root); returns logits [B, V]. Commits the state."""
        logits, hidden = self.decode_forward(reqs)
        for b, r in enumerate(reqs):
            r.num_computed += 1
            if keep_hidden:
                r.queue_hidden(hidden[b:b + 1])
        return logits

    def verify_batch_size(self, batch: int) -> int:
        """Trees a verify forward of ``batch`` requests holds: its graph's padded batch (the eager
        forward's is ``batch``)."""
        vg = self.verify_graphs
        return smallest_at_least(vg.batch_sizes, batch) if vg is not None and batch <= vg.batch_sizes[-1] else batch

    @torch.inference_mode()
    def verify(self, reqs: list[Request], batch: DraftBatch) -> VerifyResult:
        """Target forward over every request's tree (``batch``: node 0 the pending root token, the kept
        drafts below it): logits row i is node i's."""
        B, T = batch.tokens.shape
        vg = self.verify_graphs
        if vg is not None and vg.supports(reqs, T):
            logits, hidden, ctx, g = vg.run(reqs, batch)
            return VerifyResult(logits=logits, ctx=ctx, hidden=hidden, forest=ctx.forest, graph=g, tree=batch)
        valid = torch.arange(T, device=batch.tokens.device)[None] < batch.num_nodes[:, None]
        forest = PackedForest.from_padded(batch.parents, batch.num_nodes, int(batch.depth.max()) + 1).to(self.device)
        ctx = ForwardContext.build("verify", None, [r.num_computed for r in reqs], [r.state_slot for r in reqs],
                                   [r.block_table for r in reqs], self.kv_cache, self.state_pool,
                                   forest=forest, factors=self.factors.narrow(forest.num_nodes),
                                   device=self.device)
        hidden = self.model(batch.tokens[valid].to(self.device), ctx)
        flat = self.model.compute_logits(hidden)
        logits = flat.new_zeros(B, T, flat.shape[-1])
        logits[valid.to(flat.device)] = flat
        return VerifyResult(logits=logits, ctx=ctx, hidden=hidden, forest=forest, tree=batch)

    def can_accept_in_graph(self, res: VerifyResult, sampled: bool = False) -> bool:
        """Whether ``accept_commit_in_graph`` applies: the verify forward was a replayed graph with a tail
        (``sampled``: with the sampled tail)."""
        return res.graph is not None and (res.graph.sampled_tail if sampled else res.graph.tail) is not None

    @torch.inference_mode()
    def accept_commit_in_graph(self, reqs: list[Request], res: VerifyResult,
                               checkpoint_slots: list[int | None] | None = None,
                               sampling: SamplingTensors | None = None) -> list[list[int]]:
        """``accept_and_commit`` of every request in the verify graph's captured tail
        (``VerifyGraphs.run_tail``, with its prefix-cache checkpoint slots; greedy, or sampled with
        ``sampling``: the requests' ``SamplingTensors``, on the host); then ``_advance``. Returns per
        request [accepted node, emitted count, the tokens (the first ``emitted count`` are emitted),
        verified nodes]."""
        host = self.verify_graphs.run_tail(res.graph, len(reqs), checkpoint_slots, sampling)
        self._advance(reqs, host, self.verify_graphs.out_path_hidden[:len(reqs)].clone())  # [B, D, H]
        return host

    @torch.inference_mode()
    def accept_commit(self, reqs: list[Request], res: VerifyResult, logits: torch.Tensor, max_depth: int,
                      sampling: SamplingTensors | None = None, penalties=None, checkpoint=None) -> list[list[int]]:
        """``accept_and_commit`` of every request eagerly, over ``logits`` (the verify logits after the
        step's preprocessing) and the verified trees (``res.tree``); ``sampling`` on the device (None:
        greedy); ``checkpoint`` as ``accept_and_commit`` takes it. Then ``_advance``; returns what
        ``accept_commit_in_graph`` returns (one device-to-host read)."""
        B, dev = len(reqs), logits.device
        need_counts = sampling is not None or checkpoint is not None   # the uniforms' counters, the cut
        num_computed = torch.tensor([r.num_computed for r in reqs], device=dev) if need_counts else None
        out, path_hidden = accept_and_commit(
            self.model, res.ctx, logits, res.hidden, res.tree.tokens, res.tree.parents, res.tree.depth,
            torch.ones(B, dtype=torch.bool, device=dev), num_computed, max_depth, sampling=sampling,
            penalties=penalties, checkpoint=checkpoint)
        host = out.tolist()
        self._advance(reqs, host, path_hidden)
        return host

    @staticmethod
    def _advance(reqs: list[Request], host: list[list[int]], path_hidden: torch.Tensor) -> None:
        """After a commit: each request's committed length grows by its path (the emitted count), and
        the path's target hiddens [B, D, H] are queued for the drafter."""
        for b, r in enumerate(reqs):
            r.queue_hidden(path_hidden[b, :host[b][1]])
            r.num_computed += host[b][1]

    # -- drafting ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def catch_up_drafter(self, reqs: list[Request]) -> None:
        """Fill the drafter KV of every committed position whose next token is known (a finishing
        request's cached blocks then carry complete drafter entries)."""
        reqs = [r for r in reqs
                if r.mtp_computed < r.num_computed < r.num_tokens and r.pending_hidden is not None]
        if reqs:
            self._mtp_catch_up(reqs)

    def _mtp_catch_up(self, reqs: list[Request], leave: int = 0) -> torch.Tensor:
        """Feed the MTP the committed positions it has not seen but the last ``leave`` of each request;
        return its hidden at the last position fed [B, H].

        Position p of the drafter takes (target hidden at p, token p+1); the last one (p = num_computed-1)
        pairs with the pending root token and predicts the first draft level. With ``leave`` > 0 the
        requests keep their last ``leave`` positions (and target hiddens) pending: the draft graph's
        catch-up then runs them (``draft_batch`` after a prefill).
        """
        new = [r.num_computed - r.mtp_computed - leave for r in reqs]
        ids = torch.cat([torch.tensor(r.all_token_ids[r.mtp_computed + 1:r.mtp_computed + 1 + n])
                         for r, n in zip(reqs, new)])
        end = lambda r: r.pending_hidden.shape[0] - leave
        hid = torch.cat([r.pending_hidden[end(r) - n:end(r)] for r, n in zip(reqs, new)])
        ctx = ForwardContext.build("prefill", new, [r.mtp_computed for r in reqs], [0] * len(reqs),
                                   [r.block_table for r in reqs], self.mtp_cache, None, device=self.device)
        h = self.model.mtp(ids.to(self.device), hid, ctx)
        for r, n in zip(reqs, new):
            r.mtp_computed += n
            r.pending_hidden = r.pending_hidden[end(r):] if leave else None
        return h[torch.tensor(ctx.cu_host[1:], device=self.device) - 1]

    @torch.inference_mode()
    def _catch_up_head(self, reqs: list[Request]) -> None:
        """A catch-up longer than the draft graph's (the first draft after a prefill): its head eagerly,
        the last depth + 1 positions left to the graph."""
        dg = self.draft_graphs
        if dg is None or len(reqs) > dg.batch_sizes[-1]:
            return
        long = [r for r in reqs if r.num_computed - r.mtp_computed > dg.catch_up and r.pending_hidden is not None
                and r.pending_hidden.shape[0] >= r.num_computed - r.mtp_computed]
        if long:
            self._mtp_catch_up(long, leave=dg.catch_up)

    @torch.inference_mode()
    def draft_batch(self, reqs: list[Request], depth: int, topk: int, beam: int, b_ver: int,
                    max_per_request: int | None = None, *, floor: str,
                    costs: list[tuple[int, float, int]] | None = None) -> DraftBatch:
        """Draft (``draft``), keep ``b_ver`` nodes for the batch (``select_nodes``, at most
        ``max_per_request`` per request, its fairness ``floor``) and compact them below the pending root
        tokens: the step's ``DraftBatch`` [B, 1 + T_max] (untrimmed). From the draft graph when it applies
        (its drafting settings and floor; the cap is a per-step input there, and None means the graph
        family's own ``max_per_request`` there but no cap eagerly: the engine always passes one). ``costs``:
        the goodput rule's (capacity, T_ver ms, drafts per request) triples (``bole.spec.budget.goodput_rows``),
        or None."""
        dg = self.draft_graphs
        if dg is not None and (dg.depth, dg.topk, dg.beam, dg.floor, dg.goodput) == (
                depth, topk, beam, floor, costs is not None):
            self._catch_up_head(reqs)
            if dg.supports(reqs):
                self.draft_graphed = True
                return dg.run(reqs, b_ver, max_per_request, costs)
        self.draft_graphed = False
        cand = self.draft(reqs, depth, topk, beam)
        chosen = None if costs is None else torch.zeros((), dtype=torch.long, device=self.device)
        keep = select_nodes(cand.rho, cand.parents, cand.valid, cand.depth, b_ver, max_per_request=max_per_request,
                            floor=floor, costs=None if costs is None else
                            torch.tensor(costs, dtype=torch.float32, device=self.device).T, chosen=chosen)
        roots = torch.tensor([r.all_token_ids[r.num_computed] for r in reqs], device=self.device)
        return replace(compact(cand, keep, roots), budget=chosen)

    @torch.inference_mode()
    def draft(self, reqs: list[Request], depth: int, topk: int, beam: int):
        """Grow every request's candidate tree with the MTP head (EAGLE-2 style); returns DraftCandidates.

        Each ``step`` call evaluates the MTP at the new frontier. The forest it runs holds every
        frontier node evaluated so far (a frontier node's ancestors are earlier frontier nodes), so
        each node attends to the committed prefix and its own ancestors; a node's input hidden is its
        parent's MTP output (the catch-up output for first-level nodes).
        """
        h_root = self._mtp_catch_up(reqs)
        B, dev = h_root.shape[0], self.device

        def tree_ctx(par: torch.Tensor, d: int) -> ForwardContext:
            forest = PackedForest.from_padded(par, torch.full((B,), par.shape[1], device=dev), d)
            return ForwardContext.build("verify", None, [r.num_computed for r in reqs], [0] * B,
                                        [r.block_table for r in reqs], self.mtp_cache, None, forest=forest,
                                        factors=empty_factors(forest.num_nodes, dev), device=dev)

        return grow_draft_tree(self.model.mtp, h_root, depth, topk, beam, tree_ctx)
