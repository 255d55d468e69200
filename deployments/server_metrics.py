"""Prometheus metrics of one OpenAI app (``deployments.ingress``), in its own registry so several
apps can live in one process.

Request latencies are measured in the ingress from the request's *arrival* (the first ASGI
middleware, before the body is read or validated; ``deployments.http_guards.ARRIVAL_KEY``):

  bole_time_to_first_token_seconds   arrival -> the ingress receives the request's first token
  bole_queue_wait_seconds            arrival -> the engine starts computing the request: TTFT less
                                     the replica's own prefill compute time (``ServedOutput.prefill_s``),
                                     so it holds the wait in the ingress, for a replica, and in the
                                     engine's queue behind a full batch (durations only, so no clock is
                                     compared across processes)
  bole_engine_queue_seconds          of that wait, the part in the engine's own queue: the engine's
                                     receipt of the request -> its scheduling (``ServedOutput.engine_queue_s``);
                                     the rest is the ingress, the transit to the engine and its inbox
  bole_time_per_output_token_seconds after the first token, per later token
  bole_aborted_requests_total        requests ended before they finished, by reason: client_disconnected
                                     (non-streaming client went away), stream_closed (a streaming
                                     client went away), deadline (the server-side request timeout)

The per-replica gauges are refreshed from the fleet's ``ReplicaStats`` on every scrape (``export``), among
them ``bole_memory_plan_bytes{category=...}``: the engine's memory plan at start (``bole.cache.memory_plan``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deployments.replica_stats import ReplicaStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
ABORT_REASONS = ("client_disconnected", "stream_closed", "deadline")
# per-replica totals (``EngineStats`` key, metric, what it counts)
TOTALS = (
    ("preemptions", "bole_engine_preemptions", "Requests preempted by recompute (KV blocks ran out)"),
    ("prefix_hit_tokens", "bole_prefix_cache_hit_tokens", "Prompt tokens of finished requests served from the "
     "prefix cache"),
    ("prompt_tokens", "bole_engine_prompt_tokens", "Prompt tokens of finished requests"),
    ("steps", "bole_engine_steps", "Engine steps"),
    ("step_time_s", "bole_engine_step_seconds", "Seconds inside engine steps (over bole_engine_steps: the mean step)"),
    ("decode_time_s", "bole_engine_decode_seconds", "Seconds in the decode part of steps (draft, verify, "
     "acceptance, commit; ar: the decode), the rest of a step being its prefill and emission"),
    ("decode_steps", "bole_engine_decode_steps", "Engine steps that decoded or verified"),
    ("eager_forwards", "bole_engine_eager_forwards", "Decode steps whose decode / verify forward ran eagerly (no "
     "captured CUDA graph for its shape)"),
    ("eager_drafts", "bole_engine_eager_drafts", "Speculative steps whose MTP draft ran eagerly"),
    ("eager_tails", "bole_engine_eager_tails", "Speculative steps whose acceptance and commit ran eagerly"),
    ("prefill_steps", "bole_engine_prefill_steps", "Engine steps that prefilled"),
    ("eager_prefills", "bole_engine_eager_prefills", "Prefilling steps with a prefill forward that ran eagerly (no "
     "captured prefill graph fits it, or graphs are off)"),
    ("first_token_steps", "bole_engine_first_token_steps", "Engine steps that sampled first tokens"),
    ("prefill_time_s", "bole_engine_prefill_seconds", "Seconds from the start of the prefill phases that sampled "
     "first tokens (a step's start, or an admission inside it) to those tokens (prefill forwards and sampling)"),
    ("mid_step_admissions", "bole_engine_mid_step_admissions", "Requests admitted inside an engine step under way "
     "(before its decode forward, or between its draft and verify), not at its end"),
    ("beside_admissions", "bole_engine_beside_admissions", "Of the requests admitted inside a step, those prefilled "
     "on the priority stream while the step's forwards ran (admit_during_forward)"),
    ("graph_captures", "bole_engine_graph_captures", "CUDA graphs captured (at start, or inside the step that "
     "first needed one)"),
    ("capture_time_s", "bole_engine_capture_seconds", "Seconds spent capturing CUDA graphs, Triton compiles inside "
     "them included (inside steps, they stall every running request)"),
)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        hw = ["model", "hardware_class"]
        self.requests = Counter("bole_requests", "Finished /v1 HTTP requests (endpoint: the route template, or "
                                "'other' where no route matched)", ["model", "endpoint", "status"], registry=r)
        self.aborted = Counter("bole_aborted_requests", "HTTP requests ended before they finished",
                               ["model", "reason"], registry=r)
        for reason in ABORT_REASONS:  # present at 0 from the start, so a rate() sees the first one
            self.aborted.labels(model_name, reason)
        self.prompt_tokens = Counter("bole_prompt_tokens", "Prompt tokens", hw, registry=r)
        self.generation_tokens = Counter("bole_generation_tokens", "Generated tokens", hw, registry=r)
        self.ttft = Histogram("bole_time_to_first_token_seconds", "Arrival at the ingress to the first token",
                              hw, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("bole_queue_wait_seconds", "Arrival at the ingress to the start of the "
                                    "engine's work on the request (TTFT less the prefill compute)", hw,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.engine_queue = Histogram("bole_engine_queue_seconds", "The engine's receipt of the request to its "
                                      "scheduling (the part of the queue wait in the engine's own queue)", hw,
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("bole_time_per_output_token_seconds", "TPOT after the first token", hw,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.mat = Histogram("bole_request_mean_accepted_tokens", "Tokens per decode step of a request (MAT)",
                             hw, buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16), registry=r)
        rep = ["model", "replica", "hardware_class"]
        self.gauges = {
            "mat": Gauge("bole_engine_mat", "Mean accepted tokens per request-step", rep, registry=r),
            "budget_used": Gauge("bole_verify_budget_used_ratio", "Draft nodes verified within B_ver / B_ver "
                                 "over speculative steps (<= 1)", rep, registry=r),
            "floor_excess_nodes": Gauge("bole_verify_floor_excess_nodes", "Mean draft nodes per step verified "
                                        "beyond B_ver because every request keeps its depth-1 children",
                                        rep, registry=r),
            "b_ver": Gauge("bole_verify_budget_b_ver", "B_ver of the current calibration bucket", rep,
                           registry=r),
            "bucket": Gauge("bole_calibration_bucket", "Current calibration bucket index", rep, registry=r),
            "prefix_hit_rate": Gauge("bole_prefix_cache_hit_rate", "Share of prompt tokens served from "
                                     "the prefix cache", rep, registry=r),
            "running": Gauge("bole_running_requests", "Requests in the running batch", rep, registry=r),
            "batch": Gauge("bole_engine_batch", "Requests the engine's last step ran", rep, registry=r),
            "peak_batch": Gauge("bole_engine_peak_batch", "The most requests one engine step ran, since the "
                                "replica started", rep, registry=r),
            "waiting": Gauge("bole_waiting_requests", "Requests queued in the engine", rep, registry=r),
            "refused": Gauge("bole_refused_while_draining", "Requests a draining replica refused (the "
                             "ingress sent them elsewhere), since the replica started", rep, registry=r),
            "num_prefix_blocks": Gauge("bole_prefix_summary_blocks", "Block hashes in the replica's prefix "
                                       "summary", rep, registry=r),
        }
        # totals since the replica started, so a load run reads its own share as a difference
        for key, name, what in TOTALS:
            self.gauges[key] = Gauge(name, what + ", since the replica started", rep, registry=r)
        self.table = Gauge("bole_calibration_table_info", "Calibration table in use (value 1); mismatch: the "
                           "fields (model, dtype, tp_size, hardware) it was not measured for, '' if none",
                           rep + ["table_id", "mismatch"], registry=r)
        self.memory = Gauge("bole_memory_plan_bytes", "Device memory the engine planned at start, by category "
                            "(kv, state, checkpoints, factors, snapshots, activations, logits, workspace)",
                            rep + ["category"], registry=r)

    def observe_first_token(self, hardware_class: str, ttft_s: float, prefill_s: float | None,
                            engine_queue_s: float | None = None) -> None:
        labels = (self.model_name, hardware_class)
        self.ttft.labels(*labels).observe(ttft_s)
        if prefill_s is not None:
            self.queue_wait.labels(*labels).observe(max(ttft_s - prefill_s, 0.0))
        if engine_queue_s is not None:
            self.engine_queue.labels(*labels).observe(max(engine_queue_s, 0.0))

    def observe_choice(self, hardware_class: str, num_prompt_tokens: int, num_tokens: int,
                       first_token_time: float | None, num_steps: int, end: float) -> None:
        labels = (self.model_name, hardware_class)
        self.generation_tokens.labels(*labels).inc(num_tokens)
        if num_prompt_tokens:
            self.prompt_tokens.labels(*labels).inc(num_prompt_tokens)
        if first_token_time is not None and num_tokens > 1:
            self.tpot.labels(*labels).observe((end - first_token_time) / (num_tokens - 1))
        if num_steps:
            self.mat.labels(*labels).observe((num_tokens - 1) / num_steps)

    def export(self, fleet: list[ReplicaStats]) -> bytes:
        """The registry's text, the per-replica gauges set from ``fleet`` (its ``to_dict`` keys)."""
        for g in (*self.gauges.values(), self.table, self.memory):
            g.clear()
        for s in fleet:
            row = s.to_dict()
            labels = (self.model_name, s.replica_id, s.hardware_class)
            for key, g in self.gauges.items():
                g.labels(*labels).set(float(row[key]))
            self.table.labels(*labels, s.engine.table_id, s.calibration_mismatch).set(1)
            for category, n in s.memory_plan.items():
                self.memory.labels(*labels, str(category)).set(float(n))
        return generate_latest(self.registry)
