"""``make serve`` (``python -m deployments.launch``) as a user runs it, in a real subprocess: the
banner's curl line and openai snippet work as printed with ``BOLE_API_KEY`` set, and SIGINT or
SIGTERM drains and exits within a bound, with Ray and with ``--no-ray``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml
from conftest import ENGINE_OPTIONS

from bole.llm import REPO_ROOT
from bole.parallel import free_port
from deployments.launch import banner

EXIT_BOUND_S = {"no_ray": 30.0, "ray": 120.0}


def test_banner_reads_the_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("BOLE_API_KEY", "sekret")
    text = banner("http://127.0.0.1:8000", "m", "BOLE_API_KEY")
    assert 'curl -H "Authorization: Bearer $BOLE_API_KEY" http://127.0.0.1:8000/v1/models' in text
    assert 'api_key=os.environ["BOLE_API_KEY"]' in text and "import os" in text
    assert "sekret" not in text   # the key itself is never printed
    monkeypatch.delenv("BOLE_API_KEY")
    text = banner("http://127.0.0.1:8000", "m", "BOLE_API_KEY")
    assert "curl http://127.0.0.1:8000/v1/models" in text and 'api_key="unused"' in text


def write_config(tmp_path, model_path) -> tuple[str, int]:
    port = free_port()
    opts = {k: v for k, v in ENGINE_OPTIONS.items() if k != "calibration_table"}
    group = {"name": "bole-local", "hardware": "cpu", "num_replicas": 1, "engine_options": opts,
             "calibration_table": "calibration_tables/default.yaml", "ray_actor_options": {"num_cpus": 1}}
    cfg = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
           "applications": [{"name": "bole", "route_prefix": "/", "import_path": "deployments.app:build_app",
                             "args": {"model": model_path, "served_model_name": "tiny", "groups": [group]}}]}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), port


class Launch:
    """``python -m deployments.launch CONFIG [flags]`` with its output collected line by line."""

    def __init__(self, config: str, *flags: str, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "deployments.launch", config, *flags], cwd=REPO_ROOT,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for_banner(self, timeout: float) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            text = "\n".join(self.lines)
            if "print(out.choices[0].message.content)" in text:
                return text
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError("no banner:\n" + "\n".join(self.lines[-40:]))

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while not any(text in line for line in self.lines):
            if time.time() > deadline:
                raise AssertionError(f"no {text!r} in the output:\n" + "\n".join(self.lines[-40:]))
            time.sleep(0.2)

    def kill(self) -> None:
        """Whatever happened, leave no server behind (SIGINT, then SIGKILL)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def stop(self, sig: int, bound_s: float) -> float:
        t0 = time.perf_counter()
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(bound_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running {bound_s} s after {sig!r}:\n"
                                 + "\n".join(self.lines[-20:])) from None
        assert rc == 0, "\n".join(self.lines[-20:])
        return time.perf_counter() - t0


def env_with_key() -> dict:
    return {**os.environ, "PYTHONPATH": REPO_ROOT, "TRITON_INTERPRET": "1", "BOLE_API_KEY": "sekret"}


def check_banner_works(text: str, env: dict) -> None:
    """Run the printed curl line in a shell and the printed snippet in Python, as a user would."""
    curl = next(line for line in text.splitlines() if line.startswith("curl "))
    out = subprocess.run(["bash", "-c", curl + " -s -f"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and '"id":"tiny"' in out.stdout, (curl, out.stdout, out.stderr)
    snippet = text[text.index("from openai import OpenAI") - len("import os\n"):].split("\n\n")[0]
    assert snippet.startswith("import os\n")
    snippet = snippet.replace("max_tokens=64", "max_tokens=4")   # the same call, shorter on a CPU
    out = subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_no_ray_serve_banner_works_and_a_signal_drains_and_exits(tiny_model, tmp_path, sig):
    """Started with SIGINT ignored, as a background job of a non-interactive shell is: the launcher
    installs its handlers anyway."""
    config, port = write_config(tmp_path, tiny_model)
    env = env_with_key()
    launch = Launch(config, "--no-ray", env=env)
    try:
        run_no_ray_case(launch, port, sig, env)
    finally:
        launch.kill()


def run_no_ray_case(launch, port, sig, env) -> None:
    text = launch.wait_for_banner(120)
    if sig == signal.SIGINT:
        check_banner_works(text, env)
        took = launch.stop(sig, EXIT_BOUND_S["no_ray"])
    else:  # a stream in flight when the signal comes is finished before the process exits
        body = {"model": "tiny", "prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True}
        headers = {"Authorization": "Bearer sekret"}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers,
                          timeout=60) as r:
            lines = r.iter_lines()
            events = [next(line for line in lines if line.startswith("data: "))]
            stopper = threading.Thread(target=lambda: launch.stop(sig, EXIT_BOUND_S["no_ray"]))
            t0 = time.perf_counter()
            stopper.start()
            events += [line for line in lines if line.startswith("data: ")]
        stopper.join()
        took = time.perf_counter() - t0
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2], events[-3:]
        assert launch.proc.returncode == 0
    print(f"--no-ray exit after {sig.name}: {took:.1f} s")


def test_no_ray_serves_where_ray_is_not_installed(tiny_model, tmp_path):
    """The GPU machine has no Ray: ``--no-ray`` checks the config without Serve's schema and serves."""
    shim = tmp_path / "no_ray"
    (shim / "ray").mkdir(parents=True)
    (shim / "ray" / "__init__.py").write_text("raise ImportError('ray is not installed (test shim)')\n")
    config, port = write_config(tmp_path, tiny_model)
    env = {**env_with_key(), "PYTHONPATH": os.pathsep.join([str(shim), REPO_ROOT])}
    launch = Launch(config, "--no-ray", env=env)
    try:
        text = launch.wait_for_banner(120)
        assert f"http://127.0.0.1:{port}/v1" in text
        assert "bole.cache.memory_plan: memory plan on cpu" in text   # the engine's start log shows
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert r.status_code == 200
        launch.stop(signal.SIGINT, EXIT_BOUND_S["no_ray"])
    finally:
        launch.kill()


@pytest.mark.slow
def test_ray_serve_a_signal_drains_and_exits(tiny_model, tmp_path):
    config, port = write_config(tmp_path, tiny_model)
    env = env_with_key()
    launch = Launch(config, "--num-cpus", "2", env=env)
    try:
        text = launch.wait_for_banner(300)
        assert re.search(rf"http://127\.0\.0\.1:{port}/v1", text)
        # the replica's start log reaches the driver (Ray's log_to_driver, forwarded asynchronously)
        launch.wait_for("bole.cache.memory_plan: memory plan on cpu", 30)
        launch.wait_for("deployments.replica: replica", 30)
        check_banner_works(text, env)
        took = launch.stop(signal.SIGINT, EXIT_BOUND_S["ray"])
        assert "SIGINT: shutting down" in "\n".join(launch.lines)
        print(f"ray exit after SIGINT: {took:.1f} s")
    finally:
        launch.kill()


def test_a_port_in_use_is_refused(tiny_model, tmp_path):
    """Ray's proxy binds with SO_REUSEPORT: a second server on the same port would share it silently."""
    import socket

    config, port = write_config(tmp_path, tiny_model)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        r = subprocess.run([sys.executable, "-m", "deployments.launch", config], cwd=REPO_ROOT, env=env_with_key(),
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"127.0.0.1:{port} is in use" in r.stderr
