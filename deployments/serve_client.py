"""The ingress-side ``EngineClient`` of a Serve fleet: Serve handles to one replica deployment per
hardware group (``deployments.replica.BoleReplica``), with group choice, fallback to the next group
when one is full, and retries of refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace

from bole.cache.block_hash import prefix_block_hashes
from deployments.engine_client import EngineOverloaded, EngineUnavailable, unwrap_remote_error
from deployments.replica_stats import ReplicaStats
from deployments.retry import RetryPolicy, group_refused, retryable
from deployments.router import view_from_stats
from deployments.routing_policy import FleetView, RouterPolicyConfig, choose_replicas

logger = logging.getLogger(__name__)


class ServeEngineClient:
    """``EngineClient`` over Serve handles to one replica deployment per hardware group.

    With several groups, the group is chosen with the routing policy over the whole fleet view
    (``fleet``: every replica's stats as the deployments' routers see them, the same ``FleetView``
    those routers publish into: ``routing_policy.process_fleet()`` under Serve); the group's
    ``BoleRequestRouter`` then picks the replica with the same policy. Before any stats exist the
    group with the fewest requests in flight from here is used (``rank_groups``: the whole order).

    One HTTP request is one ``generate_many`` call (see ``deployments.engine_client``). A group that
    refuses the call before any output because it has no room (Serve's queue for it full, a replica's
    admission limit, the deployment unavailable: ``deployments.retry.group_refused``) passes it to the
    next group in that order at once; when every group refused, the client gets one 429
    (``EngineOverloaded``). A call that a replica refuses before any output because it is draining or
    gone is sent again, to the groups in a fresh order, after a jittered exponential backoff (``retry``:
    ``deployments.retry.RetryPolicy``), the refusing replica marked so the routers skip it; past the
    policy's attempts or budget the client gets a clean 503 with ``Retry-After``. Nothing is sent again
    after the first output (a stream's first byte). The ingress's deadline bounds all of it: at the
    deadline it cancels the task iterating this generator, and so the call in flight or the wait.
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

    def rank_groups(self, prompt_token_ids: list[int]) -> list[str]:
        """The deployments (hardware groups) that can take a request with this prompt, in the order it
        tries them: the groups of the routing policy's ranking of their accepting replicas (its first
        choice first), then the groups it did not rank (no stats yet) by requests in flight from here.
        A group whose every replica is draining or has just refused a request takes nothing while
        another can; when none can, every group, by requests in flight (their refusals are retried)."""
        if len(self.handles) == 1:
            return list(self.handles)
        fleet = {d: r for d, r in self.fleet.stats().items() if d in self.handles}
        refused = self.fleet.refused()
        owner, views = {}, []
        for dep, replicas in fleet.items():
            for rid, stats in replicas.items():
                if rid not in refused and (stats is None or stats.accepting):  # not draining (recalibration, ...)
                    owner[rid] = dep
                    views.append(view_from_stats(rid, stats, None, set(stats.prefix_blocks) if stats else set()))
        ranked: dict[str, None] = {}   # an ordered set
        if views:
            hashes = prefix_block_hashes(prompt_token_ids, self.policy.block_size)
            for rank in choose_replicas(hashes, views, self.policy).ranks:
                for rid in rank:
                    ranked.setdefault(owner[rid])
        open_groups = [d for d in self.handles if d not in fleet or d in owner.values()] or list(self.handles)
        return [*ranked, *sorted((d for d in open_groups if d not in ranked), key=lambda d: self.in_flight[d])]

    async def generate_many(self, subs):
        """Stream (index, output) from a replica of the first group that takes the call (the class
        docstring: groups that refuse as full, then retries of refusals)."""
        if not self.max_model_len:
            raise EngineUnavailable("the ingress has not reached the replicas yet")
        subs = list(subs)
        waits = self.retry.delays()
        attempts, start = 0, time.monotonic()
        while True:
            full = []   # this round's groups that had no room, in the order tried
            for name in self.rank_groups(subs[0].prompt_token_ids):
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
                    # after the first output nothing is re-sent: the client has it (a stream, its first byte)
                    if started or not (retryable(refusal) or group_refused(refusal)):
                        raise
                finally:
                    self.in_flight[name] -= len(subs)
                    if not complete:
                        cancel(stream)
                if not group_refused(refusal):
                    break   # a draining or gone replica: back off below, then a new round
                full.append(name)
                logger.info("request %s: group %s has no room (%s); trying the next group", subs[0].request_id,
                            name, type(refusal).__name__)
            else:
                raise EngineOverloaded(f"no group had room for the request: {', '.join(full)} refused it "
                                       f"(the last: {type(refusal).__name__}: {refusal})") from None
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


def cancel(stream) -> None:
    """Cancel a Serve call: the replica's generator is cancelled and aborts the engine requests. Serve's
    ``cancel`` raises the call's own error when the call never reached a replica (its queue was full:
    ``BackPressureError``; the deployment unavailable), which would replace the refusal being handled:
    there is nothing to cancel then."""
    with contextlib.suppress(Exception):
        stream.cancel()
