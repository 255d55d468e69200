"""Serve config overlays (``make serve-mixed``) and the surge config edits of the recalibration job,
as pure functions on the repository's configs."""

from __future__ import annotations

import os

import pytest
import yaml

from bole.llm import REPO_ROOT
from deployments.app import AppConfig
from deployments.overlay import load_config, merge
from deployments.surge import replica_demand, with_replicas

MIXED = os.path.join(REPO_ROOT, "cluster_configs", "mixed.yaml")
CPU = os.path.join(REPO_ROOT, "cluster_configs", "overlays", "mixed-cpu.yaml")


def test_merge_rules():
    base = {"a": {"b": 1, "c": [1, 2]}, "named": [{"name": "x", "v": 1}, {"name": "y", "v": 2}], "gone": 3}
    over = {"a": {"c": [9]}, "named": [{"name": "y", "v": 5}, {"name": "z"}], "gone": None}
    assert merge(base, over) == {"a": {"b": 1, "c": [9]},
                                 "named": [{"name": "x", "v": 1}, {"name": "y", "v": 5}, {"name": "z"}]}
    assert base["named"][1]["v"] == 2   # inputs untouched


def test_mixed_cpu_overlay_keeps_the_fleet_topology():
    real = yaml.safe_load(open(MIXED))
    sim = load_config(MIXED, [CPU])
    r_app, s_app = real["applications"][0], sim["applications"][0]
    r_groups = {g.name: g for g in AppConfig(**r_app["args"]).groups}
    s_groups = {g.name: g for g in AppConfig(**s_app["args"]).groups}
    assert set(r_groups) == set(s_groups) == {"bole-a100", "bole-gb10"}
    for name, g in s_groups.items():   # what the overlay does not name stays mixed.yaml's
        for key in ("hardware", "tp_size", "autoscaling_config", "max_ongoing_requests", "router", "num_replicas"):
            assert getattr(g, key) == getattr(r_groups[name], key), (name, key)
        assert g.engine_options["device"] == "cpu" and g.engine_options["mode"] == "bole"
        assert os.path.exists(os.path.join(REPO_ROOT, g.calibration_table))
    assert s_groups["bole-a100"].tp_size == 2 and s_groups["bole-a100"].tp_worker_options["num_gpus"] == 0
    assert sim["http_options"]["host"] == "127.0.0.1" and sim["http_options"]["port"] == 8000
    assert s_app["args"]["model"] == "models/bole-tiny-coder"
    deps = {d["name"]: d for d in s_app["deployments"]}   # Serve's own overrides: CPU, no GPU
    assert all("GPU" not in b for b in deps["bole-a100"]["placement_group_bundles"])
    assert replica_demand(deps["bole-a100"]) == {"CPU": 3.0, "accelerator_type:A100": 0.002}
    assert replica_demand(deps["bole-gb10"]) == {"CPU": 2.0, "gb10": 1.0}
    assert real == yaml.safe_load(open(MIXED)), "the fleet file itself is unchanged"


def test_bad_overlay_names_the_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: [{name: bole, args: {groups: [{name: bole-a100, tp_size: 0}]}}]\n")
    with pytest.raises(ValueError, match=f"(?s)mixed.yaml \\+ {bad}: .*tp_size"):
        load_config(MIXED, [str(bad)])


def test_surge_keeps_the_code_version():
    """A surge edits only ``num_replicas`` / an entry's own ``autoscaling_config``: Serve then restarts
    nothing (it rebuilds an app whose entries gain or lose an autoscaling_config dict)."""
    app = {"name": "bole", "import_path": "deployments.app:build_app", "args": {},
           "deployments": [{"name": "own", "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}]}
    cfgs = {"bole": app}
    code_auto = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "policy": {}}}
    up = with_replicas(cfgs, "bole", "by-code", 2, code_auto)["bole"]["deployments"]
    assert up[1] == {"name": "by-code", "num_replicas": 2, "autoscaling_config": None}
    up = with_replicas(cfgs, "bole", "own", 2, {})["bole"]["deployments"]
    assert up[0]["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 2}
    up = with_replicas(cfgs, "bole", "fixed", 2, {"num_replicas": 1})["bole"]["deployments"]
    assert up[1] == {"name": "fixed", "num_replicas": 2}
    assert cfgs["bole"]["deployments"] == app["deployments"] and len(app["deployments"]) == 1
