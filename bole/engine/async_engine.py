"""Async streaming front of the engine, for the HTTP server.

The engine steps in one background thread (torch work releases the GIL; the event loop stays free
for HTTP). ``generate`` registers a request and yields its ``RequestOutput`` deltas as they come;
leaving the iterator early (client disconnect, deadline, ``aclose``) aborts the request and frees
its memory. A failing step fails the requests of that step with the error and the engine keeps
serving others. An engine that cannot even abort them (a tensor-parallel worker died) is dead: every
request it holds, queued or sent, gets ``EngineDead`` at once, so is every later one, and the loop ends
(``is_alive`` turns false, which a replica's health check reports). Nothing waits on a dead engine.

The event loop never waits for a step. A step holds the engine lock for its whole length (tens of
milliseconds on a GPU, seconds on a loaded CPU, unbounded if a kernel hangs), so adding, aborting
and releasing requests go through an inbox the engine thread applies between steps, and
``stats()`` reads the ``EngineStats`` the engine thread publishes after every step.
Had the loop taken the lock itself, one slow step would stall every stream, /metrics, and the
deadline that is meant to end a stuck request.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import gc
import itertools
import logging
import threading
from typing import AsyncIterator

from bole.engine.core import EngineCore, EngineLimits, EngineStats, RequestTimings
from bole.engine.output import RequestOutput
from bole.errors import EngineDead
from bole.sampling_params import SamplingParams
from bole.spec.budget import CalibrationTable

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Drives any ``EngineCore`` (``bole.engine.core``) from one thread, for asyncio callers."""

    def __init__(self, engine: EngineCore):
        self.engine = engine
        self._limits = engine.limits()
        self._lock = threading.Lock()          # held by a step, run_exclusive and set_calibration
        self._inbox: collections.deque = collections.deque()   # ("add" | "abort" | "release", ...)
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._dead: EngineDead | None = None   # set once, by the engine thread's last act
        self._stats = EngineStats()
        self._batch = self._peak_batch = 0     # requests in the last step, and the most in one step
        with self._lock:
            self._publish()
        self._thread = threading.Thread(target=self._run, name="bole-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise self._dead
        if self._stopped:
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        self._send("add", rid, list(prompt_token_ids), params, loop, queue, added)
        finished = False
        try:
            await added  # InvalidRequest on bad input, raised by the engine's add_request
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            # applied in order after the add, even if this was cancelled before the add was applied
            self._send("release" if finished else "abort", rid)

    def abort(self, request_id: str) -> None:
        """Abort a request (between steps; returns at once)."""
        self._send("abort", request_id)

    def stats(self) -> EngineStats:
        """The engine's metrics, queue and budget state as of its last step (never waits for one)."""
        return self._stats

    def limits(self) -> EngineLimits:
        return self._limits

    def request_timings(self, request_id: str) -> RequestTimings | None:
        """A request's prefill and queue times once it has its first token (``EngineCore``)."""
        return self.engine.request_timings(request_id)

    def is_alive(self) -> bool:
        """Whether the step loop runs (a dead engine's does not)."""
        return self._dead is None and self._thread.is_alive()

    @property
    def model_config(self):
        """The model's shapes (what a calibration table is checked against)."""
        return self.engine.model_config

    @property
    def calibration(self) -> CalibrationTable:
        return self.engine.calibration

    def set_calibration(self, table: CalibrationTable) -> None:
        """Swap the calibration table between steps (``reconfigure`` without a restart)."""
        with self._lock:
            self.engine.calibration = table
            self._publish()

    def recalibrate(self, quick: bool = True, **kw) -> CalibrationTable:
        """The engine's ``recalibrate`` between two steps (blocking: call it through
        ``asyncio.to_thread``); the new table, not installed."""
        return self.run_exclusive(lambda e: e.recalibrate(quick, **kw))

    def cached_prefix_hashes(self, limit: int | None = None) -> list[int]:
        """The engine prefix cache's block chain hashes, read between steps (blocking)."""
        return self.run_exclusive(lambda e: e.cached_prefix_hashes(limit))

    def run_exclusive(self, fn):
        """Run ``fn(engine)`` in the calling thread between two steps (the step loop waits meanwhile).

        For maintenance that must not overlap a step, e.g. ``bole.recalibration.recalibrate``; blocking,
        so call it from async code through ``asyncio.to_thread``.
        """
        with self._lock:
            return fn(self.engine)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the step loop, then the engine (a TP driver's ranks)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout)
        self.engine.shutdown()

    # -- the engine thread --------------------------------------------------------------------------
    def _send(self, *op) -> None:
        self._inbox.append(op)
        self._wake.set()
        if self._dead is not None:   # sent while the loop died: answered here, as the loop can't
            self._fail_inbox()

    def _fail_inbox(self) -> None:
        """Every add in the inbox answered with the engine's death (each op is popped by one thread)."""
        while True:
            try:
                op, rid, *rest = self._inbox.popleft()
            except IndexError:
                return
            if op == "add":
                loop, added = rest[2], rest[4]
                try:
                    loop.call_soon_threadsafe(_settle, added, self._dead)
                except RuntimeError:  # that event loop is closed
                    pass

    def _die(self, error: BaseException) -> None:
        """The engine cannot go on: every stream gets ``EngineDead``, so does every add sent or to come."""
        logger.error("the engine is dead; failing its %d requests", len(self._streams),
                     exc_info=(type(error), error, error.__traceback__))
        self._dead = EngineDead(f"the engine failed and serves no more requests ({type(error).__name__}: {error})")
        for rid in list(self._streams):
            self._deliver(rid, self._dead)
        self._streams.clear()
        self._fail_inbox()

    def _deliver(self, rid: str, item) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, queue = target
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                self._streams.pop(rid, None)

    def _deliver_all(self, outputs: list, delivered: list) -> None:
        """A step's early outputs (first tokens), delivered mid-step: the stats are published first, so a
        caller holding a token finds its request among them (the step's admissions are in)."""
        self._publish()
        delivered.extend(outputs)
        for out in outputs:
            self._deliver(out.request_id, out)

    def _apply_inbox(self, stopping: bool = False) -> None:
        eng = self.engine
        while self._inbox:
            op, rid, *rest = self._inbox.popleft()
            if op == "add":
                self._add(rid, *rest, stopping=stopping)
            else:  # "abort" (left early) or "release" (finished): forget it either way
                self._streams.pop(rid, None)
                if op == "abort":
                    eng.abort(rid)
                eng.pop_finished(rid)

    def _add(self, rid, prompt, params, loop, queue, added, stopping: bool = False) -> bool:
        """An "add" from the inbox: the request into the engine (its stream registered), or its error
        back to the caller; whether it was added. A caller whose event loop has closed meanwhile gets
        nothing: its request, still waiting (it holds no memory), is aborted at once."""
        error = RuntimeError("the engine is shut down") if stopping else None
        if error is None:
            try:
                self.engine.add_request(prompt, params, rid)
            except Exception as e:  # noqa: BLE001 - bad input: the caller raises it
                error = e
        try:
            loop.call_soon_threadsafe(_settle, added, error)
        except RuntimeError:  # that event loop is closed: nobody waits for this request
            if error is None:
                self.engine.abort(rid)
            return False
        if error is None:
            self._streams[rid] = (loop, queue)
        return error is None

    def _admit_arrivals(self) -> int:
        """Inside a step (``EngineCore.step``'s ``admit``): apply the inbox's adds, the requests that arrived
        since the step began; the others (aborts, releases) wait for the step's end, in their order, and so
        does an add behind one of them for the same id. Returns how many were added."""
        added, deferred, later = 0, [], set()
        try:
            while True:
                try:
                    op = self._inbox.popleft()
                except IndexError:
                    break
                if op[0] == "add" and op[1] not in later:
                    added += self._add(*op[1:], stopping=self._stopped)
                else:
                    deferred.append(op)
                    later.add(op[1])
        finally:
            self._inbox.extendleft(reversed(deferred))   # before anything sent meanwhile
        return added

    def _publish(self) -> None:
        """Publish the engine's stats with this loop's batch sizes (under the lock, between steps)."""
        self._stats = dataclasses.replace(self.engine.stats(), batch=self._batch, peak_batch=self._peak_batch)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - whatever broke the loop, nobody may wait on it
            self._die(e)

    def _loop(self) -> None:
        while True:
            self._wake.clear()   # before reading the inbox: a later _send wakes the wait below
            with self._lock:
                if self._stopped:
                    self._apply_inbox(stopping=True)   # releases / aborts sent just before shutdown
                    self._publish()
                    return
                self._apply_inbox()
                busy = self.engine.has_unfinished()
                outputs, early = [], []
                if busy:
                    try:
                        # first tokens stream out mid-step; requests sent meanwhile join inside it (``admit``)
                        outputs = self.engine.step(emit_early=functools.partial(self._deliver_all, delivered=early),
                                                   admit=self._admit_arrivals)
                        stats = self.engine.stats()
                        # the step's batch: what still runs plus what finished in it
                        self._batch = stats.running + sum(o.finished for o in outputs + early)
                        self._peak_batch = max(self._peak_batch, self._batch)
                        self._stats = dataclasses.replace(stats, batch=self._batch, peak_batch=self._peak_batch)
                    except Exception as e:  # fail this step's requests, keep serving
                        logger.exception("engine step failed")
                        broken = None
                        for rid in self.engine.stats().running_ids:
                            try:
                                self.engine.abort(rid)
                            except Exception as abort_error:  # noqa: BLE001 - the engine itself is gone
                                broken = broken or abort_error
                            self._deliver(rid, e)
                        if broken is not None:
                            raise broken from e   # _run: the engine is dead
                        self._publish()
                else:
                    self._publish()
            for out in outputs:
                self._deliver(out.request_id, out)
            if not busy:
                self._wake.wait()


def freeze_startup_heap() -> None:
    """End a serving process's start: collect once, then move every object alive (imports, the model,
    tokenizer, graphs, the app) into the collector's permanent generation (``gc.freeze``), which no
    later collection walks. Without it every full collection walks them all with the whole process
    stopped (the engine thread, every stream): a ``--no-ray`` server of the embedded model on a 2-core
    CPU tracked ~0.39 M objects and, serving 300 requests, ran 3 full collections of 148-185 ms
    (2026-12-06, a ``gc.callbacks`` probe). Objects made later are collected as before; a frozen object
    freed later goes by reference counting only, so frozen cycles that become garbage stay (nothing made
    at start is dropped while serving but the first calibration table a reconfigure replaces). vLLM
    freezes after its start for the same reason."""
    gc.collect()
    gc.freeze()


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():  # the caller may have been cancelled meanwhile
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
