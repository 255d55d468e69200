"""``python -m deployments.launch cluster_configs/local.yaml``: start a local Ray cluster, deploy the
config (as ``serve run CONFIG`` does), wait until it serves, print the URL and a working openai
snippet, and keep serving until Ctrl-C (then Serve drains the replicas gracefully).

``--no-ray`` serves the config's first group in this process instead (``deployments.ingress``
over a local engine), for machines where Ray cannot start.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import yaml

from bole.llm import resolve_repo_path

SNIPPET = """\
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="{key}")
messages = [{{"role": "user", "content": "Write a Python function that adds two numbers."}}]
out = client.chat.completions.create(model="{model}", messages=messages, max_tokens=64)
print(out.choices[0].message.content)"""


def check_model(path: str) -> str | None:
    """Why the checkpoint folder cannot be served, or None."""
    full = resolve_repo_path(path)
    if not os.path.isdir(full):
        return f"{path}: no such folder"
    missing = [f for f in ("config.json", "model.safetensors") if not os.path.exists(os.path.join(full, f))]
    if missing:
        return (f"{path} has no weights yet (missing {', '.join(missing)}). The embedded model is trained by "
                "scripts/run_gpu_train.sh (issue 6); or point the config's `model:` at another checkpoint.")
    return None


def banner(url: str, model: str, key_env: str) -> str:
    key = "$" + key_env if os.environ.get(key_env) else "unused"
    return (f"\nBole is serving {model!r} at {url}/v1  (health: {url}/health, metrics: {url}/metrics)\n\n"
            f"curl {url}/v1/models\n\n" + SNIPPET.format(url=url, key=key, model=model) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.launch")
    p.add_argument("config", help="Serve config YAML (cluster_configs/local.yaml)")
    p.add_argument("--no-ray", action="store_true", help="serve in this process without Ray")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs for the local Ray cluster")
    a = p.parse_args(argv)
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    from deployments.app import AppConfig, served_name

    app = cfg["applications"][0]
    app_cfg = AppConfig(**app["args"])
    problem = check_model(app_cfg.model)
    if problem:
        print(f"make serve: {problem}", file=sys.stderr)
        return 2
    http = cfg.get("http_options", {})
    host, port = http.get("host", "127.0.0.1"), int(http.get("port", 8000))
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    name = served_name(app_cfg)
    if a.no_ray:
        return _serve_without_ray(app_cfg, host, port, url, name)

    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(cfg)
    ray.init(num_cpus=a.num_cpus, include_dashboard=False, log_to_driver=True)
    serve.start(http_options=http, proxy_location=cfg.get("proxy_location", "HeadOnly"))
    _get_global_client().deploy_apps(schema)
    print(f"deploying {app['name']} (loading the model in the replicas)...", flush=True)
    while True:
        status = serve.status().applications.get(app["name"])
        if status is not None and status.status == "RUNNING":
            break
        if status is not None and status.status == "DEPLOY_FAILED":
            print(f"deploy failed: {status.message}", file=sys.stderr)
            serve.shutdown()
            return 1
        time.sleep(1)
    print(banner(url, name, app_cfg.api_key_env), flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    print("shutting down (draining replicas)...", flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0


def _serve_without_ray(cfg, host: str, port: int, url: str, name: str) -> int:
    import uvicorn

    from bole.engine.async_engine import AsyncEngine
    from bole.llm import build_engine
    from deployments.engine_client import LocalEngineClient
    from deployments.ingress import build_app

    group = cfg.groups[0]
    engine = build_engine(cfg.model, **{**group.engine_options, "calibration_table": group.calibration_table})
    client = LocalEngineClient(AsyncEngine(engine), group.max_pending)
    app = build_app(client, name, api_key=os.environ.get(cfg.api_key_env, ""),
                    max_body_bytes=cfg.max_body_bytes, default_max_tokens=cfg.default_max_tokens)
    print(banner(url, name, cfg.api_key_env), flush=True)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
