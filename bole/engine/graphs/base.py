"""What every graph family shares: the ``GraphFamily`` protocol (supports / key / capture / run), the
capture itself, the static per-row inputs (``StaticRows``) and the size buckets.

A family captures one static forward per *graph key* (its padded batch, KV-length bucket and, per
family, tree width or token bucket), lazily the first time a key is needed or ahead of a timed run
(``capture_all``), into one memory pool the runner's families share. A family's ``_make(key)``
returns the forward as a closure over static buffers (``Graph.run``); ``capture(key)`` captures it
after loading padding-only inputs (the capture's warm-up then touches the runner's pad KV block and
pad GDN slot only). With ``capture=False`` the same static forwards run without graphs (any device:
the CPU tests of the padding and bucketing).
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from bole.models.context import ForwardContext
from bole.ops.moe import moe_experts_ref

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
DEFAULT_MIN_KV = 256
_TOK, _POS, _SLOT, _TABLE = 0, 1, 2, 3  # columns of the decode / verify static input rows


def graphs_unsupported(model) -> str | None:
    """Why the model's forwards cannot be captured (None: they can)."""
    cfg = model.config
    if (any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
            and model.backend.moe_experts is moe_experts_ref):
        return "MoE expert dispatch reads routed experts on the host (bole.ops.moe; kernels.moe_experts does not)"
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


def smallest_at_least(values: Sequence[int], n: int) -> int:
    """The first of the ascending captured sizes ``values`` that is >= n (the caller checked one is)."""
    return next(v for v in values if v >= n)


def sizes_upto(values: Sequence[int], limit: int | None) -> list[int]:
    """The captured sizes a step of size <= ``limit`` can use: those below it and the first >= it
    (the largest when none is; all when ``limit`` is None). For ``capture_all``."""
    if limit is None:
        return list(values)
    return [v for v in values if v < limit] + [next((v for v in values if v >= limit), values[-1])]


# the cuda stream handles live owners (runners) hold for their graph captures and priority work, and per
# device the streams dropped owners held, handed out again first (``own_stream``)
_HELD: set[int] = set()
_FREE: dict[torch.device, list["torch.cuda.Stream"]] = {}
# runners may be built on several threads (check, then take); reentrant: a dropped owner's finalizer
# (``_release``) may run inside the block, on a collection that an allocation there triggers
_STREAMS_LOCK = threading.RLock()


def _device_key(device) -> torch.device:
    """``device`` with its index: "cuda" and "cuda:0" name one device's streams."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _release(device: torch.device, stream: "torch.cuda.Stream") -> None:
    with _STREAMS_LOCK:
        _HELD.discard(stream.cuda_stream)
        _FREE.setdefault(device, []).append(stream)


def own_stream(owner, device) -> "torch.cuda.Stream | None":
    """A stream of the device's highest priority that no other live owner holds, held until ``owner`` is
    collected: a runner captures its graphs on one (``capture_graph``) and prefills beside its forwards on
    another. Why own: torch keys cuBLAS's workspace by (handle, stream), bakes the capture stream's into
    each graph, and frees it when any graph captured on that stream is destroyed (``CUDAGraph::reset``), so
    graphs of two runners captured on one stream share a workspace, and dropping one runner (a calibration
    sweep's, a test's engine) leaves the other's graphs a freed one. A dropped owner's stream is handed out
    again before a new one: torch keeps a stream's workspace (32 MiB on Hopper) for the process, so fresh
    streams from torch's pool for every engine of a process (a benchmark's cells) would leave one behind
    each. The highest-priority pool never holds torch's default capture stream (priority 0). None when
    every stream of that pool is held (the caller shares torch's default capture stream then, as before,
    with a warning)."""
    device = _device_key(device)
    priority = torch.cuda.Stream.priority_range()[1]
    for attempt in range(2):
        if attempt:
            gc.collect()   # dropped runners sit in reference cycles (family <-> runner) until collected
        with _STREAMS_LOCK:
            free = _FREE.setdefault(device, [])
            fresh = (torch.cuda.Stream(device, priority=priority) for _ in range(65))  # torch's pool: 32 a priority
            for s in itertools.chain(reversed(list(free)), fresh):   # the last dropped first
                if s.cuda_stream not in _HELD:
                    if s in free:
                        free.remove(s)
                    _HELD.add(s.cuda_stream)
                    weakref.finalize(owner, _release, device, s)
                    return s
    logger.warning("every high-priority stream is held by a live runner: this one shares torch's default capture "
                   "stream (and its cuBLAS workspace) with other graphs")
    return None


# per device, the one stream that warms up captures made on torch's default capture stream (``capture_graph``)
_WARMUP: dict[torch.device, "torch.cuda.Stream"] = {}


def capture_graph(run: Callable[[], None], pool, device, stream=None) -> "torch.cuda.CUDAGraph":
    """Warm ``run`` up twice (allocator, Triton autotuning) on ``stream``, then capture it into ``pool`` on
    ``stream`` (None: torch's one default capture stream, warmed up on one stream per device). The capture
    stream is more than a detail: torch keys cuBLAS's workspace by (handle, stream), so every graph
    captured on one stream bakes in the same workspace address, and two of them replayed at once on
    different streams share it (pytorch issue 193402). Graphs that may run concurrently must be captured
    on different streams. The warm-up runs on the capture stream too: a warm-up stream gets a workspace of
    its own (32 MiB on Hopper) that torch keeps for the process, freed only with a graph captured on that
    stream, so a fresh warm-up stream per capture left up to one per stream of torch's pool behind, after
    the memory plan (128 MiB an engine of the embedded model on an H100). Without a ``stream`` the warm-up
    runs on one stream per device (the capture on torch's default capture stream: the warned fallback of
    ``own_stream``)."""
    side = stream
    if side is None:
        dev = _device_key(device)
        side = _WARMUP.get(dev) or _WARMUP.setdefault(dev, torch.cuda.Stream(device=dev))
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # No garbage collection inside the capture: torch no longer collects before one, so a dead cycle
    # holding an earlier graph (an engine its owner dropped) could be freed mid-capture, and destroying
    # a graph while a stream captures invalidates that capture (cudaErrorStreamCaptureInvalidated).
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            run()
    finally:
        if collecting:
            gc.enable()
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
class Graph:
    """One key's static forward: ``run`` (a closure over the family's static buffers, what is captured),
    its context when the family keeps one, and its CUDA graph once captured."""
    key: tuple[int, ...]
    run: Callable[[], None]
    ctx: ForwardContext | None = None
    graph: "torch.cuda.CUDAGraph | None" = None

    def replay(self) -> None:
        """The captured graph, or the static forward itself when uncaptured."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()


class GraphFamily:
    """One kind of captured forward of a ``ModelRunner``, keyed by padded shapes; see the module docstring.

    Subclasses define ``supports`` (whether a step has a graph), ``key`` (its graph key), ``_make``
    (the key's ``Graph``), ``_load_padding`` (padding-only inputs for the capture's warm-up),
    ``_keys_upto`` (the keys ``capture_all`` builds) and ``run`` (a step: load its inputs, ``replay``,
    return views of the static outputs)."""

    kind = "?"   # the capture log's name of the family

    def __init__(self, runner, batch_sizes: Sequence[int], kv_cache, min_kv: int, capture: bool, pool=None,
                 capture_stream=None):
        sizes = sorted({int(b) for b in batch_sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch sizes must be ints >= 1, got {list(batch_sizes)}")
        if capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the runner is on {runner.device}")
        self.runner, self.model = runner, runner.model
        self.batch_sizes, self.capturing = sizes, capture
        # the paged cache's KV-length buckets, and the block-table width of the largest
        self.block_size = kv_cache.block_size
        self.kv_lengths = kv_buckets(min_kv, kv_cache.num_blocks * self.block_size, self.block_size)
        self.max_blocks = self.kv_lengths[-1] // self.block_size
        self.graphs: dict[tuple[int, ...], Graph] = {}
        self.pool = pool
        # the runner's own (``ModelRunner.graph_capture_stream``; None: torch's default capture stream), or
        # the family's own when it replays beside the others (``capture_graph``: its cuBLAS workspace)
        if capture_stream is None and capture:
            capture_stream = runner.graph_capture_stream()
        self.capture_stream = capture_stream
        self.replays = 0
        # host seconds of this family's captures (``num_captured`` of them; Triton compiles of kernel
        # variants first met inside a capture included): in serving, a capture inside a step stalls every request
        self.capture_seconds = 0.0

    @property
    def num_captured(self) -> int:
        return sum(g.graph is not None for g in self.graphs.values())

    def _make(self, key: tuple[int, ...]) -> Graph:
        raise NotImplementedError

    def _load_padding(self, g: Graph) -> None:
        raise NotImplementedError

    def _capture_more(self, g: Graph) -> None:
        """Graphs captured after ``g``'s, over its outputs (the verify tails)."""

    def capture(self, key: tuple[int, ...]) -> Graph:
        """Make the forward of ``key``, capture it (when capturing) into the shared pool, keep it."""
        g = self._make(key)
        if self.capturing:
            t0 = time.perf_counter()
            self._load_padding(g)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g.graph = capture_graph(g.run, self.pool, self.runner.device, self.capture_stream)
            self._capture_more(g)
            self.capture_seconds += time.perf_counter() - t0
            logger.info("captured %s graph %s", self.kind, key)
        self.graphs[key] = g
        return g

    def graph(self, key: tuple[int, ...]) -> Graph:
        """The graph of ``key``, captured now if new."""
        return self.graphs.get(key) or self.capture(key)

    @torch.inference_mode()
    def replay(self, g: Graph) -> None:
        g.replay()
        self.replays += 1

    def _keys_upto(self, max_batch: int | None, max_len: int | None, **limits) -> list[tuple[int, ...]]:
        """Every key a step of <= max_batch requests with <= max_len committed keys (and the family's
        ``limits``) can need; all when None."""
        raise NotImplementedError

    @torch.inference_mode()
    def capture_all(self, max_batch: int | None = None, max_len: int | None = None, **limits) -> int:
        """Build ahead of time every graph ``_keys_upto`` names, so no capture happens inside a timed
        run; returns how many were built."""
        new = list(dict.fromkeys(k for k in self._keys_upto(max_batch, max_len, **limits) if k not in self.graphs))
        for k in new:
            self.capture(k)
        return len(new)
