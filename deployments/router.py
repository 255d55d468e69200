"""Ray Serve request router for Bole replicas: ``BoleRequestRouter`` wraps the pure policy of
``deployments.routing_policy`` (prefix affinity, imbalance guard, hardware-aware budget tie-break).

Configure it on the replica deployment (YAML ``request_router_config``)::

    request_router_config:
      request_router_class: deployments.router:BoleRequestRouter
      request_router_kwargs: {block_size: 16, match_rate_threshold: 0.5, imbalance_threshold: 8,
                              affinity_load_slack: 4, comparable_load_slack: 1, routed_memory_blocks: 4096}
      request_routing_stats_period_s: 1.0

The kwargs are ``RouterPolicyConfig``'s fields plus ``routed_memory_blocks``. A replica's view is
built from its ``record_routing_stats`` dict, read back once per report as ``ReplicaStats``
(``deployments.replica_stats``: hardware class, b_ver_per_request, queue, admission, prefix_blocks)
and from Ray's queue-length cache (fresher than the periodic stats). Because stats are periodic, the router also
remembers the block hashes it has just sent to each replica (``on_request_routed``), so a burst of
requests sharing a prefix sticks to one replica before its next stats report.

Draining replicas (``accepting: False`` in their stats: being drained for recalibration or shutdown)
are routed around while any other replica is available, and so are replicas that just refused a
request (``FleetView.mark_refused``, set by the ingress's retry before the stats catch up).
Control calls that name a replica
(``target_replica=<unique id>`` keyword, used by ``deployments.recalibrate``) go to exactly that replica.

The router instance lives in the caller's process (the ingress replica). It publishes every
replica's stats into that process's fleet view (``routing_policy.process_fleet()``, taken once at
construction: Serve builds routers from config kwargs only): the ingress's client, given the same
view, reads it to pick a deployment (hardware class) in a mixed fleet with the same policy, and to
export /metrics.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from bole.cache.block_hash import prefix_block_hashes
from deployments import routing_policy
from deployments.engine_client import SubRequest
from deployments.replica_stats import ReplicaStats
from deployments.routing_policy import (
    PrefixSummary,
    ReplicaView,
    RouterPolicyConfig,
    choose_replicas,
)

logger = logging.getLogger(__name__)


def prompt_token_ids(pending_request: PendingRequest | None) -> list[int] | None:
    """The (first) prompt of a ``generate_many(subs)`` call, if it is one: its choices share it, and a
    batch of prompts goes where its first prompt is cached."""
    if pending_request is None:
        return None
    subs = pending_request.kwargs.get("subs")
    if subs is None and pending_request.args:
        subs = pending_request.args[0]
    return subs[0].prompt_token_ids if isinstance(subs, list) and subs and isinstance(subs[0], SubRequest) else None


def view_from_stats(replica_id: str, stats: ReplicaStats | None, load: int | None, cached) -> ReplicaView:
    """The policy's view of a replica from its last report (None before its first one)."""
    if stats is None:
        return ReplicaView(replica_id, load or 0, cached=cached)
    return ReplicaView(replica_id, stats.load if load is None else load, stats.engine.b_ver_per_request,
                       stats.hardware_class, cached)


class _Cached:
    """Chain hashes a replica holds: its reported summary plus what was routed to it since."""

    def __init__(self, reported: set, routed: PrefixSummary):
        self.reported, self.routed = reported, routed

    def __contains__(self, h) -> bool:
        return h in self.reported or h in self.routed


class BoleRequestRouter(RequestRouter):
    def initialize_state(self, routed_memory_blocks: int = 4096, **policy_kwargs: Any) -> None:
        """``request_router_kwargs``: ``RouterPolicyConfig`` fields + ``routed_memory_blocks`` (how many
        recently routed block hashes to remember per replica)."""
        self.policy = RouterPolicyConfig(**policy_kwargs)
        self.routed_memory_blocks = routed_memory_blocks
        self._routed: dict[str, PrefixSummary] = {}
        # replica -> (its routing-stats dict, that dict as ReplicaStats, its prefix blocks as a set)
        self._reported: dict[str, tuple[dict, ReplicaStats | None, set]] = {}
        self.decisions: dict[str, int] = {}
        # through the module: Serve pickles this class by value, a module reference stays shared
        self.fleet = routing_policy.process_fleet()

    # -- views ------------------------------------------------------------------------------------
    def _reported_stats(self, r: RunningReplica) -> tuple[ReplicaStats | None, set]:
        """The replica's last routing stats, parsed once per report (``ReplicaStats.from_dict``)."""
        rid, raw = r.replica_id.unique_id, r.routing_stats
        if rid not in self._reported or self._reported[rid][0] is not raw:   # held, so never a reused id
            stats = ReplicaStats.from_dict(raw) if raw else None   # {} until the first report
            self._reported[rid] = (raw, stats, set(stats.prefix_blocks) if stats else set())
        return self._reported[rid][1:]

    def _view(self, r: RunningReplica) -> ReplicaView:
        rid = r.replica_id.unique_id
        stats, reported = self._reported_stats(r)
        routed = self._routed.setdefault(rid, PrefixSummary(self.routed_memory_blocks))
        load = self.replica_queue_len_cache.get(r.replica_id)
        return view_from_stats(rid, stats, load, _Cached(reported, routed))

    def _accepting(self, r: RunningReplica) -> bool:
        stats, _ = self._reported_stats(r)
        return stats is None or stats.accepting

    # -- RequestRouter API -------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get("target_replica") if pending_request is not None else None
        if target is not None:  # a control call for one replica; none listed yet: back off, retry
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        refused = self.fleet.refused()
        accepting = [r for r in candidate_replicas if self._accepting(r) and r.replica_id.unique_id not in refused]
        candidate_replicas = accepting or candidate_replicas
        ids = prompt_token_ids(pending_request)
        hashes = prefix_block_hashes(ids, self.policy.block_size) if ids else []
        decision = choose_replicas(hashes, [self._view(r) for r in candidate_replicas], self.policy)
        self.decisions[decision.reason] = self.decisions.get(decision.reason, 0) + 1
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[i] for i in rank] for rank in decision.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        ids = prompt_token_ids(pending_request)
        if ids:
            summary = self._routed.setdefault(replica_id.unique_id, PrefixSummary(self.routed_memory_blocks))
            summary.add(prefix_block_hashes(ids, self.policy.block_size))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for table in (self._routed, self._reported):
            for rid in list(table):
                if rid not in live:
                    del table[rid]
        self.fleet.publish(self._deployment_id.name,
                           {r.replica_id.unique_id: self._reported_stats(r)[0] for r in replicas})
