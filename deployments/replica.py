"""The Bole replica deployment (one engine per replica) and the ingress-side client that reaches it.

``BoleReplica`` is a plain class; ``deployments.app`` turns it into a Serve deployment with the
options of its hardware group (resources, autoscaling, ``request_router_config``). It offers:

  generate(prompt_token_ids, params, request_id)  streaming ``ServedOutput`` deltas; cancelling the
                                                  call (client gone) aborts the engine request
  record_routing_stats()  hardware class, calibration table id, current bucket and B_ver, the
                          B_ver per request with one more request, queue, running batch, MAT, and
                          ``prefix_blocks``: the chain hashes of the most recent prompt blocks this
                          replica computed (a bounded LRU; ``routing_policy.PrefixSummary``)
  reconfigure(user_config)  ``{"calibration_table": path | mapping}`` swaps the table between
                            engine steps, no restart (rolling recalibration pushes tables this way)
  drain(timeout) / resume()  stop admitting (new requests get 503 and Serve retries elsewhere is
                             the caller's job), wait for in-flight ones; resume admits again
  __del__                 graceful shutdown: drain, then stop the engine loop

Note: the engine has no prefix cache yet (the prompt is recomputed on every replica), so today
``prefix_blocks`` says where a prefix *was* computed; affinity routing turns into cache hits once
the engine keeps those blocks. The summary's format does not change then.

Tensor parallelism (``tp_size > 1``) is not implemented: the model has the slicing hooks
(``load_model(path, tp_rank, tp_size)``) but no all-reduce forward yet; a replica with
``tp_size > 1`` refuses to start rather than silently running TP=1.
"""

from __future__ import annotations

import asyncio
import logging
import os

from bole.engine.async_engine import AsyncEngine
from bole.hardware import resolve_calibration
from bole.llm import build_engine, resolve_repo_path
from bole.sampling_params import SamplingParams
from bole.spec.budget import CalibrationTable
from deployments.engine_client import (
    EngineUnavailable,
    LocalEngineClient,
    engine_limits,
    hardware_class,
)
from deployments.routing_policy import PrefixSummary, prefix_block_hashes

logger = logging.getLogger(__name__)


class BoleReplica:
    def __init__(self, model_path: str, engine_options: dict | None = None, hardware: str = "auto",
                 tp_size: int = 1, max_pending: int | None = None, prefix_summary_blocks: int = 4096,
                 drain_timeout_s: float = 60.0):
        if tp_size != 1:
            raise NotImplementedError("tensor parallelism (tp_size > 1) is not implemented yet: the model "
                                      "has no all-reduce forward; deploy this group with tp_size: 1")
        options = dict(engine_options or {})
        engine = build_engine(model_path, **options)
        self.hardware_class = hardware_class(engine.config.device) if hardware == "auto" else hardware
        self.client = LocalEngineClient(AsyncEngine(engine), max_pending, self.hardware_class)
        self.block_size = engine.config.cache.block_size
        self.prefix = PrefixSummary(prefix_summary_blocks)
        self.model_path, self.drain_timeout_s = model_path, drain_timeout_s
        logger.info("replica up: %s on %s, table %s", model_path, self.hardware_class,
                    engine.calibration.table_id)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str):
        if self.client.accepting:
            self.prefix.add(prefix_block_hashes(prompt_token_ids, self.block_size))
        async for out in self.client.generate(prompt_token_ids, params, request_id):
            yield out

    def info(self) -> dict:
        max_model_len, vocab_size = engine_limits(self.client.async_engine.engine)
        return {"max_model_len": max_model_len, "vocab_size": vocab_size, "block_size": self.block_size,
                "hardware_class": self.hardware_class, "model_path": self.model_path}

    def stats(self) -> dict:
        return self.client.stats()

    def record_routing_stats(self) -> dict:
        stats = self.client.stats()
        stats["block_size"] = self.block_size
        stats["prefix_blocks"] = self.prefix.to_list()
        stats["num_prefix_blocks"] = len(self.prefix)
        return stats

    async def is_ready(self) -> bool:
        return await self.client.is_ready()

    def reconfigure(self, user_config: dict) -> None:
        table = (user_config or {}).get("calibration_table")
        if table is None:
            return
        engine = self.client.async_engine.engine
        if isinstance(table, dict):
            loaded = CalibrationTable.from_dict(table)
        else:  # a path, or "auto": by hardware class and model shapes (bole.hardware)
            hw = self.hardware_class if self.hardware_class != "cpu" else None
            loaded = resolve_calibration(resolve_repo_path(str(table)), engine.model.config,
                                         engine.config.device, engine.config.dtype, hardware=hw)
        self.client.async_engine.set_calibration(loaded)
        logger.info("calibration table swapped to %s", loaded.table_id)

    async def drain(self, timeout_s: float | None = None) -> bool:
        return await self.client.drain(self.drain_timeout_s if timeout_s is None else timeout_s)

    def resume(self) -> None:
        self.client.accepting = True

    async def check_health(self) -> None:
        if not await self.client.is_alive():
            raise RuntimeError("the engine loop died")

    async def __del__(self):
        await self.client.drain(self.drain_timeout_s)
        self.client.async_engine.shutdown()


class ServeEngineClient:
    """``EngineClient`` over Serve handles to one replica deployment per hardware group.

    With several groups, the group is chosen with the routing policy over the whole fleet view
    (``routing_policy.FLEET``, every replica's stats as the deployments' routers see them); the group's
    ``BoleRequestRouter`` then picks the replica with the same policy. Before any stats exist the
    group with the fewest requests in flight from here is used.
    """

    def __init__(self, handles: dict, tokenizer, policy=None):
        from deployments.routing_policy import RouterPolicyConfig

        self.handles = handles
        self.tokenizer = tokenizer
        self.policy = policy or RouterPolicyConfig()
        self.max_model_len = 0
        self.vocab_size = 0
        self.in_flight = {name: 0 for name in handles}

    async def start(self) -> None:
        infos = await asyncio.gather(*(h.info.remote() for h in self.handles.values()))
        # the fleet serves one model; the smallest capacity bounds what every group can take
        self.max_model_len = min(i["max_model_len"] for i in infos)
        self.vocab_size = min(i["vocab_size"] for i in infos)

    def _pick(self, prompt_token_ids: list[int]) -> str:
        from deployments.router import view_from_stats
        from deployments.routing_policy import FLEET, choose_replicas

        if len(self.handles) == 1:
            return next(iter(self.handles))
        fleet = {d: r for d, r in FLEET.stats().items() if d in self.handles}
        owner, views = {}, []
        for dep, replicas in fleet.items():
            for rid, stats in replicas.items():
                owner[rid] = dep
                views.append(view_from_stats(rid, stats, None, set(stats.get("prefix_blocks") or [])))
        if views:
            hashes = prefix_block_hashes(prompt_token_ids, self.policy.block_size)
            ranks = choose_replicas(hashes, views, self.policy).ranks
            if ranks:
                return owner[ranks[0][0]]
        return min(self.handles, key=lambda d: self.in_flight[d])

    async def generate(self, prompt_token_ids, params, request_id):
        if not self.max_model_len:
            raise EngineUnavailable("the ingress has not reached the replicas yet")
        name = self._pick(prompt_token_ids)
        self.in_flight[name] += 1
        stream = self.handles[name].options(stream=True).generate.remote(prompt_token_ids, params, request_id)
        finished = False
        try:
            async for out in stream:
                finished = out.finished
                yield out
        finally:
            self.in_flight[name] -= 1
            if not finished:
                stream.cancel()   # the replica's generator is cancelled and aborts the engine request

    async def is_alive(self) -> bool:
        return bool(self.max_model_len)

    async def is_ready(self) -> bool:
        if not self.max_model_len:
            return False
        try:
            oks = await asyncio.gather(*(h.is_ready.remote() for h in self.handles.values()))
        except Exception:
            return False
        return any(oks)

    async def fleet_stats(self) -> list[dict]:
        from deployments.routing_policy import FLEET

        fleet = FLEET.stats()
        out = []
        for dep in self.handles:
            for rid, stats in fleet.get(dep, {}).items():
                if stats:
                    out.append({"replica": rid, "deployment": dep,
                                **{k: v for k, v in stats.items() if k != "prefix_blocks"}})
        if not out:  # no router has seen stats yet: ask one replica per group
            stats = await asyncio.gather(*(h.stats.remote() for h in self.handles.values()))
            out = [{"replica": f"{dep}/?", "deployment": dep, **s}
                   for dep, s in zip(self.handles, stats, strict=True)]
        return out


def model_tokenizer(model_path: str):
    """The checkpoint folder's tokenizer (None when it has none)."""
    path = resolve_repo_path(model_path)
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
