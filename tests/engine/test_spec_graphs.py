"""CUDA graphs of the speculative step (bole.engine.graphs.verify and .draft): verification and the MTP draft.

CPU: the static verify forward the graphs capture (batch padded to Bc rows, trees padded to Tc nodes
with extra root children, KV length bucketed, the forest laid out on the device) run uncaptured gives
the eager verify's logits, and the commit after it leaves the same GDN state, conv windows and K/V;
the static draft (catch-up chain + tree expansion over static forests) gives the eager draft's
candidates over two steps; the engine's speculative modes emit ar's greedy tokens through both,
prefix cache on and off. GPU (``gpu`` mark): the same with real capture and replay.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re

import pytest
import torch
from checkpoints import make_checkpoint, write_token_frequencies
from engine_helpers import default_table, meta_model, run_arrivals, uncaptured_spec_graphs

from bole.backend import resolve_backend, tree_acceptance
from bole.cache.kv_cache import PagedKVCache, blocks_needed
from bole.calibrate_sweep import synthetic_batch
from bole.config import EngineConfig
from bole.engine.drafting import empty_factors
from bole.engine.engine import LLMEngine
from bole.engine.graphs.base import graphs_unsupported
from bole.engine.runner import ModelRunner
from bole.engine.sequence import Request
from bole.layers.attention import GatedAttention
from bole.models.context import ForwardContext
from bole.models.loader import load_model
from bole.ops.moe import moe_experts_ref
from bole.sampling_params import SamplingParams
from bole.spec.budget import width_cap
from bole.spec.drafter import tree_size
from bole.spec.tree import MAX_TREE_NODES, PackedForest, random_tree, tree_widths

PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15], [3] * 14, [5, 1, 6, 2, 8]]
DEPTH = 4  # tree depth bound with the root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("vgraphs_dense")
    make_checkpoint(path, "dense", 64)
    write_token_frequencies(path, 64)  # for draft_vocab
    return str(path)



def _requests(runner: ModelRunner, prompts, keep_hidden: bool = False) -> list[Request]:
    reqs = []
    for i, p in enumerate(prompts):
        r = Request(f"r{i}", list(p), SamplingParams(), seed=0)
        r.block_table = runner.allocator.allocate(blocks_needed(len(p) + 64, runner.block_size))
        r.state_slot = runner.state_pool.allocate()
        reqs.append(r)
    runner.prefill([(r, len(r.prompt_token_ids) - 1) for r in reqs], keep_hidden=keep_hidden)
    return reqs


def test_tree_widths():
    assert tree_widths(53) == [8, 16, 32, 53]
    assert tree_widths(16) == [8, 16]
    assert tree_widths(4) == [4]


def test_full_padded_forest_matches_from_padded():
    gen = torch.Generator().manual_seed(3)
    B, T, D = 3, 12, 6
    parents = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        parents[b] = torch.tensor(random_tree(T, D, generator=gen).parents)
    ref = PackedForest.from_padded(parents, torch.full((B,), T), D)
    out = PackedForest.full_padded(parents, D)
    for f in ("cu_seqlens", "parents", "depth", "anc", "anc_bits", "request_ids"):
        assert torch.equal(getattr(out, f), getattr(ref, f)), f
    # in place over static buffers
    blank = PackedForest.full_padded(torch.full((B, T), -1), D)
    assert PackedForest.full_padded(parents, D, out=blank) is blank
    assert torch.equal(blank.anc, ref.anc) and torch.equal(blank.depth, ref.depth)


def _roots(reqs) -> list[int]:
    """The requests' pending root tokens (node 0 of their trees)."""
    return [r.all_token_ids[r.num_computed] for r in reqs]


def _commit(runner: ModelRunner, reqs, res, nodes: list[int]) -> list[int]:
    """Commit each request's path to ``nodes[b]`` (a chosen node, not an accepted one) after ``res``
    and advance the request as a step does: path lengths."""
    local = list(nodes) + [-1] * (res.forest.num_requests - len(reqs))  # a graph's padding rows: nothing
    lengths = runner.model.commit(res.ctx, local)
    paths = res.forest.accepted_path_nodes(local)
    for b, r in enumerate(reqs):
        r.queue_hidden(res.hidden[paths[b, :lengths[b]].long()])
        r.num_computed += lengths[b]
    return lengths[:len(reqs)]


def _assert_same_commits(eager, graph, re, rg, tol, device):
    """Two runners' requests after the same commits: GDN state, conv windows, layer-0 K/V of every
    committed position and the drafter's pending hiddens agree within tol."""
    assert [r.num_computed for r in re] == [r.num_computed for r in rg]
    for a, b in zip(re, rg, strict=True):
        for pa, pb in ((eager.state_pool.ssm, graph.state_pool.ssm),
                       (eager.state_pool.conv, graph.state_pool.conv)):
            assert float((pa[:, a.state_slot] - pb[:, b.state_slot]).abs().max()) <= tol
        sa = eager.kv_cache.slots_for(a.block_table, torch.arange(a.num_computed)).to(device)
        sb = graph.kv_cache.slots_for(b.block_table, torch.arange(b.num_computed)).to(device)
        assert float((eager.kv_cache.gather(0, sa)[0] - graph.kv_cache.gather(0, sb)[0]).abs().max()) <= tol
        assert float((a.pending_hidden - b.pending_hidden).abs().max()) <= tol


def _compare_verify(path, device, capture, tol):
    """The same drafts verified and committed by an eager runner and a graph runner (same model)."""
    model = load_model(path, dtype="float32", device=device)
    kw = dict(num_blocks=128, block_size=4, num_state_slots=6, max_batch_nodes=4 * 16,
              kv_dtype=torch.float32, device=device)
    eager, graph = ModelRunner(model, **kw), ModelRunner(model, **kw)
    vg = graph.enable_verify_graphs((1, 2, 4), (8, 16), DEPTH, capture=capture, min_kv=8)
    gen = torch.Generator().manual_seed(0)
    for batch_prompts, drafts in ((PROMPTS[:1], 6), (PROMPTS[:3], 20), (PROMPTS, 33)):
        B = len(batch_prompts)
        re, rg = _requests(eager, batch_prompts), _requests(graph, batch_prompts)
        batch = synthetic_batch(drafts, B, DEPTH, 64, gen, device, _roots(re))
        T = batch.tokens.shape[1]
        assert vg.supports(rg, T)
        r1, r2 = eager.verify(re, batch), graph.verify(rg, batch)
        assert r2.logits.shape == r1.logits.shape == (B, T, 64)
        valid = batch.tokens >= 0  # the root and the drafts
        assert valid[:, 0].all()
        err = float((r2.logits - r1.logits)[valid].abs().max())
        assert err <= tol, (B, err)
        # commit the deepest node of each tree (a different path length per request)
        deepest = [int(torch.argmax(torch.where(batch.tokens[b] >= 0, batch.depth[b], -1))) for b in range(B)]
        l1 = _commit(eager, re, r1, deepest)
        l2 = _commit(graph, rg, r2, deepest)
        assert l1 == l2
        _assert_same_commits(eager, graph, re, rg, tol, device)
        for runner, reqs in ((eager, re), (graph, rg)):
            for r in reqs:
                runner.allocator.free(r.block_table)
                runner.state_pool.free(r.state_slot)
    assert {k[0] for k in vg.graphs} == {1, 4} and {k[1] for k in vg.graphs} >= {8, 16}
    return vg


def test_static_verify_matches_eager_cpu(ckpt):
    vg = _compare_verify(ckpt, "cpu", capture=False, tol=1e-4)
    assert vg.num_captured == 0 and vg.replays == 3


def test_static_verify_reads_nothing_on_the_host():
    """The static verify forward runs on the meta device, where any host read of a device value
    raises. The GDN tree verifier is stubbed there (its torch twin loops over requests on the host;
    the Triton kernel's launch takes shapes and pointers only, and is captured in the GPU test)."""
    model = meta_model()

    def stub(q, k, v, g, beta, forest, initial_state, state_indices=None, scale=None, use_qk_l2norm=False,
             u_out=None, logp_out=None):
        N, HV, V = v.shape[1], v.shape[2], v.shape[3]
        return torch.empty_like(v), v.new_empty(N, HV, V), v.new_empty(N, HV)

    backend = dataclasses.replace(model.backend, tree_verify=stub)
    for m in model.modules():
        if hasattr(m, "backend"):
            m.backend = backend
    runner = ModelRunner(model, 16, 4, 4, 32, torch.float32, "meta")
    vg = runner.enable_verify_graphs((1, 2, 4), (8,), DEPTH, capture=False, min_kv=8)
    reqs = []
    for i in range(3):
        r = Request(f"r{i}", [1, 2, 3, 4, 5 + i], SamplingParams(), seed=0)
        r.block_table, r.state_slot, r.num_computed = runner.allocator.allocate(3), runner.state_pool.allocate(), 4
        reqs.append(r)
    batch = synthetic_batch(9, 3, DEPTH, 64, torch.Generator().manual_seed(0), "cpu", _roots(reqs))
    batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to("meta")
                                          for f in dataclasses.fields(batch) if getattr(batch, f.name) is not None})
    logits, hidden, ctx, _ = vg.run(reqs, batch)
    assert logits.shape == (3, batch.tokens.shape[1], 64) and logits.device.type == "meta"
    assert hidden.shape == (4 * 8, 32) and ctx.forest.num_requests == 4


def _compare_draft(path, device, capture, tol, tree_attention=None, draft_vocab=None, cap=127, floor="children",
                   depth=3):
    """Two draft + verify + commit steps of the same requests on an eager runner and a draft-graph
    runner: the selected, compacted drafts agree (tokens, parents, depths, sources and counts
    exactly; log-probabilities within tol), with a budget that keeps everything, then one that cuts.
    ``tree_attention``: the graph runner's drafter attends through it (its own model copy), the eager
    one through the batched SDPA path. ``draft_vocab``: both drafters score only these token ids, and
    every draft is one of them. ``cap``: drafts kept per request at most (the graph's is a per-step input;
    the depth-1 floor is kept past it). ``floor``: the budget's fairness floor, a graph family's setting."""
    model = load_model(path, dtype="float32", device=device)
    model.mtp.restrict_vocab(draft_vocab)
    D, k, beam = depth, 3, 2
    kw = dict(num_blocks=128, block_size=4, num_state_slots=6, max_batch_nodes=4 * 32,
              kv_dtype=torch.float32, device=device)
    graph_model = model
    if tree_attention is not None:
        graph_model = load_model(path, dtype="float32", device=device)
        for m in graph_model.mtp.modules():
            if isinstance(m, GatedAttention):
                m.tree_attention = tree_attention
    eager, graph = ModelRunner(model, **kw), ModelRunner(graph_model, **kw)
    dg = graph.enable_draft_graphs((1, 2, 4), D, k, beam, capture=capture, min_kv=8, max_per_request=127,
                                   floor=floor)
    for batch_prompts in (PROMPTS[:1], PROMPTS[:3]):
        re, rg = _requests(eager, batch_prompts, True), _requests(graph, batch_prompts, True)
        # everything, a cut, and a cut 5 nodes past the depth-1 floor (k per request; a graph's padding
        # rows must take none of those 5)
        for step, b_ver in enumerate((100, 2 * len(batch_prompts) + 3, k * len(batch_prompts) + 5)):
            # after the prefill the catch-up is the prompt (> depth + 1 for the longer ones: eager)
            assert dg.supports(rg) == (step > 0 or len(batch_prompts) == 1)
            d1 = eager.draft_batch(re, D, k, beam, b_ver, max_per_request=cap, floor=floor)
            d2 = graph.draft_batch(rg, D, k, beam, b_ver, max_per_request=cap, floor=floor)
            for f in ("tokens", "parents", "depth", "source_index", "num_nodes"):
                assert torch.equal(getattr(d1, f), getattr(d2, f)), (step, f)
            assert float((d1.rho - d2.rho).nan_to_num(0, 0, 0).abs().max()) <= tol
            assert [(r.mtp_computed, r.pending_hidden) for r in re] == [(r.num_computed, None) for r in rg]
            # T_max = 3 + 6 (D - 1) drafts (15 at D = 3), and each tree's root
            floor_size = k if floor == "children" else 1
            per_request = min(3 + 6 * (D - 1), max(cap, floor_size))
            kept = max(min(b_ver, per_request * len(batch_prompts)), floor_size * len(batch_prompts))
            assert int(d2.num_nodes.sum()) == kept + len(batch_prompts)
            assert int(d2.num_nodes.max()) <= per_request + 1
            assert d1.tokens[:, 0].tolist() == _roots(re) and (d1.parents[:, 0] == -1).all()
            if draft_vocab is not None:
                drafts = d2.tokens[:, 1:][d2.tokens[:, 1:] >= 0]
                assert drafts.numel() and torch.isin(drafts, torch.tensor(draft_vocab)).all()
            # verify the kept drafts, commit each request's deepest node (paths of different lengths)
            for runner, reqs, d in ((eager, re, d1), (graph, rg, d2)):
                batch = d.trimmed()
                res = runner.verify(reqs, batch)
                deepest = [int(torch.argmax(batch.depth[b])) for b in range(len(reqs))]
                _commit(runner, reqs, res, deepest)
                for r in reqs:  # the emitted tokens (any, the same in both runners) up to the new root
                    for _ in range(r.num_computed + 1 - r.num_tokens):
                        r.append_token(7)
        for runner, reqs in ((eager, re), (graph, rg)):
            for r in reqs:
                runner.allocator.free(r.block_table)
                runner.state_pool.free(r.state_slot)
    assert {key[0] for key in dg.graphs} == {1, 4} and dg.replays == 6
    return dg


def test_static_draft_matches_eager_cpu(ckpt):
    dg = _compare_draft(ckpt, "cpu", capture=False, tol=1e-4)
    assert dg.num_captured == 0


def test_static_draft_with_a_cap_matches_eager_cpu(ckpt):
    # a per-request cap (cap_tree_width's) below the trees' size: the graph takes it per step, as eagerly;
    # below topk (3) the depth-1 floor is kept past it
    for cap in (4, 2):
        dg = _compare_draft(ckpt, "cpu", capture=False, tol=1e-4, cap=cap)
        assert dg.num_captured == 0 and dg.max_per_request == 127


def test_static_draft_best_child_floor_matches_eager_cpu(ckpt):
    # the best-child floor, with and without a cap: graph and eager drafts agree
    for cap in (127, 2):
        dg = _compare_draft(ckpt, "cpu", capture=False, tol=1e-4, cap=cap, floor="best_child")
        assert dg.floor == "best_child"


def test_static_draft_reduced_vocab_matches_eager_cpu(ckpt):
    # the drafter scoring 16 of the 64 ids (a scattered subset): eager and static drafts agree, and
    # draft only those ids (the graph's reduced lm_head and id gather are device ops at fixed shapes)
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:16].tolist()
    dg = _compare_draft(ckpt, "cpu", capture=False, tol=1e-4, draft_vocab=ids)
    assert dg.mtp.vocab_width == 16 and dg.num_captured == 0


def test_static_draft_tree_attention_kernel_cpu(ckpt):
    # the drafter's attention through kernels.tree_attention (interpreted) over the static forests
    # gives the eager SDPA path's drafts
    from kernels.tree_attention import tree_attention

    calls = []
    dg = _compare_draft(ckpt, "cpu", capture=False, tol=1e-4,
                        tree_attention=lambda *a, **kw: (calls.append(1), tree_attention(*a, **kw))[1])
    assert dg.num_captured == 0 and len(calls) == 6 * 3  # 6 drafts: the catch-up chain, 2 tree levels


def _engine(path, device, mode, graphs: bool, **opts):
    opts.setdefault("calibration_table", default_table())
    cfg = EngineConfig.from_options(mode=mode, num_blocks=128, block_size=4,
                                    max_num_seqs=4, device=device, enable_cuda_graphs=graphs,
                                    cuda_graph_batch_sizes=(1, 2, 4), depth=3, topk=3, beam=3, **opts)
    return LLMEngine(load_model(path, dtype="float32", device=device), cfg)


@pytest.mark.parametrize("mode,prefix_cache,layout_kernel,draft_vocab,cap,floor", [
    ("bole", True, False, None, False, "children"), ("bole", False, False, None, False, "children"),
    ("serial_tree", True, False, None, False, "children"), ("bole", True, True, None, False, "children"),
    ("bole", True, False, 16, False, "children"), ("bole", True, False, None, True, "best_child")])
def test_engine_static_verify_tokens_cpu(ckpt, mode, prefix_cache, layout_kernel, draft_vocab, cap, floor,
                                        tmp_path):
    max_tokens = [12, 5, 20, 9]
    ref = run_arrivals(_engine(ckpt, "cpu", "ar", False, enable_prefix_cache=False), PROMPTS, max_tokens)
    table = default_table()
    if cap:  # budgets small enough for the cap to bind (the default table's 64-256 exceed these trees)
        table = tmp_path / "small.yaml"
        table.write_text(re.sub(r"b_ver: *\d+", "b_ver: 8", open(default_table()).read()))
    eng = _engine(ckpt, "cpu", mode, False, enable_prefix_cache=prefix_cache, draft_vocab=draft_vocab,
                  cap_tree_width=cap, budget_floor=floor, calibration_table=str(table))
    if layout_kernel:  # forest layouts and the tail's acceptance by their kernels (interpreted), as on a GPU
        from kernels.greedy_accept import greedy_accept
        from kernels.tree_layout import tree_layout

        eng.model.backend = dataclasses.replace(eng.model.backend, tree_layout=tree_layout,
                                                greedy_accept=tree_acceptance(greedy_accept))
    assert eng.runner.verify_graphs is None  # the option is ignored on the CPU
    spec = eng.config.spec
    vg = eng.runner.enable_verify_graphs((1, 2, 4), tree_widths(eng.lookahead), spec.depth + 1,
                                         capture=False, min_kv=8)
    dg = eng.runner.enable_draft_graphs((1, 2, 4), spec.depth, spec.topk, spec.beam, capture=False, min_kv=8,
                                        max_per_request=MAX_TREE_NODES - 1, floor=spec.budget_floor)
    if prefix_cache:  # as the engine wires them when it builds the graphs itself
        vg.enable_checkpoints(eng.prefix_cache.checkpoints, eng.config.cache.checkpoint_interval,
                              eng.prefix_cache.scratch_slot)
    seen, draft_batch = [], eng.runner.draft_batch   # the options reach the drafts (tokens cannot show it)
    eng.runner.draft_batch = lambda reqs, *a, **kw: (seen.append((len(reqs), a[-1], kw)),
                                                     draft_batch(reqs, *a, **kw))[1]
    assert run_arrivals(eng, PROMPTS, max_tokens) == ref
    assert vg.replays > 0 and dg.replays > 0
    assert seen and all(kw["floor"] == floor for _, _, kw in seen)
    caps = [width_cap(int(b_ver), B, tree_widths(eng.lookahead), MAX_TREE_NODES - 1) if cap else MAX_TREE_NODES - 1
            for B, b_ver, _ in seen]
    assert [kw["max_per_request"] for _, _, kw in seen] == caps and (not cap or min(caps) < MAX_TREE_NODES - 1)
    # every greedy step accepts, commits and checkpoints in the verify graph's tail
    assert vg.tail_replays == vg.replays
    if prefix_cache:  # paths jumped over checkpoint boundaries, and the tail took those checkpoints
        assert eng.prefix_cache.num_checkpoints > 0


def test_engine_goodput_budget_tokens_cpu(ckpt, tmp_path):
    """budget_rule="goodput": every step's capacities and timings (the measured table's bucket) reach the
    draft, eagerly and through the static draft graph; the device chooses what to keep, and the step
    reports the capacity it chose; the greedy tokens stay ar's. A table without timings is refused at
    start, by name."""
    from bole.llm import resolve_repo_path
    from bole.spec.budget import CalibrationTable, goodput_costs, goodput_rows, select_b_ver

    max_tokens = [12, 5, 20, 9]
    ref = run_arrivals(_engine(ckpt, "cpu", "ar", False), PROMPTS, max_tokens)
    path = str(resolve_repo_path("calibration_tables/cpu-bole-tiny-coder.yaml"))
    table = CalibrationTable.load(path)
    # flat timings: every capacity costs the same, so the largest wins, above what these trees hold
    flat = table.to_dict()
    for b in flat["buckets"]:
        b["t_ver_ms"] = {n: 1.0 for n in b["t_ver_ms"]}
        b["b_ver"] = select_b_ver(b["t_ver_ms"], b["t_dec_ms"], flat["epsilon"])
    flat_path = tmp_path / "flat.yaml"
    CalibrationTable.from_dict(flat).dump(flat_path)
    for graph, tpath in ((False, path), (True, path), (True, str(flat_path))):
        eng = _engine(ckpt, "cpu", "bole", False, budget_rule="goodput", calibration_table=tpath)
        spec, tab = eng.config.spec, CalibrationTable.load(tpath)
        if graph:
            dg = eng.runner.enable_draft_graphs((1, 2, 4), spec.depth, spec.topk, spec.beam, capture=False,
                                                min_kv=8, max_per_request=MAX_TREE_NODES - 1,
                                                floor=spec.budget_floor, goodput=True)
        seen, draft_batch = [], eng.runner.draft_batch
        eng.runner.draft_batch = lambda reqs, *a, _seen=seen, _draft=draft_batch, **kw: (
            _seen.append((len(reqs), a[-1], kw["max_per_request"], kw["costs"])), _draft(reqs, *a, **kw))[1]
        steps, record = [], eng.metrics.record_step
        eng.metrics.record_step = lambda s, _steps=steps, _record=record: (
            _steps.append(s) if s.decode_requests else None, _record(s))[1]
        assert run_arrivals(eng, PROMPTS, max_tokens) == ref
        widths = eng.spec_step.widths   # each capacity with the width the calibration timed it at
        assert seen and all(costs == goodput_rows(goodput_costs(tab.buckets[tab.lookup(B, 0, spec.depth + 1)[0]]
                                                                .t_ver_ms), B, widths, cap, True)
                            and b_ver == costs[-1][0] for B, b_ver, cap, costs in seen)
        assert any(c[2] < cap for _, _, cap, costs in seen for c in costs)   # a per-capacity cap binds somewhere
        assert not graph or dg.replays > 0
        # each step reports the capacity the device chose (one of its bucket's), not the drafts it kept
        assert len(steps) == len(seen) and all(s.b_ver in [c[0] for c in costs]
                                               for s, (_, _, _, costs) in zip(steps, seen))
        drafts = [s.tree_nodes - s.decode_requests for s in steps]
        assert all(d <= max(s.b_ver, s.decode_requests * spec.topk) for d, s in zip(drafts, steps))
        snap = eng.metrics.snapshot()
        assert snap["mean_b_ver"] == sum(s.b_ver for s in steps) / len(steps)
        assert snap["budget_used"] == sum(min(d, s.b_ver) for d, s in zip(drafts, steps)) / sum(s.b_ver for s in steps)
        if tpath == path:   # the measured CPU table: its smallest capacity (8) pays best, and is filled
            assert {s.b_ver for s in steps} == {8} and snap["budget_used"] == 1.0
        else:   # flat: every draft kept, at the smallest capacity (ties) that holds them, rarely filled
            whole = tree_size(eng.model.mtp.vocab_width, spec.depth, spec.topk, spec.beam)
            assert all(d == s.decode_requests * whole
                       and s.b_ver == min(n for n, _, w in costs if n >= d and w >= whole)
                       for d, s, (_, _, _, costs) in zip(drafts, steps, seen))
            assert 0 < snap["budget_used"] < 0.9
    with pytest.raises(ValueError, match="default.*without timings.*goodput"):
        _engine(ckpt, "cpu", "bole", False, budget_rule="goodput")
    wide = table.to_dict()   # more capacities than a goodput cost row holds: refused at install, not mid-run
    for b in wide["buckets"]:
        b["t_ver_ms"] = {8 * (i + 1): 1.0 + i for i in range(17)}
        b["b_ver"] = select_b_ver(b["t_ver_ms"], b["t_dec_ms"], wide["epsilon"])
    wide["capture_set"] = sorted(wide["buckets"][0]["t_ver_ms"])
    with pytest.raises(ValueError, match="1 to 16 timed capacities"):
        eng.calibration = CalibrationTable.from_dict(wide)


def _multiturn(eng, turns: int = 3, max_tokens: int = 10) -> list[list[int]]:
    """Served-like arrivals: a conversation per PROMPTS entry, one starting every other step, each turn
    the previous prompt + its answer + the next prompt (so its head is a prefix-cache hit); every turn's
    output tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    live, outs, step = {}, {}, 0
    while step < 2 * len(PROMPTS) or live:
        if step % 2 == 0 and step // 2 < len(PROMPTS):
            c = step // 2
            live[eng.add_request(PROMPTS[c], params)] = (c, 0, PROMPTS[c])
        for o in eng.step():
            if o.finished:
                c, t, prompt = live.pop(o.request_id)
                outs[c, t] = o.output_token_ids
                if t + 1 < turns:
                    nxt = prompt + o.output_token_ids + PROMPTS[(c + t + 1) % len(PROMPTS)]
                    live[eng.add_request(nxt, params)] = (c, t + 1, nxt)
        step += 1
    return [outs[k] for k in sorted(outs)]


def test_multiturn_arrivals_stay_on_the_graph_path_cpu(ckpt):
    """The serving path's shape of work: requests arriving while others decode, and turns whose head is
    a prefix-cache hit (GDN checkpoints every 4-token block) with the rest prefilled. With the GPU's graph
    families built (uncaptured on the CPU: their static paths run), no decode step's draft, verify forward
    or acceptance leaves them (``EngineStats.eager_*``), and every turn's tokens equal ar's."""
    ref = _multiturn(_engine(ckpt, "cpu", "ar", False, enable_prefix_cache=False))
    eng = _engine(ckpt, "cpu", "bole", False)
    vg = uncaptured_spec_graphs(eng, (1, 2, 4), min_kv=8)
    assert _multiturn(eng) == ref
    s = eng.stats()
    assert s.decode_steps > 0 and s.prefix_hit_tokens > 0 and eng.prefix_cache.num_checkpoints > 0
    assert (s.eager_forwards, s.eager_drafts, s.eager_tails) == (0, 0, 0)
    assert vg.replays == vg.tail_replays == s.decode_steps


@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_graphs_captured_at_start_cover_the_run_cpu(ckpt, mode):
    """``capture_graphs(max_len)`` (the engine option ``cuda_graph_capture_len``) builds every key a step of
    <= max_num_seqs requests of <= max_len tokens needs: a run within that adds none, with ar's tokens. On
    the CPU the families run uncaptured; the option itself is then a no-op (no families)."""
    max_tokens = [12, 5, 20, 9]  # prompts of <= 14 tokens: <= 34 tokens a request
    ref = run_arrivals(_engine(ckpt, "cpu", "ar", False, enable_prefix_cache=False), PROMPTS, max_tokens)
    eng = _engine(ckpt, "cpu", mode, False, enable_prefix_cache=False)
    if mode == "ar":
        families = [eng.runner.enable_cuda_graphs((1, 2, 4), capture=False, min_kv=8)]
    else:
        spec = eng.config.spec
        families = [eng.runner.enable_verify_graphs((1, 2, 4), tree_widths(eng.lookahead), spec.depth + 1,
                                                    capture=False, min_kv=8),
                    eng.runner.enable_draft_graphs((1, 2, 4), spec.depth, spec.topk, spec.beam, capture=False,
                                                   min_kv=8, max_per_request=MAX_TREE_NODES - 1,
                                                   floor=spec.budget_floor)]
    n = eng.capture_graphs(34)
    keys = [set(f.graphs) for f in families]
    assert n == sum(len(k) for k in keys) > 0 and eng.capture_graphs(34) == 0
    assert run_arrivals(eng, PROMPTS, max_tokens) == ref
    assert [set(f.graphs) for f in families] == keys and all(f.replays > 0 for f in families)
    assert _engine(ckpt, "cpu", mode, True, cuda_graph_capture_len=64).runner.all_graphs() == []
    for bad in (0, -3, 2.5, True, "64"):
        with pytest.raises(ValueError, match="cuda_graph_capture_len"):
            _engine(ckpt, "cpu", mode, True, cuda_graph_capture_len=bad)


def test_graph_captures_counted_cpu(ckpt, monkeypatch):
    """``EngineStats.graph_captures`` / ``capture_time_s`` (``bole_engine_graph_captures`` /
    ``bole_engine_capture_seconds`` in /metrics) count every graph the families capture: at start
    (``capture_graphs``) and inside the steps that first need a key. The CPU has no CUDA graphs, so the
    capture is stood in for by a graph that replays the static forward it was given."""
    import bole.engine.graphs.base as base
    import bole.engine.graphs.verify as verify

    class Replays:
        def __init__(self, run):
            self.run = run

        def replay(self):
            self.run()

    for module in (base, verify):
        monkeypatch.setattr(module, "capture_graph", lambda run, pool, device, stream=None: Replays(run))
    max_tokens = [12, 5, 20, 9]
    ref = run_arrivals(_engine(ckpt, "cpu", "ar", False, enable_prefix_cache=False), PROMPTS, max_tokens)
    eng = _engine(ckpt, "cpu", "bole", False, enable_prefix_cache=False)
    spec = eng.config.spec
    families = [eng.runner.enable_verify_graphs((1, 2, 4), tree_widths(eng.lookahead), spec.depth + 1,
                                                capture=False, min_kv=8),
                eng.runner.enable_draft_graphs((1, 2, 4), spec.depth, spec.topk, spec.beam, capture=False,
                                               min_kv=8, max_per_request=MAX_TREE_NODES - 1, floor=spec.budget_floor)]
    for f in families:
        f.capturing, f.pool = True, "pool"
    assert (eng.stats().graph_captures, eng.stats().capture_time_s) == (0, 0.0)
    n = eng.capture_graphs(1)   # at start: the keys of steps whose requests hold one token
    start = eng.stats()
    assert start.graph_captures == n > 0 and start.capture_time_s > 0
    assert run_arrivals(eng, PROMPTS, max_tokens) == ref   # requests grow to 34 tokens: more keys, captured lazily
    end = eng.stats()
    assert end.graph_captures == sum(len(f.graphs) for f in families) > n
    assert end.capture_time_s > start.capture_time_s


def test_incremental_draft_levels_equal_whole_forest_cpu(ckpt, monkeypatch):
    """Each draft level runs only its new frontier (``ForwardContext.suffix``; the earlier nodes' K/V are
    in the drafter's cache from their own level): the drafts of the graph family's static forward equal an
    eager draft that re-runs the whole forest every level, tokens and trees exactly, log-probs within
    rounding, over steps that keep everything or cut."""
    import bole.engine.runner as runner_module
    from bole.engine.drafting import grow_draft_tree

    monkeypatch.setattr(runner_module, "grow_draft_tree", functools.partial(grow_draft_tree, incremental=False))
    _compare_draft(ckpt, "cpu", capture=False, tol=1e-5, depth=5)  # levels reading keys of two levels before


def test_forest_suffix_context():
    """``suffix`` keeps the keys and the mask columns, takes the rows (positions, KV slots, mask rows) of
    each request's last nodes, and moves num_cached past the earlier ones; it refuses unequal trees."""
    kv = PagedKVCache(1, 16, 4, 1, 8, dtype=torch.float32)
    tables = [kv.allocator.allocate(4), kv.allocator.allocate(4)]
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, -1, 1, 1, 0]])
    forest = PackedForest.from_padded(parents, torch.tensor([5, 5]), 4)
    ctx = ForwardContext.build("verify", None, [3, 6], [0, 1], tables, kv, None, forest=forest,
                               factors=empty_factors(10, "cpu"))
    sub = ctx.suffix(2)
    pa, spa = ctx.padded_attention(), sub.padded_attention()
    assert sub.cu_host == [0, 3, 6] and sub.num_cached_host == [5, 8] and sub.num_cached.tolist() == [5, 8]
    assert sub.positions.tolist() == ctx.positions.view(2, 5)[:, 2:].reshape(-1).tolist()
    assert sub.slot_mapping.tolist() == ctx.slot_mapping.view(2, 5)[:, 2:].reshape(-1).tolist()
    assert sub.kv_positions.tolist() == [5, 6, 7, 8, 9, 10] and sub.cu_seqlens.tolist() == [0, 3, 6]
    assert spa.rows.tolist() == list(range(6)) and sub.forest is None
    with pytest.raises(ValueError, match="no forest"):
        sub.tree_mask(0)
    assert torch.equal(spa.kv_index, pa.kv_index) and torch.equal(spa.mask, pa.mask[:, :, 2:]) and spa.tq == 3
    for bad in (5, -1):
        with pytest.raises(ValueError, match="suffix"):
            ctx.suffix(bad)
    uneven = PackedForest.from_padded(parents, torch.tensor([5, 3]), 4)
    ctx = ForwardContext.build("verify", None, [3, 6], [0, 1], tables, kv, None, forest=uneven,
                               factors=empty_factors(8, "cpu"))
    with pytest.raises(ValueError, match="equal trees"):
        ctx.suffix(1)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("vgraphs_moe")
    make_checkpoint(path, "moe", 64)
    return str(path)


def _moe_engine(path, device, mode, graphs: bool, kernel: bool, table: str | None = None):
    """An engine on the MoE checkpoint whose routed experts run through kernels.moe_experts (``kernel``) or
    the torch loop (bole.ops.moe, the torch backend's); the default table unless ``table``."""
    from kernels.moe_experts import moe_experts  # interpreted on the CPU (the torch backend's other ops)

    backend = dataclasses.replace(resolve_backend("auto", device), moe_experts=moe_experts if kernel else
                                  moe_experts_ref)
    cfg = EngineConfig.from_options(mode=mode, num_blocks=128, block_size=4, max_num_seqs=4, device=device,
                                    enable_cuda_graphs=graphs, cuda_graph_batch_sizes=(1, 2, 4), depth=3, topk=3,
                                    beam=3, calibration_table=table or default_table(), enable_prefix_cache=False)
    return LLMEngine(load_model(path, dtype="float32", device=device, backend=backend), cfg)


@pytest.mark.parametrize("mode", ["bole", "serial_tree"])
def test_auto_budget_rule_engines_cpu(ckpt, moe_ckpt, mode, caplog):
    """The default budget_rule="auto" as engines fix it at start: goodput on the MoE model with a timed
    table (its greedy tokens ar's, in both speculative modes), eq. 12's on the dense model with the same
    table and on the MoE model with the default (untimed) table."""
    from bole.llm import resolve_repo_path

    timed = str(resolve_repo_path("calibration_tables/cpu-bole-tiny-coder.yaml"))
    max_tokens = [12, 5, 20, 9]
    with caplog.at_level(logging.INFO, logger="bole.engine.engine"):
        eng = _moe_engine(moe_ckpt, "cpu", mode, False, kernel=False, table=timed)
    assert eng.config.spec.budget_rule == "goodput"
    assert "budget rule auto: goodput (routed-expert model" in caplog.text   # the start log says what auto chose
    seen, draft_batch = [], eng.runner.draft_batch   # each step's goodput costs reach the draft
    eng.runner.draft_batch = lambda reqs, *a, **kw: (seen.append(kw["costs"]), draft_batch(reqs, *a, **kw))[1]
    assert run_arrivals(eng, PROMPTS, max_tokens) == run_arrivals(
        _moe_engine(moe_ckpt, "cpu", "ar", False, kernel=False), PROMPTS, max_tokens)
    assert seen and all(c is not None for c in seen)
    assert _engine(ckpt, "cpu", mode, False, calibration_table=timed).config.spec.budget_rule == "epsilon"
    assert _moe_engine(moe_ckpt, "cpu", mode, False, kernel=False).config.spec.budget_rule == "epsilon"
    # ar has no budget: its setting stays as given
    assert _moe_engine(moe_ckpt, "cpu", "ar", False, kernel=False, table=timed).config.spec.budget_rule == "auto"


@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_moe_static_forwards_tokens_cpu(moe_ckpt, mode):
    """A MoE model's decode, verify and draft forwards as the graphs run them (uncaptured): graphs refuse the
    torch loop over the routed experts (a host read); with kernels.moe_experts the static forwards emit the
    eager torch-loop engine's greedy tokens."""
    max_tokens = [12, 5, 20, 9]
    ref = run_arrivals(_moe_engine(moe_ckpt, "cpu", "ar", False, kernel=False), PROMPTS, max_tokens)
    loop = _moe_engine(moe_ckpt, "cpu", mode, False, kernel=False)
    assert "host" in graphs_unsupported(loop.model)
    eng = _moe_engine(moe_ckpt, "cpu", mode, False, kernel=True)
    assert graphs_unsupported(eng.model) is None
    if mode == "ar":
        graphs = eng.runner.enable_cuda_graphs((1, 2, 4), capture=False, min_kv=8)
    else:
        spec = eng.config.spec
        graphs = eng.runner.enable_verify_graphs((1, 2, 4), tree_widths(eng.lookahead), spec.depth + 1,
                                                 capture=False, min_kv=8)
        dg = eng.runner.enable_draft_graphs((1, 2, 4), spec.depth, spec.topk, spec.beam, capture=False, min_kv=8,
                                            max_per_request=MAX_TREE_NODES - 1,
                                            floor=spec.budget_floor)
    assert run_arrivals(eng, PROMPTS, max_tokens) == ref
    assert graphs.replays > 0 and (mode == "ar" or dg.replays > 0)


@pytest.mark.gpu
def test_goodput_budget_in_captured_graphs_cuda(ckpt):
    """budget_rule="goodput" with CUDA graphs: the draft graph takes each step's costs and chooses on the
    device; every draft replays a graph and the greedy tokens are ar's."""
    from bole.llm import resolve_repo_path

    max_tokens = [12, 5, 20, 9]
    ref = run_arrivals(_engine(ckpt, "cuda", "ar", False), PROMPTS, max_tokens)
    eng = _engine(ckpt, "cuda", "bole", True, budget_rule="goodput", cuda_graph_capture_len=34,
                  calibration_table=str(resolve_repo_path("calibration_tables/cpu-bole-tiny-coder.yaml")))
    assert eng.runner.draft_graphs.goodput and eng.runner.draft_graphs.num_captured > 0
    assert run_arrivals(eng, PROMPTS, max_tokens) == ref
    s = eng.stats()
    assert s.decode_steps > 0 and (s.eager_forwards, s.eager_drafts) == (0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_graphs_captured_at_start_cuda(ckpt, mode):
    """``cuda_graph_capture_len``: the graphs are captured at construction, and a run within the length
    captures none, with the eager engine's tokens."""
    max_tokens = [12, 5, 20, 9]
    ref = run_arrivals(_engine(ckpt, "cuda", "ar", False), PROMPTS, max_tokens)
    eng = _engine(ckpt, "cuda", mode, True, cuda_graph_capture_len=34)
    families = eng.runner.all_graphs()
    captured = [f.num_captured for f in families]
    assert families and all(c > 0 for c in captured)
    assert run_arrivals(eng, PROMPTS, max_tokens) == ref
    assert [f.num_captured for f in families] == captured and all(f.replays > 0 for f in families)
    s = eng.stats()   # every decode step replayed a graph: none of its parts ran eagerly
    assert s.decode_steps > 0 and (s.eager_forwards, s.eager_drafts, s.eager_tails) == (0, 0, 0)
    assert s.graph_captures == sum(captured) and s.capture_time_s > 0   # all at start, none inside a step


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_moe_engine_captures_graphs_cuda(moe_ckpt, mode):
    """On the GPU the triton backend's MoE dispatch is captured: the graphed engine emits the eager loop's
    tokens (fp32: IEEE products in the kernel), with graphs captured and replayed."""
    max_tokens = [12, 5, 20, 9]
    eager = _moe_engine(moe_ckpt, "cuda", "ar", True, kernel=False)
    assert eager.runner.graphs is None  # the loop's host read: graphs refused, the engine runs eagerly
    ref = run_arrivals(eager, PROMPTS, max_tokens)
    eng = _moe_engine(moe_ckpt, "cuda", mode, True, kernel=True)
    graphs = eng.runner.graphs if mode == "ar" else eng.runner.verify_graphs
    assert graphs is not None and eng.model.backend.name == "triton"
    assert run_arrivals(eng, PROMPTS, max_tokens) == ref
    assert graphs.replays > 0 and graphs.num_captured > 0


@pytest.mark.parametrize("mode", ["bole", "serial_tree"])
def test_tail_checkpoints_equal_eager_checkpoints_cpu(ckpt, mode):
    # the same arrivals through the tail (checkpoints committed out of place in the graph) and eagerly
    # (SpeculativeStep's eager accept_commit): the same cached blocks, and checkpoint states that agree
    max_tokens = [12, 5, 20, 9]
    engines = []
    for tail in (False, True):
        eng = _engine(ckpt, "cpu", mode, False, enable_prefix_cache=True)
        spec = eng.config.spec
        vg = eng.runner.enable_verify_graphs((1, 2, 4), tree_widths(eng.lookahead), spec.depth + 1,
                                             capture=False, min_kv=8, tail=tail)
        if tail:
            vg.enable_checkpoints(eng.prefix_cache.checkpoints, eng.config.cache.checkpoint_interval,
                                  eng.prefix_cache.scratch_slot)
        toks = run_arrivals(eng, PROMPTS, max_tokens)
        engines.append((eng, toks, vg))
    (e1, t1, v1), (e2, t2, v2) = engines
    assert t1 == t2 and v1.tail_replays == 0 and v2.tail_replays == v2.replays > 0
    c1, c2 = e1.prefix_cache, e2.prefix_cache
    n1 = {n.hash: n for n in c1._nodes}
    n2 = {n.hash: n for n in c2._nodes}
    assert n1.keys() == n2.keys()
    compared = 0
    for h, a in n1.items():
        b = n2[h]
        assert (a.checkpoint is None) == (b.checkpoint is None)
        if a.checkpoint is not None:
            for pa, pb in ((c1.checkpoints.ssm, c2.checkpoints.ssm), (c1.checkpoints.conv, c2.checkpoints.conv)):
                assert float((pa[:, a.checkpoint] - pb[:, b.checkpoint]).abs().max()) <= 1e-4
            compared += 1
    assert compared > 0


def _greedy_drafts(runner: ModelRunner, reqs, batch):
    """Rewrite the drafts so each node's first child carries the target's argmax after it (siblings
    kept distinct): greedy acceptance then walks long paths. One verify per depth level."""
    tok, par = batch.tokens.clone(), batch.parents.tolist()
    for _ in range(int(batch.depth.max()) + 1):
        am = runner.verify(reqs, dataclasses.replace(batch, tokens=tok)).logits.argmax(-1).tolist()
        for b, row in enumerate(par):
            seen = set()
            for i, p in enumerate(row):
                if i == 0 or int(tok[b, i]) < 0:  # node 0 is the root, not a draft
                    continue
                want = am[b][p]
                t = want if p not in seen else (want + i) % 64
                seen.add(p)
                tok[b, i] = t
    return dataclasses.replace(batch, tokens=tok)


def _compare_tail(path, device, capture, tol):
    """Greedy acceptance + commit in the verify graph's tail against the eager ``accept_commit`` of the
    same verified drafts (the same ``accept_and_commit``, over the eager forward) and a plain
    ``accept_tree``: the same accepted nodes and tokens, then the same GDN state, conv windows, K/V and
    drafter hiddens; and the prefix-cache checkpoints (the state at the last multiple of 4 tokens inside
    each commit, written into a reserved slot) equal the pre-commit state committed in place along the
    cut path, while a reserved slot of a path that crosses nothing stays untouched."""
    from bole.cache.prefix_cache import boundary_cut
    from bole.cache.state_pool import StatePool
    from bole.spec.sampling import accept_tree

    model = load_model(path, dtype="float32", device=device)
    kw = dict(num_blocks=128, block_size=4, num_state_slots=6, max_batch_nodes=4 * 16,
              kv_dtype=torch.float32, device=device)
    eager, graph = ModelRunner(model, **kw), ModelRunner(model, **kw)
    vg = graph.enable_verify_graphs((1, 2, 4), (8, 16), DEPTH, capture=capture, min_kv=8)
    interval = 4
    ck_graph, ck_eager = StatePool.like(graph.state_pool, 6), StatePool.like(eager.state_pool, 6)
    vg.enable_checkpoints(ck_graph, interval, scratch_slot=5)
    gen = torch.Generator().manual_seed(1)
    crossed = 0
    for batch_prompts, drafts in ((PROMPTS[:1], 6), (PROMPTS[:3], 20)):
        B = len(batch_prompts)
        re, rg = _requests(eager, batch_prompts), _requests(graph, batch_prompts)
        batch = _greedy_drafts(eager, re, synthetic_batch(drafts, B, DEPTH, 64, gen, device, _roots(re)))
        r1, r2 = eager.verify(re, batch), graph.verify(rg, batch)
        acc = accept_tree(batch.tokens, batch.parents, torch.zeros(B, batch.tokens.shape[1], device=device),
                          logits=r1.logits, temperature=0.0, top_k=0, top_p=0.0, max_depth=DEPTH - 1)
        starts, lengths = [r.num_computed for r in rg], acc.num_emitted.tolist()
        ck_copy = StatePool.like(eager.state_pool, B)  # the committed state before the commits
        for b, r in enumerate(re):
            eager.state_pool.copy_slot(r.state_slot, ck_copy, b)
        with torch.no_grad():
            for pool in (ck_graph, ck_eager):
                pool.ssm.fill_(float("nan"))
                pool.conv.fill_(float("nan"))
        host = graph.accept_commit_in_graph(rg, r2, list(range(B)))  # request b's checkpoint -> slot b
        host_eager = eager.accept_commit(re, r1, r1.logits, DEPTH - 1,
                                         checkpoint=(ck_eager, interval, torch.arange(B, device=device)))
        assert host_eager == host
        cuts = [boundary_cut(st, n, interval) for st, n in zip(starts, lengths, strict=True)]
        # the checkpoints the way they were first made: the pre-commit state committed in place
        ctx = dataclasses.replace(r1.ctx, kv_cache=None, state_pool=ck_copy,
                                  state_slots=torch.arange(B, device=device))
        model.commit(ctx, [int(p[c - 1]) - r1.ctx.cu_host[b] if c else -1
                           for b, (p, c) in enumerate(zip(r1.forest.accepted_path_nodes(
                               acc.accepted_node.tolist()).tolist(), cuts, strict=True))])
        for b, c in enumerate(cuts):
            if c:
                assert float((ck_copy.ssm[:, b] - ck_eager.ssm[:, b]).abs().max()) <= tol
                assert float((ck_copy.conv[:, b] - ck_eager.conv[:, b]).abs().max()) <= tol
        for b, c in enumerate(cuts):
            for pg, pe in ((ck_graph.ssm, ck_eager.ssm), (ck_graph.conv, ck_eager.conv)):
                if c:
                    assert float((pg[:, b] - pe[:, b]).abs().max()) <= tol
                else:  # nothing crossed: nothing written
                    assert torch.isnan(pg[:, b]).all() and torch.isnan(pe[:, b]).all()
        crossed += sum(1 for c in cuts if c)
        assert [h[0] for h in host] == acc.accepted_node.tolist() and max(acc.num_emitted.tolist()) >= 3
        assert [h[1] for h in host] == acc.num_emitted.tolist()
        assert [h[2:2 + h[1]] for h in host] == [t[:n] for t, n in zip(acc.tokens.tolist(), acc.num_emitted.tolist())]
        _assert_same_commits(eager, graph, re, rg, tol, device)
    assert vg.tail_replays == 2 and crossed >= 2
    return vg


def test_tail_checkpoints_under_pool_pressure_cpu(ckpt):
    # a full checkpoint pool: the tail's reservations must not evict checkpoints for steps that cross
    # no boundary (only a real crossing takes an LRU checkpoint's slot), so a prompt cached before
    # unrelated decoding restores as much as on the eager path
    P = [(7 * i + 3) % 60 + 1 for i in range(21)]
    Q = [11, 12, 13, 14, 15]
    results = []
    for tail in (False, True):
        eng = _engine(ckpt, "cpu", "bole", False, enable_prefix_cache=True, num_checkpoint_slots=2)
        spec, cache = eng.config.spec, eng.prefix_cache
        vg = eng.runner.enable_verify_graphs((1, 2, 4), tree_widths(eng.lookahead), spec.depth + 1,
                                             capture=False, min_kv=8, tail=tail)
        if tail:
            vg.enable_checkpoints(cache.checkpoints, eng.config.cache.checkpoint_interval, cache.scratch_slot)
        restored = []

        def share(req, chain, restored=restored, share=cache.share):
            restored.append(chain[-1].end if chain else 0)
            return share(req, chain)
        cache.share = share
        for prompt, n in ((P, 1), (Q, 3), (P + [9], 1)):
            run_arrivals(eng, [prompt], [n])
        results.append((restored[-1], cache.evicted_checkpoints, cache.checkpoints.num_free))
        assert vg.tail_replays == (vg.replays if tail else 0)
    assert results[0] == results[1] and results[0][0] > 0


def test_checkpoints_must_precede_graphs(ckpt):
    # a graph's tail fixes the checkpoint setting when it is built
    eng = _engine(ckpt, "cpu", "bole", False, enable_prefix_cache=True)
    s = eng.config.spec
    vg = eng.runner.enable_verify_graphs((1, 2, 4), tree_widths(eng.lookahead), s.depth + 1, capture=False, min_kv=8)
    vg.capture((1, vg.widths[0], vg.kv_lengths[-1]))
    with pytest.raises(ValueError, match="enable_checkpoints must precede"):
        vg.enable_checkpoints(eng.prefix_cache.checkpoints, eng.config.cache.checkpoint_interval,
                              eng.prefix_cache.scratch_slot)


def _run_sampled(eng) -> list[list[int]]:
    """Seeded sampled requests (and one greedy) arriving one per step: each request's tokens."""
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.3, seed=5, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.5, top_p=0.7, seed=2, max_tokens=9, ignore_eos=True)]
    ids, outs, pending = [], {}, list(zip(PROMPTS, params))
    while pending or eng.has_unfinished():
        if pending:
            p, sp = pending.pop(0)
            ids.append(eng.add_request(p, sp))
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.output_token_ids
    return [outs[i] for i in ids]


@pytest.mark.parametrize("mode", ["bole", "serial_tree"])
def test_engine_sampled_tail_tokens_cpu(ckpt, mode):
    """Sampled steps accept and commit in the verify graph's sampled tail (uncaptured): the same tokens as
    the eager acceptance, which are ar's (a seeded request's tokens do not depend on the mode)."""
    ref = _run_sampled(_engine(ckpt, "cpu", "ar", False, enable_prefix_cache=False))
    eng = _engine(ckpt, "cpu", mode, False)
    spec = eng.config.spec
    vg = eng.runner.enable_verify_graphs((1, 2, 4), tree_widths(eng.lookahead), spec.depth + 1,
                                         capture=False, min_kv=8, sampled_tail=True)
    vg.enable_checkpoints(eng.prefix_cache.checkpoints, eng.config.cache.checkpoint_interval,
                          eng.prefix_cache.scratch_slot)
    assert _run_sampled(eng) == ref
    assert vg.tail_replays == vg.replays > 0


def test_verify_tail_matches_eager_cpu(ckpt):
    _compare_tail(ckpt, "cpu", capture=False, tol=1e-4)


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_graphed_verify_matches_eager_cuda(ckpt):
    vg = _compare_verify(ckpt, "cuda", capture=True, tol=1e-3)
    assert vg.num_captured == len(vg.graphs) >= 2


@pytest.mark.gpu
def test_graphed_verify_tail_matches_eager_cuda(ckpt):
    vg = _compare_tail(ckpt, "cuda", capture=True, tol=1e-3)
    assert all(g.tail is not None and g.tail.graph is not None for g in vg.graphs.values())


@pytest.mark.gpu
def test_engine_sampled_tail_tokens_cuda(ckpt):
    ref = _run_sampled(_engine(ckpt, "cuda", "ar", False))
    eng = _engine(ckpt, "cuda", "bole", True)
    vg = eng.runner.verify_graphs
    assert _run_sampled(eng) == ref
    assert vg.tail_replays == vg.replays > 0
    assert all(g.sampled_tail is not None and g.sampled_tail.graph is not None for g in vg.graphs.values())


@pytest.mark.gpu
def test_graphed_draft_matches_eager_cuda(ckpt):
    # the drafter's products in TF32 (draft_math, its tree attention too): eager and graph GEMMs of other
    # shapes round differently, ~1e-3 over the cumulative log-probabilities of a deep draft
    dg = _compare_draft(ckpt, "cuda", capture=True, tol=3e-3)
    assert dg.num_captured == len(dg.graphs) >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bole", "serial_tree"])
def test_engine_verify_graph_tokens_cuda(ckpt, mode):
    max_tokens = [12, 5, 20, 9]
    ref = run_arrivals(_engine(ckpt, "cuda", "ar", False), PROMPTS, max_tokens)
    eng = _engine(ckpt, "cuda", mode, True)
    vg, dg = eng.runner.verify_graphs, eng.runner.draft_graphs
    assert vg is not None and dg is not None and eng.runner.graphs is None
    assert run_arrivals(eng, PROMPTS, max_tokens) == ref
    assert vg.replays > 0 and vg.num_captured > 0 and dg.replays > 0 and dg.num_captured > 0
    assert vg.tail_replays > 0
