"""cluster_configs/*.yaml are valid Serve configs whose args build a Bole application."""

from __future__ import annotations

import os

import pytest
import yaml

from bole.llm import REPO_ROOT
from deployments.app import AppConfig, build_app
from deployments.launch import check_model

CONFIGS = ("local.yaml", "mixed.yaml")


@pytest.mark.parametrize("name", CONFIGS)
def test_cluster_config_validates_and_builds(name):
    from ray.serve.schema import ServeDeploySchema

    with open(os.path.join(REPO_ROOT, "cluster_configs", name)) as f:
        cfg = yaml.safe_load(f)
    ServeDeploySchema.model_validate(cfg)
    app = cfg["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    parsed = AppConfig(**app["args"])
    for g in parsed.groups:
        if g.calibration_table != "auto":
            assert os.path.exists(os.path.join(REPO_ROOT, g.calibration_table)), g.calibration_table
    assert build_app(app["args"]) is not None   # binds the deployments (no cluster needed)


def test_mixed_fleet_has_one_group_per_hardware_class():
    with open(os.path.join(REPO_ROOT, "cluster_configs", "mixed.yaml")) as f:
        groups = AppConfig(**yaml.safe_load(f)["applications"][0]["args"]).groups
    assert {g.hardware for g in groups} == {"a100", "gb10"}
    assert {g.calibration_table for g in groups} == {"calibration_tables/a100-qwen3.5-9b.yaml",
                                                     "calibration_tables/gb10-qwen3.5-9b.yaml"}
    assert all(g.autoscaling_config for g in groups)
    assert [g.tp_size for g in groups if g.hardware == "a100"] == [2]


def test_bad_app_configs_are_rejected():
    base = {"model": "m", "groups": [{"name": "a"}]}
    AppConfig(**base)
    with pytest.raises(ValueError):
        AppConfig(**{**base, "groups": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ValueError):
        AppConfig(**{**base, "groups": [{"name": "a", "engine_options": {"block_size": 16}},
                                        {"name": "b", "engine_options": {"block_size": 32}}]})
    with pytest.raises(ValueError):
        AppConfig(**{**base, "groups": [{"name": "a", "typo": 1}]})


def test_tp_groups_need_one_bundle_per_rank():
    base = {"model": "m", "groups": [{"name": "a", "tp_size": 2}]}
    AppConfig(**base)   # no bundles: the replica creates its own placement group
    tp2 = {"name": "a", "tp_size": 2}
    AppConfig(**{**base, "groups": [{**tp2, "placement_group_bundles": [{"CPU": 1}] * 2}]})
    with pytest.raises(ValueError, match="one bundle per TP rank"):
        AppConfig(**{**base, "groups": [{**tp2, "placement_group_bundles": [{"CPU": 1}]}]})


def test_make_serve_explains_missing_weights(tmp_path):
    assert "no weights" in check_model(str(tmp_path))


def test_make_serve_accepts_sharded_weights(tmp_path):
    """A sharded checkpoint (model-0000k-of-0000n.safetensors + index, as Hugging Face writes large
    models and bole.models.widen writes the widened ones) has no model.safetensors; it is servable."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    assert "*.safetensors" in check_model(str(tmp_path))   # an index alone is no weights
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert check_model(str(tmp_path)) is None
    (tmp_path / "config.json").unlink()
    assert "config.json" in check_model(str(tmp_path))


def test_capacity_defaults_follow_what_the_engines_admit():
    """Serve's default max_ongoing_requests (5) had capped the endpoint at 5 requests."""
    with open(os.path.join(REPO_ROOT, "cluster_configs", "local.yaml")) as f:
        local = AppConfig(**yaml.safe_load(f)["applications"][0]["args"])
    (g,) = local.groups
    assert g.admission_limit == 4 * g.engine_options["max_num_seqs"] == g.replica_max_ongoing
    assert g.replica_max_queued == g.replica_max_ongoing   # one more round of what the replica holds
    assert local.ingress_max_ongoing == 2 * (g.admission_limit + g.replica_max_queued) + 8
    fleet = AppConfig(model="m", groups=[
        {"name": "a", "engine_options": {"max_num_seqs": 8}, "num_replicas": 2},
        {"name": "b", "engine_options": {"max_num_seqs": 4}, "max_pending": 6, "max_ongoing_requests": 5,
         "num_replicas": "auto", "autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}])
    a, b = fleet.groups
    assert (a.replica_max_ongoing, b.replica_max_ongoing) == (32, 5)
    assert (a.replica_max_queued, b.replica_max_queued) == (2 * 32, 3 * 5)
    assert fleet.ingress_max_ongoing == 2 * (2 * 32 + 3 * 6 + 2 * 32 + 3 * 5) + 8
    assert fleet.ingress_max_queued == 2 * 32 + 3 * 6 + 2 * 32 + 3 * 5 + 8
    small = AppConfig(model="m", groups=[{"name": "a", "max_queued_requests": 3}], ingress_max_ongoing_requests=7,
                      ingress_max_queued_requests=2)
    assert (small.ingress_max_ongoing, small.ingress_max_queued, small.groups[0].replica_max_queued) == (7, 2, 3)
    # and the built Serve application carries them: every queue of Serve's bounded, the proxy's refusal a 429
    with open(os.path.join(REPO_ROOT, "cluster_configs", "local.yaml")) as f:
        app = build_app(yaml.safe_load(f)["applications"][0]["args"])
    ingress = app._bound_deployment._deployment_config
    assert ingress.max_ongoing_requests == local.ingress_max_ongoing
    assert ingress.max_queued_requests == local.ingress_max_queued
    assert (ingress.backpressure_config.status_code, ingress.backpressure_config.retry_after_s) == (429, 1.0)
    replica = app._bound_deployment.init_args[0][g.name]._bound_deployment
    assert replica._deployment_config.max_ongoing_requests == g.replica_max_ongoing
    assert replica._deployment_config.max_queued_requests == g.replica_max_queued
    with pytest.raises(ValueError):
        AppConfig(model="m", groups=[{"name": "a"}], request_timeout_s=0)
    with pytest.raises(ValueError):
        AppConfig(model="m", groups=[{"name": "a", "max_queued_requests": 0}])


def test_serves_proxy_timeout_covers_its_queue(capsys):
    """make serve gives Serve's proxy the deadline plus slack (it counts from the proxy's receipt, its
    queue included) unless the config sets one; mixed.yaml, deployed with `serve deploy`, sets it."""
    from deployments.app import PROXY_TIMEOUT_SLACK_S
    from deployments.launch import serve_http_options

    app = AppConfig(model="m", groups=[{"name": "a"}], request_timeout_s=3)
    assert app.proxy_request_timeout_s == 3 + PROXY_TIMEOUT_SLACK_S
    assert serve_http_options({"port": 1}, app) == {"port": 1, "request_timeout_s": 3 + PROXY_TIMEOUT_SLACK_S}
    assert serve_http_options({"request_timeout_s": 4}, app) == {"request_timeout_s": 4}
    assert capsys.readouterr().err == ""
    serve_http_options({"request_timeout_s": 2}, app)
    assert "before their 504" in capsys.readouterr().err
    serve_http_options({"request_timeout_s": 60}, app)
    assert "after its deadline" in capsys.readouterr().err
    with open(os.path.join(REPO_ROOT, "cluster_configs", "mixed.yaml")) as f:
        mixed = yaml.safe_load(f)
    assert mixed["http_options"]["request_timeout_s"] == AppConfig(**mixed["applications"][0]["args"]) \
        .proxy_request_timeout_s


@pytest.mark.parametrize("name", CONFIGS)
def test_cluster_configs_install_the_proxy_callback(name, capsys):
    """`serve run` / `serve deploy` of a cluster config starts Serve's controller, and so its proxies,
    with the callback that makes the proxy's own errors OpenAI-shaped (deployments.proxy_errors), as
    `make serve` does; launch keeps a config's own controller options."""
    from ray.serve.schema import ServeDeploySchema

    from deployments.launch import serve_controller_options
    from deployments.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    with open(os.path.join(REPO_ROOT, "cluster_configs", name)) as f:
        cfg = yaml.safe_load(f)
    options = ServeDeploySchema.model_validate(cfg).controller_options
    assert options.runtime_env["env_vars"][PROXY_CALLBACK_ENV] == PROXY_CALLBACK
    assert serve_controller_options(cfg["controller_options"]) == cfg["controller_options"]
    assert capsys.readouterr().err == ""
    other = {"runtime_env": {"env_vars": {PROXY_CALLBACK_ENV: "mine:callback"}}}
    assert serve_controller_options(other) == other
    assert PROXY_CALLBACK in capsys.readouterr().err
