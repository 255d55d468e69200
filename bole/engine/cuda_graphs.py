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
size, MoE models (the expert dispatch reads the routed experts on the host), tensor parallelism.

With ``capture=False`` the same static forward runs without a graph (any device): it tests the
padding and bucketing logic on CPU and gives the benchmark an "uncaptured static" reference.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from bole.models.context import ForwardContext, StaticDecode

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
DEFAULT_MIN_KV = 256
_TOK, _POS, _SLOT, _TABLE = 0, 1, 2, 3  # columns of the static input buffer


def graphs_unsupported(model) -> str | None:
    """Why the model's decode forward cannot be captured (None: it can)."""
    cfg = model.config
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        return "MoE expert dispatch reads routed experts on the host"
    if getattr(model, "tp_size", 1) != 1:
        return "tensor parallelism is not captured"
    return None


def kv_buckets(min_kv: int, capacity: int, block_size: int) -> list[int]:
    """KV lengths graphs are captured for: min_kv doubling (block multiples) up to >= capacity."""
    up = lambda n: -(-n // block_size) * block_size
    out, L = [], up(max(1, min(min_kv, capacity)))
    while L < capacity:
        out.append(L)
        L = up(2 * L)
    out.append(up(capacity))
    return out


def kv_layout(cache, min_kv: int) -> tuple[int, list[int], int]:
    """A graph family over the paged ``cache``: (block size, its KV-length buckets, the blocks of the
    largest bucket: the block-table width of its input rows)."""
    bs = cache.block_size
    lengths = kv_buckets(min_kv, cache.num_blocks * bs, bs)
    return bs, lengths, lengths[-1] // bs


def smallest_at_least(values: Sequence[int], n: int) -> int:
    """The first of the ascending captured sizes ``values`` that is >= n (the caller checked one is)."""
    return next(v for v in values if v >= n)


def sizes_upto(values: Sequence[int], limit: int | None) -> list[int]:
    """The captured sizes a step of size <= ``limit`` can use: those below it and the first >= it
    (the largest when none is; all when ``limit`` is None). For ``capture_all``."""
    if limit is None:
        return list(values)
    return [v for v in values if v < limit] + [next((v for v in values if v >= limit), values[-1])]


def capture_graph(run: Callable[[], None], pool, device) -> "torch.cuda.CUDAGraph":
    """Warm ``run`` up twice on a side stream (allocator, Triton autotuning), then capture it into ``pool``."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph


class StaticRows:
    """A graph's per-row inputs (int64 unless ``dtype``): the host writes a pinned mirror (``begin``
    returns it as a numpy array) and ``upload`` moves its first rows to ``device`` (the buffer the graph
    reads) in ONE non-blocking copy; an event keeps the next ``begin`` from overwriting a copy still in
    flight."""

    def __init__(self, rows: int, width: int, device, dtype=torch.long):
        dev = torch.device(device)
        self.device = torch.zeros(rows, width, dtype=dtype, device=dev)
        self.host = torch.zeros(rows, width, dtype=dtype, pin_memory=dev.type == "cuda")
        self._np = self.host.numpy()
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None

    def begin(self):
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffer
        return self._np

    def upload(self, rows: int) -> None:
        self.device[:rows].copy_(self.host[:rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def fill_roots(self, reqs, rows: int, num_blocks: int, pad_slot: int, pad_block: int) -> None:
        """The decode / verify layout (``_TOK``, ``_POS``, ``_SLOT``, ``_TABLE``...): per request its pending
        root token, num_computed, GDN state slot and first ``num_blocks`` block ids; rows past the
        requests (padding) token 0 at position 0 with the pad slot and pad block."""
        h = self.begin()
        h[:rows, _TOK] = 0
        h[:rows, _POS] = 0
        h[:rows, _SLOT] = pad_slot
        h[:rows, _TABLE:] = pad_block
        for b, r in enumerate(reqs):
            h[b, _TOK] = r.all_token_ids[r.num_computed]
            h[b, _POS] = r.num_computed
            h[b, _SLOT] = r.state_slot
            t = r.block_table[:num_blocks]
            h[b, _TABLE:_TABLE + len(t)] = t


@dataclass
class _Graph:
    batch: int
    kv_len: int
    ctx: ForwardContext
    run: Callable[[], None]            # the static forward (what is captured)
    graph: "torch.cuda.CUDAGraph | None" = None


class DecodeGraphs:
    """Captured decode forwards of one ``ModelRunner``; see the module docstring."""

    def __init__(self, runner, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, pad_block: int = 0,
                 pad_slot: int = 0, capture: bool = True, min_kv: int = DEFAULT_MIN_KV):
        sizes = sorted({int(b) for b in batch_sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch sizes must be ints >= 1, got {list(batch_sizes)}")
        if capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the runner is on {runner.device}")
        why = graphs_unsupported(runner.model)
        if why:
            raise ValueError(f"decode cannot be captured for this model: {why}")
        self.runner, self.model = runner, runner.model
        self.batch_sizes, self.capture = sizes, capture
        self.pad_block, self.pad_slot = int(pad_block), int(pad_slot)
        self.block_size, self.kv_lengths, self.max_blocks = kv_layout(runner.kv_cache, min_kv)
        dev = runner.device
        self.rows = StaticRows(max(sizes), _TABLE + self.max_blocks, dev)
        H, V = self.model.config.hidden_size, self.model.config.vocab_size
        dtype = self.model.lm_head.weight.dtype
        self.out_hidden = torch.zeros(max(sizes), H, dtype=dtype, device=dev)
        self.out_logits = torch.zeros(max(sizes), V, dtype=dtype, device=dev)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None
        self.replays = 0

    # -- selection -------------------------------------------------------------------------------
    def supports(self, reqs) -> bool:
        """Whether this step can run from a graph (batch within the captured sizes, KV within the cache)."""
        return 0 < len(reqs) <= self.batch_sizes[-1] and \
            max(r.num_computed for r in reqs) < self.kv_lengths[-1]

    def key(self, batch: int, max_len: int) -> tuple[int, int]:
        """(Bc, Lc) for a step of ``batch`` requests whose longest has ``max_len`` keys (new token included)."""
        return smallest_at_least(self.batch_sizes, batch), smallest_at_least(self.kv_lengths, max_len)

    @property
    def num_captured(self) -> int:
        return sum(g.graph is not None for g in self.graphs.values())

    # -- building --------------------------------------------------------------------------------
    def _build(self, Bc: int, Lc: int) -> _Graph:
        dev, bs, runner = self.runner.device, self.block_size, self.runner
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

        g = _Graph(Bc, Lc, ctx, run)
        if self.capture:
            self._load([], Bc, Lc)  # capture-time warm-up touches the pad block and pad slot only
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g.graph = capture_graph(run, self.pool, dev)
            logger.info("captured decode graph batch=%d kv_len=%d", Bc, Lc)
        self.graphs[Bc, Lc] = g
        return g

    def _load(self, reqs, Bc: int, Lc: int) -> None:
        """The step's rows (and padding rows) into the static inputs."""
        self.rows.fill_roots(reqs, Bc, Lc // self.block_size, self.pad_slot, self.pad_block)
        self.rows.upload(Bc)

    @torch.inference_mode()
    def capture_all(self, max_batch: int | None = None, max_len: int | None = None) -> int:
        """Build ahead of time every graph a step of <= max_batch requests of <= max_len keys can need
        (all keys when None), so no capture happens inside a timed run; returns how many were built."""
        built = 0
        for Bc in sizes_upto(self.batch_sizes, max_batch):
            for Lc in sizes_upto(self.kv_lengths, max_len):
                if (Bc, Lc) not in self.graphs:
                    self._build(Bc, Lc)
                    built += 1
        return built

    @torch.inference_mode()
    def prepare(self, reqs) -> _Graph:
        """Load the step's inputs into the static buffers; return the graph to replay (captured if new)."""
        Bc, Lc = self.key(len(reqs), max(r.num_computed for r in reqs) + 1)
        g = self.graphs.get((Bc, Lc)) or self._build(Bc, Lc)
        self._load(reqs, Bc, Lc)
        return g

    @torch.inference_mode()
    def replay(self, g: _Graph) -> None:
        if g.graph is not None:
            g.graph.replay()
        else:
            g.run()
        self.replays += 1

    @torch.inference_mode()
    def run(self, reqs) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode forward of ``reqs`` (state committed as in eager decode); returns (logits [B, V],
        hidden [B, H]) as views of the static outputs: valid until the next replay."""
        g = self.prepare(reqs)
        self.replay(g)
        B = len(reqs)
        return self.out_logits[:B], self.out_hidden[:B]


def decode_step_fn(runner, reqs, graphed: bool = True) -> Callable[[], torch.Tensor]:
    """For benchmarks: a callable running one decode forward of ``reqs`` and returning its logits [B, V].

    The requests are not advanced: every call rewrites the new token's K/V at ``num_computed`` and
    applies one GDN step to their state slots (values drift, costs do not). ``graphed``: replay the
    captured graph (inputs loaded once, so a call is the replay alone), which needs ``runner.graphs``
    (``ModelRunner(..., cuda_graph_batch_sizes=...)`` or ``runner.enable_cuda_graphs``); else the
    runner's eager decode forward, host-side context building included.
    """
    if not graphed:
        return lambda: runner.decode_forward(reqs, use_graphs=False)[0]
    graphs = runner.graphs
    if graphs is None or not graphs.supports(reqs):
        raise ValueError("the runner has no decode graph for this batch (enable_cuda_graphs first)")
    g = graphs.prepare(reqs)
    B = len(reqs)

    def step():
        graphs.replay(g)
        return graphs.out_logits[:B]
    return step
