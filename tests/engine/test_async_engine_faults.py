"""AsyncEngine when its engine fails: a failed step fails that step's requests and the engine serves on; an
engine that cannot even abort them (a tensor-parallel worker died) is dead, and nothing waits on it. A
black-box probe killed one TP worker of a Ray Serve replica: its requests hung until Serve force-killed the
replica, 140-150 s later, because the abort inside the step's error handler raised and ended the loop."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from bole.engine.async_engine import AsyncEngine
from bole.engine.core import EngineLimits, EngineStats
from bole.engine.output import RequestOutput
from bole.errors import EngineDead
from bole.sampling_params import SamplingParams


class FaultyEngine:
    """An ``EngineCore`` whose steps emit one token per request until ``fail`` is set; then a step raises,
    and so does ``abort`` when ``abort_fails`` (a dead remote worker)."""

    tokenizer = None

    def __init__(self, abort_fails: bool):
        self.abort_fails, self.fail = abort_fails, False
        self.running: dict[str, int] = {}
        self.aborted: list[str] = []

    def limits(self) -> EngineLimits:
        return EngineLimits(4, 64, 64, 16, 16, "cpu", "float32", 1)

    def stats(self) -> EngineStats:
        return dataclasses.replace(EngineStats(), running_ids=list(self.running))

    def add_request(self, prompt, params=None, request_id=None) -> str:
        self.running[request_id] = 0
        return request_id

    def abort(self, request_id: str) -> bool:
        if self.abort_fails and self.fail:
            raise ConnectionError("the worker holding this request died")
        self.aborted.append(request_id)
        return self.running.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def pop_finished(self, request_id: str):
        return None

    def step(self, emit_early=None, admit=None) -> list[RequestOutput]:
        if self.fail:
            raise RuntimeError("a worker died under the step")
        outs = []
        for rid in self.running:
            self.running[rid] += 1
            outs.append(RequestOutput(request_id=rid, new_token_ids=[1], new_text="", finished=False,
                                      finish_reason=None))
        time.sleep(0.005)  # a step takes a moment
        return outs

    def shutdown(self) -> None:
        pass


async def _first_then_rest(aeng: AsyncEngine, rid: str):
    """Read a request's first output, then return the task reading the rest."""
    gen = aeng.generate([1, 2, 3], SamplingParams(max_tokens=100), rid)
    await asyncio.wait_for(gen.__anext__(), 5)

    async def rest():
        async for _ in gen:
            pass
    return asyncio.ensure_future(rest())


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on():
    async def main():
        eng = FaultyEngine(abort_fails=False)
        aeng = AsyncEngine(eng)
        try:
            a = await _first_then_rest(aeng, "a")
            eng.fail = True
            with pytest.raises(RuntimeError, match="a worker died under the step"):
                await asyncio.wait_for(a, 5)
            assert "a" in eng.aborted and aeng.is_alive()
            eng.fail = False
            b = await _first_then_rest(aeng, "b")   # still served
            b.cancel()
        finally:
            aeng.shutdown()
    asyncio.run(main())


def test_an_engine_that_cannot_abort_is_dead_and_nothing_waits_on_it():
    async def main():
        eng = FaultyEngine(abort_fails=True)
        aeng = AsyncEngine(eng)
        try:
            streams = [await _first_then_rest(aeng, f"r{i}") for i in range(3)]
            eng.fail = True
            for t in streams:   # every stream ends at once with the step's error or the death
                with pytest.raises((RuntimeError, EngineDead)):
                    await asyncio.wait_for(t, 5)
            for _ in range(100):   # the loop ends right after failing them
                if not aeng._thread.is_alive():
                    break
                await asyncio.sleep(0.01)
            assert not aeng.is_alive()
            # a later request is refused at once, not queued behind a loop that is gone
            with pytest.raises(EngineDead, match="ConnectionError"):
                await asyncio.wait_for(aeng.generate([1], SamplingParams(max_tokens=2), "late").__anext__(), 1)
        finally:
            aeng.shutdown()
    asyncio.run(main())


def test_an_add_sent_after_the_loop_died_is_answered():
    """An add that reaches the inbox after the loop is gone (a caller past ``generate``'s check as the
    engine died) is answered by the sender's side, not left waiting."""
    async def main():
        eng = FaultyEngine(abort_fails=True)
        aeng = AsyncEngine(eng)
        try:
            first = await _first_then_rest(aeng, "x")
            eng.fail = True
            with pytest.raises((RuntimeError, EngineDead)):
                await asyncio.wait_for(first, 5)
            aeng._thread.join(5)
            assert not aeng._thread.is_alive()
            loop = asyncio.get_running_loop()
            added = loop.create_future()
            aeng._send("add", "y", [1], SamplingParams(max_tokens=2), loop, asyncio.Queue(), added)
            with pytest.raises(EngineDead):
                await asyncio.wait_for(added, 2)
        finally:
            aeng.shutdown()
    asyncio.run(main())
