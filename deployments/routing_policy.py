"""Replica choice for the Bole router, as a pure function (no Ray): prefix affinity, an imbalance
guard with power-of-two fallback, and a hardware-aware tie-break by verification budget.

Prefix identity. A prompt is cut into full blocks of ``block_size`` tokens (the engine's KV block
size, so one routing block is one cache block) and each block gets a *chain* hash: the hash of the
previous block's hash and this block's token ids (``bole.cache.block_hash``, the prefix cache's
own). Block i's hash therefore names the whole prefix up to block i, and "replica r holds the
first m blocks" is m consecutive hits from the start.
Replicas publish the chain hashes of the blocks they computed recently (``PrefixSummary``); the
router adds the hashes of requests it has just sent (stats arrive periodically, routing is now).

The choice (``choose_replicas``), given each replica's load (ongoing requests):
  1. imbalance guard: if max load - min load > ``imbalance_threshold``, ignore affinity and do a
     power-of-two choice (two random replicas, the less loaded first) so a hot prefix cannot pile
     every request onto one replica;
  2. affinity: the replicas holding the longest matched prefix, if it covers at least
     ``match_rate_threshold`` of the prompt's blocks and their load is within
     ``affinity_load_slack`` of the least loaded replica;
  3. otherwise the least loaded replicas (within ``comparable_load_slack``);
  4. among the comparable replicas of 2 or 3, prefer the largest verification budget per request
     (``b_ver_per_request``: B_ver of the bucket the replica would be in with one more request,
     divided by that batch size), so a mixed A100 / GB10 fleet sends work where its calibrated
     budget leaves the most speculation per request; then the lower load; then at random.
The result is a ranking for Ray Serve: the chosen replica first, then the others by load.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

from deployments.checks import require_at_least

if TYPE_CHECKING:  # the policy itself stays free of the engine's imports
    from deployments.replica_stats import ReplicaStats


class PrefixSummary:
    """A bounded LRU set of chain hashes: the compact summary of a replica's cached prefix blocks."""

    def __init__(self, capacity: int = 4096):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def add(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def __contains__(self, h: int) -> bool:
        return h in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def to_list(self) -> list[int]:
        return list(self._hashes)


def matched_blocks(prompt_hashes: Sequence[int], cached) -> int:
    """How many leading blocks of the prompt ``cached`` holds (chain hashes: stop at the first miss)."""
    n = 0
    for h in prompt_hashes:
        if h not in cached:
            break
        n += 1
    return n


@dataclass(frozen=True)
class RouterPolicyConfig:
    """Thresholds of the routing policy (the ``request_router_kwargs`` of the deployment).

    block_size: tokens per routing block; must equal the engine's KV ``block_size``.
    match_rate_threshold: affinity applies only if the best replica holds at least this fraction
        of the prompt's full blocks (0 < x <= 1).
    imbalance_threshold: if the most and least loaded replicas differ by more than this many
        ongoing requests, affinity is ignored and a power-of-two choice is made.
    affinity_load_slack: an affinity replica may carry at most this many more ongoing requests
        than the least loaded replica (else the prefix is recomputed elsewhere).
    comparable_load_slack: replicas within this many ongoing requests of the least loaded one
        are "comparable" for the hardware-aware tie-break.
    """

    block_size: int = 16
    match_rate_threshold: float = 0.5
    imbalance_threshold: int = 8
    affinity_load_slack: int = 4
    comparable_load_slack: int = 1

    def __post_init__(self):
        require_at_least(self, 1, "block_size")
        if not 0 < self.match_rate_threshold <= 1:
            raise ValueError(f"match_rate_threshold must be in (0, 1], got {self.match_rate_threshold}")
        require_at_least(self, 0, "imbalance_threshold", "affinity_load_slack", "comparable_load_slack")


@dataclass(frozen=True)
class ReplicaView:
    """What the policy knows about one replica."""

    replica_id: str
    load: int                          # ongoing requests (running + waiting)
    b_ver_per_request: float = 0.0     # verification budget per request with one more request
    hardware_class: str = "unknown"
    cached: frozenset | set = field(default_factory=frozenset)  # chain hashes it holds


@dataclass(frozen=True)
class RoutingDecision:
    ranks: list[list[str]]             # replica ids, most preferred rank first
    reason: str                        # "affinity" | "least_loaded" | "imbalance" | "single" | "none"
    matched_blocks: int = 0


def _best_budget(views: list[ReplicaView], rng: random.Random) -> ReplicaView:
    top = max((v.b_ver_per_request, -v.load) for v in views)
    tied = [v for v in views if (v.b_ver_per_request, -v.load) == top]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def _ranks(chosen: ReplicaView, views: list[ReplicaView]) -> list[list[str]]:
    rest = sorted((v for v in views if v.replica_id != chosen.replica_id),
                  key=lambda v: (v.load, -v.b_ver_per_request))
    return [[chosen.replica_id]] + ([[v.replica_id for v in rest]] if rest else [])


def choose_replicas(prompt_hashes: Sequence[int], replicas: Sequence[ReplicaView], cfg: RouterPolicyConfig,
                    rng: random.Random | None = None) -> RoutingDecision:
    """Rank ``replicas`` for a prompt with chain hashes ``prompt_hashes`` (see the module docstring)."""
    rng = rng or random
    views = list(replicas)
    if not views:
        return RoutingDecision([], "none")
    if len(views) == 1:
        return RoutingDecision([[views[0].replica_id]], "single")
    loads = [v.load for v in views]
    low = min(loads)
    if max(loads) - low > cfg.imbalance_threshold:
        a, b = rng.sample(views, 2)
        first, second = sorted((a, b), key=lambda v: (v.load, -v.b_ver_per_request))
        return RoutingDecision([[first.replica_id], [second.replica_id]], "imbalance")
    if prompt_hashes:
        matches = {v.replica_id: matched_blocks(prompt_hashes, v.cached) for v in views}
        best = max(matches.values())
        if best > 0 and best / len(prompt_hashes) >= cfg.match_rate_threshold:
            holders = [v for v in views if matches[v.replica_id] == best
                       and v.load <= low + cfg.affinity_load_slack]
            if holders:
                h_low = min(v.load for v in holders)
                comparable = [v for v in holders if v.load <= h_low + cfg.comparable_load_slack]
                return RoutingDecision(_ranks(_best_budget(comparable, rng), views), "affinity", best)
    comparable = [v for v in views if v.load <= low + cfg.comparable_load_slack]
    return RoutingDecision(_ranks(_best_budget(comparable, rng), views), "least_loaded")


class FleetView:
    """Latest routing stats of every replica, by deployment, as seen by this process's routers, and
    the replicas that refused a request lately (``mark_refused``: draining, before their next stats
    report says so), which the routers skip for ``refused_ttl_s`` while another replica is available
    (long enough for the replica's stats, reported every ``request_routing_stats_period_s``, to say it)."""

    def __init__(self, refused_ttl_s: float = 5.0):
        if refused_ttl_s < 0:
            raise ValueError(f"refused_ttl_s must be >= 0, got {refused_ttl_s!r}")
        self.refused_ttl_s = refused_ttl_s
        self._lock = threading.Lock()
        # deployment -> replica id -> its stats (None before its first report)
        self._stats: dict[str, dict[str, ReplicaStats | None]] = {}
        self._refused: dict[str, float] = {}   # replica id -> until when (time.monotonic()) to skip it

    def mark_refused(self, replica_id: str) -> None:
        with self._lock:
            self._refused[replica_id] = time.monotonic() + self.refused_ttl_s

    def refused(self) -> set[str]:
        now = time.monotonic()
        with self._lock:
            for rid in [r for r, until in self._refused.items() if until <= now]:
                del self._refused[rid]
            return set(self._refused)

    def publish(self, deployment: str, stats_by_replica: dict[str, ReplicaStats | None]) -> None:
        with self._lock:
            self._stats[deployment] = dict(stats_by_replica)

    def stats(self) -> dict[str, dict[str, ReplicaStats | None]]:
        with self._lock:
            return {d: dict(r) for d, r in self._stats.items()}


# Serve constructs each RequestRouter itself, from serialisable ``request_router_kwargs`` only, so a
# FleetView object cannot be handed to it: this per-process registry is the one way in. Routers take
# it once, at construction (``BoleRequestRouter.initialize_state``); everything else (the ingress's
# ``ServeEngineClient``) is given it as a constructor argument.
_PROCESS_FLEET = FleetView()


def process_fleet() -> FleetView:
    """This process's fleet view: the one its routers publish into and its ingress reads."""
    return _PROCESS_FLEET
