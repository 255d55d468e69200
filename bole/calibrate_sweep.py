"""The calibration sweep's measurements (Algorithm 3): the plan, synthetic batches, timed forwards.

Buckets c = (batch, kv, depth) come from the listed points of each axis: a point is the *upper edge*
of its bucket (points 1,4,16 give batch buckets [1,1], [2,4], [5,16]; look-ups past the last point
clamp to it) and every bucket is measured at its upper edges. At each point the sweep times, with
the engine's own ``ModelRunner`` on the engine's model:
  T_dec(c)    ``runner.decode`` of B requests (one token each), and
  T_ver(N|c)  ``runner.verify`` of a forest of B trees holding N draft nodes in all (split evenly,
              shapes from ``random_tree``, depth <= d-1 under each request's root node, so the
              forest has N + B nodes: exactly what the engine verifies when the budget is N),
for every capacity N of the capture set G, as medians over interleaved rounds (CUDA events after a
synchronize on the GPU, perf_counter on the CPU), after warm-up. The sweep gets its own runner
(own KV cache and state pool, sharing the weights): its B dummy requests hold blocks and slots
whose contents are filled directly with random values instead of being prefilled, because the
forwards' cost depends on the lengths, not on the cached values. The forwards run eagerly, or with
``cuda_graphs`` replayed from CUDA graphs as the engine serves them with ``enable_cuda_graphs``
(``provenance.execution`` says which); the tables are then built by ``bole.calibrate_table``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from bole.cache.kv_cache import blocks_needed
from bole.calibrate_model import split_nodes
from bole.config import ModelConfig
from bole.engine.runner import ModelRunner
from bole.engine.sequence import Request
from bole.models.qwen3_5 import HybridForCausalLM
from bole.sampling_params import SamplingParams
from bole.spec.drafter import DraftBatch
from bole.spec.tree import feasible_capacities, random_tree, tree_widths


@dataclass(frozen=True)
class SweepPlan:
    """Bucket points per axis (upper edges), the capture set G, ε and the timing repetitions."""

    batch_points: tuple[int, ...] = (1, 2, 4, 8, 16)
    kv_points: tuple[int, ...] = (512, 2048, 8192)
    depth_points: tuple[int, ...] = (5,)              # tree depth with the root: SpecConfig.depth + 1
    capture_set: tuple[int, ...] = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    epsilon: float = 0.1
    warmup: int = 2
    iters: int = 7
    seed: int = 0

    def __post_init__(self):
        for name, lowest in (("batch_points", 1), ("kv_points", 0), ("depth_points", 2), ("capture_set", 1)):
            pts = tuple(int(p) for p in getattr(self, name))
            if not pts or list(pts) != sorted(set(pts)) or pts[0] < lowest:
                raise ValueError(f"{name} must be a strictly increasing list of ints >= {lowest}, got {pts}")
            object.__setattr__(self, name, pts)
        if self.warmup < 0 or self.iters < 1 or not self.epsilon >= 0:
            raise ValueError(f"need warmup >= 0, iters >= 1, epsilon >= 0 (got {self.warmup}, {self.iters}, "
                             f"{self.epsilon})")

    def points(self) -> list[tuple[int, int, int]]:
        return list(itertools.product(self.batch_points, self.kv_points, self.depth_points))

    def ranges(self, batch: int, kv: int, depth: int) -> dict:
        """The bucket whose upper edges are this point."""
        out = {}
        for axis, pts, lowest, p in (("batch", self.batch_points, 1, batch), ("kv", self.kv_points, 0, kv),
                                     ("depth", self.depth_points, 1, depth)):
            i = pts.index(p)
            out[axis] = [lowest if i == 0 else pts[i - 1] + 1, p]
        return out


QUICK_PLAN = SweepPlan(batch_points=(1, 4, 16), kv_points=(1024, 8192), capture_set=(8, 16, 32, 64, 128, 256),
                       warmup=1, iters=4)

# Real Qwen3.5 shapes (DESIGN.md §5) for random-weight sweeps; vocabulary of the Qwen3.5 tokenizer.
_QWEN35 = dict(model_type="qwen3_5_text", vocab_size=248320, rope_theta=10_000_000.0,
               partial_rotary_factor=0.25, attention_bias=False, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, gdn_layout="split", head_dim=256,
               num_mtp_layers=0, dtype="bfloat16")
SHAPES = {
    # Qwen3.5-4B: layers, hidden, attention heads, FFN width as public Megatron launch scripts and model
    # cards give them (32 x 2560, 16 q / 4 kv heads of 256, FFN 9216); GDN heads as the 9B's (16 key /
    # 32 value heads of 128: the "GVA" layout GGUF loaders name for the 4B and 9B alike).
    "qwen3.5-4b": dict(hidden_size=2560, num_hidden_layers=32, linear_num_key_heads=16,
                       linear_num_value_heads=32, num_attention_heads=16, num_key_value_heads=4,
                       intermediate_size=9216),
    "qwen3.5-9b": dict(hidden_size=4096, num_hidden_layers=32, linear_num_key_heads=16,
                       linear_num_value_heads=32, num_attention_heads=16, num_key_value_heads=4,
                       intermediate_size=12288),
    "qwen3.5-27b": dict(hidden_size=5120, num_hidden_layers=64, linear_num_key_heads=16,
                        linear_num_value_heads=48, num_attention_heads=24, num_key_value_heads=4,
                        intermediate_size=17408),
    # Qwen3.5-35B-A3B (the MoE shape that fits one H200: ~70 GB in bf16): 40 layers x 2048, 16 q / 2 kv
    # attention heads of 256, GDN 16 key / 32 value heads of 128, every layer MoE (256 experts of 512, top 8,
    # a gated shared expert of 512), as public Megatron launch scripts give it.
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                            linear_num_key_heads=16, linear_num_value_heads=32, num_attention_heads=16,
                            num_key_value_heads=2, intermediate_size=None, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512),
}
DENSE_SHAPES = tuple(n for n, s in SHAPES.items() if not s.get("num_experts"))


def shapes_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shapes {name!r}; known: {sorted(SHAPES)}")
    s = SHAPES[name]
    layer_types = tuple("full_attention" if i % 4 == 3 else "linear_attention"   # 3 GDN : 1 attention
                        for i in range(s["num_hidden_layers"]))
    return ModelConfig(layer_types=layer_types, **{**_QWEN35, **s})  # an entry may set its own vocab_size


def random_model(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 0):
    """HybridForCausalLM with random weights (timing only: values do not change the cost)."""
    with torch.device("meta"):
        model = HybridForCausalLM(cfg, num_mtp_layers=0, device=device)
    model = model.to(dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:  # zero-centred norms, A_log = 0, dt_bias = 1 (the layers' own initial values)
                p.fill_(1.0 if name.endswith("dt_bias") else 0.0)
    return model.eval().fuse_projections()


def time_ms(fns: dict, warmup: int, iters: int, device: torch.device, tick=lambda: None) -> dict:
    """{key: [ms per call]}: warm-up, then ``iters`` rounds calling every fn once (interleaved)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
            tick()
    out = {k: [] for k in fns}
    cuda = device.type == "cuda"
    for _ in range(iters):
        for k, fn in fns.items():
            if cuda:
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                out[k].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                out[k].append((time.perf_counter() - t0) * 1e3)
            tick()
    return out


def synthetic_batch(num_drafts: int, batch: int, depth: int, vocab: int, gen: torch.Generator,
                    device, roots: Sequence[int]) -> DraftBatch:
    """N drafts split evenly over B requests as random EAGLE-like trees of depth <= depth - 1, below
    the roots ``roots[b]`` (node 0, the requests' pending tokens)."""
    shares = [t - 1 for t in split_nodes(num_drafts, batch)]
    T = 1 + max(shares)
    tokens = torch.full((batch, T), -1, dtype=torch.long)
    parents = torch.full((batch, T), -1, dtype=torch.long)
    depths = torch.zeros(batch, T, dtype=torch.long)
    tokens[:, 0] = torch.as_tensor(list(roots), dtype=torch.long)
    for b, n in enumerate(shares):
        if n:
            tree = random_tree(n, depth - 1, generator=gen)
            # the drafts are nodes 1..n: a draft tree's root children hang below node 0
            parents[b, 1:n + 1] = torch.tensor([p + 1 for p in tree.parents])
            depths[b, 1:n + 1] = torch.tensor(tree.depths)
            tokens[b, 1:n + 1] = torch.randint(vocab, (n,), generator=gen)
    valid = tokens >= 0
    drafts = valid & (torch.arange(T) > 0)
    return DraftBatch(tokens=tokens.to(device), parents=parents.to(device), depth=depths.to(device),
                      rho=torch.where(valid, 0.0, float("-inf")).to(device),
                      source_index=torch.where(drafts, torch.arange(T).expand(batch, T) - 1, -1).to(device),
                      num_nodes=torch.tensor([n + 1 for n in shares], device=device))


def _dummy_requests(runner: ModelRunner, batch: int, kv: int, max_nodes: int, vocab: int,
                    gen: torch.Generator) -> list[Request]:
    """B decoding requests with kv committed tokens, holding blocks for kv + their tree and a state slot."""
    reqs = []
    for b in range(batch):
        prompt = torch.randint(vocab, (kv + 1,), generator=gen).tolist()
        r = Request(f"calib-{b}", prompt, SamplingParams(), seed=0)
        # verify writes the tree's K/V at kv + local index: up to 1 + ceil(N / B) positions past kv
        need = blocks_needed(kv + 3 + max_nodes // batch, runner.block_size)
        r.block_table = runner.allocator.allocate(need)
        r.state_slot = runner.state_pool.allocate()
        r.num_computed, r.prefilled = kv, True
        reqs.append(r)
    slots = torch.tensor([r.state_slot for r in reqs], device=runner.device)
    pool = runner.state_pool
    with torch.no_grad():  # allocate() zeroed the slots: give them state-like random contents
        pool.ssm[:, slots] = 0.05 * torch.randn_like(pool.ssm[:, slots])
        pool.conv[:, slots] = torch.randn_like(pool.conv[:, slots])
    return reqs


def _point_fns(runner: ModelRunner, reqs: list[Request], kv: int, depth: int, capture_set,
               gen: torch.Generator) -> dict:
    """{"dec": decode step, N: verify of an N-draft forest} for one bucket point."""
    def decode():
        runner.decode(reqs, keep_hidden=False)
        for r in reqs:  # decode advanced the requests: rewind (their KV entry is simply rewritten)
            r.num_computed = kv

    fns = {"dec": decode}
    for n in feasible_capacities(capture_set, len(reqs)):  # a tree never exceeds MAX_TREE_NODES
        batch = synthetic_batch(n, len(reqs), depth, runner.cfg.vocab_size, gen, runner.device,
                                [r.all_token_ids[r.num_computed] for r in reqs])
        fns[n] = (lambda batch=batch: runner.verify(reqs, batch))
    return fns


def graph_widths(plan: SweepPlan) -> list[int]:
    """The tree widths (nodes per request, root included) graphed verify forwards are captured for: the
    engine's ``tree_widths`` up to the widest tree the sweep verifies (a tree is padded up to one)."""
    return tree_widths(max(1 + -(-n // b) for b in plan.batch_points
                           for n in feasible_capacities(plan.capture_set, b)))


def _runner(model, plan: SweepPlan, device: torch.device, dtype: torch.dtype, cuda_graphs: bool) -> ModelRunner:
    """The sweep's own runner. With ``cuda_graphs`` its decode and verify run through the runner's
    graphs (one family per batch point; captured on CUDA, the same static forwards uncaptured on the
    CPU), with one more KV block and state slot for their padding rows and a factor buffer for trees
    padded to the captured widths."""
    max_b, max_n, bs = max(plan.batch_points), max(plan.capture_set), 16
    per_req = blocks_needed(max(plan.kv_points) + max_n + 3, bs)
    spare = int(cuda_graphs)
    nodes = max_b * graph_widths(plan)[-1] if cuda_graphs else max_n + max_b
    runner = ModelRunner(model, max_b * per_req + spare, bs, max_b + spare, nodes, dtype, device)
    if cuda_graphs:
        runner.enable_cuda_graphs(plan.batch_points, capture=device.type == "cuda")
    return runner


def measure(model, plan: SweepPlan, device, dtype: torch.dtype, progress: bool = True,
            cuda_graphs: bool = False) -> list[dict]:
    """Time T_dec and T_ver(N) at every plan point; returns one raw record per point. ``cuda_graphs``:
    the forwards as the engine runs them with ``enable_cuda_graphs`` (decode and verify replayed from
    graphs, each captured by its first warm-up call, so at least one warm-up call runs)."""
    from tqdm import tqdm

    device = torch.device(device)
    runner = _runner(model, plan, device, dtype, cuda_graphs)
    verify_graphs = {}  # depth -> VerifyGraphs: a family has one depth bound, the drafter's depth + 1
    warmup = max(plan.warmup, int(cuda_graphs))
    gen = torch.Generator().manual_seed(plan.seed)
    with torch.no_grad():
        runner.kv_cache.kv.normal_(0.0, 1.0)
    records = []
    calls = len(plan.points()) * (1 + len(plan.capture_set)) * (warmup + plan.iters)
    bar = tqdm(total=calls, desc="calibrate", unit="fwd", disable=not progress)
    for B, kv, d in plan.points():
        if cuda_graphs:
            if d not in verify_graphs:
                verify_graphs[d] = runner.enable_verify_graphs(plan.batch_points, graph_widths(plan), d, tail=False,
                                                               capture=device.type == "cuda")
            runner.verify_graphs = verify_graphs[d]
        reqs = _dummy_requests(runner, B, kv, max(plan.capture_set), model.config.vocab_size, gen)
        fns = _point_fns(runner, reqs, kv, d, plan.capture_set, gen)
        samples = time_ms(fns, warmup, plan.iters, device, tick=lambda: bar.update(1))
        for r in reqs:
            runner.allocator.free(r.block_table)
            runner.state_pool.free(r.state_slot)
        records.append({"at": [B, kv, d], "dec": samples.pop("dec"), "ver": samples})
    bar.close()
    return records
