"""The Bole replica deployment: one engine per replica (the ingress reaches it through
``deployments.serve_client.ServeEngineClient``).

``BoleReplica`` is a plain class; ``deployments.app`` turns it into a Serve deployment with the
options of its hardware group (resources, autoscaling, ``request_router_config``). It offers:

  generate_many(subs)     streaming (sub-request index, ``ServedOutput``) for a list of
                          ``SubRequest`` (the n choices / prompts of one HTTP request, admitted
                          together); cancelling the call (client gone) aborts their engine requests
  stats()                 ``ReplicaStats`` (``deployments.replica_stats``): the engine's stats and
                          this replica's admission state, typed across the Serve handle
  record_routing_stats()  the same as Serve's routing-stats dict (``ReplicaStats.to_dict``) with
                          ``prefix_blocks``: the chain hashes of the prefix blocks this replica's
                          engine has cached (see below); the routers read it back as ReplicaStats
  reconfigure(user_config)  ``{"calibration_table": path | mapping}`` swaps the table between
                            engine steps, no restart (rolling recalibration pushes tables this way)
  drain(timeout) / resume()  stop admitting (reported as ``accepting: False`` in the routing stats,
                             so routers route around the replica; a request that still arrives gets
                             ``EngineUnavailable`` (with this replica's id and a Retry-After) before
                             any token and the ingress retries it elsewhere with backoff,
                             ``deployments.retry``), wait for in-flight ones; resume admits again
  recalibrate(quick, checks)  re-sweep the calibration table on this replica's engine between steps
                          (``AsyncEngine.recalibrate``; two sweeps, validated by
                          ``bole.recalibration``) and return it without installing it; the rolling
                          job (deployments.recalibrate) calls it on a drained replica
  set_calibration(table)  install a table (mapping) without a redeploy
  __del__                 graceful shutdown: drain, then stop the engine loop (and the TP workers)

A table that was not measured for how this replica runs (model shapes, dtype, tp_size, hardware
class: ``bole.hardware.table_mismatch``) is logged as a WARNING whenever it is installed, and the
routing stats carry ``calibration_mismatch`` (the fields, e.g. "dtype,tp_size"), which /metrics
shows as the ``mismatch`` label of ``bole_calibration_table_info``.

Control calls aimed at one replica (the rolling job) pass ``target_replica=<replica unique id>``:
``BoleRequestRouter`` routes such calls to exactly that replica, and the replica checks the id.

``prefix_blocks`` comes from the engine's prefix cache (``LLMEngine.cached_prefix_hashes``: the
blocks it can actually reuse) when it has one; otherwise (cache disabled, TP driver) it falls back to
the chain hashes of prompts this replica recently computed. ``prefix_source`` says which.

Tensor parallelism (``tp_size > 1``): the engine is a ``deployments.tp.TPEngine`` driving one worker
actor per rank in a STRICT_PACK placement group (the deployment's ``placement_group_bundles``, or one
the replica creates); everything above works the same on it. ``tp_size == 1`` keeps the engine in
the replica's process.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import replace

from bole.cache.block_hash import prefix_block_hashes
from bole.engine.async_engine import AsyncEngine, freeze_startup_heap
from bole.hardware import resolve_calibration
from bole.llm import build_engine, resolve_repo_path
from bole.spec.budget import CalibrationTable
from deployments.engine_client import (
    LocalEngineClient,
    SubRequest,
    hardware_class,
    model_tokenizer,
    warn_if_mismatched,
)
from deployments.logs import configure_logging
from deployments.replica_stats import ReplicaStats
from deployments.routing_policy import PrefixSummary

logger = logging.getLogger(__name__)


class BoleReplica:
    def __init__(self, model_path: str, engine_options: dict | None = None, hardware: str = "auto",
                 tp_size: int = 1, max_pending: int | None = None, prefix_summary_blocks: int = 4096,
                 drain_timeout_s: float = 60.0, tp_worker_options: dict | None = None):
        configure_logging()   # this process's start log: the memory plan, graphs, "replica up"
        options = dict(engine_options or {})
        if tp_size > 1:
            from deployments.tp import TPEngine

            engine = TPEngine(model_path, options, tp_size, tp_worker_options)
            engine.tokenizer = model_tokenizer(model_path)
        else:
            engine = build_engine(model_path, **options)
        limits = engine.limits()
        self.hardware_class = hardware_class(limits.device) if hardware == "auto" else hardware
        self.replica_id = _replica_id()
        self.engine = AsyncEngine(engine)
        self.client = LocalEngineClient(self.engine, max_pending, self.hardware_class, self.replica_id)
        self.block_size = limits.block_size
        self.prefix = PrefixSummary(prefix_summary_blocks)
        self.model_path, self.drain_timeout_s, self.tp_size = model_path, drain_timeout_s, tp_size
        self.model_name = os.path.basename(os.path.normpath(model_path))  # the id recalibrated tables carry
        logger.info("replica %s up: %s on %s (tp %d), table %s", self.replica_id, model_path,
                    self.hardware_class, tp_size, engine.calibration.table_id)
        freeze_startup_heap()   # no full collection walks the model and graphs again (it says why)

    def _check_target(self, target_replica: str | None) -> None:
        if target_replica is not None and target_replica != self.replica_id:
            raise RuntimeError(f"a call for replica {target_replica} reached {self.replica_id}")

    async def generate_many(self, subs: list[SubRequest]):
        if self.client.accepting:
            for ids in {tuple(s.prompt_token_ids) for s in subs}:
                self.prefix.add(prefix_block_hashes(ids, self.block_size))
        async for item in self.client.generate_many(subs):
            yield item

    def info(self) -> dict:
        limits = self.engine.limits()
        return {"max_model_len": limits.max_model_len, "vocab_size": limits.vocab_size,
                "block_size": self.block_size,
                "max_choices": self.client.max_choices,
                "hardware_class": self.hardware_class, "model_path": self.model_path,
                "replica_id": self.replica_id, "tp_size": self.tp_size}

    def stats(self) -> ReplicaStats:
        return self.client.stats()

    def _cached_prefix_blocks(self) -> list[int]:
        """The engine prefix cache's block chain hashes (same hashing as the router), read between
        steps; [] when the engine has no prefix cache (or is a TP driver, which does not expose it)."""
        return self.engine.cached_prefix_hashes(self.prefix.capacity)

    def record_routing_stats(self) -> dict:
        """``ReplicaStats.to_dict()`` with the prefix blocks: Serve carries routing stats as a dict."""
        # What the engine really holds; else where prompts were recently computed (a bounded LRU).
        cached = self._cached_prefix_blocks()
        stats = replace(self.client.stats(), prefix_blocks=tuple(cached or self.prefix.to_list()),
                        prefix_source="engine_cache" if cached else "recent_prompts")
        return stats.to_dict()

    async def is_ready(self) -> bool:
        return await self.client.is_ready()

    def reconfigure(self, user_config: dict) -> None:
        table = (user_config or {}).get("calibration_table")
        if table is None:
            return
        if isinstance(table, dict):
            loaded = CalibrationTable.from_dict(table)
        else:  # a path, or "auto": by hardware class and model shapes (bole.hardware)
            hw = self.hardware_class if self.hardware_class != "cpu" else None
            limits = self.engine.limits()
            loaded = resolve_calibration(resolve_repo_path(str(table)), self.engine.model_config,
                                         limits.device, limits.dtype, hardware=hw)
        self._install(loaded)

    async def drain(self, timeout_s: float | None = None, target_replica: str | None = None) -> bool:
        self._check_target(target_replica)
        return await self.client.drain(self.drain_timeout_s if timeout_s is None else timeout_s)

    def resume(self, target_replica: str | None = None) -> None:
        self._check_target(target_replica)
        self.client.accepting = True

    def calibration_info(self, target_replica: str | None = None) -> dict:
        """Where this replica stands, for the rolling job: table, admission, requests served so far."""
        self._check_target(target_replica)
        stats = self.client.stats()
        return {"replica_id": self.replica_id, "table_id": stats.engine.table_id, "accepting": stats.accepting,
                "pending": stats.pending, "hardware_class": self.hardware_class,
                "finished": stats.engine.finished, "mismatch": stats.calibration_mismatch,
                "table": self.engine.calibration.to_dict()}

    async def recalibrate(self, quick: bool = True, checks=None, target_replica: str | None = None) -> dict:
        """Re-sweep this replica's table between engine steps (``bole.recalibration.recalibrate``:
        two sweeps, validated with ``checks``, a ``TableChecks``) without installing it; returns the
        new and the old table (mappings). Raises ``RecalibrationError`` if a check refuses it."""
        self._check_target(target_replica)
        old = self.engine.calibration
        new = await asyncio.to_thread(self.engine.recalibrate, quick, checks=checks, hardware=self.hardware_class,
                                      model_name=self.model_name)
        logger.info("recalibrated %s: %s -> %s (not installed yet)", self.replica_id, old.table_id, new.table_id)
        return {"replica_id": self.replica_id, "old_table_id": old.table_id, "table_id": new.table_id,
                "table": new.to_dict(), "old_table": old.to_dict()}

    def set_calibration(self, table: dict, target_replica: str | None = None) -> str:
        self._check_target(target_replica)
        return self._install(CalibrationTable.from_dict(table))

    def _install(self, table: CalibrationTable) -> str:
        """Swap the table between engine steps; warn loudly if it does not describe this replica."""
        self.engine.set_calibration(table)
        logger.info("replica %s: calibration table %s installed", self.replica_id, table.table_id)
        warn_if_mismatched(self.engine, self.hardware_class, f"replica {self.replica_id}")
        return table.table_id

    async def check_health(self) -> None:
        if not await self.client.is_alive():
            raise RuntimeError("the engine loop died")

    async def __del__(self):
        await self.client.drain(self.drain_timeout_s)
        self.engine.shutdown()   # the step loop, then the engine (TP workers and their placement group)


def _replica_id() -> str:
    """This Serve replica's unique id (routers see it as ``replica_id.unique_id``); "local" outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not running inside a Serve replica
        return "local"
