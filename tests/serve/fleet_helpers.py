"""Helpers of the rolling-recalibration tests: stale calibration tables and a steady client load."""

from __future__ import annotations

import threading
import time

import openai
import yaml

from bole.calibrate_sweep import SweepPlan
from bole.calibrate_table import build_table
from bole.hardware import model_signature
from bole.models.loader import read_config

STALE_T_DEC_MS = 2000.0   # a decode step here takes tens of ms: a re-measured table is far more than 3x off


def stale_table(path, model_path: str, hardware: str, dtype: str = "float32", tp_size: int = 1,
                batch=(1, 4), kv=(512,), depth=(3,), capture=(8, 16, 32)) -> str:
    """Write a measured-looking table for the model at ``path`` whose timings are STALE_T_DEC_MS per
    decode step (as if measured on a much slower device or clock); its bucket layout is the plan the
    live recalibration re-measures. Returns the path."""
    plan = SweepPlan(batch_points=batch, kv_points=kv, depth_points=depth, capture_set=capture)
    records = [{"at": [B, k, d], "dec": [STALE_T_DEC_MS * B ** 0.1],
                "ver": {n: [STALE_T_DEC_MS * B ** 0.1 * (0.95 + 0.01 * n)] for n in capture}}
               for B, k, d in plan.points()]
    signature = model_signature(read_config(model_path)[1])
    header = {"hardware": hardware, "model": "tiny", "dtype": dtype, "tp_size": tp_size, "versions": {},
              "date": "2026-01-02", "source": "measured", "notes": "stale on purpose (tests)",
              "provenance": {"model_signature": signature}}
    with open(path, "w") as f:
        yaml.safe_dump(build_table(plan, records, header).to_dict(), f, sort_keys=False)
    return str(path)


class SteadyLoad:
    """``clients`` threads sending short greedy completions back to back through the openai client
    until stopped; every result or failure is recorded with its time."""

    def __init__(self, url: str, clients: int = 4, model: str = "tiny", max_tokens: int = 4):
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.results: list[tuple[float, int]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)]

    def _client(self, k: int) -> None:
        oai = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=180)
        i = 0
        while not self.stop.is_set():
            try:
                r = oai.completions.create(model=self.model, prompt=[5 + k, 6, 7, 8 + i % 50], temperature=0,
                                           max_tokens=self.max_tokens, extra_body={"ignore_eos": True})
                self.results.append((time.time(), r.usage.completion_tokens))
            except Exception as e:  # noqa: BLE001 - every failure is a test failure
                self.errors.append(f"{time.time():.1f} {e!r}")
            i += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(200)

    def served_between(self, t0: float, t1: float) -> int:
        return sum(1 for t, _ in self.results if t0 <= t <= t1)
