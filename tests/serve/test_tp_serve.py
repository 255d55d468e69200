"""A tensor-parallel replica on a real local Ray cluster: one replica with tp_size=2 on CPU (two TP
worker actors in the deployment's STRICT_PACK placement group, gloo on 127.0.0.1) behind the OpenAI
ingress; its greedy outputs equal a tp_size=1 engine's."""

from __future__ import annotations

import openai
import pytest
from conftest import ENGINE_OPTIONS
from test_ray_serve import deploy, start_serve

from bole.llm import build_engine
from bole.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100, 7, 100, 7, 3]]


def tp_config(model_path, port) -> dict:
    opts = {k: v for k, v in ENGINE_OPTIONS.items() if k != "calibration_table"}
    group = {"name": "bole-tp", "hardware": "cpu", "tp_size": 2, "num_replicas": 1, "engine_options": opts,
             "calibration_table": "calibration_tables/default.yaml",
             "ray_actor_options": {"num_cpus": 0},          # the driver, inside bundle 0
             "placement_group_bundles": [{"CPU": 1}, {"CPU": 1}],
             "tp_worker_options": {"num_cpus": 1}, "router": {"stats_period_s": 0.5}}
    app = {"name": "bole", "route_prefix": "/", "import_path": "deployments.app:build_app",
           "args": {"model": model_path, "served_model_name": "tiny", "groups": [group]}}
    return {"http_options": {"host": "127.0.0.1", "port": port}, "applications": [app]}


def test_tp2_replica_serves_tp1_greedy_output(tiny_model):
    ray = pytest.importorskip("ray")
    from ray import serve

    engine = build_engine(tiny_model, **ENGINE_OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = []
    for p in PROMPTS:  # the text the ingress serves: the concatenated per-step deltas
        engine.add_request(p, params)
        text = ""
        while engine.has_unfinished():
            text += "".join(out.new_text for out in engine.step())
        want.append(text)

    ray.init(num_cpus=2, object_store_memory=80 * 1024 * 1024, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"TRITON_INTERPRET": "1"}})
    try:
        port = start_serve()
        deploy(tp_config(tiny_model, port), timeout=150)
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        for p, w in zip(PROMPTS, want, strict=True):
            r = oai.completions.create(model="tiny", prompt=p, temperature=0, max_tokens=6,
                                       extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 6
            assert r.choices[0].text == w
        # the replica's placement group: 2 bundles, each used by one TP worker (1 CPU)
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert [len(g["bundles"]) for g in groups] == [2]
        assert groups[0]["strategy"] == "STRICT_PACK"
        assert ray.available_resources().get("CPU", 0) == 0
    finally:
        serve.shutdown()
        ray.shutdown()
