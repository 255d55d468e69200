"""The ingress-side client reads the fleet view it is given (no process global), no Ray cluster needed."""

import asyncio

from bole.engine.core import EngineStats
from deployments.replica_stats import ReplicaStats
from deployments.routing_policy import FleetView, RouterPolicyConfig, process_fleet
from deployments.serve_client import ServeEngineClient
from deployments.server_metrics import ServerMetrics


def stats(rid: str, running: int, hardware: str, accepting: bool = True) -> ReplicaStats:
    return ReplicaStats(EngineStats(running=running, b_ver_per_request=4.0, table_id="t"), rid, hardware, 4, 16, 0,
                        accepting, 0, "", prefix_blocks=(1, 2))


def test_the_given_fleet_view_picks_the_group_and_feeds_metrics():
    fleet = FleetView()
    client = ServeEngineClient({"a100": object(), "gb10": object()}, None, fleet, RouterPolicyConfig(block_size=4))
    fleet.publish("a100", {"r1": stats("r1", 9, "a100")})
    fleet.publish("gb10", {"r2": stats("r2", 0, "gb10")})
    assert client.pick_group(list(range(8))) == "gb10"         # the least loaded replica's group
    fleet.publish("gb10", {"r2": stats("r2", 0, "gb10", accepting=False)})
    assert client.pick_group(list(range(8))) == "a100"         # a draining group takes nothing
    fleet.publish("a100", {"r1": stats("r1", 9, "a100"), "r3": None})   # r3 has not reported yet
    rows = asyncio.run(client.fleet_stats())
    assert {(r.replica_id, r.deployment) for r in rows} == {("r1", "a100"), ("r2", "gb10")}   # not r3
    text = ServerMetrics("m").export(rows).decode()   # the prefix blocks as their count, never as a list
    assert 'bole_prefix_summary_blocks{hardware_class="a100",model="m",replica="r1"} 2.0' in text
    assert 'bole_running_requests{hardware_class="a100",model="m",replica="r1"} 9.0' in text
    assert "a100" not in process_fleet().stats()   # nothing went through the process registry


def test_a_replica_without_stats_yet_counts_as_accepting_and_idle():
    fleet = FleetView()
    client = ServeEngineClient({"a100": object(), "gb10": object()}, None, fleet, RouterPolicyConfig(block_size=4))
    fleet.publish("a100", {"r1": stats("r1", 0, "a100", accepting=False)})
    fleet.publish("gb10", {"r2": None})   # listed by the router, no routing stats reported yet
    assert client.pick_group(list(range(8))) == "gb10"
    fleet.publish("gb10", {"r2": stats("r2", 0, "gb10", accepting=False)})
    client.in_flight["gb10"] = 1   # every replica draining: the group with less in flight from here
    assert client.pick_group(list(range(8))) == "a100"


def test_ready_while_the_routers_pick_is_a_draining_replica():
    """/ready during a one-replica class's surge: the router's pick can be the replica being drained (it
    says not ready) before its stats say so; the surge replica's stats say it accepts, so the fleet is
    ready. With no replica accepting, it is not."""
    class Handle:
        def __init__(self, ready):
            self.is_ready = type("M", (), {"remote": staticmethod(lambda: _value(ready))})

    async def _value(v):
        return v

    fleet = FleetView()
    client = ServeEngineClient({"cpu": Handle(False)}, None, fleet, RouterPolicyConfig(block_size=4))
    client.max_model_len = 64
    fleet.publish("cpu", {"old": stats("old", 0, "cpu", accepting=False), "surge": stats("surge", 0, "cpu")})
    assert asyncio.run(client.is_ready())
    fleet.publish("cpu", {"old": stats("old", 0, "cpu", accepting=False), "surge": None})
    assert not asyncio.run(client.is_ready())
    client.handles = {"cpu": Handle(True)}
    assert asyncio.run(client.is_ready())
