"""The engine contract: what ``AsyncEngine`` and the serving layer may call on an engine.

``EngineCore`` is a structural protocol (like Ray Serve LLM's engine protocol): ``LLMEngine`` (one
process) and ``deployments.tp.TPEngine`` (a driver of tensor-parallel ranks) both satisfy it, and
nothing above the engine reaches past it (no scheduler, no model, no metrics object). What an
engine reports crosses that line as frozen dataclasses: ``EngineLimits`` (fixed at start),
``EngineStats`` (as of the last step: metrics, queue, where the batch stands in the budget table) and
``RequestTimings`` (a request's clock at its first token). They pickle, so they cross Ray's actor
boundaries as they are (TP ranks, Serve handles); the serving layer carries ``EngineStats`` inside
``deployments.replica_stats.ReplicaStats``, whose ``to_dict`` is the one place it becomes a plain
mapping (Serve's routing stats, /metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from bole.engine.output import RequestOutput
from bole.sampling_params import SamplingParams
from bole.spec.budget import CalibrationTable


@dataclass(frozen=True)
class EngineLimits:
    """What an engine can take, fixed when it starts."""

    max_num_seqs: int       # the running batch's bound
    max_model_len: int      # prompt + max_tokens must fit: the smaller of the model's positions and kv_tokens
    kv_tokens: int          # the KV cache's tokens less one step's lookahead (the draft tree's reserve)
    vocab_size: int         # prompt token ids lie in [0, vocab_size)
    block_size: int         # KV block tokens: the prefix hashes' granularity
    device: str
    dtype: str
    tp_size: int
    memory_plan: dict = field(default_factory=dict)  # bytes per category (bole.cache.memory_plan.MemoryPlan)
    cuda_graphs: bool = False  # decode / verify replay captured CUDA graphs (what its table should time)


@dataclass(frozen=True)
class RequestTimings:
    """A request's engine clock at its first token."""

    prefill_s: float        # scheduled -> first token: compute, not waiting
    engine_queue_s: float   # arrival -> scheduled: the wait in the engine's queue


@dataclass(frozen=True)
class EngineStats:
    """An engine's metrics (``EngineMetrics.snapshot``), queue and budget state after its last step.

    ``bucket`` / ``b_ver`` are the calibration table's cell for the running batch and
    ``b_ver_per_request`` the share each request would get with one more: what the router weighs
    (docs/DESIGN.md §5). ``held`` counts every request the engine still holds: running, waiting, and
    finished ones not yet released (``pop_finished``); 0 when it is idle and has forgotten everything.
    ``batch`` / ``peak_batch`` are the last step's batch and the largest one, filled in by
    ``AsyncEngine``."""

    steps: int = 0
    mat: float = 0.0
    mean_tree_nodes: float = 0.0
    mean_b_ver: float = 0.0
    budget_used: float = 0.0
    floor_excess_nodes: float = 0.0
    prefix_hit_rate: float = 0.0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    verify_time_share: float = 0.0
    mean_ttft_s: float = 0.0
    mean_tpot_s: float = 0.0
    emitted_tokens: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    step_time_s: float = 0.0
    decode_time_s: float = 0.0
    decode_steps: int = 0
    eager_forwards: int = 0
    eager_drafts: int = 0
    eager_tails: int = 0
    prefill_steps: int = 0
    eager_prefills: int = 0
    first_token_steps: int = 0
    prefill_time_s: float = 0.0
    mid_step_admissions: int = 0   # requests admitted inside a step under way (EngineConfig.admit_mid_step)
    beside_admissions: int = 0     # of those, prefilled beside the step's forwards (admit_during_forward)
    graph_captures: int = 0        # CUDA graphs captured since start (ModelRunner.graph_captures)
    capture_time_s: float = 0.0    # host seconds in those captures, at start or inside steps
    running: int = 0
    waiting: int = 0
    held: int = 0
    running_ids: tuple[str, ...] = ()
    table_id: str = ""
    bucket: int = 0
    b_ver: int = 0
    b_ver_per_request: float = 0.0
    batch: int = 0
    peak_batch: int = 0


def budget_stats(metrics: dict, calibration: CalibrationTable, depth: int, running: list[tuple[str, int]],
                 waiting: int, held: int) -> EngineStats:
    """``EngineStats`` of a batch: ``running`` as (request id, tokens computed), ``depth`` the draft
    depth (a tree has depth + 1 levels), ``metrics`` an ``EngineMetrics.snapshot``, ``held`` the
    requests the engine holds."""
    n = len(running)
    kv_len = max((k for _, k in running), default=0)
    bucket, b_ver = calibration.lookup(max(n, 1), kv_len, depth + 1)
    _, b_next = calibration.lookup(n + 1, kv_len, depth + 1)
    return EngineStats(**metrics, running=n, waiting=waiting, held=held, running_ids=tuple(r for r, _ in running),
                       table_id=calibration.table_id, bucket=bucket, b_ver=b_ver,
                       b_ver_per_request=b_next / (n + 1))


@runtime_checkable
class EngineCore(Protocol):
    """An engine ``AsyncEngine`` can drive: requests in, ``RequestOutput`` deltas out, one step at a
    time, from one thread; every call between steps."""

    tokenizer: Any
    calibration: CalibrationTable   # settable between steps: the next step uses the new table

    @property
    def model_config(self) -> Any: ...

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def step(self, emit_early: Callable[[list[RequestOutput]], None] | None = None,
             admit: Callable[[], int] | None = None) -> list[RequestOutput]:
        """One step's outputs. An engine may hand some to ``emit_early`` before the step ends (then it does
        not return them): ``LLMEngine`` hands its prefills' first tokens as soon as they are sampled, before
        the step's decode or speculative forwards, so a new request's TTFT does not include them. An engine
        may call ``admit`` inside the step to take requests sent since it began (it adds them through
        ``add_request`` and returns how many); one that does not takes them at the next step."""
        ...

    def pop_finished(self, request_id: str) -> Any: ...

    def stats(self) -> EngineStats: ...

    def limits(self) -> EngineLimits: ...

    def request_timings(self, request_id: str) -> RequestTimings | None: ...

    def cached_prefix_hashes(self, limit: int | None = None) -> list[int]: ...

    def recalibrate(self, quick: bool = True, **kw) -> CalibrationTable: ...

    def shutdown(self) -> None: ...
