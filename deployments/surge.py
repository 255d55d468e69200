"""A replica deployment's size, read and changed through Serve's declarative config (the rolling
recalibration job's surge replicas).

Serve treats ``num_replicas`` and ``autoscaling_config`` in an application's ``deployments:``
section as lightweight options: changing them starts or stops replicas and restarts none. So a
*surge* is a redeploy of the running config (``serve details``' ``deployed_app_config`` of every
application, as ``serve deploy`` would send it) with one more replica for one deployment:
``num_replicas: n + 1`` (``with_replicas`` explains how autoscaled deployments are held without a
rebuild); going back is a redeploy at ``n`` and then of the application's config as it was
(``deploy_app``: the other applications as they run then). When Serve scales
down on one node it stops the newest replica first (the surge replica); the job does not rely on
that (it installs a recalibrated table on the surge replica too).

A surge needs the application to have been deployed from a config (``serve run`` / ``serve deploy``
/ ``make serve``) and free resources for one more replica (``headroom``); an autoscaling deployment
also needs ``max_replicas`` above its running count, unless the caller forces it.
"""

from __future__ import annotations

import asyncio
import copy
import time


def serve_details() -> dict:
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_details()


def running_replicas(app: str, deployment: str, details: dict | None = None) -> list[str]:
    """Unique ids of a deployment's RUNNING replicas, oldest first."""
    # while Serve rebuilds an app after a config change its deployments can be briefly unlisted
    dep = (details or serve_details())["applications"][app]["deployments"].get(deployment, {})
    replicas = [r for r in dep.get("replicas", []) if r["state"] == "RUNNING"]
    return [r["replica_id"] for r in sorted(replicas, key=lambda r: r.get("start_time_s", 0.0))]


def replica_deployments(app: str, details: dict | None = None) -> list[str]:
    """The app's replica deployments (every deployment but the ingress)."""
    from deployments.app import INGRESS_NAME

    deps = (details or serve_details())["applications"][app]["deployments"]
    return sorted(d for d in deps if d != INGRESS_NAME)


def replica_demand(deployment_config: dict) -> dict[str, float]:
    """Ray resources one more replica takes: its placement-group bundles, else its actor options."""
    bundles = deployment_config.get("placement_group_bundles")
    if bundles:
        out: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                out[k] = out.get(k, 0.0) + float(v)
        return out
    opts = deployment_config.get("ray_actor_options") or {}
    out = {"CPU": float(opts.get("num_cpus", 1) or 0), "GPU": float(opts.get("num_gpus", 0) or 0)}
    out.update({k: float(v) for k, v in (opts.get("resources") or {}).items()})
    if opts.get("accelerator_type"):
        out[f"accelerator_type:{opts['accelerator_type']}"] = 0.001
    return {k: v for k, v in out.items() if v}


def headroom(app: str, deployment: str, details: dict | None = None) -> tuple[bool, str]:
    """(True, how) if one more replica of ``deployment`` can start now, else (False, why not)."""
    import ray

    details = details or serve_details()
    info = details["applications"][app]
    if not info.get("deployed_app_config"):
        return False, f"application {app!r} was not deployed from a config (serve run / serve deploy)"
    cfg = info["deployments"][deployment]["deployment_config"]
    running = len(running_replicas(app, deployment, details))
    auto = cfg.get("autoscaling_config")
    if auto and int(auto.get("max_replicas", 1)) <= running:
        return False, f"autoscaling max_replicas={auto.get('max_replicas')} is already running"
    free = ray.available_resources()
    short = {k: (v, free.get(k, 0.0)) for k, v in replica_demand(cfg).items() if free.get(k, 0.0) < v - 1e-9}
    if short:
        return False, "not enough free resources for one more replica: " + ", ".join(
            f"{k} needs {need:g}, {have:g} free" for k, (need, have) in short.items())
    how = f"autoscaling headroom (max_replicas {auto['max_replicas']})" if auto else "free cluster resources"
    return True, f"{how} for replica {running + 1}"


def app_configs(details: dict | None = None) -> dict[str, dict]:
    """Every application's config as deployed (deep copies), by name."""
    details = details or serve_details()
    return {name: copy.deepcopy(a["deployed_app_config"]) for name, a in details["applications"].items()
            if a.get("deployed_app_config")}


def with_replicas(configs: dict[str, dict], app: str, deployment: str, n: int, deployment_config: dict) -> dict:
    """``configs`` with ``deployment`` of ``app`` held at exactly ``n`` replicas (its ``deployments:`` entry).

    Serve rebuilds an application, restarting every replica, when its *code version* changes, and
    that hash covers whether each ``deployments:`` entry carries an ``autoscaling_config`` (and its
    policy). So the entry keeps its kind: an entry with its own ``autoscaling_config`` gets
    ``min_replicas = max_replicas = n`` in it; a deployment autoscaled by the code (``build_app``)
    gets ``num_replicas: n`` with ``autoscaling_config: null`` (fixed meanwhile; restoring the
    config gives the code's autoscaling back); a fixed one gets ``num_replicas: n``.
    """
    out = copy.deepcopy(configs)
    entries = out[app].setdefault("deployments", [])
    entry = next((e for e in entries if e.get("name") == deployment), None)
    if entry is None:
        entry = {"name": deployment}
        entries.append(entry)
    if isinstance(entry.get("autoscaling_config"), dict):
        entry["autoscaling_config"] = {**entry["autoscaling_config"], "min_replicas": n, "max_replicas": n}
        entry["autoscaling_config"].pop("initial_replicas", None)
    else:
        entry["num_replicas"] = n
        if deployment_config.get("autoscaling_config"):
            entry["autoscaling_config"] = None
    return out


def deploy(configs: dict[str, dict]) -> None:
    """Apply application configs (every application Serve runs from a config must be listed: the
    controller deletes the others)."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate({"applications": list(configs.values())})
    _get_global_client().deploy_apps(schema)


def deploy_app(app: str, config: dict) -> None:
    """Apply ``config`` to ``app``, every other application as it runs now (not as it ran when the
    caller read ``config``: another application redeployed meanwhile keeps its new config)."""
    deploy(app_configs() | {app: config})


async def wait_for_replicas(app: str, deployment: str, n: int, timeout_s: float, poll_s: float = 0.5) -> list[str]:
    """Wait until exactly ``n`` replicas of ``deployment`` run and none is starting or stopping; their
    ids. TimeoutError names what is still running. A coroutine, so a stopped job (SIGINT) cancels it
    at once instead of leaving a thread polling until the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        details = await asyncio.to_thread(serve_details)
        info = details["applications"][app]
        dep = info["deployments"].get(deployment, {})
        states = [r["state"] for r in dep.get("replicas", [])]
        if info["status"] == "RUNNING" and states.count("RUNNING") == n and len(states) == n:
            return running_replicas(app, deployment, details)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{deployment}: wanted {n} running replicas within {timeout_s:.0f}s, "
                               f"have states {states}")
        await asyncio.sleep(poll_s)
