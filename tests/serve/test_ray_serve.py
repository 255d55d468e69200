"""The Serve application on a real local Ray cluster: two CPU replicas of a tiny checkpoint behind
the OpenAI ingress and the Bole router, reached over HTTP with the openai client."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from conftest import ENGINE_OPTIONS

from bole.parallel import free_port

pytestmark = pytest.mark.slow

MODEL = "tiny"


def start_serve(attempts: int = 4, controller_options: dict | None = None, **http_options) -> int:
    """serve.start on 127.0.0.1 and a free port (`bole.parallel.free_port`: outside the ranges Ray's own
    processes draw from), retried on another port if the proxy still cannot bind; returns the port.
    ``http_options``: more of Serve's HTTP options (request_timeout_s); ``controller_options`` as
    deployments.launch passes them (the proxy callback)."""
    from ray import serve

    for attempt in range(attempts):
        port = free_port()
        try:
            serve.start(http_options={**http_options, "host": "127.0.0.1", "port": port},
                        **({"controller_options": controller_options} if controller_options else {}))
            return port
        except Exception as e:  # ray.exceptions.RayTaskError(RuntimeError) from the proxy actor
            if "Failed to bind" not in str(e) or attempt == attempts - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


# short retry budget: a request the whole fleet refuses gets its 503 within seconds
APP_EXTRA = {"retry_budget_s": 2.0}


def app_args(model_path, table="calibration_tables/default.yaml"):
    opts = {k: v for k, v in ENGINE_OPTIONS.items() if k != "calibration_table"}
    return {"model": model_path, "served_model_name": MODEL, **APP_EXTRA,
            "groups": [{"name": "bole-cpu", "hardware": "cpu", "num_replicas": 2, "engine_options": opts,
                        "calibration_table": table, "ray_actor_options": {"num_cpus": 1},
                        "router": {"stats_period_s": 0.5}}]}


def deploy_config(model_path, port, table="calibration_tables/default.yaml", override_table=None) -> dict:
    """A Serve config like cluster_configs/local.yaml, for the tiny model (what `serve run` deploys)."""
    app = {"name": "bole", "route_prefix": "/", "import_path": "deployments.app:build_app",
           "args": app_args(model_path, table)}
    if override_table:  # a lightweight update: only user_config changes -> reconfigure, no restart
        app["deployments"] = [{"name": "bole-cpu", "user_config": {"calibration_table": override_table}}]
    return {"http_options": {"host": "127.0.0.1", "port": port}, "applications": [app]}


def deploy(cfg: dict, timeout: float = 120.0) -> None:
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(cfg))
    deadline = time.time() + timeout
    while time.time() < deadline:
        app = serve.status().applications.get("bole")
        if app is not None and app.status == "RUNNING" and all(
                d.status == "HEALTHY" for d in app.deployments.values()):
            return
        if app is not None and app.status == "DEPLOY_FAILED":
            raise RuntimeError(app.message)
        time.sleep(0.5)
    raise TimeoutError("the application did not become RUNNING")


@pytest.fixture(scope="module")
def cluster(tiny_model):
    ray = pytest.importorskip("ray")
    from ray import serve

    ray.init(num_cpus=2, object_store_memory=80 * 1024 * 1024, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"TRITON_INTERPRET": "1"}})
    port = start_serve()
    deploy(deploy_config(tiny_model, port))
    yield f"http://127.0.0.1:{port}", port
    serve.shutdown()
    ray.shutdown()


def fleet(url) -> dict:
    """{replica: {metric: value}} from the ingress's /metrics."""
    out: dict = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("bole_") and 'replica="' in line:
            name = line.split("{")[0]
            replica = line.split('replica="')[1].split('"')[0]
            out.setdefault(replica, {})[name] = float(line.split()[-1])
            if name == "bole_calibration_table_info":
                out[replica]["table_id"] = line.split('table_id="')[1].split('"')[0]
    return out


def wait_for(pred, timeout=20.0, poll=0.25):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError("condition not met in time")


def test_ray_serve_openai_prefix_affinity_and_reconfigure(cluster, tiny_model):
    url, port = cluster
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert [m.id for m in oai.models.list().data] == [MODEL]
    replicas = wait_for(lambda: (f := fleet(url)) and len(f) == 2 and f)
    assert all(r["bole_prefix_summary_blocks"] == 0 for r in replicas.values())

    # one shared prefix of 12 blocks (block_size 4), sent 5 times with different tails
    prefix = list(range(5, 53))
    for i in range(5):
        r = oai.completions.create(model=MODEL, prompt=prefix + [100 + i, 7], temperature=0, max_tokens=3,
                                   extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
    counts = wait_for(lambda: (c := sorted(v["bole_prefix_summary_blocks"] for v in fleet(url).values()))
                      and sum(c) >= 12 and c)
    assert counts[0] == 0 and counts[1] >= 12, f"the shared prefix was spread over replicas: {counts}"

    # streaming chat with usage, through the ingress and a replica
    chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              stream=True, stream_options={"include_usage": True},
                                              temperature=0, max_tokens=4, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 4
    assert httpx.get(url + "/ready").status_code == 200
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=10 ** 6)

    # swap the calibration table through user_config: same replicas, new table
    before = set(fleet(url))
    deploy(deploy_config(tiny_model, port, override_table="calibration_tables/a100-qwen3.5-9b.yaml"))
    after = wait_for(lambda: (f := fleet(url)) and all(v.get("table_id", "").startswith("a100/")
                                                        for v in f.values()) and len(f) == 2 and f)
    assert set(after) == before, "reconfigure restarted the replicas"
    assert oai.completions.create(model=MODEL, prompt="def", max_tokens=2).usage.completion_tokens >= 1


def test_ray_serve_logprobs_echo_and_penalties(cluster, tiny_model):
    """logprobs (completions and chat, streamed and not), echo with prompt logprobs and the penalties
    through the Ray Serve app: the library's values on the same checkpoint."""
    from bole.llm import LLM
    from bole.sampling_params import SamplingParams

    url, _ = cluster
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    llm = LLM(tiny_model, **ENGINE_OPTIONS)
    prompt = "def add(a, b):"
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2,
                                             prompt_logprobs=2, presence_penalty=1.5, repetition_penalty=1.3))[0]
    r = oai.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, temperature=0, max_tokens=4,
                               presence_penalty=1.5, extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    c = r.choices[0]
    assert c.text == prompt + ref.text and c.logprobs.token_logprobs[0] is None
    want = [e.logprob for e in ref.prompt_logprobs[1:]] + [e.logprob for e in ref.logprobs]
    assert max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs[1:], want, strict=True)) <= 1e-5
    msgs = [{"role": "user", "content": "hi"}]
    chunks = list(oai.chat.completions.create(model=MODEL, messages=msgs, stream=True, logprobs=True,
                                              top_logprobs=1, temperature=0, max_tokens=3,
                                              extra_body={"ignore_eos": True}))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    full = oai.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=1, temperature=0,
                                       max_tokens=3, extra_body={"ignore_eos": True}).choices[0].logprobs.content
    assert len(streamed) == 3 and [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in full]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(model=MODEL, messages=msgs, top_logprobs=2, max_tokens=1)


def test_ray_serve_n_choices_best_of_and_batch_prompts(cluster):
    from choices_check import check_best_of_and_batch, check_choices

    url, _ = cluster
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    timings = check_choices(oai, MODEL, repeats=20)
    print({k: round(v, 3) for k, v in timings.items()})
    check_best_of_and_batch(oai, MODEL, [5, 6, 7, 8, 9])


def metric_values(text: str, name: str) -> list[float]:
    return [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{")]


def test_ray_serve_64_concurrent_requests_fill_the_engine_batch(cluster):
    """Serve's default max_ongoing_requests (5) had capped the endpoint at 5 requests; now the
    ingress and the replicas take what the engines admit, so both batches reach max_num_seqs, and
    /metrics answers under the load."""
    import asyncio

    url, _ = cluster
    seqs = ENGINE_OPTIONS["max_num_seqs"]
    before = [v.get("bole_engine_peak_batch", 0) for v in fleet(url).values()]
    assert max(before) < seqs   # no earlier test filled a batch: what follows is this load's doing

    async def main():
        oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
        peaks, scrape_s = [], []
        done = asyncio.Event()

        async def scrape():
            async with httpx.AsyncClient(timeout=60) as c:
                while not done.is_set():
                    t0 = time.perf_counter()
                    text = (await c.get(url + "/metrics")).text
                    scrape_s.append(time.perf_counter() - t0)
                    peaks.append(max(metric_values(text, "bole_engine_peak_batch"), default=0))
                    await asyncio.sleep(0.2)

        async def one(i):
            r = await oai.completions.create(model=MODEL, prompt=[5 + i % 7, 6, 7, 8 + i], temperature=0,
                                             max_tokens=12, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens

        scraper = asyncio.ensure_future(scrape())
        try:
            counts = await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            done.set()
            await scraper
        return counts, peaks, scrape_s

    counts, peaks, scrape_s = asyncio.run(main())
    assert counts == [12] * 64
    peak = wait_for(lambda: (f := fleet(url)) and all(v.get("bole_engine_peak_batch") == seqs for v in f.values())
                    and f, timeout=10)   # the stats lag by a period
    assert len(peak) == 2, "both replicas' batches reached max_num_seqs"
    # each replica's engine totals reach the ingress's /metrics through Serve's routing stats: steps, the
    # seconds inside them, and (no CUDA graphs on the CPU) every decode step's forward run eagerly
    for v in peak.values():
        assert v["bole_engine_steps"] >= v["bole_engine_decode_steps"] > 0
        assert v["bole_engine_step_seconds"] >= v["bole_engine_decode_seconds"] > 0
        assert v["bole_engine_eager_forwards"] == v["bole_engine_decode_steps"]
    assert max(scrape_s) < 10.0, f"/metrics took {max(scrape_s):.1f} s under load"
    text = httpx.get(url + "/metrics").text
    # requests held behind full batches: their queue wait is part of TTFT and measured on its own
    qsum = sum(metric_values(text, "bole_queue_wait_seconds_sum"))
    tsum = sum(metric_values(text, "bole_time_to_first_token_seconds_sum"))
    assert qsum > 0.5 and tsum >= qsum
    print(f"64 concurrent: batch peaks {[v['bole_engine_peak_batch'] for v in peak.values()]} (before: "
          f"{before}), /metrics max {max(scrape_s):.2f} s, queue wait sum {qsum:.1f} s of TTFT sum {tsum:.1f} s")


def refused_total(url) -> float:
    return sum(v.get("bole_refused_while_draining", 0.0) for v in fleet(url).values())


def test_ray_serve_draining_replicas_get_retried_with_backoff_then_a_clean_503(cluster):
    from ray import serve

    url, _ = cluster
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    handle = serve.get_deployment_handle("bole-cpu", "bole")
    replicas = sorted(wait_for(lambda: (f := fleet(url)) and len(f) == 2 and f))
    a, b = replicas
    assert handle.options(method_name="drain").remote(target_replica=a).result(timeout_s=60)
    try:
        # one replica draining: every request is served by the other one, right away
        for i in range(8):
            r = oai.completions.create(model=MODEL, prompt=[9, 9, i], max_tokens=2, extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 2
        # both draining: the ingress backs off (jittered exponential, 2 s budget), then a clean 503
        assert handle.options(method_name="drain").remote(target_replica=b).result(timeout_s=60)
        wait_for(lambda: (f := fleet(url)) and len(f) == 2 and all("bole_refused_while_draining" in v
                                                                  for v in f.values()))
        before = refused_total(url)
        for stream in (False, True):
            t0 = time.perf_counter()
            body = {"model": MODEL, "prompt": [9, 9], "max_tokens": 2, "stream": stream}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            took = time.perf_counter() - t0
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert "Traceback" not in r.text and "\x1b[" not in r.text and "RayTaskError" not in r.text
            err = r.json()["error"]
            assert err["type"] == "unavailable_error" and "draining" in err["message"]
            assert 1.0 < took < 10.0, took
        wait_for(lambda: refused_total(url) - before >= 2)   # the replicas' stats carry their refusals
        time.sleep(1.5)
        attempts = refused_total(url) - before
        # two requests, each at most max_attempts sends within its 2 s budget: a tight loop would
        # have made hundreds
        assert 2 <= attempts <= 2 * 12, attempts
    finally:
        for rid in (a, b):
            handle.options(method_name="resume").remote(target_replica=rid).result(timeout_s=60)
    r = oai.completions.create(model=MODEL, prompt=[9, 9, 1], max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_ray_serve_replica_killed_mid_stream(cluster):
    """The in-flight client gets an error event and [DONE] (no hang), new requests are served, and
    after Serve restarts the replica the fleet is whole again. Last in this module: it kills one."""
    import json

    import ray
    from ray.serve.context import _get_global_client

    url, _ = cluster

    def running():
        dep = _get_global_client().get_serve_details()["applications"]["bole"]["deployments"]["bole-cpu"]
        return {r["replica_id"]: r["actor_name"] for r in dep["replicas"] if r["state"] == "RUNNING"}

    # the longest stream the replica admits, so it is still running when the kill lands
    limit = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": limit - 3, "ignore_eos": True, "stream": True}
    for _ in range(3):
        before = wait_for(lambda: (r := running()) and len(r) == 2 and r, timeout=180)
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as s:
            lines = s.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            busy = wait_for(lambda: [r for r, v in fleet(url).items() if v.get("bole_running_requests", 0) >= 1],
                            poll=0.02)
            ray.kill(ray.get_actor(before[busy[0]], namespace="serve"), no_restart=False)
            events += [line[6:] for line in lines if line.startswith("data: ")]
        last = json.loads(events[-2]) if len(events) > 1 else {}
        if "error" in last or not any(c.get("finish_reason") for c in last.get("choices", [])):
            break
        # the stream ended normally before the kill landed (the replicas' stats reach /metrics late on a
        # loaded 2-core box, and an event may carry several tokens): once the killed replica is back, again
        wait_for(lambda killed=busy[0]: (r := running()) and len(r) == 2 and killed not in r and r, timeout=180)
    tokens = sum(1 for e in events[:-1] if "error" not in json.loads(e))
    assert tokens < body["max_tokens"], f"the stream finished ({tokens} tokens) before the kill landed"
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2]), f"the stream ended without the replica's error: {events[-2]}"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "unavailable_error" and "Traceback" not in err["message"], err
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert oai.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2).usage.completion_tokens >= 1
    after = wait_for(lambda: (r := running()) and len(r) == 2 and busy[0] not in r and r, timeout=180)
    assert len(set(after) - set(before)) == 1
    assert oai.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2).usage.completion_tokens >= 1


def test_rolling_recalibration_one_replica_at_a_time(cluster, tiny_model, tmp_path):
    """Two replicas of one class: the job drains them in turn (the other serves: no surge), each gets
    its own re-measured table, and a client sending requests the whole time sees no failure."""
    import asyncio

    from fleet_helpers import SteadyLoad, stale_table

    from bole.recalibration import TableChecks
    from deployments.recalibrate import RollingOptions, rolling_recalibrate

    url, port = cluster
    stale = stale_table(tmp_path / "stale.yaml", tiny_model, "cpu")
    deploy(deploy_config(tiny_model, port, override_table=stale))        # reconfigure: no restart
    old = wait_for(lambda: (f := fleet(url)) and len(f) == 2 and all(
        v["table_id"].startswith("cpu/tiny/") for v in f.values()) and f)
    # the shared CPU box's noise: T_dec within 10x, B_ver within 3 capacities (the defaults are for GPUs)
    checks = TableChecks(monotone_tolerance=0.9, repeat_tolerance=9.0, repeat_capacities=3)
    opts = RollingOptions(checks=checks, settle_s=1.0)
    with SteadyLoad(url, clients=3, model=MODEL) as load:
        wait_for(lambda: len(load.results) >= 3, timeout=60)
        report = asyncio.run(rolling_recalibrate("bole", ["bole-cpu"], opts))
    assert not load.errors, load.errors[:3]
    assert report.ok and [(c.strategy, len(c.replicas)) for c in report.classes] == [("rolling", 2)]
    assert sorted(e.replica_id for e in report.events) == sorted(old)
    windows = sorted((e.drained_at, e.resumed_at) for e in report.events)
    assert windows[0][1] <= windows[1][0], windows
    assert load.served_between(report.started_at, report.finished_at) >= 3
    after = wait_for(lambda: (f := fleet(url)) and {v["table_id"] for v in f.values()}
                     == {e.new_table_id for e in report.events} and f)
    assert set(after) == set(old)
