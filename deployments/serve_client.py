"""The ingress-side ``EngineClient`` of a Serve fleet: Serve handles to one replica deployment per
hardware group (``deployments.replica.BoleReplica``), with group choice and retries of refusals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from bole.cache.block_hash import prefix_block_hashes
from deployments.engine_client import EngineUnavailable, unwrap_remote_error
from deployments.replica_stats import ReplicaStats
from deployments.retry import RetryPolicy, retryable
from deployments.router import view_from_stats
from deployments.routing_policy import FleetView, RouterPolicyConfig, choose_replicas

logger = logging.getLogger(__name__)


class ServeEngineClient:
    """``EngineClient`` over Serve handles to one replica deployment per hardware group.

    With several groups, the group is chosen with the routing policy over the whole fleet view
    (``fleet``: every replica's stats as the deployments' routers see them, the same ``FleetView``
    those routers publish into: ``routing_policy.process_fleet()`` under Serve); the group's
    ``BoleRequestRouter`` then picks the replica with the same policy. Before any stats exist the
    group with the fewest requests in flight from here is used.

    One HTTP request is one ``generate_many`` call (see ``deployments.engine_client``). A call that
    a replica refuses before any output (draining, or the replica is gone) is sent again after a
    jittered exponential backoff (``retry``: ``deployments.retry.RetryPolicy``), the refusing
    replica marked so the routers skip it; past the policy's attempts or budget the client gets a
    clean 503 with ``Retry-After``.
    """

    def __init__(self, handles: dict, tokenizer, fleet: FleetView, policy: RouterPolicyConfig | None = None,
                 retry: RetryPolicy | None = None):
        self.fleet = fleet
        self.retry = retry or RetryPolicy()
        self.handles = handles
        self.tokenizer = tokenizer
        self.policy = policy or RouterPolicyConfig()
        self.max_model_len = 0
        self.vocab_size = 0
        self.max_choices = 1
        self.in_flight = {name: 0 for name in handles}

    async def start(self) -> None:
        infos = await asyncio.gather(*(h.info.remote() for h in self.handles.values()))
        # the fleet serves one model; the smallest capacity bounds what every group can take
        self.max_model_len = min(i["max_model_len"] for i in infos)
        self.vocab_size = min(i["vocab_size"] for i in infos)
        self.max_choices = min(i["max_choices"] for i in infos)

    def pick_group(self, prompt_token_ids: list[int]) -> str:
        """The deployment (hardware group) a request with this prompt goes to (see the class docstring)."""
        if len(self.handles) == 1:
            return next(iter(self.handles))
        fleet = {d: r for d, r in self.fleet.stats().items() if d in self.handles}
        owner, views = {}, []
        for dep, replicas in fleet.items():
            for rid, stats in replicas.items():
                if stats is None or stats.accepting:  # a draining replica (recalibration, shutdown) is skipped
                    owner[rid] = dep
                    views.append(view_from_stats(rid, stats, None, set(stats.prefix_blocks) if stats else set()))
        if views:
            hashes = prefix_block_hashes(prompt_token_ids, self.policy.block_size)
            ranks = choose_replicas(hashes, views, self.policy).ranks
            if ranks:
                return owner[ranks[0][0]]
        # a class whose every replica is draining takes nothing while another class can
        open_groups = [d for d in self.handles if d not in fleet or d in owner.values()] or list(self.handles)
        return min(open_groups, key=lambda d: self.in_flight[d])

    async def generate_many(self, subs):
        """Stream (index, output) from a replica of the chosen group, retrying refusals (above)."""
        if not self.max_model_len:
            raise EngineUnavailable("the ingress has not reached the replicas yet")
        subs = list(subs)
        waits = self.retry.delays()
        attempts, start = 0, time.monotonic()
        while True:
            name = self.pick_group(subs[0].prompt_token_ids)
            self.in_flight[name] += len(subs)
            stream = self.handles[name].options(stream=True).generate_many.remote(subs)
            attempts += 1
            started = complete = False
            try:
                async for item in stream:
                    started = True
                    yield item
                complete = True
                return
            except Exception as e:
                refusal = unwrap_remote_error(e)
                if started or not retryable(refusal):
                    raise
            finally:
                self.in_flight[name] -= len(subs)
                if not complete:
                    stream.cancel()   # the replica's generator is cancelled and aborts the engine requests
            replica = refusal.replica_id if isinstance(refusal, EngineUnavailable) else None
            if replica:
                self.fleet.mark_refused(replica)
            wait = next(waits, None)
            if wait is None:
                raise EngineUnavailable(
                    f"no replica accepted the request: {attempts} attempts over {time.monotonic() - start:.1f} s "
                    f"(the last: {type(refusal).__name__}: {refusal})",
                    retry_after_s=refusal.retry_after_s if isinstance(refusal, EngineUnavailable) else 1.0) from None
            logger.info("request %s refused by %s (%s); again in %.2f s", subs[0].request_id,
                        replica or name, type(refusal).__name__, wait)
            await asyncio.sleep(wait)

    async def drain(self, timeout: float | None = None) -> bool:
        """Nothing in flight here to wait for: each replica drains its own requests (``BoleReplica``)."""
        return True

    async def close(self) -> None:
        """The replicas outlive this ingress; nothing to stop."""

    async def is_alive(self) -> bool:
        return bool(self.max_model_len)

    async def is_ready(self) -> bool:
        """Some replica accepts requests: the one each group's router picks says so, or, when that pick is
        a replica being drained (the least loaded, until its next stats report marks it), any replica whose
        reported stats say it accepts (a surge replica beside it)."""
        if not self.max_model_len:
            return False
        try:
            oks = await asyncio.gather(*(h.is_ready.remote() for h in self.handles.values()))
        except Exception:
            oks = []
        return any(oks) or any(s is not None and s.accepting
                               for reps in self.fleet.stats().values() for s in reps.values())

    async def fleet_stats(self) -> list[ReplicaStats]:
        """Every replica's stats as the routers last saw them, tagged with its deployment; before any
        router has, one replica's own per group."""
        fleet = self.fleet.stats()
        out = [replace(stats, deployment=dep) for dep in self.handles for stats in fleet.get(dep, {}).values()
               if stats is not None]
        if not out:
            stats = await asyncio.gather(*(h.stats.remote() for h in self.handles.values()))
            out = [replace(s, deployment=dep) for dep, s in zip(self.handles, stats, strict=True)]
        return out
