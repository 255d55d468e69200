"""The engine protocol the HTTP ingress talks to, and its in-process implementation.

The ingress never touches ``LLMEngine``; it holds an ``EngineClient``:

    tokenizer          the model's tokenizer (chat template, prompt encoding, usage counts)
    max_model_len      prompt + max_tokens must fit in this many tokens
    vocab_size         token ids of prompts must lie in [0, vocab_size)
    generate(...)      async iterator of ``ServedOutput`` deltas; leaving it early aborts the request
    is_alive()         whether the engine loop runs (GET /health)
    is_ready()         whether new requests are accepted (GET /ready; False while draining)
    fleet_stats()      one dict per replica for /metrics (hardware class, MAT, budget, queue, ...)

``LocalEngineClient`` wraps an ``AsyncEngine`` in this process (tests, single-process serving);
``deployments.replica.ServeEngineClient`` forwards to Ray Serve replicas through a handle.
Admission control lives here: beyond ``max_pending`` requests in flight new ones fail fast with
``EngineOverloaded`` (HTTP 429) instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from bole.engine.engine import RequestOutput
from bole.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ServedOutput(RequestOutput):
    """A ``RequestOutput`` delta tagged with the hardware class of the replica that produced it."""

    hardware_class: str = "unknown"

    @staticmethod
    def wrap(out: RequestOutput, hardware: str) -> "ServedOutput":
        return ServedOutput(**vars(out), hardware_class=hardware)


class EngineOverloaded(RuntimeError):
    """Too many requests in flight: retry later (HTTP 429)."""


class EngineUnavailable(RuntimeError):
    """The engine is draining, starting or stopped (HTTP 503)."""


class EngineClient(Protocol):
    tokenizer: Any
    max_model_len: int
    vocab_size: int

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str) -> AsyncIterator[RequestOutput]: ...

    async def is_ready(self) -> bool: ...

    async def is_alive(self) -> bool: ...

    async def fleet_stats(self) -> list[dict]: ...


def hardware_class(device: str = "cpu") -> str:
    """The hardware class of this process's device (``bole.hardware``: a100, gb10, h200, cpu, ...)."""
    from bole.hardware import detect_hardware

    return detect_hardware(device)


def calibration_mismatch(engine, hardware: str) -> dict[str, tuple]:
    """Where the engine's calibration table was not measured for how it runs (``bole.hardware.
    table_mismatch``: model shapes, dtype, tp_size, hardware class); {} when it matches."""
    from bole.hardware import table_mismatch

    cfg = engine.config
    return table_mismatch(engine.calibration, engine.model.config, cfg.dtype, cfg.tp_size, hardware)


def warn_if_mismatched(engine, hardware: str, where: str) -> dict[str, tuple]:
    """Log loudly (WARNING) when the calibration table does not describe this engine; the mismatch."""
    mismatch = calibration_mismatch(engine, hardware)
    if mismatch:
        detail = ", ".join(f"{k} {have!r} (runs {want!r})" for k, (have, want) in mismatch.items())
        logger.warning("CALIBRATION TABLE MISMATCH on %s: table %s was measured for %s; its verification "
                       "budgets do not describe this replica. Recalibrate it (python -m deployments.recalibrate) "
                       "or name a matching calibration_table.", where, engine.calibration.table_id, detail)
    return mismatch


def engine_limits(engine) -> tuple[int, int]:
    """(max_model_len, vocab_size) of an ``LLMEngine``: the KV capacity less one step's lookahead."""
    return engine.capacity_tokens - engine.lookahead, engine.model.config.vocab_size


class LocalEngineClient:
    """An ``AsyncEngine`` in this process, with admission control and a drain switch."""

    def __init__(self, async_engine, max_pending: int | None = None, hardware: str | None = None):
        self.async_engine = async_engine
        engine = async_engine.engine
        self.tokenizer = engine.tokenizer
        self.max_model_len, self.vocab_size = engine_limits(engine)
        self.max_pending = max_pending if max_pending is not None else 4 * engine.config.max_num_seqs
        self.hardware_class = hardware or hardware_class(engine.config.device)
        self.num_pending = 0
        self.accepting = True
        self._checked_table, self._mismatch = None, ""
        warn_if_mismatched(engine, self.hardware_class, f"the {self.hardware_class} engine")
        self._idle = asyncio.Event()
        self._idle.set()

    async def generate(self, prompt_token_ids, params, request_id) -> AsyncIterator[RequestOutput]:
        if not self.accepting:
            raise EngineUnavailable("the server is draining; retry on another replica")
        if self.num_pending >= self.max_pending:
            raise EngineOverloaded(f"{self.num_pending} requests in flight (max_pending={self.max_pending})")
        self.num_pending += 1
        self._idle.clear()
        try:
            async for out in self.async_engine.generate(prompt_token_ids, params, request_id):
                yield ServedOutput.wrap(out, self.hardware_class)
        finally:
            self.num_pending -= 1
            if self.num_pending == 0:
                self._idle.set()

    async def is_alive(self) -> bool:
        return self.async_engine._thread.is_alive()

    async def is_ready(self) -> bool:
        return self.accepting and await self.is_alive()

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

    def stats(self) -> dict:
        snap = self.async_engine.metrics()
        snap.update(self.async_engine.budget_state())
        snap.update(hardware_class=self.hardware_class, pending=self.num_pending, accepting=self.accepting)
        table = self.async_engine.engine.calibration
        if self._checked_table is not table:  # recomputed only when the table object changes
            self._checked_table = table
            self._mismatch = ",".join(calibration_mismatch(self.async_engine.engine, self.hardware_class))
        snap["calibration_mismatch"] = self._mismatch   # e.g. "dtype,tp_size"; "" when the table matches
        return snap

    async def fleet_stats(self) -> list[dict]:
        return [{"replica": "local", **self.stats()}]
