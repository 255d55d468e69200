"""Serve application builders that YAML names (``import_path: deployments.app:build_app``).

``build_app(args)`` validates ``args`` as an ``AppConfig`` and returns one Serve application:

    OpenAIIngress (FastAPI, deployments.ingress)  --handles-->  one BoleReplica deployment per group

A *group* is one hardware class: its own resources (accelerator type or custom resource), replica
count or autoscaling, calibration table (pushed through ``user_config`` so it can be swapped with
``reconfigure`` / ``serve deploy`` without restarts), and the ``BoleRequestRouter`` with the group's
routing thresholds. The ingress is shared; with several groups it picks the group with the same
policy over the whole fleet view (``deployments.serve_client.ServeEngineClient``).

Capacity comes from the engines: a replica admits ``max_pending`` engine requests (its running batch
and queue; default 4 x max_num_seqs) and Serve's ``max_ongoing_requests`` defaults to that, so the
engines' batches fill and /metrics is answered under load. Serve's own default (5) had capped the
whole endpoint at 5 requests.

Nothing waits in Serve without bound, and every request's deadline covers Serve's queues. Serve holds a
call beyond a deployment's ``max_ongoing_requests`` in the caller's queue, unbounded by default: a
burst waited there with its deadline not started (the ingress starts it), and was answered long after
``request_timeout_s``. So:
  - a group's queue (in the ingress, for its replicas) holds one more round of what its replicas
    hold (``max_queued_requests``); beyond it the group refuses at once (Serve's ``BackPressureError``):
    the ingress tries the next group, and answers an OpenAI-shaped 429 when every group refused
    (deployments.serve_client, deployments.http_errors);
  - the ingress takes twice what the groups admit and queue (``fleet_holds``), plus
    ``PROBE_HEADROOM`` for /metrics and probes: the second half for the requests it is refusing, so
    overload reaches its 429 instead of waiting in the proxy's queue;
  - the proxy's queue for the ingress holds ``fleet_holds`` plus ``PROBE_HEADROOM`` (Serve counts a
    request as queued while handing it over, so less would refuse bursts the fleet can take); beyond
    it the proxy answers 429 with ``Retry-After`` itself (``backpressure_config``);
  - Serve's proxy ends any request ``proxy_request_timeout_s`` (the deadline plus
    ``PROXY_TIMEOUT_SLACK_S``) after it arrived (``http_options.request_timeout_s``, set by
    deployments.launch): the ingress's 504 comes first, and a request held in the proxy's queue is
    still answered (408) and cancelled, its engine requests aborted.
The proxy writes those answers (and its 503s) itself, in plain text; its callback,
``deployments.proxy_errors``, which the configs install, makes them the app's OpenAI-shaped JSON.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bole.config import CacheConfig, EngineConfig
from deployments.engine_client import default_max_pending, model_tokenizer
from deployments.ingress import DEFAULT_REQUEST_TIMEOUT_S
from deployments.retry import RetryPolicy
from deployments.routing_policy import RouterPolicyConfig, process_fleet

ROUTER_CLASS = "deployments.router:BoleRequestRouter"
INGRESS_NAME = "openai-ingress"
PROBE_HEADROOM = 8   # ingress slots beyond what the engines admit: /metrics, /health, /ready
# Serve's proxy answers a request this long after its deadline at the latest: time for the ingress's own
# 504 (measured from the ingress's receipt, a little after the proxy's) to come first
PROXY_TIMEOUT_SLACK_S = 2.0
# what the proxy tells a client it refuses because the ingress's queue is full (Serve's backpressure_config)
INGRESS_BACKPRESSURE = {"status_code": 429, "retry_after_s": 1.0}


class RouterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    match_rate_threshold: float = Field(RouterPolicyConfig.match_rate_threshold, gt=0, le=1,
                                        description="Least fraction of the prompt's blocks a replica must "
                                                    "hold for prefix affinity to apply.")
    imbalance_threshold: int = Field(RouterPolicyConfig.imbalance_threshold, ge=0,
                                     description="Max - min ongoing requests beyond which affinity is "
                                                 "ignored for a power-of-two choice.")
    affinity_load_slack: int = Field(RouterPolicyConfig.affinity_load_slack, ge=0,
                                     description="How many more ongoing requests than the least loaded "
                                                 "replica an affinity replica may carry.")
    comparable_load_slack: int = Field(RouterPolicyConfig.comparable_load_slack, ge=0,
                                       description="Replicas within this load of the least loaded are "
                                                   "compared by verification budget per request.")
    routed_memory_blocks: int = Field(4096, ge=1, description="Recently routed block hashes remembered "
                                                              "per replica (between stats reports).")
    stats_period_s: float = Field(1.0, gt=0, description="How often replicas report routing stats.")


class GroupConfig(BaseModel):
    """One hardware group: a replica deployment."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="Deployment name, e.g. 'bole-a100'.")
    hardware: str = Field("auto", description="Hardware class reported for routing and metrics "
                                              "('auto': detect, bole.hardware).")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel degree (GPUs per replica).")
    engine_options: dict[str, Any] = Field(default_factory=dict,
                                           description="EngineConfig options (mode, device, dtype, depth, "
                                                       "topk, beam, draft_vocab, budget_epsilon, cap_tree_width, "
                                                       "budget_floor, budget_rule, num_blocks, gpu_memory_utilization, "
                                                       "block_size, max_num_seqs, ...).")
    calibration_table: str = Field("auto", description="Calibration table path, or 'auto' (by hardware "
                                                       "class and model shapes).")
    num_replicas: Union[int, Literal["auto"]] = Field(1, description="Replica count, or 'auto' to autoscale.")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Serve autoscaling (min_replicas, max_replicas, target_ongoing_requests, ...).")
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1},
                                              description="Resources of a replica actor (num_gpus, "
                                                          "accelerator_type, resources: {gb10: 1}, ...).")
    placement_group_bundles: list[dict[str, float]] | None = Field(
        None, description="One bundle per TP rank, each holding that rank's worker actor; the first "
                          "also hosts the replica actor (ray_actor_options). Without it a TP replica "
                          "creates its own STRICT_PACK group of tp_size bundles.")
    tp_worker_options: dict[str, Any] = Field(
        default_factory=dict, description="Ray resources of each TP worker actor (num_cpus, num_gpus); "
                                          "default 1 CPU, plus 1 GPU when the device is cuda.")
    placement_group_strategy: str = Field("STRICT_PACK", description="Placement of the TP bundles.")
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Calls a replica holds at once (Serve); default its admission limit "
                                "(max_pending), so Serve never holds back what the engine would take.")
    max_pending: int | None = Field(None, ge=1, description="Engine requests a replica admits: its running "
                                                            "batch and its queue (default 4 x max_num_seqs).")
    max_queued_requests: int | None = Field(
        None, ge=1, description="Calls an ingress replica holds for this group while every replica is full "
                                "(Serve's max_queued_requests); beyond it the client gets a 429 at once. Default: "
                                "what the replicas hold (max replicas x max_ongoing_requests), one more round.")
    graceful_shutdown_timeout_s: float = Field(60.0, gt=0, description="Drain time on shutdown / downscale.")
    router: RouterOptions = Field(default_factory=RouterOptions, description="Routing thresholds.")

    @model_validator(mode="after")
    def _tp_bundles(self):
        if self.placement_group_bundles is not None and self.tp_size > 1 \
                and len(self.placement_group_bundles) != self.tp_size:
            n = len(self.placement_group_bundles)
            raise ValueError(f"group {self.name}: {n} placement_group_bundles for tp_size={self.tp_size}: "
                             "give one bundle per TP rank")
        return self

    @property
    def block_size(self) -> int:
        return int(self.engine_options.get("block_size", CacheConfig.block_size))

    @property
    def admission_limit(self) -> int:
        """Engine requests one replica admits (running + queued)."""
        seqs = int(self.engine_options.get("max_num_seqs", EngineConfig.max_num_seqs))
        return self.max_pending or default_max_pending(seqs)

    @property
    def replica_max_ongoing(self) -> int:
        return self.max_ongoing_requests or self.admission_limit

    @property
    def max_replica_count(self) -> int:
        """Replicas the group can have at most (autoscaling's max_replicas, else num_replicas)."""
        if self.autoscaling_config is not None:
            return int(self.autoscaling_config.get("max_replicas", 1))
        return self.num_replicas if isinstance(self.num_replicas, int) else 1

    @property
    def replica_max_queued(self) -> int:
        """Serve's queue bound of the group, per caller (ingress replica). One round of what the replicas
        hold: Serve counts a call as queued while handing it to a replica, so less would refuse a burst
        the replicas can take (their engines queue behind the batch already)."""
        return self.max_queued_requests or self.max_replica_count * self.replica_max_ongoing


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., description="Checkpoint folder (config.json, model.safetensors, tokenizer).")
    served_model_name: str | None = Field(None, description="Model id clients send (default: folder name).")
    groups: list[GroupConfig] = Field(..., min_length=1,
                                      description="Replica deployments, one per hardware class.")
    ingress_replicas: int = Field(1, ge=1, description="Ingress (HTTP) replicas.")
    api_key_env: str = Field("BOLE_API_KEY", description="Env var holding the bearer key (unset: no auth).")
    default_max_tokens: int | None = Field(None, ge=1, description="Chat max_tokens if a request has none.")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Larger HTTP bodies get 413.")
    ingress_max_ongoing_requests: int | None = Field(
        None, ge=1, description="HTTP requests one ingress replica handles at once (Serve); default twice "
                                "what the groups can admit and queue (sum of max replicas x max_pending plus "
                                f"their max_queued_requests) plus {PROBE_HEADROOM} for /metrics and probes, so "
                                "neither starves under load and overload reaches the ingress's 429.")
    ingress_max_queued_requests: int | None = Field(
        None, ge=1, description="HTTP requests Serve's proxy holds while every ingress slot is taken (Serve's "
                                "max_queued_requests, per proxy); beyond it the proxy answers 429 with "
                                "Retry-After at once. Default: what the groups admit and queue, plus "
                                f"{PROBE_HEADROOM}.")
    request_timeout_s: float = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0, description="Server-side deadline of "
                                     "every request (then 504 and its engine requests are aborted); Serve's "
                                     "proxy answers any request still open "
                                     f"{PROXY_TIMEOUT_SLACK_S:g} s later, held in its queue or not.")
    retry_budget_s: float = Field(RetryPolicy.budget_s, ge=0, description="How long the ingress keeps "
                                  "retrying a request that replicas refuse (draining) before a 503.")
    protect_metrics: bool = Field(False, description="With an API key, require it on /metrics, /docs and "
                                                     "/openapi.json too (or set BOLE_PROTECT_METRICS=1).")

    @field_validator("groups")
    @classmethod
    def _unique_names(cls, groups):
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")
        return groups

    @model_validator(mode="after")
    def _same_block_size(self):
        sizes = {g.block_size for g in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"all groups must use one KV block_size (routing hashes blocks), "
                             f"got {sorted(sizes)}")
        return self

    @property
    def fleet_holds(self) -> int:
        """Calls the groups hold at once: admitted by their replicas, and queued for them."""
        return sum(g.max_replica_count * g.admission_limit + g.replica_max_queued for g in self.groups)

    @property
    def ingress_max_ongoing(self) -> int:
        if self.ingress_max_ongoing_requests is not None:
            return self.ingress_max_ongoing_requests
        # twice: as many again for the requests the ingress is refusing (each holds a slot until its 429
        # is written), so overload reaches the ingress's 429 instead of waiting in the proxy's queue
        return 2 * self.fleet_holds + PROBE_HEADROOM

    @property
    def ingress_max_queued(self) -> int:
        """The proxy's queue for the ingress: a burst the fleet can hold is never refused while the proxy
        hands it over (Serve counts those as queued), and a slow ingress sheds the rest at once."""
        return self.ingress_max_queued_requests or self.fleet_holds + PROBE_HEADROOM

    @property
    def proxy_request_timeout_s(self) -> float:
        """Serve's end-to-end HTTP timeout (``http_options.request_timeout_s``), counted from the request's
        arrival at the proxy, so it covers the proxy's queue, which the ingress's deadline cannot see."""
        return self.request_timeout_s + PROXY_TIMEOUT_SLACK_S


def replica_deployment(group: GroupConfig, model: str):
    """The bound Serve deployment of one group."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deployments.replica import BoleReplica

    router_kwargs = group.router.model_dump(exclude={"stats_period_s"})
    options: dict[str, Any] = dict(
        name=group.name, max_ongoing_requests=group.replica_max_ongoing,
        max_queued_requests=group.replica_max_queued,
        ray_actor_options=group.ray_actor_options,
        user_config={"calibration_table": group.calibration_table},
        graceful_shutdown_timeout_s=group.graceful_shutdown_timeout_s,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={"block_size": group.block_size, **router_kwargs},
            request_routing_stats_period_s=group.router.stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 5 * group.router.stats_period_s)))
    if group.autoscaling_config is not None:
        options["autoscaling_config"] = group.autoscaling_config
    else:
        options["num_replicas"] = group.num_replicas
    if group.placement_group_bundles:
        options["placement_group_bundles"] = group.placement_group_bundles
        options["placement_group_strategy"] = group.placement_group_strategy
    # the table travels only in user_config: swapping it later is a reconfigure, not a restart
    engine_options = {k: v for k, v in group.engine_options.items() if k != "calibration_table"}
    return serve.deployment(BoleReplica).options(**options).bind(
        model, engine_options, hardware=group.hardware, tp_size=group.tp_size, max_pending=group.max_pending,
        drain_timeout_s=group.graceful_shutdown_timeout_s, tp_worker_options=group.tp_worker_options or None)


def _ingress_class():
    from ray import serve

    @serve.ingress()
    class OpenAIIngress:
        def __init__(self, replicas: dict, config: dict):
            from bole.engine.async_engine import freeze_startup_heap
            from deployments.serve_client import ServeEngineClient

            self.config = cfg = AppConfig(**config)
            g = cfg.groups[0]
            thresholds = g.router.model_dump(exclude={"stats_period_s", "routed_memory_blocks"})
            policy = RouterPolicyConfig(block_size=g.block_size, **thresholds)
            retry = RetryPolicy(budget_s=cfg.retry_budget_s)
            # the view this process's routers publish into (routing_policy.process_fleet says why)
            self.client = ServeEngineClient(replicas, model_tokenizer(cfg.model), process_fleet(), policy, retry)
            freeze_startup_heap()   # Ray, the tokenizer, the client: no full collection walks them again

        def __serve_build_asgi_app__(self):
            from deployments.ingress import openai_app

            cfg = self.config
            return openai_app(self.client, served_name(cfg), api_key=os.environ.get(cfg.api_key_env, ""),
                              max_body_bytes=cfg.max_body_bytes, default_max_tokens=cfg.default_max_tokens,
                              request_timeout_s=cfg.request_timeout_s, protect_metrics=cfg.protect_metrics or None)

    return OpenAIIngress


def served_name(cfg: AppConfig) -> str:
    return cfg.served_model_name or os.path.basename(os.path.normpath(cfg.model))


def build_app(args: dict):
    """Serve application for ``args`` (an ``AppConfig`` mapping, e.g. the YAML ``args``)."""
    from ray import serve

    cfg = AppConfig(**args)
    replicas = {g.name: replica_deployment(g, cfg.model) for g in cfg.groups}
    ingress = serve.deployment(_ingress_class()).options(
        name=INGRESS_NAME, num_replicas=cfg.ingress_replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=cfg.ingress_max_ongoing, max_queued_requests=cfg.ingress_max_queued,
        backpressure_config=INGRESS_BACKPRESSURE)
    return ingress.bind(replicas, cfg.model_dump())
