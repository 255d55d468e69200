"""Tensor-parallel replicas: one Ray worker actor per TP rank, driven in lockstep (SPMD engines).

    BoleReplica (tp_size > 1)
      AsyncEngine(TPEngine)            the usual step thread; TPEngine is the driver
        TPWorker rank 0 ... rank n-1   Ray actors, one per placement-group bundle, each holding one
                                       rank's LLMEngine (its weight slice, caches of its local heads)

``TPEngine`` implements ``bole.engine.core.EngineCore``, as ``LLMEngine`` does. ``add_request`` /
``abort`` / ``step`` go to every worker (``bole.parallel`` explains why identical calls give
identical tokens); ``step`` returns rank 0's outputs after checking that every
rank emitted the same tokens (a divergence would mean a bug, and fails loudly). Unseeded requests
get their seed here, before fan-out, so stochastic sampling agrees across ranks too. Rank 0 also
returns its ``EngineStats`` (running / waiting requests, metrics, budget state) with every step.

Placement: the workers go into a STRICT_PACK placement group of ``tp_size`` bundles (one node, so the
process group binds 127.0.0.1). Under Serve with ``placement_group_bundles`` the replica actor
already runs in such a group (its own resources taken from bundle 0): the workers join it, one per
bundle. Otherwise the driver creates the group and removes it on shutdown. The process group is
gloo on CPU and NCCL on CUDA; rank 0 picks the rendezvous port on its own node.

Recalibration (``recalibrate``) runs the sweep on every rank at once (its forwards contain the
all-reduce) and returns rank 0's table; installing it (the ``calibration`` setter) puts that one
table on every rank, so the budget, and with it every scheduling decision, stays identical across
ranks.
"""

from __future__ import annotations

import logging
import random
from dataclasses import replace

import ray

from bole.config import EngineConfig
from bole.engine.core import EngineLimits, EngineStats, RequestTimings
from bole.engine.output import RequestOutput
from bole.sampling_params import SamplingParams
from bole.spec.budget import CalibrationTable
from deployments.logs import configure_logging

logger = logging.getLogger(__name__)


class TPWorker:
    """One TP rank: joins the process group, then holds and steps that rank's engine."""

    def __init__(self, rank: int, tp_size: int):
        configure_logging()   # this rank's engine start log
        self.rank, self.tp_size = rank, tp_size
        self.engine = None

    def pick_port(self) -> int:
        from bole.parallel import free_port

        return free_port("127.0.0.1")

    def setup(self, port: int, model_path: str, engine_options: dict) -> dict:
        import torch

        from bole.engine.async_engine import freeze_startup_heap
        from bole.llm import build_engine
        from bole.parallel import init_tp_group

        device = engine_options.get("device", "cpu")
        if not str(device).startswith("cuda"):
            torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources()
                                               .get("CPU", 1))))
        group = init_tp_group(self.rank, self.tp_size, "127.0.0.1", port, device=device)
        # every rank decodes text: stop strings end requests, and all ranks must end them alike
        self.engine = build_engine(model_path, tokenizer=True, tp_rank=self.rank,
                                   tp_group=group.group, **{**engine_options, "tp_size": self.tp_size})
        freeze_startup_heap()   # a rank's pause would stall every rank's collective
        return {"calibration": self.engine.calibration.to_dict(), "limits": self.engine.limits(),
                "stats": self.engine.stats()}

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> str:
        return self.engine.add_request(prompt_token_ids, params, request_id)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def step(self) -> dict:
        outputs = self.engine.step()
        for out in outputs:
            if out.finished:  # the driver keeps what it needs; free the finished request here
                self.engine.pop_finished(out.request_id)
        return {"outputs": outputs, "stats": self.engine.stats() if self.rank == 0 else None}

    def recalibrate(self, quick: bool = True, **kw) -> dict:
        """Sweep on this rank (every rank at once: the forwards all-reduce) without installing; the
        table or the error (``bole.recalibration.recalibrate``'s keywords)."""
        try:
            return {"table": self.engine.recalibrate(quick, **kw).to_dict()}
        except Exception as e:  # noqa: BLE001 - reported to the driver, which keeps the old table
            return {"error": f"{type(e).__name__}: {e}"}

    def set_calibration(self, table: dict) -> EngineStats:
        """Install ``table``; this rank's stats under it (the budget state changes with the table)."""
        self.engine.calibration = CalibrationTable.from_dict(table)
        return self.engine.stats()


class TPEngine:
    """Driver of ``tp_size`` ``TPWorker`` actors with ``LLMEngine``'s serving surface."""

    def __init__(self, model_path: str, engine_options: dict, tp_size: int,
                 worker_options: dict | None = None, ready_timeout_s: float = 600.0):
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from bole.llm import resolve_repo_path
        from bole.models.loader import read_config

        if tp_size < 2:
            raise ValueError(f"TPEngine is for tp_size >= 2, got {tp_size}")
        options = {k: v for k, v in engine_options.items() if k != "tp_size"}
        self.config = EngineConfig.from_options(**options, tp_size=tp_size)
        self.tp_size = tp_size
        _, self._model_config = read_config(resolve_repo_path(model_path))
        on_gpu = self.config.device.startswith("cuda")
        worker_options = {"num_cpus": 1, "num_gpus": 1 if on_gpu else 0, **(worker_options or {})}

        self._own_pg = None
        pg = get_current_placement_group()
        if pg is None or len(pg.bundle_specs) < tp_size:
            if pg is not None:
                logger.warning("the replica's placement group has %d bundles for tp_size=%d: creating one",
                               len(pg.bundle_specs), tp_size)
            bundle = {"CPU": float(worker_options["num_cpus"])}
            if worker_options["num_gpus"]:
                bundle["GPU"] = float(worker_options["num_gpus"])
            pg = self._own_pg = placement_group([bundle] * tp_size, strategy="STRICT_PACK")
            ray.get(pg.ready(), timeout=ready_timeout_s)
        actor = ray.remote(TPWorker)
        self.workers = [
            actor.options(**worker_options, scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank, placement_group_capture_child_tasks=False)
            ).remote(rank, tp_size)
            for rank in range(tp_size)]
        port = ray.get(self.workers[0].pick_port.remote(), timeout=ready_timeout_s)
        infos = ray.get([w.setup.remote(port, model_path, options) for w in self.workers],
                        timeout=ready_timeout_s)
        self._limits, self._stats = infos[0]["limits"], infos[0]["stats"]
        self._calibration = CalibrationTable.from_dict(infos[0]["calibration"])
        self.tokenizer = None
        self._unfinished: set[str] = set()
        self._ids = 0
        logger.info("TP engine up: %d ranks of %s", tp_size, model_path)

    @property
    def model_config(self):
        return self._model_config

    def limits(self) -> EngineLimits:
        return self._limits

    def stats(self) -> EngineStats:
        """Rank 0's stats as of the last step (every rank schedules alike)."""
        return self._stats

    def request_timings(self, request_id: str) -> RequestTimings | None:
        return None  # the ranks keep their requests' clocks; the driver does not fetch them per token

    def cached_prefix_hashes(self, limit: int | None = None) -> list[int]:
        return []  # rank 0's prefix cache stays on its worker; the replica falls back to recent prompts

    # -- calibration: one table on every rank -------------------------------------------------------
    @property
    def calibration(self) -> CalibrationTable:
        return self._calibration

    @calibration.setter
    def calibration(self, table: CalibrationTable) -> None:
        self._stats = ray.get([w.set_calibration.remote(table.to_dict()) for w in self.workers])[0]
        self._calibration = table

    def recalibrate(self, quick: bool = True, **kw) -> CalibrationTable:
        """Sweep on all ranks at once (call between steps); rank 0's table, not installed (the
        ``calibration`` setter installs one table on every rank)."""
        from bole.recalibration import RecalibrationError

        results = ray.get([w.recalibrate.remote(quick, **kw) for w in self.workers])
        if "error" in results[0]:
            raise RecalibrationError(results[0]["error"])
        return CalibrationTable.from_dict(results[0]["table"])

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if params.seed is None:  # every rank must draw with the same seed
            params = replace(params, seed=random.getrandbits(62))
        if request_id is None:
            request_id, self._ids = f"tp-req-{self._ids}", self._ids + 1
        refs = [w.add_request.remote(prompt_token_ids, params, request_id) for w in self.workers]
        try:
            ray.get(refs[0])  # validation errors (InvalidRequest) come from rank 0 ...
        except ray.exceptions.RayTaskError as e:
            ray.wait(refs[1:], num_returns=len(refs) - 1)  # ... and every rank raised the same one
            raise e.as_instanceof_cause() from None
        ray.get(refs[1:])
        self._unfinished.add(request_id)
        return request_id

    def abort(self, request_id: str) -> bool:
        found = ray.get([w.abort.remote(request_id) for w in self.workers])
        self._unfinished.discard(request_id)
        return found[0]

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def pop_finished(self, request_id: str):
        return None  # workers free finished requests as they finish

    def step(self, emit_early=None, admit=None) -> list[RequestOutput]:
        """Every rank's step; all its outputs returned at the end (the ranks step remotely, so nothing is
        handed to ``emit_early``, and requests join between steps only: ``admit`` is not called)."""
        states = ray.get([w.step.remote() for w in self.workers])
        outputs = states[0]["outputs"]
        emitted = [[(o.request_id, o.new_token_ids, o.finished) for o in s["outputs"]] for s in states]
        if any(e != emitted[0] for e in emitted[1:]):
            raise RuntimeError(f"tensor-parallel ranks diverged: {emitted}")
        for out in outputs:
            if out.finished:
                self._unfinished.discard(out.request_id)
        self._stats = states[0]["stats"]
        return outputs

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            ray.kill(w)
        if self._own_pg is not None:
            remove_placement_group(self._own_pg)
            self._own_pg = None
