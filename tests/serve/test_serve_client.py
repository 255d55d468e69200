"""The ingress-side client reads the fleet view it is given (no process global), no Ray cluster needed."""

import asyncio

from deployments.routing_policy import FleetView, RouterPolicyConfig, process_fleet
from deployments.serve_client import ServeEngineClient


def stats(running: int, hardware: str, accepting: bool = True) -> dict:
    return {"running": running, "waiting": 0, "b_ver_per_request": 4.0, "hardware_class": hardware,
            "accepting": accepting, "prefix_blocks": [1, 2]}


def test_the_given_fleet_view_picks_the_group_and_feeds_metrics():
    fleet = FleetView()
    client = ServeEngineClient({"a100": object(), "gb10": object()}, None, fleet, RouterPolicyConfig(block_size=4))
    fleet.publish("a100", {"r1": stats(9, "a100")})
    fleet.publish("gb10", {"r2": stats(0, "gb10")})
    assert client._pick(list(range(8))) == "gb10"         # the least loaded replica's group
    fleet.publish("gb10", {"r2": stats(0, "gb10", accepting=False)})
    assert client._pick(list(range(8))) == "a100"         # a draining group takes nothing
    rows = asyncio.run(client.fleet_stats())
    assert {(r["replica"], r["deployment"]) for r in rows} == {("r1", "a100"), ("r2", "gb10")}
    assert all("prefix_blocks" not in r for r in rows)
    assert "a100" not in process_fleet().stats()   # nothing went through the process registry
