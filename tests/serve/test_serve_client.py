"""The ingress-side client reads the fleet view it is given (no process global), no Ray cluster needed;
a group that refuses a request as full passes it to the next group, through the real app on a real
uvicorn server over fake group handles."""

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError

from bole.engine.core import EngineStats
from bole.sampling_params import SamplingParams
from deployments.engine_client import EngineOverloaded, EngineUnavailable, ServedOutput, SubRequest
from deployments.ingress import openai_app
from deployments.replica_stats import ReplicaStats
from deployments.retry import GROUP_REFUSED_ERRORS, RetryPolicy
from deployments.routing_policy import FleetView, RouterPolicyConfig, process_fleet
from deployments.serve_client import ServeEngineClient
from deployments.server_metrics import ServerMetrics

MODEL = "m"


def stats(rid: str, running: int, hardware: str, accepting: bool = True) -> ReplicaStats:
    return ReplicaStats(EngineStats(running=running, b_ver_per_request=4.0, table_id="t"), rid, hardware, 4, 16, 0,
                        accepting, 0, "", prefix_blocks=(1, 2))


def test_the_given_fleet_view_picks_the_group_and_feeds_metrics():
    fleet = FleetView()
    client = ServeEngineClient({"a100": object(), "gb10": object()}, None, fleet, RouterPolicyConfig(block_size=4))
    fleet.publish("a100", {"r1": stats("r1", 9, "a100")})
    fleet.publish("gb10", {"r2": stats("r2", 0, "gb10")})
    assert client.rank_groups(list(range(8)))[0] == "gb10"         # the least loaded replica's group
    fleet.publish("gb10", {"r2": stats("r2", 0, "gb10", accepting=False)})
    assert client.rank_groups(list(range(8)))[0] == "a100"         # a draining group takes nothing
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
    assert client.rank_groups(list(range(8)))[0] == "gb10"
    fleet.publish("gb10", {"r2": stats("r2", 0, "gb10", accepting=False)})
    client.in_flight["gb10"] = 1   # every replica draining: the group with less in flight from here
    assert client.rank_groups(list(range(8)))[0] == "a100"


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


class FakeGroup:
    """A Serve handle to one hardware group's deployment. Each call (``options(stream=True).generate_many
    .remote(subs)``) waits ``delay_s``, then refuses with ``refusal`` or streams one finished token per
    sub-request tagged with ``hardware`` (``refuse_after_first``: one output, then the refusal). It
    records its calls (in ``order``, shared by the groups) and the streams the client cancelled."""

    def __init__(self, hardware: str, order: list, refusal: BaseException | None = None, delay_s: float = 0.0,
                 refuse_after_first: bool = False):
        self.hardware, self.order, self.refusal, self.delay_s = hardware, order, refusal, delay_s
        self.refuse_after_first = refuse_after_first
        self.calls = self.cancelled = 0
        self.generate_many = SimpleNamespace(remote=self._call)
        self.info = SimpleNamespace(remote=self._info)

    def options(self, **_):
        return self

    async def _info(self) -> dict:
        return {"max_model_len": 64, "vocab_size": 100, "max_choices": 4}

    def _call(self, subs):
        self.calls += 1
        self.order.append(self.hardware)
        group = self

        class Stream:   # Serve's DeploymentResponseGenerator: iterated, or cancelled
            def __aiter__(self):
                return group._outputs(subs)

            def cancel(self):
                group.cancelled += 1
                if type(group.refusal).__name__ in GROUP_REFUSED_ERRORS and not group.refuse_after_first:
                    raise group.refusal   # as Serve's: a call that never reached a replica raises its error

        return Stream()

    async def _outputs(self, subs):
        await asyncio.sleep(self.delay_s)
        if self.refusal is not None and not self.refuse_after_first:
            raise self.refusal
        for i, sub in enumerate(subs):
            yield i, ServedOutput(sub.request_id, [7], "x", True, "length", output_token_ids=[7],
                                  hardware_class=self.hardware)
            if self.refusal is not None:
                raise self.refusal


def two_groups(full: dict, policy=None, **client_options):
    """A client over groups a100 and gb10 (``full``: a group's refusal), the a100 replica the less
    loaded (the group choice's first); its groups and the shared order of their calls."""
    order: list = []
    groups = {name: FakeGroup(name, order, full.get(name)) for name in ("a100", "gb10")}
    fleet = FleetView()
    fleet.publish("a100", {"r1": stats("r1", 0, "a100")})
    fleet.publish("gb10", {"r2": stats("r2", 3, "gb10")})
    client = ServeEngineClient(groups, None, fleet, RouterPolicyConfig(block_size=4), **client_options)
    client.max_model_len = 64
    return client, groups, order


def collect(client, n: int = 1) -> list:
    subs = [SubRequest(list(range(8)), SamplingParams(max_tokens=1), f"cmpl-{i}") for i in range(n)]

    async def run():
        return [item async for item in client.generate_many(subs)]

    return asyncio.run(run())


ray_wrapped_overload = RayTaskError("generate_many", "Traceback: ...", EngineOverloaded("16 requests in flight"))


@pytest.mark.parametrize("refusal", [BackPressureError(num_queued_requests=16, max_queued_requests=16),
                                     EngineOverloaded("16 in flight"), ray_wrapped_overload.as_instanceof_cause()],
                         ids=["serve_queue_full", "replica_admission", "replica_admission_through_ray"])
def test_a_full_group_passes_the_request_to_the_next_at_once(refusal):
    # a long backoff: the next group must be asked at once, not after a retry's wait
    client, groups, order = two_groups({"a100": refusal}, retry=RetryPolicy(base_s=5.0, max_delay_s=5.0))
    assert client.rank_groups(list(range(8))) == ["a100", "gb10"]
    t0 = time.monotonic()
    out = collect(client, n=2)
    assert time.monotonic() - t0 < 2.0
    assert order == ["a100", "gb10"] and groups["a100"].cancelled == 1
    assert sorted(i for i, _ in out) == [0, 1] and {o.hardware_class for _, o in out} == {"gb10"}
    assert client.in_flight == {"a100": 0, "gb10": 0}


def test_the_fallback_follows_the_group_choices_order():
    """Three groups: the two the policy ranks (the less loaded first), then one with no stats yet; a
    group whose every replica is draining is not asked while another can be."""
    order: list = []
    full = BackPressureError(num_queued_requests=4, max_queued_requests=4)
    groups = {"a100": FakeGroup("a100", order, full), "gb10": FakeGroup("gb10", order, full),
              "h200": FakeGroup("h200", order), "cpu": FakeGroup("cpu", order)}
    fleet = FleetView()
    fleet.publish("a100", {"r1": stats("r1", 1, "a100")})
    fleet.publish("gb10", {"r2": stats("r2", 0, "gb10")})
    fleet.publish("cpu", {"r3": stats("r3", 0, "cpu", accepting=False)})
    client = ServeEngineClient(groups, None, fleet, RouterPolicyConfig(block_size=4, comparable_load_slack=0))
    client.max_model_len = 64
    assert client.rank_groups(list(range(8))) == ["gb10", "a100", "h200"]
    out = collect(client)
    assert order == ["gb10", "a100", "h200"] and out[0][1].hardware_class == "h200"
    # every group full: one round, then the overload (the ingress's 429); the draining class never asked
    groups["h200"].refusal = EngineOverloaded("8 in flight")
    order.clear()
    with pytest.raises(EngineOverloaded, match="no group had room .* gb10, a100, h200 refused it"):
        collect(client)
    assert order == ["gb10", "a100", "h200"]


def test_a_stream_is_not_sent_again_after_its_first_output():
    client, groups, order = two_groups({"a100": BackPressureError(num_queued_requests=1, max_queued_requests=1)})
    groups["a100"].refuse_after_first = True
    with pytest.raises(BackPressureError):
        collect(client, n=2)
    assert order == ["a100"]


def test_a_draining_refusal_is_still_retried_after_a_backoff():
    """A replica that refuses as draining is marked and the request sent again after a wait: to the
    other group, as the marked replica was its group's only one."""
    client, groups, order = two_groups({"a100": EngineUnavailable("draining", replica_id="r1")},
                                       retry=RetryPolicy(base_s=0.2, max_delay_s=0.2))
    t0 = time.monotonic()
    out = collect(client)
    assert time.monotonic() - t0 >= 0.1   # the backoff's wait, in [step / 2, step]
    assert order == ["a100", "gb10"] and out[0][1].hardware_class == "gb10"


@pytest.fixture
def fleet_server(serve_app):
    """The real app over a two-group client whose groups the test makes full or slow; a 1 s deadline."""
    def start(full: dict, **delays):
        client, groups, order = two_groups(full)
        for name, delay in delays.items():
            groups[name].delay_s = delay
        srv = serve_app(openai_app(client, MODEL, api_key="", request_timeout_s=1.0)).__enter__()
        servers.append(srv)
        return srv, groups, order

    servers: list = []
    yield start
    for srv in servers:
        srv.__exit__(None, None, None)


BODY = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}


@pytest.mark.parametrize("stream", [False, True])
def test_http_served_by_the_free_group_and_one_429_when_all_are_full(fleet_server, stream):
    full = BackPressureError(num_queued_requests=16, max_queued_requests=16)
    srv, groups, order = fleet_server({"a100": full})
    r = httpx.post(srv.url + "/v1/completions", json={**BODY, "stream": stream}, timeout=30)
    assert r.status_code == 200, r.text
    if stream:   # re-routed before its first byte: a whole stream from gb10
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" not in r.text
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "x"
    assert order == ["a100", "gb10"]
    groups["gb10"].refusal = EngineOverloaded("16 requests in flight (max_pending=16)")
    order.clear()
    r = httpx.post(srv.url + "/v1/completions", json={**BODY, "stream": stream}, timeout=30)
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["type"] == "overloaded_error"
    assert order == ["a100", "gb10"]   # each group asked once: one 429, no retry rounds


def test_http_the_deadline_bounds_the_fallback(fleet_server):
    """a100 refuses after 0.6 s, gb10 answers only after 30: the 1 s deadline passes during the fallback,
    the client gets the 504 as without one, and gb10's call is cancelled."""
    srv, groups, order = fleet_server({"a100": BackPressureError(num_queued_requests=1, max_queued_requests=1)},
                                      a100=0.6, gb10=30.0)
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
    assert time.monotonic() - t0 < 3.0
    assert order == ["a100", "gb10"] and groups["gb10"].cancelled == 1
