"""Online serving in every mode: one ``--no-ray`` server per mode (``python -m deployments.launch
cluster_configs/local.yaml --no-ray`` with an overlay), loaded by ``benchmarks/serve_load.py``'s
multi-turn coding workload at several Poisson rates; what the clients saw beside what the server
counted (``/metrics``).

    python benchmarks/serve_modes.py --device cuda --rates 4 16 64 --out benchmarks/results/serve_modes_h200.json

Per mode (``--modes``, each a fresh server, so no mode inherits another's prefix cache; a mode may carry
engine options of its own, ``MODE+KEY=VALUE[,KEY=VALUE...]``, e.g. ``bole+admit_during_forward=true``, for an
A/B inside one run; they apply after ``--engine-option``):
  1. start the server on a free port (engine options: ``--device``, ``--dtype``, CUDA graphs on a GPU,
     ``--num-blocks``, ``--max-num-seqs``, any ``--engine-option KEY=VALUE``), wait for /health;
  2. a warm-up phase at every rate, highest first (``--warmup-requests`` each, not reported with the
     rates): Triton compiles and the lazily captured CUDA graphs (batch, KV length, tree width) are paid
     here, the small batches of the low rates included (a single warm-up at the highest rate left them
     to the first measured phase: the H200 run of 2026-12-03, whose 2/s phase paid them in every mode);
  3. one phase per rate: ``serve_load.py --workload multiturn`` (conversations of ``--turns`` turns,
     each turn the previous prompt + answer + the next held-out prompt; conversations arrive at
     ``rate`` per second). Every phase takes its own slice of the held-out prompts, so no phase hits
     blocks an earlier phase cached; the server's totals (preemptions, prefix-cache hit and prompt
     tokens, MAT, queue wait, seconds inside engine steps, and the decode steps whose forward / draft /
     acceptance ran eagerly) are read before and after, and the phase reports the differences: with them
     the mean engine step, the engine's busy share of the phase and the eager shares;
  4. SIGINT (drain), then SIGKILL if it is still there after 40 s.

Every step has a timeout; no phase starts after ``--budget-s``. The JSON is rewritten after every
phase (a killed run keeps what ran), the table is printed at the end, and the JSON is the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from importlib import metadata
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.serve_load import HELDOUT, heldout_prompts  # noqa: E402
from deployments import server_metrics  # noqa: E402

MODES = ("ar", "serial_tree", "bole")
BASE_CONFIG = "cluster_configs/local.yaml"
# server totals read from /metrics (summed over label sets: one replica here): the replicas' totals, as
# the ingress names them, and the request histograms' sums and counts
TOTALS = tuple(name for _, name, _ in server_metrics.TOTALS) + (
    "bole_request_mean_accepted_tokens_sum", "bole_request_mean_accepted_tokens_count",
    "bole_queue_wait_seconds_sum", "bole_queue_wait_seconds_count", "bole_engine_queue_seconds_sum",
    "bole_engine_queue_seconds_count", "bole_generation_tokens_total")


TERMINATED: list[int] = []   # the signal that ended the run, once one has


def _terminate(sig, frame) -> None:
    TERMINATED.append(sig)
    raise SystemExit(128 + sig)


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Prometheus text of ``url`` as {metric name: value summed over its label sets}."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def server_delta(before: dict, after: dict) -> dict:
    """What the server counted during one phase (differences of its totals)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in TOTALS}
    prompt, n_mat, n_wait = d["bole_engine_prompt_tokens"], d["bole_request_mean_accepted_tokens_count"], \
        d["bole_queue_wait_seconds_count"]
    n_queue = d["bole_engine_queue_seconds_count"]
    steps, decode_steps = d["bole_engine_steps"], d["bole_engine_decode_steps"]
    share = lambda k: round(d[k] / decode_steps, 4) if decode_steps else None
    prefills, first = d["bole_engine_prefill_steps"], d["bole_engine_first_token_steps"]
    return {
        "preemptions": int(d["bole_engine_preemptions"]),
        "prefix_hit_tokens": int(d["bole_prefix_cache_hit_tokens"]),
        "prompt_tokens": int(prompt),
        "prefix_hit_rate": round(d["bole_prefix_cache_hit_tokens"] / prompt, 4) if prompt else None,
        "mean_mat": round(d["bole_request_mean_accepted_tokens_sum"] / n_mat, 3) if n_mat else None,
        "mean_queue_wait_ms": round(1000 * d["bole_queue_wait_seconds_sum"] / n_wait, 2) if n_wait else None,
        # of that wait, the part in the engine's own queue (the rest: the ingress and the transit to the engine)
        "mean_engine_queue_ms": round(1000 * d["bole_engine_queue_seconds_sum"] / n_queue, 2) if n_queue else None,
        "generation_tokens": int(d["bole_generation_tokens_total"]),
        "peak_batch_since_start": int(after.get("bole_engine_peak_batch", 0)),
        # the engine's own time: seconds inside steps, the mean step, and the share of decode steps whose
        # forward / draft / acceptance ran eagerly (no captured graph for that step's shape)
        "engine_step_s": round(d["bole_engine_step_seconds"], 3),
        "mean_step_ms": round(1000 * d["bole_engine_step_seconds"] / steps, 2) if steps else None,
        "steps": int(steps),
        "mean_decode_ms": round(1000 * d["bole_engine_decode_seconds"] / decode_steps, 2) if decode_steps else None,
        "eager_forward_share": share("bole_engine_eager_forwards"),
        "eager_draft_share": share("bole_engine_eager_drafts"),
        "eager_tail_share": share("bole_engine_eager_tails"),
        # the steps that prefilled (the share with an eager prefill forward), and the mean time to the
        # first tokens of those that sampled some
        "prefill_steps": int(prefills),
        "mean_prefill_ms": round(1000 * d["bole_engine_prefill_seconds"] / first, 2) if first else None,
        "eager_prefill_share": round(d["bole_engine_eager_prefills"] / prefills, 4) if prefills else None,
        # requests admitted inside a step under way (EngineConfig.admit_mid_step), not at its end
        "mid_step_admissions": int(d["bole_engine_mid_step_admissions"]),
        # of those, prefilled beside the step's forwards (EngineConfig.admit_during_forward)
        "beside_admissions": int(d["bole_engine_beside_admissions"]),
        # graphs captured during the phase (lazily, inside steps) and the seconds of steps they took
        "graph_captures": int(d["bole_engine_graph_captures"]),
        "capture_s": round(d["bole_engine_capture_seconds"], 3),
    }


def prompt_slices(prompts: list[str], sizes: list[int]) -> tuple[list[list[str]], bool]:
    """Consecutive slices of ``sizes`` prompts (cycled past the end); True when a slice repeats one."""
    out, k = [], 0
    for n in sizes:
        out.append([prompts[(k + i) % len(prompts)] for i in range(n)])
        k += n
    return out, k > len(prompts)


def split_mode(label: str) -> tuple[str, dict]:
    """``MODE`` or ``MODE+KEY=VALUE[,KEY=VALUE...]`` -> (the engine mode, its own options, YAML values);
    ValueError naming the label otherwise."""
    mode, _, extra = label.partition("+")
    if mode not in MODES:
        raise ValueError(f"--modes {label!r}: the mode must be one of {', '.join(MODES)}")
    opts = {}
    for kv in filter(None, extra.split(",")):
        key, eq, value = kv.partition("=")
        if not key or not eq:
            raise ValueError(f"--modes {label!r}: {kv!r} is not KEY=VALUE")
        opts[key] = yaml.safe_load(value)
    if "+" in label and not opts:
        raise ValueError(f"--modes {label!r}: no KEY=VALUE after '+'")
    return mode, opts


def overlay(args, label: str, port: int) -> dict:
    mode, own = split_mode(label)
    opts = {"mode": mode, "device": args.device, "dtype": args.dtype, "num_blocks": args.num_blocks,
            "max_num_seqs": args.max_num_seqs, "enable_cuda_graphs": args.device.startswith("cuda")}
    if opts["enable_cuda_graphs"]:   # as served (cluster_configs/mixed.yaml): no capture inside a served step
        opts["cuda_graph_capture_len"] = 1024
    for kv in args.engine_option:
        key, _, value = kv.partition("=")
        opts[key] = yaml.safe_load(value)
    opts.update(own)
    group = {"name": "bole-local", "engine_options": opts}
    if args.calibration_table:
        group["calibration_table"] = args.calibration_table
    return {"http_options": {"host": "127.0.0.1", "port": port},
            # served_model_name null: the model folder's name (the overlay removes the base's)
            "applications": [{"name": "bole", "args": {"model": args.model, "served_model_name": None,
                                                       "groups": [group]}}]}


def file_name(label: str) -> str:
    """A mode label as a file name part (its options' ``+ = ,`` become ``_``)."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in label)


def child_env() -> dict:
    """The environment of the server and client processes: the repository first on the path, then
    what the caller's PYTHONPATH holds (run_gpu_agent.sh's wheels)."""
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


class Server:
    """One ``deployments.launch --no-ray`` process, its output in ``log``."""

    def __init__(self, args, mode: str, workdir: Path, log: Path):
        from bole.parallel import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        from deployments.overlay import load_config

        cfg = workdir / f"overlay_{file_name(mode)}.yaml"
        cfg.write_text(yaml.safe_dump(overlay(args, mode, self.port)))
        app = load_config(str(ROOT / BASE_CONFIG), [str(cfg)], serve_schema=False)["applications"][0]["args"]
        self.engine_options = {**app["groups"][0]["engine_options"],
                               "calibration_table": app["groups"][0].get("calibration_table", "auto")}
        self.log_path, self.log = log, open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "deployments.launch", BASE_CONFIG, "--no-ray",
                                      "--overlay", str(cfg)], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=child_env())

    def wait_healthy(self, timeout: float) -> str | None:
        """None once /health answers 200, else why not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"server exited with {self.proc.returncode}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return None
            except OSError:
                pass
            time.sleep(0.5)
        return f"no /health after {timeout:.0f} s"

    def stop(self, grace_s: float = 40.0) -> int | None:
        """SIGINT (the server drains), SIGKILL after ``grace_s``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode

    def tail(self, n: int = 30) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()[-n:]


def run_phase(args, url: str, label: str, prompts: list[str], rate: float, workdir: Path) -> dict:
    """One serve_load.py run (a subprocess under --phase-timeout-s): its result, or an error."""
    pfile = workdir / f"prompts_{label}.jsonl"
    pfile.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cmd = [sys.executable, "benchmarks/serve_load.py", "--base-url", url + "/v1", "--workload", "multiturn",
           "--turns", str(args.turns), "--num-requests", str(len(prompts)), "--request-rate", str(rate),
           "--max-tokens", str(args.max_tokens), "--prompts", str(pfile), "--seed", str(args.seed),
           "--no-warmup", "--label", label, "--timeout", str(args.phase_timeout_s)]
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.phase_timeout_s,
                           env=child_env())
    except subprocess.TimeoutExpired:
        return {"error": f"serve_load.py timed out after {args.phase_timeout_s} s"}
    if r.returncode != 0:
        return {"error": f"serve_load.py exited with {r.returncode}: {(r.stderr or r.stdout)[-1500:]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])["result"]


def run_mode(args, mode: str, slices: list[list[str]], workdir: Path, doc: dict, save) -> None:
    rec = doc["modes"][mode] = {"rates": []}
    t0 = time.perf_counter()
    server = Server(args, mode, workdir, Path(args.log_dir) / f"server_{file_name(mode)}.log")
    rec["engine_options"] = server.engine_options
    try:
        why = server.wait_healthy(args.start_timeout_s)
        rec["startup_s"] = round(time.perf_counter() - t0, 1)
        if why:
            rec["error"], rec["server_log_tail"] = why, server.tail()
            return
        k = len(args.rates)
        warm = sorted(zip(args.rates, slices[:k]), key=lambda p: -p[0])
        phases = [(f"warmup@{r:g}", r, s) for r, s in warm] + [(f"{r:g}", r, s) for r, s in zip(args.rates, slices[k:])]
        for name, rate, prompts in phases:
            if time.monotonic() > args.deadline:
                rec.setdefault("skipped", []).append(name)
                continue
            before = scrape(server.url + "/metrics")
            client = run_phase(args, server.url, f"{file_name(mode)}@{name}", prompts, rate, workdir)
            row = {"rate": rate, "client": client, "server": server_delta(before, scrape(server.url + "/metrics"))}
            if name.startswith("warmup"):
                rec.setdefault("warmup", []).append(row)
            else:
                rec["rates"].append(row)
            save()
    except Exception as e:  # noqa: BLE001 - a failed mode is a result; the next mode still runs
        rec["error"], rec["server_log_tail"] = f"{type(e).__name__}: {e}", server.tail()
    finally:
        # killed by run_gpu_agent.sh's `timeout` (SIGTERM, SIGKILL 10 s later): leave no server behind
        rec["exit_code"] = server.stop(5.0 if TERMINATED else 40.0)
        save()


def summary_rows(doc: dict) -> list[dict]:
    rows = []
    for mode, rec in doc["modes"].items():
        for row in rec["rates"]:
            c, s = row["client"], row["server"]
            if "error" in c:
                rows.append({"mode": mode, "rate": row["rate"], "error": c["error"][:200]})
                continue
            rows.append({"mode": mode, "rate": row["rate"], "completed": c["completed"], "failed": c["failed"],
                         "req_per_s": c["request_throughput_per_s"], "tok_per_s": c["output_tokens_per_s"],
                         **{f"{k}_{q}_ms": c[k][f"{q}_ms"] for k in ("ttft", "tpot") for q in ("mean", "p50", "p99")},
                         "prefix_hit_rate": s["prefix_hit_rate"], "preemptions": s["preemptions"],
                         "mean_mat": s["mean_mat"], "queue_wait_ms": s["mean_queue_wait_ms"],
                         "engine_queue_ms": s.get("mean_engine_queue_ms"),
                         "step_ms": s.get("mean_step_ms"), "decode_ms": s.get("mean_decode_ms"),
                         "busy_share": round(s["engine_step_s"] / c["duration_s"], 3)
                         if s.get("engine_step_s") is not None and c.get("duration_s") else None,
                         **{f"eager_{k}": s.get(f"eager_{k}_share") for k in ("forward", "draft", "tail", "prefill")},
                         "prefill_ms": s.get("mean_prefill_ms"), "mid_step": s.get("mid_step_admissions"),
                         "beside": s.get("beside_admissions"),
                         "captures": s.get("graph_captures"), "capture_s": s.get("capture_s")})
    return rows


def print_table(rows: list[dict]) -> None:
    cols = ("mode", "rate", "req_per_s", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p50_ms",
            "tpot_p99_ms", "prefix_hit_rate", "preemptions", "mean_mat", "step_ms", "decode_ms", "busy_share",
            "queue_wait_ms", "engine_queue_ms", "eager_forward", "eager_draft", "eager_tail", "prefill_ms",
            "eager_prefill", "mid_step", "beside", "captures", "capture_s")
    print(" ".join(f"{c:>13}" for c in cols))
    for r in rows:
        cells = " ".join(f"{'-' if r.get(c) is None else r[c]!s:>13}" for c in cols)
        print(cells + (f"  {r['error']}" if "error" in r else ""))


def plot_cdfs(doc: dict, path: str) -> bool:
    """TTFT and TPOT CDFs, one column per rate, one line per mode (from the clients' ``samples_ms``);
    False when there is nothing to plot (or no matplotlib)."""
    rates = sorted({row["rate"] for rec in doc["modes"].values() for row in rec["rates"]
                    if "samples_ms" in row["client"]})
    if not rates:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError:
        return False
    fig, axes = plt.subplots(2, len(rates), figsize=(4.6 * len(rates), 7), squeeze=False)
    plain = FuncFormatter(lambda x, _: f"{x:g}")
    for j, rate in enumerate(rates):
        for mode, rec in doc["modes"].items():
            row = next((r for r in rec["rates"] if r["rate"] == rate and "samples_ms" in r["client"]), None)
            for i, key in enumerate(("ttft", "tpot")):
                xs = row["client"]["samples_ms"][key] if row else []
                if xs:
                    axes[i][j].step(xs, [(k + 1) / len(xs) for k in range(len(xs))], where="post", label=mode)
        for i, key in enumerate(("TTFT", "TPOT")):
            axes[i][j].set(xlabel=f"{key} (ms)", ylabel="fraction of requests", xscale="log",
                           title=f"{rate:g} conversations/s")
            ax = axes[i][j].xaxis   # plain numbers at 1, 2, 5 per decade (10^x labels overlapped)
            ax.set_major_formatter(plain)
            ax.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
            ax.set_minor_formatter(plain)
            axes[i][j].grid(alpha=0.3)
            axes[i][j].legend()
    fig.suptitle(f"serve_modes on {doc['hardware']}: {doc['settings']['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "fastapi", "uvicorn", "pydantic", "openai"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/bole-tiny-coder")
    ap.add_argument("--modes", nargs="+", default=list(MODES),
                    help=f"{', '.join(MODES)}, each optionally MODE+KEY=VALUE[,KEY=VALUE...] (its own engine options)")
    ap.add_argument("--rates", nargs="+", type=float, default=[4.0, 16.0, 64.0], help="conversations per second")
    ap.add_argument("--num-requests", type=int, default=48, help="requests (turns) per rate")
    ap.add_argument("--warmup-requests", type=int, default=24)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--num-blocks", type=int, default=2048, help="KV blocks of the engine (CacheConfig)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--calibration-table", default=None, help="default: the config's (auto)")
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                    help="another engine option (YAML value), e.g. depth=4; repeatable")
    ap.add_argument("--start-timeout-s", type=float, default=180.0)
    ap.add_argument("--phase-timeout-s", type=float, default=120.0)
    ap.add_argument("--budget-s", type=float, default=420.0, help="no phase starts after this many seconds")
    ap.add_argument("--tag", default=None, help="hardware name for the record (default: the device)")
    ap.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--png", default=None, help="TTFT / TPOT CDFs (default: beside --out; 'none': off)")
    args = ap.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    for label in args.modes:
        try:
            split_mode(label)
        except ValueError as e:
            ap.error(str(e))
    if len(set(args.modes)) != len(args.modes):
        ap.error(f"--modes repeats a mode: {args.modes}")
    if any(not (r > 0) or math.isinf(r) for r in args.rates):
        ap.error("--rates must be finite and > 0")
    if min(args.num_requests, args.warmup_requests, args.turns) < 1:
        ap.error("--num-requests, --warmup-requests and --turns must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    args.deadline = time.monotonic() + args.budget_s
    workdir = Path(tempfile.mkdtemp(prefix="serve_modes_"))
    args.log_dir = args.log_dir or str(workdir)
    os.makedirs(args.log_dir, exist_ok=True)
    slices, overlap = prompt_slices(heldout_prompts(HELDOUT), [args.warmup_requests] * len(args.rates)
                                    + [args.num_requests] * len(args.rates))
    settings = {k: v for k, v in vars(args).items() if k not in ("deadline", "out", "log_dir")}
    doc = {"benchmark": "serve_modes", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": " ".join(sys.argv), "hardware": args.tag or args.device, "versions": versions(),
           "settings": {**settings, "workload": "multiturn", "prompt_slices_overlap": overlap}, "modes": {}}
    t0 = time.perf_counter()

    def save():
        doc["elapsed_s"] = round(time.perf_counter() - t0, 1)
        doc["summary"] = summary_rows(doc)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    for mode in args.modes:
        if time.monotonic() > args.deadline:
            doc["modes"][mode] = {"rates": [], "skipped": ["budget"]}
            continue
        print(f"== {mode}: starting the server", flush=True)
        run_mode(args, mode, slices, workdir, doc, save)
    save()
    png = args.png or (str(Path(args.out).with_suffix(".png")) if args.out else "none")
    if png != "none" and plot_cdfs(doc, png):
        print(f"CDFs: {png}", flush=True)
    print_table(doc["summary"])
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
