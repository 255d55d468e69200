"""The memory plan: how many KV blocks, GDN state slots and checkpoint slots an engine gets, and what
its speculative buffers and one step's activations take, planned once at start.

``plan_memory(cfg, config, free, total)`` is a pure function of the model's shapes (this rank's: the
runner sizes its caches from ``local_config`` under tensor parallelism), the engine options and the
device's free / total bytes read once after the weights are loaded. The budget is

    budget = gpu_memory_utilization × total − (total − free)       (what is in use stays in use)

and it is spent in this order (bytes per unit are sized on the meta device from the allocators
themselves, ``PagedKVCache`` / ``StatePool`` / ``TreeFactors``, so the figures follow the buffers):

  state        max_num_seqs + 1 GDN state slots (plus a CUDA graph's padding slot)
  factors      the verify factor buffer: one node a verify row, ``EngineConfig.max_verify_rows`` rows (bole's
               default: the step's token budget; serial_tree's: max_num_seqs × (1 + tree nodes); at most
               that; ``bole.spec.budget.engine_verify_rows``, docs/DESIGN.md §4, §5)
  snapshots    serial_tree only: a state per node and GDN layer, same node count (what SGLang keeps)
  activations  one forward's transients: max_num_batched_tokens (or the largest prefill graph's token
               bucket, if larger, with prefill graphs) × hidden × ACTIVATION_WIDTHS, the
               chunked GDN prefill's per-chunk states, one request's gathered K / V at the model's
               longest position (the per-request prefill attention repeats them to every query head);
               twice that with ``admit_during_forward`` (a prefill beside the step's forward, on a stream
               whose cached blocks the other stream never reuses)
  logits       the widest lm_head call: max(verify rows, max_num_batched_tokens)
               rows × vocab × LOGITS_BYTES (the verify logits, their padded copy or a graph's static
               output, the fp32 upcast and one fp32 working buffer of the processing); with
               ``admit_during_forward`` the sum of the two (a prefill's prompt logprobs beside the verify's)
  workspace    WORKSPACE_BYTES for cuBLAS / Triton workspaces and allocator fragmentation
  checkpoints  prefix-cache checkpoint slots: CHECKPOINT_SHARE of what is left, at most one per
               checkpoint boundary of the KV blocks (plus the scratch slot)
  kv           every byte left: KV blocks of the attention layers and the drafter's layers, but no more
               than KV_WORKING_SETS × max_num_seqs requests at the model's longest position (the running
               batch's own blocks and as many again of cached prefixes): a short-context model does not
               take the device, so several engines of it share one GPU (every planned engine still
               plans from the memory the engines before it left free)

A count the user gave (``num_blocks``, ``num_checkpoint_slots``) wins but must fit. A configuration
that cannot fit, at least one tree's worth of KV blocks per running request, is refused at start
with a ValueError saying what does fit, so a run never fails later for lack of memory. On the CPU
there is no budget: the counts are the configured ones (512 blocks, 32 checkpoint slots by default)
and the plan only reports their bytes.

The activation widths and workspace are a stated estimate, not a profile run: ACTIVATION_WIDTHS
covers the dense MLP's fused gate / up output and its product (3 × intermediate ≈ 9–10 hidden widths
at the Qwen3.5 shapes), the GDN projections with their fp32 upcasts (≈ 6), the residual stream, norms
and attention projections (≈ 6), rounded up.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace

import torch

from bole.cache.kv_cache import PagedKVCache, blocks_needed
from bole.cache.state_pool import StatePool
from bole.models.context import TreeFactors
from bole.spec.budget import engine_verify_rows, floor_drafts, verify_rows_floor
from bole.spec.drafter import tree_size

logger = logging.getLogger(__name__)

GiB = 1 << 30
ACTIVATION_WIDTHS = 24            # hidden widths of live activations per batched token (module docstring)
LOGITS_FP32_COPIES = 2            # fp32 upcast + one fp32 working buffer per logits row
LOGITS_NATIVE_COPIES = 3          # lm_head output, its padded [B, 1 + T, V] copy, a graph's static output
GDN_CHUNK = 64                    # tokens per chunk of the chunked GDN prefill (one fp32 state per chunk)
WORKSPACE_BYTES = 1 * GiB
CHECKPOINT_SHARE = 0.1
KV_WORKING_SETS = 2               # planned KV: at most twice what max_num_seqs requests address at full length
CPU_NUM_BLOCKS, CPU_NUM_CHECKPOINT_SLOTS = 512, 32
CATEGORIES = ("kv", "state", "checkpoints", "factors", "snapshots", "activations", "logits", "workspace")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per category (``CATEGORIES``) and the counts they buy. ``budget`` is None on the CPU
    (nothing planned: the counts are the configured ones); ``max_num_seqs_fit`` the most running
    requests this budget holds with these tree settings (None on the CPU)."""

    kv: int
    state: int
    checkpoints: int
    factors: int
    snapshots: int
    activations: int
    logits: int
    workspace: int
    num_blocks: int
    num_state_slots: int
    num_checkpoint_slots: int
    device: str
    free: int | None = None
    total: int | None = None
    budget: int | None = None
    max_num_seqs_fit: int | None = None
    verify_rows: int | None = None   # the rows one verify forward holds (speculative modes; max_verify_rows)

    @property
    def planned(self) -> bool:
        return self.budget is not None

    def categories(self) -> dict[str, int]:
        """{category: bytes}: what /metrics reports as ``bole_memory_plan_bytes{category=...}``."""
        d = asdict(self)
        return {k: d[k] for k in CATEGORIES}

    @property
    def total_bytes(self) -> int:
        return sum(self.categories().values())

    def lines(self) -> list[str]:
        """One line per category, GiB (the engine logs them at start)."""
        head = (f"memory plan on {self.device}: {gib(self.budget)} GiB budget of {gib(self.free)} GiB free / "
                f"{gib(self.total)} GiB" if self.planned else
                f"memory plan on {self.device}: configured counts (no device budget)")
        counts = {"kv": f"{self.num_blocks} blocks", "state": f"{self.num_state_slots} slots",
                  "checkpoints": f"{self.num_checkpoint_slots} slots"}
        if self.verify_rows is not None:
            counts["factors"] = counts["logits"] = f"{self.verify_rows} verify rows"
        return [head] + [f"  {k:<12} {gib(v):>8} GiB" + (f"  ({counts[k]})" if k in counts else "")
                         for k, v in self.categories().items()]

    def resolve(self, config):
        """``config`` with the planned counts filled in (what the caches are built from)."""
        return replace(config, cache=replace(config.cache, num_blocks=self.num_blocks,
                                             num_checkpoint_slots=self.num_checkpoint_slots))


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.2f}"


@dataclass(frozen=True)
class _Unit:
    """Bytes of one of each thing the plan counts."""

    block: int       # one KV block, attention + drafter layers
    slot: int        # one GDN state slot (ssm + conv, every GDN layer)
    node: int        # one verify node's factors and conv inputs, every GDN layer
    snapshot: int    # one verify node's per-layer states (serial_tree only, else 0)
    ssm_layer: int   # one GDN layer's ssm state (a chunk state of the chunked prefill)


def _units(cfg, config, num_mtp_layers: int) -> _Unit:
    dtype = config.torch_dtype
    size = lambda t: t.numel() * t.element_size()
    kv = PagedKVCache(cfg.num_attn_layers + num_mtp_layers, 1, config.cache.block_size,
                      cfg.num_key_value_heads, cfg.head_dim, dtype, "meta")
    pool = StatePool.for_model(cfg, 1, conv_dtype=dtype, device="meta")
    per_node = TreeFactors.transient_bytes(cfg, 1, dtype)
    return _Unit(size(kv.kv), size(pool.ssm) + size(pool.conv), per_node["factors"] + per_node["conv_inputs"],
                 per_node["snapshots"] if config.mode == "serial_tree" else 0, size(pool.ssm) // cfg.num_gdn_layers)


def _fixed(cfg, config, u: _Unit, seqs: int, lookahead: int, spare: int) -> dict[str, int]:
    """Bytes that do not depend on the KV blocks, for ``seqs`` running requests."""
    T, dt, P = config.max_num_batched_tokens, config.torch_dtype.itemsize, cfg.max_position_embeddings
    nodes = engine_verify_rows(config, seqs, lookahead, check=False)   # EngineConfig.max_verify_rows
    # a captured prefill's forward runs over its whole token bucket, padding included (its transients sit
    # in the graphs' own pool): the largest bucket can exceed the step's token budget
    A = max(T, config.prefill_graph_tokens[-1]) if config.prefill_graphs else T
    gather = 2 * P * cfg.num_attention_heads * cfg.head_dim * dt + T * P  # K, V per query head; bool mask
    beside = config.prefills_beside_forward   # a prefill beside the step's forward
    return {
        "state": (seqs + 1 + spare) * u.slot,
        "factors": nodes * u.node,
        "snapshots": nodes * u.snapshot,
        "activations": (1 + beside) * (A * cfg.hidden_size * ACTIVATION_WIDTHS * dt + -(-A // GDN_CHUNK) * u.ssm_layer
                                       + gather),
        "logits": (nodes + T if beside else max(nodes, T)) * cfg.vocab_size
        * (LOGITS_NATIVE_COPIES * dt + LOGITS_FP32_COPIES * 4),
        "workspace": WORKSPACE_BYTES,
    }


def plan_memory(cfg, config, free: int | None = None, total: int | None = None,
                num_mtp_layers: int | None = None) -> MemoryPlan:
    """The plan for model shapes ``cfg`` (a ``ModelConfig``, this rank's heads) and ``config`` (an
    ``EngineConfig``) given the device's ``free`` / ``total`` bytes (None: the CPU, counts as
    configured). ``num_mtp_layers``: the drafter's layers that hold KV (default ``cfg``'s)."""
    cc = config.cache
    mtp = cfg.num_mtp_layers if num_mtp_layers is None else num_mtp_layers
    lookahead = 1 + (tree_size(cfg.vocab_size, config.spec.depth, config.spec.topk, config.spec.beam)
                     if config.mode != "ar" else 0)
    spare = int(config.enable_cuda_graphs and config.device.startswith("cuda"))
    u = _units(cfg, config, mtp)
    fixed = _fixed(cfg, config, u, config.max_num_seqs, lookahead, spare)
    common = dict(num_state_slots=config.max_num_seqs + 1 + spare, device=config.device, **fixed,
                  verify_rows=None if config.mode == "ar" else
                  engine_verify_rows(config, config.max_num_seqs, lookahead, check=False))
    ckpt_on = cc.enable_prefix_cache
    if free is None:
        blocks = cc.num_blocks or CPU_NUM_BLOCKS
        slots = cc.num_checkpoint_slots or CPU_NUM_CHECKPOINT_SLOTS
        return MemoryPlan(kv=(blocks + spare) * u.block, checkpoints=(slots + 1) * u.slot if ckpt_on else 0,
                          num_blocks=blocks, num_checkpoint_slots=slots, **common)
    budget = int(cc.gpu_memory_utilization * total) - (total - free)
    min_blocks = config.max_num_seqs * blocks_needed(1 + lookahead, cc.block_size)

    def need(seqs: int) -> int:   # the least a batch of ``seqs`` requests takes
        f = _fixed(cfg, config, u, seqs, lookahead, spare)
        return sum(f.values()) + (seqs * blocks_needed(1 + lookahead, cc.block_size) + spare) * u.block \
            + (2 * u.slot if ckpt_on else 0)   # one checkpoint slot and the scratch slot

    fit = _max_fit(need, budget)
    env = (f"{gib(budget)} GiB (gpu_memory_utilization={cc.gpu_memory_utilization} of {gib(total)} GiB, "
           f"{gib(total - free)} GiB in use)")
    if fit < config.max_num_seqs:
        spec = config.spec   # the fairness floor's rows: what max_verify_rows cannot go below
        floor = None if config.mode == "ar" else verify_rows_floor(
            config.max_num_seqs, lookahead, floor_drafts(spec.budget_floor, spec.topk))[0]
        raise ValueError(_refusal(config, fixed, need(config.max_num_seqs), fit, env, common["verify_rows"], floor))
    left = budget - sum(fixed.values()) - spare * u.block
    ckpt = lambda n: (n + 1) * u.slot if ckpt_on else 0   # n checkpoint slots and the scratch slot
    planned_slots = ckpt_on and cc.num_checkpoint_slots is None
    slots = max(1, int(CHECKPOINT_SHARE * left) // u.slot) if planned_slots else \
        cc.num_checkpoint_slots or CPU_NUM_CHECKPOINT_SLOTS
    if cc.num_blocks is not None:   # a count given wins, not capped, checked
        most = (left - ckpt(1 if planned_slots else slots)) // u.block
        if cc.num_blocks > most:
            raise ValueError(f"num_blocks={cc.num_blocks} needs {gib(cc.num_blocks * u.block)} GiB of KV cache; at "
                             f"most {max(most, 0)} blocks fit in {env} after the other buffers; lower num_blocks "
                             f"or leave it unset (planned)")
        blocks = cc.num_blocks
        if planned_slots:
            slots = max(1, min(slots, (left - blocks * u.block) // u.slot - 1))
    else:
        room = left - min_blocks * u.block   # what checkpoints may take at most
        if ckpt(slots) > room:   # only a given num_checkpoint_slots can: ``fit`` counted one slot
            raise ValueError(f"num_checkpoint_slots={slots} leaves fewer KV blocks than the {min_blocks} that "
                             f"max_num_seqs={config.max_num_seqs} trees need, in {env}; at most "
                             f"{max(room // u.slot - 1, 0)} checkpoint slots fit; lower num_checkpoint_slots")
        # no more than the batch can address at the longest position, KV_WORKING_SETS times over
        blocks = min((left - ckpt(slots)) // u.block, KV_WORKING_SETS * config.max_num_seqs *
                     blocks_needed(cfg.max_position_embeddings + lookahead, cc.block_size))
    if planned_slots:  # at most one per checkpoint boundary
        slots = max(1, min(slots, blocks // cc.checkpoint_interval_blocks))
    return MemoryPlan(kv=(blocks + spare) * u.block, checkpoints=(slots + 1) * u.slot if ckpt_on else 0,
                      num_blocks=blocks, num_checkpoint_slots=slots, free=free, total=total, budget=budget,
                      max_num_seqs_fit=fit, **common)


def _max_fit(need, budget: int, limit: int = 1 << 16) -> int:
    """The largest s in [0, limit] with need(s) <= budget (need is increasing): bisection."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid - 1)
    return lo


def _refusal(config, fixed: dict[str, int], needed: int, fit: int, env: str, rows: int | None,
             floor_rows: int | None) -> str:
    spec, s = config.spec, config.max_num_seqs
    big = max(("snapshots", "factors", "logits", "state"), key=fixed.get)
    ar = config.mode == "ar"
    # ar's widest lm_head call is a prefill's: every row of its chunk, for a request with prompt logprobs
    what = {"snapshots": "per-node snapshot buffers", "factors": "verify factor buffers",
            "logits": "prefill logits" if ar else "verify logits", "state": "GDN state slots"}[big]
    hint = "lower max_num_seqs"
    if not ar:
        hint += f" or the tree nodes (depth={spec.depth}, topk={spec.topk}, beam={spec.beam})"
    T = config.max_num_batched_tokens
    if big == "logits" and (ar or rows <= T):   # the logits are sized by the larger of the two
        hint += (f", or lower max_num_batched_tokens (now {T}: the widest lm_head call, a prefill's"
                 + ("" if ar else " or a verify's") + ")")
    elif not ar and big in ("logits", "factors") and rows > floor_rows:
        hint += f", or lower the rows one verify forward holds (max_verify_rows; now {rows}, at least {floor_rows})"
    if config.mode == "serial_tree":
        hint += " or use mode='bole' (no per-node snapshots, docs/DESIGN.md §4)"
    return (f"max_num_seqs={s} with {config.mode} needs {gib(needed)} GiB ({gib(fixed[big])} GiB of {what}, the "
            f"rest KV blocks for one tree per request, activations and workspace); at most {fit} fit in {env}; "
            f"{hint}, or raise gpu_memory_utilization")


def device_memory(device, tp_size: int = 1) -> tuple[int | None, int | None]:
    """(free, total) bytes of a CUDA device, read once (after the weights are loaded); (None, None) on
    the CPU. Under tensor parallelism every rank plans with the least free memory of any rank, so all
    ranks build the same counts and schedule alike (``bole.parallel``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    import torch.distributed as dist

    if tp_size > 1 and dist.is_available() and dist.is_initialized():
        t = torch.tensor([free, total], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        free, total = int(t[0]), int(t[1])
    return free, total


def plan_engine_memory(model, config):
    """The engine's hook: measure, plan, log; returns (plan, config with the planned counts)."""
    cfg = getattr(model, "local_config", model.config)
    mtp = len(model.mtp.layers) if getattr(model, "mtp", None) is not None else 0
    plan = plan_memory(cfg, config, *device_memory(config.device, config.tp_size), num_mtp_layers=mtp)
    for line in plan.lines():
        logger.info(line)
    return plan, plan.resolve(config)
