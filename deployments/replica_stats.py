"""What a replica reports: ``ReplicaStats``, its engine's ``EngineStats`` plus the serving layer's own
state (admission, calibration mismatch, the prefix blocks it holds), typed on every hop.

    LLMEngine / TPEngine.stats() -> AsyncEngine.stats()          EngineStats
    LocalEngineClient.stats() -> BoleReplica.stats()              ReplicaStats (pickled across Serve handles)
    BoleReplica.record_routing_stats() -> Serve's controller      ``to_dict()``: Serve's routing stats are a
                                                                  dict, and the controller cannot import us
    BoleRequestRouter -> FleetView -> ServeEngineClient           ``from_dict()``: ReplicaStats again
    ServerMetrics.export (/metrics)                               ``to_dict()`` for the gauges' keys

``to_dict`` / ``from_dict`` are the one conversion, and they round-trip: the dict is flat (the engine's
fields beside the replica's, no name shared) and unknown keys are refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bole.engine.core import EngineStats

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineStats))


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's engine stats and its serving state, as of the engine's last step."""

    engine: EngineStats
    replica_id: str                 # Serve's unique id of the replica ("local" outside Serve)
    hardware_class: str             # bole.hardware's class: a100, gb10, h200, cpu, ...
    block_size: int                 # KV block tokens: the granularity of ``prefix_blocks``
    max_pending: int                # engine requests admitted at most (more get HTTP 429)
    pending: int                    # engine requests in flight now
    accepting: bool                 # False while draining: routers route around it
    refused: int                    # requests refused while draining, since the replica started
    calibration_mismatch: str       # table fields not measured for this replica, e.g. "dtype,tp_size"
    prefix_blocks: tuple[int, ...] = ()   # chain hashes of prefix blocks it holds (routing reports)
    prefix_source: str = ""         # "engine_cache" | "recent_prompts" (routing reports), else ""
    deployment: str = ""            # the Serve deployment the ingress reached it through; "" in-process
    memory_plan: dict = dataclasses.field(default_factory=dict)  # bytes per category, fixed at start

    def __post_init__(self):
        if not isinstance(self.engine, EngineStats):
            raise TypeError(f"engine must be an EngineStats, got {type(self.engine).__name__}")

    @property
    def load(self) -> int:
        """Requests in the engine: running plus waiting."""
        return self.engine.running + self.engine.waiting

    def to_dict(self) -> dict:
        """The flat mapping of the wire formats (Serve's routing stats, /metrics): lists for tuples,
        ``num_prefix_blocks`` added (a /metrics gauge; ``from_dict`` drops it)."""
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self.engine).items()}
        for f in dataclasses.fields(self):
            if f.name != "engine":
                v = getattr(self, f.name)
                out[f.name] = list(v) if isinstance(v, tuple) else v
        out["num_prefix_blocks"] = len(self.prefix_blocks)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "ReplicaStats":
        """The inverse of ``to_dict``; ``ValueError`` naming any key neither dataclass has."""
        unknown = set(d) - ENGINE_FIELDS - OWN_FIELDS - {"num_prefix_blocks"}
        if unknown:
            raise ValueError(f"unknown replica stats keys: {sorted(unknown)}")
        engine = EngineStats(**{k: tuple(v) if k == "running_ids" else v for k, v in d.items() if k in ENGINE_FIELDS})
        rest = {k: tuple(v) if k == "prefix_blocks" else v for k, v in d.items() if k in OWN_FIELDS}
        return cls(engine=engine, **rest)


OWN_FIELDS = frozenset(f.name for f in dataclasses.fields(ReplicaStats)) - {"engine"}
