"""``python -m deployments.launch cluster_configs/local.yaml``: start a local Ray cluster, deploy the
config (as ``serve run CONFIG`` does), wait until it serves, print the URL and a working openai
snippet, and keep serving until SIGINT (Ctrl-C) or SIGTERM: then Serve drains the replicas and the
process exits (``--no-ray``: uvicorn stops accepting, the app drains, the engine stops).

``--no-ray`` serves the config's first group in this process instead (``deployments.ingress``
over a local engine), for machines where Ray cannot start.

``--overlay FILE`` (repeatable) applies an overlay to the config (``deployments.overlay``) and
``--resources JSON`` gives the local Ray head custom resources: ``make serve-mixed`` runs
``cluster_configs/mixed.yaml`` on this machine with ``cluster_configs/overlays/mixed-cpu.yaml`` and
the ``accelerator_type:A100`` / ``gb10`` resources of the real fleet's nodes. The banner prints the
Ray address, for ``python -m deployments.recalibrate --address``.

Serve's proxy gets an end-to-end timeout (``http_options.request_timeout_s``) unless the config sets
one: the app's deadline plus slack (``AppConfig.proxy_request_timeout_s``), so a request held in the
proxy's queue, where the ingress's deadline has not started, is still answered in time. Serve's
controller gets the proxy callback of ``deployments.proxy_errors`` in its environment
(``controller_options``, which the proxies inherit) unless the config names one: the proxy's own
answers (its 408, 429, 503) are OpenAI-shaped JSON, and a client cannot change its timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from bole.config import ENGINE_MODES
from bole.llm import resolve_repo_path

SNIPPET = """\
{imports}from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key={key})
messages = [{{"role": "user", "content": "Write a Python function that adds two numbers."}}]
out = client.chat.completions.create(model="{model}", messages=messages, max_tokens=64)
print(out.choices[0].message.content)"""


def check_model(path: str) -> str | None:
    """Why the checkpoint folder cannot be served, or None."""
    full = resolve_repo_path(path)
    if not os.path.isdir(full):
        return f"{path}: no such folder"
    # weights as the loader reads them (bole.models.loader): one file or shards, *.safetensors only
    missing = [] if os.path.exists(os.path.join(full, "config.json")) else ["config.json"]
    if not any(f.endswith(".safetensors") for f in os.listdir(full)):
        missing.append("*.safetensors")
    if missing:
        return (f"{path} has no weights yet (missing {', '.join(missing)}). The embedded model is trained by "
                "scripts/run_gpu_train.sh (issue 6); or point the config's `model:` at another checkpoint.")
    return None


def banner(url: str, model: str, key_env: str) -> str:
    """Where the server is, a curl line and an openai snippet that work as printed: with a key set,
    both read it from the environment variable (never printed) and send it."""
    if os.environ.get(key_env):
        curl = f'curl -H "Authorization: Bearer ${key_env}" {url}/v1/models'
        snippet = SNIPPET.format(imports="import os\n", url=url, key=f'os.environ["{key_env}"]', model=model)
    else:
        curl = f"curl {url}/v1/models"
        snippet = SNIPPET.format(imports="", url=url, key='"unused"', model=model)
    return (f"\nBole is serving {model!r} at {url}/v1  (health: {url}/health, metrics: {url}/metrics)\n\n"
            f"{curl}\n\n{snippet}\n")


def serve_http_options(http: dict, app_cfg) -> dict:
    """``http`` (the config's ``http_options``) with Serve's end-to-end timeout: the app's
    ``proxy_request_timeout_s`` unless ``http`` sets one, which wins; one outside [deadline, deadline
    + slack] is said on stderr (shorter: Serve's 408 cuts requests before their 504; longer: a request
    held in Serve's queue may be answered after its deadline)."""
    given, deadline, fits = http.get("request_timeout_s"), app_cfg.request_timeout_s, app_cfg.proxy_request_timeout_s
    if given is None:
        return {**http, "request_timeout_s": fits}
    if not deadline <= given <= fits:
        why = "Serve's proxy ends requests before their 504 (408)" if given < deadline else \
            "a request held in Serve's queue may be answered after its deadline"
        print(f"make serve: http_options.request_timeout_s is {given:g} s for a request_timeout_s of {deadline:g} s: "
              f"{why}; {fits:g} s fits", file=sys.stderr)
    return http


def serve_controller_options(options: dict | None) -> dict:
    """``options`` (the config's ``controller_options``) with ``deployments.proxy_errors``'s proxy
    callback among the controller's environment variables, which Serve's proxies inherit. A config
    that names another callback keeps it, said on stderr (the proxy's own errors are then that one's)."""
    from deployments.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    options = dict(options or {})
    runtime_env = dict(options.get("runtime_env") or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    given = env_vars.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    if given != PROXY_CALLBACK:
        print(f"make serve: controller_options sets {PROXY_CALLBACK_ENV}={given}: Serve's proxy answers its own "
              f"errors through it (not {PROXY_CALLBACK}, which makes them OpenAI-shaped)", file=sys.stderr)
    return {**options, "runtime_env": {**runtime_env, "env_vars": env_vars}}


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be served, or None. Checked first: Ray's HTTP proxy binds with
    SO_REUSEPORT, so a second ``make serve`` would silently share the port with the first one."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        try:
            sock.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


class StopSignals:
    """SIGINT and SIGTERM set ``requested`` (the caller drains and exits); a second one exits at once.
    Installed explicitly: a process started in the background inherits SIGINT ignored, and Python
    then never raises KeyboardInterrupt, so Ctrl-C / ``kill -INT`` did nothing."""

    def __init__(self):
        self.requested: int | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, sig, frame) -> None:
        if self.requested is not None:
            print("second signal: exiting without draining", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        self.requested = sig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.launch")
    p.add_argument("config", help="Serve config YAML (cluster_configs/local.yaml)")
    p.add_argument("--no-ray", action="store_true", help="serve in this process without Ray")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs for the local Ray cluster")
    p.add_argument("--mode", choices=ENGINE_MODES, default=None,
                   help="override every group's engine_options.mode (ar / serial_tree / bole)")
    p.add_argument("--overlay", action="append", default=[], help="overlay YAML applied to the config "
                   "(deployments.overlay; repeatable, in order)")
    p.add_argument("--deploy-timeout-s", type=float, default=900.0,
                   help="give up (and stop) when the application is not running after this long")
    p.add_argument("--resources", type=json.loads, default=None,
                   help='custom resources of the local Ray head, JSON: \'{"accelerator_type:A100": 1, "gb10": 2}\'')
    a = p.parse_args(argv)
    from deployments.app import AppConfig, served_name
    from deployments.overlay import load_config

    try:
        cfg = load_config(a.config, a.overlay, serve_schema=not a.no_ray)
    except ValueError as e:
        print(f"make serve: {e}", file=sys.stderr)
        return 2

    app = cfg["applications"][0]
    if a.mode is not None:
        for group in app["args"]["groups"]:
            group.setdefault("engine_options", {})["mode"] = a.mode
    app_cfg = AppConfig(**app["args"])
    problem = check_model(app_cfg.model)
    if problem:
        print(f"make serve: {problem}", file=sys.stderr)
        return 2
    http = cfg["http_options"] = serve_http_options(cfg.get("http_options", {}), app_cfg)
    host, port = http.get("host", "127.0.0.1"), int(http.get("port", 8000))
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    name = served_name(app_cfg)
    busy = port_in_use(host, port)
    if busy:
        print(f"make serve: {host}:{port} is in use ({busy}); stop that server or change http_options.port",
              file=sys.stderr)
        return 2
    stop = StopSignals()
    if a.no_ray:
        return _serve_without_ray(app_cfg, host, port, url, name)

    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(cfg)
    ray.init(num_cpus=a.num_cpus, resources=a.resources, include_dashboard=False, log_to_driver=True)
    serve.start(http_options=http, proxy_location=cfg.get("proxy_location", "HeadOnly"),
                controller_options=serve_controller_options(cfg.get("controller_options")))
    _get_global_client().deploy_apps(schema)
    print(f"deploying {app['name']} (loading the model in the replicas)...", flush=True)
    deadline = time.monotonic() + a.deploy_timeout_s
    while stop.requested is None:
        status = serve.status().applications.get(app["name"])
        if status is not None and status.status == "RUNNING":
            break
        failed = status is not None and status.status == "DEPLOY_FAILED"
        if failed or time.monotonic() > deadline:  # e.g. resources no node has: say so, do not wait forever
            why = "deploy failed" if failed else f"not running after {a.deploy_timeout_s:.0f} s"
            details = {n: (d.status, d.message) for n, d in status.deployments.items()} if status else {}
            print(f"{why}: {status.message if status else ''} {details}", file=sys.stderr)
            serve.shutdown()
            ray.shutdown()
            return 1
        time.sleep(1)
    if stop.requested is None:
        print(banner(url, name, app_cfg.api_key_env), flush=True)
        # a job on this cluster (the rolling recalibration) connects by address; with Ray's token auth
        # on (the default for a new local cluster) an explicit address needs RAY_AUTH_MODE=token as well
        auth = "RAY_AUTH_MODE=token " if os.environ.get("RAY_AUTH_MODE") == "token" else ""
        print(f"recalibrate: {auth}python -m deployments.recalibrate --address "
              f"{ray.get_runtime_context().gcs_address}\n", flush=True)
    while stop.requested is None:
        time.sleep(0.2)
    print(f"{signal.Signals(stop.requested).name}: shutting down (draining replicas)...", flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0


def _serve_without_ray(cfg, host: str, port: int, url: str, name: str) -> int:
    import uvicorn

    from bole.engine.async_engine import AsyncEngine, freeze_startup_heap
    from bole.llm import build_engine
    from deployments.engine_client import LocalEngineClient
    from deployments.ingress import openai_app
    from deployments.logs import configure_logging

    configure_logging()   # the engine's start log: the memory plan, graphs, warm-up
    group = cfg.groups[0]
    engine = build_engine(cfg.model, **{**group.engine_options, "calibration_table": group.calibration_table})
    client = LocalEngineClient(AsyncEngine(engine), group.max_pending)
    app = openai_app(client, name, api_key=os.environ.get(cfg.api_key_env, ""),
                    max_body_bytes=cfg.max_body_bytes, default_max_tokens=cfg.default_max_tokens,
                    request_timeout_s=cfg.request_timeout_s, protect_metrics=cfg.protect_metrics or None)
    freeze_startup_heap()   # no full collection walks the model, graphs and app again (it says why)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=30))

    def announce():  # once the socket listens: the banner's commands work as soon as they show
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            print(banner(url, name, cfg.api_key_env), flush=True)

    threading.Thread(target=announce, daemon=True).start()
    # uvicorn takes SIGINT / SIGTERM while it runs (stop accepting, drain through the app's
    # lifespan, then stop the engine) and re-raises the signal to StopSignals afterwards
    server.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
