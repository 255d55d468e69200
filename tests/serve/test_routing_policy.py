"""The router's pure policy: chain block hashes, prefix affinity, imbalance guard, budget tie-break."""

from __future__ import annotations

import random

import pytest

from bole.cache.block_hash import prefix_block_hashes
from deployments.routing_policy import (
    PrefixSummary,
    ReplicaView,
    RouterPolicyConfig,
    choose_replicas,
    matched_blocks,
)

CFG = RouterPolicyConfig(block_size=4, match_rate_threshold=0.5, imbalance_threshold=4, affinity_load_slack=2,
                         comparable_load_slack=1)


def test_chain_hashes_name_whole_prefixes():
    a = prefix_block_hashes(list(range(10)), 4)
    assert len(a) == 2                                              # partial last block not hashed
    assert prefix_block_hashes(list(range(8)) + [99, 98], 4) == a   # same first 8 tokens
    b = prefix_block_hashes([0, 1, 2, 7] + list(range(4, 8)), 4)
    assert b[0] != a[0] and b[1] != a[1]                            # block 2 differs because block 1 does
    assert prefix_block_hashes([1, 2, 3], 4) == []
    with pytest.raises(ValueError):
        prefix_block_hashes([1], 0)


def test_summary_is_bounded_lru_and_matches_leading_blocks():
    s = PrefixSummary(capacity=3)
    h = prefix_block_hashes(list(range(20)), 4)                     # 5 blocks
    s.add(h)
    assert len(s) == 3 and h[0] not in s and h[4] in s
    assert matched_blocks(h, s) == 0                                # chain: the first block is gone
    assert matched_blocks(h[:2], set(h)) == 2


def views(*specs):
    return [ReplicaView(rid, load, bpr, "x", set(cached)) for rid, load, bpr, cached in specs]


def test_affinity_wins_among_comparable_loads():
    h = prefix_block_hashes(list(range(16)), 4)
    d = choose_replicas(h, views(("a", 1, 10.0, []), ("b", 2, 10.0, h[:3]), ("c", 0, 50.0, h[:1])), CFG)
    assert d.reason == "affinity" and d.matched_blocks == 3 and d.ranks[0] == ["b"]
    assert d.ranks[1] == ["c", "a"]                                 # the rest by load


def test_low_match_rate_or_overloaded_holder_falls_back():
    h = prefix_block_hashes(list(range(16)), 4)
    d = choose_replicas(h, views(("a", 0, 10.0, []), ("b", 0, 10.0, h[:1])), CFG)   # 1/4 < 0.5
    assert d.reason == "least_loaded"
    d = choose_replicas(h, views(("a", 0, 10.0, []), ("b", 3, 10.0, h)), CFG)       # 3 > 0 + slack 2
    assert d.reason == "least_loaded" and d.ranks[0] == ["a"]


def test_imbalance_guard_uses_power_of_two():
    h = prefix_block_hashes(list(range(16)), 4)
    vs = views(("hot", 9, 10.0, h), ("a", 0, 10.0, []), ("b", 1, 10.0, []), ("c", 2, 10.0, []))
    seen = set()
    for seed in range(40):
        d = choose_replicas(h, vs, CFG, random.Random(seed))
        assert d.reason == "imbalance" and len(d.ranks) == 2
        first, second = d.ranks[0][0], d.ranks[1][0]
        load = {v.replica_id: v.load for v in vs}
        assert load[first] <= load[second]
        seen.add(first)
    assert "hot" not in seen and len(seen) >= 2


def test_hardware_aware_tie_break_prefers_budget_per_request():
    # equal loads, no prefix: the replica whose bucket leaves more B_ver per request wins
    d = choose_replicas([], views(("a100", 2, 24.0, []), ("gb10", 2, 48.0, []), ("far", 5, 99.0, [])), CFG)
    assert d.ranks[0] == ["gb10"]
    # "far" has the biggest budget but is not comparable in load (5 > 2 + 1)
    d = choose_replicas([], views(("a100", 2, 24.0, []), ("b", 3, 30.0, [])), CFG)
    assert d.ranks[0] == ["b"]                                      # within comparable_load_slack


def test_edge_cases_and_config_validation():
    assert choose_replicas([], [], CFG).ranks == []
    assert choose_replicas([1], views(("only", 7, 0.0, [])), CFG).ranks == [["only"]]
    for bad in (dict(block_size=0), dict(match_rate_threshold=0), dict(imbalance_threshold=-1)):
        with pytest.raises(ValueError):
            RouterPolicyConfig(**bad)


def test_retry_backoff_is_jittered_exponential_and_bounded():
    import random

    from deployments.retry import RetryPolicy

    policy = RetryPolicy(base_s=0.1, max_delay_s=2.0, budget_s=30.0, max_attempts=12)
    waits = list(policy.delays(random.Random(0)))
    assert len(waits) == 11   # attempts 2..12
    for k, w in enumerate(waits):
        step = min(2.0, 0.1 * 2 ** k)
        assert step / 2 <= w <= step   # never near zero: no tight loop
    assert sum(waits) <= 30.0   # 11 waits of at most 2 s: max_attempts runs out first
    other = list(policy.delays(random.Random(1)))
    assert other != waits   # jittered: clients refused together spread out
    for seed in range(50):   # the budget is spent, never undershot: only the last wait is cut
        for budget in (1.0, 2.0):
            short = list(RetryPolicy(budget_s=budget).delays(random.Random(seed)))
            assert sum(short) == pytest.approx(budget) and 2 <= len(short) <= 6
            for k, w in enumerate(short[:-1]):
                assert min(2.0, 0.1 * 2 ** k) / 2 <= w
            assert short[-1] > 0
    assert list(RetryPolicy(max_attempts=1).delays()) == []
    with pytest.raises(ValueError):
        RetryPolicy(base_s=0)


def test_refused_replicas_are_skipped_until_their_mark_expires():
    import time

    from deployments.routing_policy import FleetView

    fleet = FleetView(refused_ttl_s=0.2)
    fleet.mark_refused("r1")
    assert fleet.refused() == {"r1"}
    time.sleep(0.25)
    assert fleet.refused() == set()
