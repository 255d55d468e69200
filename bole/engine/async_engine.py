"""Async streaming front of the engine, for the HTTP server.

The engine steps in one background thread (torch work releases the GIL; the event loop stays free
for HTTP). ``generate`` registers a request and yields its ``RequestOutput`` deltas as they come;
leaving the iterator early (client disconnect, ``aclose``) aborts the request and frees its memory.
A failing step fails the requests of that step with the error and the engine keeps serving others.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator

from bole.engine.engine import LLMEngine, RequestOutput
from bole.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="bole-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._work:
            rid = self.engine.add_request(prompt_token_ids, params, request_id)  # ValueError on bad input
            self._streams[rid] = (loop, queue)
            self._work.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            if not finished:
                self.abort(rid)
            with self._lock:
                self._streams.pop(rid, None)
                self.engine.pop_finished(rid)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            self._streams.pop(request_id, None)
            return self.engine.abort(request_id)

    def metrics(self) -> dict:
        with self._lock:
            snap = self.engine.metrics.snapshot()
            snap["running"] = len(self.engine.scheduler.running)
            snap["waiting"] = len(self.engine.scheduler.waiting)
            return snap

    def budget_state(self) -> dict:
        """Where the batch stands in the calibration table, for routing: the current bucket and its
        B_ver, and the B_ver per request the batch would get with one more request."""
        with self._lock:
            eng = self.engine
            running, spec = eng.scheduler.running, eng.config.spec
            kv_len = max((r.num_computed for r in running), default=0)
            n = len(running)
            bucket, b_ver = eng.calibration.lookup(max(n, 1), kv_len, spec.depth + 1)
            _, b_next = eng.calibration.lookup(n + 1, kv_len, spec.depth + 1)
            return {"table_id": eng.calibration.table_id, "bucket": bucket, "b_ver": b_ver,
                    "b_ver_per_request": b_next / (n + 1), "running": n,
                    "waiting": len(eng.scheduler.waiting)}

    def set_calibration(self, table) -> None:
        """Swap the calibration table between steps (``reconfigure`` without a restart)."""
        with self._lock:
            self.engine.calibration = table

    def run_exclusive(self, fn):
        """Run ``fn(engine)`` in the calling thread between two steps (the step loop waits meanwhile).

        For maintenance that must not overlap a step, e.g. ``bole.calibrate.recalibrate``; blocking,
        so call it from async code through ``asyncio.to_thread``.
        """
        with self._lock:
            return fn(self.engine)

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._work:
            self._stopped = True
            self._work.notify()
        self._thread.join(timeout)

    def _deliver(self, rid: str, item) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _run(self) -> None:
        while True:
            with self._work:
                while not self._stopped and not self.engine.has_unfinished():
                    self._work.wait()
                if self._stopped:
                    return
                try:
                    outputs = self.engine.step()
                except Exception as e:  # fail this step's requests, keep serving
                    logger.exception("engine step failed")
                    for req in list(self.engine.scheduler.running):
                        self.engine.abort(req.request_id)
                        self._deliver(req.request_id, e)
                    continue
                for out in outputs:
                    self._deliver(out.request_id, out)
