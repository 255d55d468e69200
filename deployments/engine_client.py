"""The engine protocol the HTTP ingress talks to, and its in-process implementation.

The ingress never touches ``LLMEngine``; it holds an ``EngineClient``:

    tokenizer          the model's tokenizer (chat template, prompt encoding, usage counts)
    max_model_len      prompt + max_tokens must fit in this many tokens
    vocab_size         token ids of prompts must lie in [0, vocab_size)
    max_choices        the most sub-requests one HTTP request may carry (n x prompts)
    generate_many(subs)  async iterator of (sub-request index, ``ServedOutput`` delta); leaving it
                       early aborts every sub-request still running
    is_alive()         whether the engine loop runs (GET /health)
    is_ready()         whether new requests are accepted (GET /ready; False while draining)
    fleet_stats()      one ``ReplicaStats`` per replica for /metrics (engine stats, admission, ...)
    start() / drain(timeout) / close()   the app's lifespan: before the first request, then
                       finish what is in flight, then stop

One HTTP request (``n`` choices, or a batch of prompts) is a list of ``SubRequest``: each is its own
engine request with its own id (and seed), and they travel together as one call, so they are
admitted together (all or none) and reach one replica. They must not be N concurrent Serve calls:
Serve gives every call made while handling one HTTP request that request's internal id, and its
request router keeps one pending entry per internal id, so the second of two calls that wait for a
replica at the same moment was never assigned.

``LocalEngineClient`` wraps an ``AsyncEngine`` in this process (tests, single-process serving, and
inside each replica); ``deployments.serve_client.ServeEngineClient`` forwards to Ray Serve replicas.
Admission control lives here: beyond ``max_pending`` engine requests in flight new ones fail fast
with ``EngineOverloaded`` (HTTP 429) instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, Sequence

from bole.engine.async_engine import AsyncEngine
from bole.engine.core import RequestTimings
from bole.engine.output import RequestOutput
from bole.errors import EngineDead
from bole.hardware import detect_hardware, table_mismatch
from bole.llm import resolve_repo_path
from bole.sampling_params import SamplingParams
from deployments.replica_stats import ReplicaStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SubRequest:
    """One engine request of an HTTP request: one choice of one prompt."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str


@dataclass
class ServedOutput(RequestOutput):
    """A ``RequestOutput`` delta tagged with the hardware class of the replica that produced it.

    On a request's first delta, ``prefill_s`` is the engine's time from scheduling the request to
    its first token (compute, not waiting) and ``engine_queue_s`` its wait in the engine's queue;
    None on later deltas and where the engine does not expose them (TP drivers)."""

    hardware_class: str = "unknown"
    prefill_s: float | None = None
    engine_queue_s: float | None = None

    @staticmethod
    def wrap(out: RequestOutput, hardware: str, timings: RequestTimings | None = None) -> "ServedOutput":
        if timings is None:
            return ServedOutput(**vars(out), hardware_class=hardware)
        return ServedOutput(**vars(out), hardware_class=hardware, prefill_s=timings.prefill_s,
                            engine_queue_s=timings.engine_queue_s)


class EngineOverloaded(RuntimeError):
    """Too many requests in flight: retry later (HTTP 429)."""


class EngineUnavailable(RuntimeError):
    """The engine is draining, starting or stopped (HTTP 503 with ``Retry-After``)."""

    def __init__(self, message: str, retry_after_s: float = 1.0, replica_id: str | None = None):
        super().__init__(message)
        self.retry_after_s, self.replica_id = retry_after_s, replica_id

    def __reduce__(self):  # keep the fields across Ray's pickling
        return type(self), (str(self), self.retry_after_s, self.replica_id)


class RequestTimeout(TimeoutError):
    """The request passed its server-side deadline (HTTP 504); its engine requests are aborted."""


def unwrap_remote_error(e: BaseException) -> BaseException:
    """The exception a replica raised, out of Ray's ``RayTaskError`` wrapper (whose ``str`` is the
    remote traceback with ANSI colours, never fit for a client)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


class EngineClient(Protocol):
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    max_choices: int

    def generate_many(self, subs: Sequence[SubRequest]) -> AsyncIterator[tuple[int, ServedOutput]]: ...

    async def is_ready(self) -> bool: ...

    async def is_alive(self) -> bool: ...

    async def fleet_stats(self) -> list[ReplicaStats]: ...

    async def start(self) -> None: ...

    async def drain(self, timeout: float | None = None) -> bool: ...

    async def close(self) -> None: ...


def hardware_class(device: str = "cpu") -> str:
    """The hardware class of this process's device (``bole.hardware``: a100, gb10, h200, cpu, ...)."""
    return detect_hardware(device)


def calibration_mismatch(engine: AsyncEngine, hardware: str) -> dict[str, tuple]:
    """Where the engine's calibration table was not measured for how it runs (``bole.hardware.
    table_mismatch``: model shapes, dtype, tp_size, hardware class, eager or graphed); {} when it matches."""
    limits = engine.limits()
    return table_mismatch(engine.calibration, engine.model_config, limits.dtype, limits.tp_size, hardware,
                          limits.cuda_graphs)


def warn_if_mismatched(engine: AsyncEngine, hardware: str, where: str) -> dict[str, tuple]:
    """Log loudly (WARNING) when the calibration table does not describe this engine; the mismatch."""
    mismatch = calibration_mismatch(engine, hardware)
    if mismatch:
        detail = ", ".join(f"{k} {have!r} (runs {want!r})" for k, (have, want) in mismatch.items())
        logger.warning("CALIBRATION TABLE MISMATCH on %s: table %s was measured for %s; its verification "
                       "budgets do not describe this replica. Recalibrate it (python -m deployments.recalibrate) "
                       "or name a matching calibration_table.", where, engine.calibration.table_id, detail)
    return mismatch


async def merge_streams(streams: Sequence[AsyncIterator], deadline: float | None = None
                        ) -> AsyncIterator[tuple[int, Any]]:
    """Interleave async iterators as (stream index, item), each iterated (and closed) inside its own
    task, so closing this never touches a generator another task is running. ``deadline`` (the
    event loop's clock) raises ``RequestTimeout`` when no stream has finished by then. An error of
    one stream is raised here; leaving early, an error or the deadline cancel every stream."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, it: AsyncIterator) -> None:
        try:
            async with contextlib.aclosing(it):
                async for item in it:
                    queue.put_nowait((i, item))
        except Exception as e:  # noqa: BLE001 - handed to the consumer; CancelledError propagates
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            timeout = None if deadline is None else deadline - loop.time()
            try:
                if timeout is not None and timeout <= 0:
                    raise asyncio.TimeoutError
                i, item = await asyncio.wait_for(queue.get(), timeout)
            except asyncio.TimeoutError:
                raise RequestTimeout("the request passed its server-side deadline") from None
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class LocalEngineClient:
    """An ``AsyncEngine`` in this process, with admission control and a drain switch."""

    def __init__(self, async_engine: AsyncEngine, max_pending: int | None = None, hardware: str | None = None,
                 replica_id: str = "local"):
        self.async_engine = async_engine
        limits = async_engine.limits()
        self.tokenizer = async_engine.tokenizer
        self.max_model_len, self.vocab_size = limits.max_model_len, limits.vocab_size
        self.block_size = limits.block_size
        self.memory_plan = dict(limits.memory_plan)   # bytes per category, fixed at start
        self.max_pending = max_pending if max_pending is not None else default_max_pending(limits.max_num_seqs)
        self.max_choices = self.max_pending
        self.hardware_class = hardware or hardware_class(limits.device)
        self.replica_id = replica_id
        self.num_pending = 0
        self.num_refused = 0        # requests refused while draining (the ingress retries them elsewhere)
        self.accepting = True
        self._checked_table, self._mismatch = None, ""
        warn_if_mismatched(async_engine, self.hardware_class, f"the {self.hardware_class} engine")
        self._idle = asyncio.Event()
        self._idle.set()

    async def generate_many(self, subs: Sequence[SubRequest]) -> AsyncIterator[tuple[int, ServedOutput]]:
        if not self.accepting:
            self.num_refused += 1
            raise EngineUnavailable("the server is draining; retry on another replica",
                                    replica_id=self.replica_id)
        if self.num_pending + len(subs) > self.max_pending:
            raise EngineOverloaded(f"{self.num_pending} requests in flight, {len(subs)} more asked for "
                                   f"(max_pending={self.max_pending})")
        self.num_pending += len(subs)   # all or none: admitted together, released together
        self._idle.clear()
        try:
            async for i, out in merge_streams([self._one(s) for s in subs]):
                yield i, out
        finally:
            self.num_pending -= len(subs)
            if self.num_pending == 0:
                self._idle.set()

    async def _one(self, sub: SubRequest) -> AsyncIterator[ServedOutput]:
        first = True
        try:
            async for out in self.async_engine.generate(sub.prompt_token_ids, sub.params, sub.request_id):
                # the request stays in the engine until its stream ends
                timings = self.async_engine.request_timings(sub.request_id) if first and out.new_token_ids else None
                first = first and not out.new_token_ids
                yield ServedOutput.wrap(out, self.hardware_class, timings)
        except EngineDead as e:  # a 503 the ingress retries on another replica (before any output)
            raise EngineUnavailable(str(e), replica_id=self.replica_id) from None

    async def is_alive(self) -> bool:
        return self.async_engine.is_alive()

    async def is_ready(self) -> bool:
        return self.accepting and await self.is_alive()

    async def start(self) -> None:
        """Nothing to learn: the engine's limits were read at construction."""

    async def close(self) -> None:
        self.async_engine.shutdown()

    async def drain(self, timeout: float | None = None) -> bool:
        """Stop admitting and wait for in-flight requests; True if they all finished in time."""
        self.accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def stats(self) -> ReplicaStats:
        """The engine's stats as of its last step, with this client's admission state."""
        table = self.async_engine.calibration
        if self._checked_table is not table:  # recomputed only when the table object changes
            self._checked_table = table
            self._mismatch = ",".join(calibration_mismatch(self.async_engine, self.hardware_class))
        return ReplicaStats(self.async_engine.stats(), self.replica_id, self.hardware_class, self.block_size,
                            self.max_pending, self.num_pending, self.accepting, self.num_refused, self._mismatch,
                            memory_plan=self.memory_plan)

    async def fleet_stats(self) -> list[ReplicaStats]:
        return [self.stats()]


def default_max_pending(max_num_seqs: int) -> int:
    """Engine requests a replica admits by default: its running batch and three batches queued."""
    return 4 * max_num_seqs


def model_tokenizer(model_path: str):
    """The checkpoint folder's tokenizer (None when it has none)."""
    path = resolve_repo_path(model_path)
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
