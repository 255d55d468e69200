"""GDN tree verification, one layer: SGLang's three tree verifiers vs our closed form, side by side.

Columns per (model, batch, tree size), all measured in the same process on the same GPU:
    sglang_tree_us   SGLang 0.5.23 ``fused_recurrent_gated_delta_rule_update`` in tree mode (per-node
                     fp32 snapshots in ``intermediate_states_buffer``), loaded from .peers/sglang/
    sglang_chunk_us  SGLang's development-tree ``chunk_gated_delta_rule_tree_verify`` (chunk_tree_verify.py
                     at bab5e472), loaded from .peers/sglang-main/ (benchmarks/peers_dev.py); T <= 64
    sglang_fused_us  SGLang's development-tree ``tree_gdn_triton_verify`` (gdn_tree_triton.py at 205c2b55,
                     tf32), loaded from .peers/sglang-main/; its gating runs inside the timed call
    torch_closed_us  bole.ops.gdn.gdn_tree_verify_ref (naive torch closed form, Python loop per request);
                     null above --torch-max-batch
    bole_us          kernels.gdn_tree_verify, best of its ``configs`` (named in bole_config)
    bole_by_method   per ``method`` (blocked / horner / tuned): its fastest validated config, its time
                     (re-timed like bole_us) and errors; the table prints one column per method
    floor_us         bytes that must move / measured device-to-device copy bandwidth
    snapshot_bytes   per request and layer, SGLang-style per-node states: T·HV·V·K·4
    factor_bytes     per request and layer, what our commit needs: T·(HV·V·4 + HK·K·2 + HV·4)
    rel_err          max|O_bole − O_ref| / max|O_ref|; every contender's own error is <name>_rel_err
Every error is against the float64 serial recurrence (bole.ops.gdn.gdn_tree_serial_ref on .double() inputs,
request by request; U and logP from its snapshots). A contender is validated before it is timed: finite
O within REL_TOL of that reference (our kernel: U too). One that refuses the shape (a stated limit, e.g.
the chunk peer at T > 64), fails, or misses the tolerance has a null time and says why in <name>_note.

Trees: EAGLE-like, depth ≤ --max-depth (8), a different random tree per request, node 0 the only
first-level node (SGLang's tree shape, see benchmarks/peers.py). Times are triton.testing.do_bench
medians of CUDA-graph replays. --adversarial draws the hard inputs instead: queries and keys a·c + noise
with one shared direction c per key head (mean pairwise cosine of the normalised keys ≈ --key-cos, 0.9),
beta = sigmoid(N(0,1) + 2.5), g = −0.02·softplus(N(0,1)); every contender's error on them is reported.

    python benchmarks/gdn_verify.py                # full sweep on a GPU
    python benchmarks/gdn_verify.py --quick        # 9B heads, T in {16,32,64,128,256}, batch in {1,16,32}
    python benchmarks/gdn_verify.py --quick --adversarial
    python benchmarks/gdn_verify.py --smoke        # CPU, TRITON_INTERPRET=1, tiny shapes
    python benchmarks/gdn_verify.py --smoke --peers-only --dtype fp16   # the peers alone (interpreter: no bf16 dots)
    python benchmarks/gdn_verify.py --models qwen3.5-9b --trees 64 --batches 1 16   # the bar rows only
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # GDN heads (DESIGN.md §5)
    "qwen3.5-9b": dict(HK=16, HV=32, K=128, V=128),
    "qwen3.5-27b": dict(HK=16, HV=48, K=128, V=128),
    "tiny": dict(HK=2, HV=4, K=16, V=16),  # --smoke only
}
TREE_SIZES, BATCHES, MAX_DEPTH = (8, 16, 32, 64, 128, 256), (1, 4, 8, 16, 32), 8
QUICK_TREES, QUICK_BATCHES = (16, 32, 64, 128, 256), (1, 16, 32)
BAR_ROWS = [("qwen3.5-9b", 16, 64), ("qwen3.5-9b", 1, 64)]  # DESIGN.md §7, measured first


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON path (PNG beside it); default "
                    "benchmarks/results/gdn_verify[_adversarial]_h200.json, /tmp/gdn_verify[_adversarial]_smoke.json "
                    "with --smoke")
    ap.add_argument("--quick", action="store_true",
                    help=f"qwen3.5-9b, T in {'/'.join(map(str, QUICK_TREES))}, "
                         f"batch in {'/'.join(map(str, QUICK_BATCHES))}")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes")
    ap.add_argument("--models", nargs="*", default=None, choices=[m for m in SHAPES if m != "tiny"])
    ap.add_argument("--trees", type=int, nargs="*", default=None, help="only these tree sizes")
    ap.add_argument("--batches", type=int, nargs="*", default=None, help="only these batch sizes")
    ap.add_argument("--torch-max-batch", type=int, default=8, help="skip torch_closed_us above this batch")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new rows after this")
    ap.add_argument("--methods", nargs="*", default=["blocked", "horner", "tuned"],
                    help="kernel methods to sweep (of METHODS, plus 'tuned': the engine's dispatch)")
    ap.add_argument("--precisions", nargs="*", default=None,
                    help="only candidates with these input precisions (ieee, tf32, tf32x3; default all)")
    ap.add_argument("--sweep", choices=("auto", "full"), default="auto",
                    help="kernel configurations per row (see BoleKernel)")
    ap.add_argument("--compile-workers", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)),
                    help="processes that compile every kernel variant ahead of the timing loop (0: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adversarial", action="store_true",
                    help="correlated queries/keys (--key-cos), beta ≈ 0.9, slow decay (module docstring)")
    ap.add_argument("--key-cos", type=float, default=0.9, help="mean key cosine of --adversarial")
    ap.add_argument("--max-depth", type=int, default=MAX_DEPTH, help="tree depth cap")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                    help="q, k, v dtype (fp16 for the chunk peer under the CPU interpreter)")
    ap.add_argument("--peers-only", action="store_true",
                    help="only the SGLang peers and the float64 reference (no bole kernel, no torch closed form)")
    return ap.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere
elif ARGS is not None and os.environ.pop("TRITON_INTERPRET", "0") == "1":
    print("note: TRITON_INTERPRET=1 unset: interpreted timings mean nothing (use --smoke on CPU)")

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(REPO_ROOT))
from benchmarks import peers_dev  # noqa: E402
from benchmarks.kernel_sweep import BoleKernel, precompile  # noqa: E402
from benchmarks.peers import SGLangTreeVerifier, sglang_available, single_root_tree  # noqa: E402
from bole.ops import gdn as gdn_ops  # noqa: E402
from bole.spec.tree import PackedForest  # noqa: E402


def bench_us(fn, smoke: bool, warmup_ms=2, rep_ms=10, graph=True) -> float:
    """Median time of fn() in µs: do_bench on a GPU, a wall clock under the CPU interpreter.

    With ``graph`` fn is captured once in a CUDA graph and do_bench times its replays: do_bench still
    flushes L2 before each replay, and host-side launch overhead (Python argument checks, autograd
    wrappers) no longer leaks into small-batch GPU times, as in a serving engine's graph replay.
    """
    if not smoke:
        if graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            fn = g.replay
        return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    fn()
    ts = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * sorted(ts)[len(ts) // 2]


def copy_bandwidth(device, smoke: bool) -> dict:
    """Device-to-device copy of a large buffer; bandwidth counts read + write bytes."""
    nbytes = (64 if smoke else 2048) << 20
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src), smoke, warmup_ms=20, rep_ms=200, graph=False)
    return {"bytes_per_copy": nbytes, "copy_us": us, "gb_per_s": 2 * nbytes / us / 1e3}


def load_bole_kernel():
    """kernels.gdn_tree_verify, imported lazily: (BoleKernel, None), or (None, why) when it is absent."""
    try:
        from benchmarks import verify_space
        from kernels import gdn_tree_verify as mod
        from kernels import gdn_tree_verify_launch as launch
    except Exception as e:  # absent on a CPU smoke run, or broken: skip the column, say so
        return None, f"kernels.gdn_tree_verify unavailable ({type(e).__name__}: {e}); bole_us skipped"
    return BoleKernel(mod.gdn_tree_verify, launch, configs_for=verify_space.configs_for), None


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def correlated(n: int, heads: int, dim: int, key_cos: float, gen: torch.Generator) -> torch.Tensor:
    """[n, heads, dim] rows a·c_h + noise (c_h a unit vector per head, noise N(0, I/dim)): the mean
    pairwise cosine of the normalised rows is ≈ a² / (a² + 1) = key_cos."""
    c = torch.randn(heads, dim, generator=gen)
    c = c / c.norm(dim=-1, keepdim=True)
    a = math.sqrt(key_cos / (1.0 - key_cos))
    return a * c[None] + torch.randn(n, heads, dim, generator=gen) / math.sqrt(dim)


def make_inputs(model, batch, T, device, seed, dtype=torch.bfloat16, adversarial=False, key_cos=0.9,
                max_depth=MAX_DEPTH):
    s = SHAPES[model]
    HK, HV, K, V = s["HK"], s["HV"], s["K"], s["V"]
    gen = torch.Generator().manual_seed(seed)
    trees = [single_root_tree(T, max_depth, generator=gen) for _ in range(batch)]
    forest = PackedForest.from_trees(trees, device=device, max_depth=max_depth)  # fixed anc width
    N = forest.num_nodes
    rnd = lambda *shape: torch.randn(*shape, generator=gen)
    cast = dict(dtype=dtype, device=device)
    if adversarial:  # the issue-23 stress inputs (module docstring)
        q, k = correlated(N, HK, K, key_cos, gen)[None], correlated(N, HK, K, key_cos, gen)[None]
        q, k = q.to(**cast), k.to(**cast)
    else:
        q, k = rnd(1, N, HK, K).to(**cast), rnd(1, N, HK, K).to(**cast)
    v = rnd(1, N, HV, V).to(**cast)
    if adversarial:
        g = (-0.02 * torch.nn.functional.softplus(rnd(1, N, HV))).to(device)
        beta = torch.sigmoid(rnd(1, N, HV) + 2.5).to(device)
    else:
        # Qwen3.5 gates: g = -exp(A_log)·softplus(a + dt_bias) (small negatives), beta = sigmoid(b)
        g = (-torch.exp(rnd(HV) * 0.5 - 2.0) * torch.nn.functional.softplus(rnd(1, N, HV))).to(device)
        beta = torch.sigmoid(rnd(1, N, HV)).to(device)
    slots = 2 * batch
    pool = (0.05 * rnd(slots, HV, V, K)).to(device)  # fp32 state pool [slots, HV, V, K]
    state_indices = torch.randperm(slots, generator=gen)[:batch].to(device=device, dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, forest=forest, pool=pool, state_indices=state_indices)


def reference_f64(x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float64 serial recurrence on x's inputs: (O [1, N, HV, V], U [N, HV, V], logP [N, HV]).

    bole.ops.gdn.gdn_tree_serial_ref on .double() inputs, one request at a time (its per-node snapshots
    are then one request's, T·HV·V·K·8 bytes). U and logP come from the same snapshots: node i's
    update is S_i = exp(g_i)·S_parent + u_i k̂_iᵀ (k̂ the normalised key), so u_i = ΔS k̂_i / |k̂_i|²,
    and logP_i is the sum of g over i's path.
    """
    forest, cu = x["forest"], x["forest"].cu_seqlens.tolist()
    q, k, v, g, beta = (x[n].double() for n in ("q", "k", "v", "g", "beta"))
    pool, device = x["pool"].double(), q.device
    HK, HV = k.shape[2], v.shape[2]
    khat = gdn_ops.l2norm(k[0]).repeat_interleave(HV // HK, dim=1)  # [N, HV, K]
    o = torch.empty_like(v)
    u = torch.empty(v.shape[1:], dtype=torch.float64, device=device)
    logp = torch.empty(g.shape[1:], dtype=torch.float64, device=device)
    for b in range(forest.num_requests):
        s, e = cu[b], cu[b + 1]
        tree = forest.tree(b)
        sub = PackedForest.from_trees([tree], device=device)
        slot = x["state_indices"][b:b + 1]
        o[:, s:e], snaps = gdn_ops.gdn_tree_serial_ref(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                                   sub, pool, slot, use_qk_l2norm=True)
        parents = torch.tensor(tree.parents, device=device) + 1  # 0: the committed state
        before = torch.cat([pool[slot.long()], snaps])[parents]  # [T, HV, V, K]
        dS = snaps - g[0, s:e].exp()[:, :, None, None] * before
        kh = khat[s:e]
        u[s:e] = torch.einsum("thvk,thk->thv", dS, kh) / (kh * kh).sum(-1, keepdim=True)
        logp[s:e] = tree.ancestor_mask().to(device=device, dtype=torch.float64) @ g[0, s:e]
        del snaps, before, dS
    return o, u, logp


def floor_bytes(x) -> int:
    """Bytes that must move: S_pre reads, q/k/v/g/beta reads, o (bf16) and u, logp (fp32) writes."""
    B, HV, V, K = x["forest"].num_requests, *x["pool"].shape[1:]
    N = x["forest"].num_nodes
    reads = B * HV * V * K * x["pool"].element_size()
    reads += sum(x[n].numel() * x[n].element_size() for n in ("q", "k", "v", "g", "beta"))
    writes = N * HV * V * (x["v"].element_size() + 4) + N * HV * 4
    return reads + writes


REL_TOL = 1e-2  # bf16-input rounding (issue 2's bar for rel_err)


def rel_err(o, ref) -> float | None:
    """max|o − ref| / max|ref| (in float64); None (JSON null) when either holds a NaN/inf."""
    o, ref = o.double(), ref.double()
    err = float((o - ref).abs().max() / ref.abs().max())
    return err if err == err and err != float("inf") else None


PEERS = ("sglang_tree", "sglang_chunk", "sglang_fused")  # column prefixes, in table order


def peer_absent(name: str) -> str | None:
    """Why the peer's files are not here (None when they are)."""
    if name == "sglang_tree":
        return None if sglang_available() else ("absent: SGLang 0.5.23's serial verifier (.peers/sglang/); "
                                                "run scripts/fetch_peers.sh")
    files = peers_dev.CHUNK_FILES if name == "sglang_chunk" else peers_dev.FUSED_FILES
    gone = peers_dev.missing(files)
    return f"absent: .peers/sglang-main/ lacks {', '.join(gone)}; {peers_dev.FETCH_HINT}" if gone else None


def make_peer(name: str, common):
    if name == "sglang_tree":
        return SGLangTreeVerifier(*common, use_qk_l2norm=True)
    if name == "sglang_chunk":
        return peers_dev.SGLangChunkTreeVerifier(*common, use_qk_l2norm=True)
    return peers_dev.SGLangFusedTreeVerifier(*common, use_qk_l2norm=True)


def run_contender(name: str, make, ref, row: dict, smoke: bool, graph: bool = True, out_of=None):
    """Build one contender, check its O against the float64 reference, and time it only if it passes.

    Fills row[name + "_us" / "_rel_err" / "_note"]: a refusal (ValueError: a limit the adapter
    states), a failure, or an O off by more than REL_TOL (or non-finite) leaves the time null and
    says why. Returns the first call's result (None when it refused or failed); ``out_of`` picks O
    out of it.
    """
    try:
        run = make()
    except ValueError as e:
        row[f"{name}_note"] = f"refused: {e}"
        return None
    try:
        out = run()
    except Exception as e:  # a peer's own assertion or compile error: reported, not fatal
        row[f"{name}_note"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
        return None
    o = out if out_of is None else out_of(out)
    err = row[f"{name}_rel_err"] = rel_err(o, ref)
    if err is None or err > REL_TOL:
        row[f"{name}_note"] = (f"not timed: rel_err {fmt(err, '.3g')} against float64 exceeds {REL_TOL} "
                               f"({int((~o.isfinite()).sum())} non-finite)")
        return out
    try:
        row[f"{name}_us"] = bench_us(run, smoke, graph=graph)
    except Exception as e:
        row[f"{name}_note"] = f"timing failed: {type(e).__name__}: {str(e)[:300]}"
    return out


def run_row(model, batch, T, device, args, bole, notes) -> dict:
    s = SHAPES[model]
    x = make_inputs(model, batch, T, device, seed=args.seed + 1000 * batch + T, dtype=DTYPES[args.dtype],
                    adversarial=args.adversarial, key_cos=args.key_cos, max_depth=args.max_depth)
    common = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["forest"], x["pool"], x["state_indices"])
    row = dict(model=model, batch=batch, tree_nodes=T, depth=int(x["forest"].depth.max()),
               **{f"{p}_{c}": None for p in PEERS for c in ("us", "rel_err", "note")},
               torch_closed_us=None, torch_closed_rel_err=None, torch_closed_note=None,
               bole_us=None, bole_config=None, best_peer=None, best_peer_us=None,
               floor_us=None, snapshot_bytes=T * s["HV"] * s["V"] * s["K"] * 4,
               factor_bytes=T * (s["HV"] * s["V"] * 4 + s["HK"] * s["K"] * 2 + s["HV"] * 4),
               rel_err=None, rel_err_ref="float64_serial", rel_err_u=None, rel_err_logp=None,
               bole_candidates=0, bole_nonfinite=None, closed_nonfinite=None, bole_rejected=[],
               bole_by_method=None)
    row["floor_us"] = floor_bytes(x) / args.bandwidth_bps * 1e6
    ref_out = reference_f64(x)  # O, U, logP of the float64 serial recurrence: every contender's reference
    ref = ref_out[0]
    for name in PEERS:
        row[f"{name}_note"] = peer_absent(name)
        if row[f"{name}_note"] is None:
            run_contender(name, lambda name=name: make_peer(name, common), ref, row, args.smoke)
    peers_dev.release_workspaces()
    timed_peers = {p: row[f"{p}_us"] for p in PEERS if row[f"{p}_us"] is not None}
    if timed_peers:
        row["best_peer"] = min(timed_peers, key=timed_peers.get)
        row["best_peer_us"] = timed_peers[row["best_peer"]]
    closed_out = None
    if args.peers_only:
        row["torch_closed_note"] = "--peers-only"
    elif batch > args.torch_max_batch:
        row["torch_closed_note"] = f"batch above --torch-max-batch {args.torch_max_batch}"
    else:  # the torch closed form; its calls sync with the host, so it is timed without a graph
        closed_out = run_contender(
            "torch_closed", lambda: (lambda: gdn_ops.gdn_tree_verify_ref(*common, use_qk_l2norm=True)), ref, row,
            args.smoke, graph=False, out_of=lambda out: out[0])
    if bole is not None:
        N, HV, V = x["forest"].num_nodes, s["HV"], s["V"]
        outs = dict(o_out=torch.empty_like(x["v"]),
                    u_out=torch.empty(N, HV, V, dtype=torch.float32, device=device),
                    logp_out=torch.empty(N, HV, dtype=torch.float32, device=device))
        key = (model, T)
        cands = bole.candidates(s, T, batch, args.sweep, key)
        timed = []
        if args.smoke:  # the interpreter is slow: the first two candidates of each method
            cands = [kw for i, kw in enumerate(cands)
                     if sum(bole.method_of(c) == bole.method_of(kw) for c in cands[:i]) < 2]
        for kw in cands:
            if timed and time.time() > args.deadline:
                notes.append(f"{model} b={batch} T={T}: time budget spent, sweep cut at {len(timed)}")
                break
            call = lambda kw=kw: bole.fn(*common, use_qk_l2norm=True, **outs, **kw)
            try:
                for t in outs.values():
                    t.fill_(float("nan"))
                o_c, u_c, _ = call()
                # A candidate must be right before it may be fast: finite outputs within the bf16-input
                # tolerance of the float64 reference's O, and U likewise (the commit consumes U).
                err = rel_err(o_c, ref)
                err_u = rel_err(u_c, ref_out[1])
                if err is None or err > REL_TOL or err_u is None or err_u > REL_TOL:
                    row["bole_rejected"].append(f"{bole.label(kw)}: rel_err={err} rel_err_u={err_u}")
                    continue
                us = bench_us(call, args.smoke, warmup_ms=1, rep_ms=4)  # quick sweep, re-timed below
            except Exception as e:  # a config invalid for this shape: skip it, keep the note
                notes.append(f"{model} b={batch} T={T} {bole.label(kw)}: {type(e).__name__}: {e}")
                continue
            timed.append((us, bole.label(kw), call, bole.method_of(kw) or "default"))
        timed.sort(key=lambda t: t[0])
        if key not in bole.ranked:
            bole.ranked[key] = [lab for _, lab, _, _ in timed]
        row["bole_candidates"] = len(timed)
        best = {}  # method -> its fastest candidate in the quick sweep
        for _, label, call, method in timed:
            best.setdefault(method, (label, call))
        by_method = {}
        for method, (label, call) in best.items():
            for t in outs.values():
                t.fill_(float("nan"))  # an element the kernel fails to write shows up in rel_err
            o, u, logp = call()
            e = dict(us=None, config=label, rel_err=rel_err(o, ref), rel_err_u=rel_err(u, ref_out[1]),
                     rel_err_logp=rel_err(logp, ref_out[2]),
                     nonfinite=[int((~t.isfinite()).sum()) for t in (o, u, logp)])
            e["us"] = bench_us(call, args.smoke)
            by_method[method] = e
        row["bole_by_method"] = by_method
        if "tuned" in by_method and hasattr(bole.module, "tuned_launch"):  # what tuned=True launched
            cfg, method, precision = bole.module.tuned_launch(max(16, triton.next_power_of_2(T)), batch * s["HV"],
                                                              s["K"], s["V"])
            by_method["tuned"]["launch"] = f"{method}:{cfg}:{precision}"
        if by_method:
            e = min(by_method.values(), key=lambda e: e["us"])
            row.update(bole_us=e["us"], bole_config=e["config"], rel_err=e["rel_err"], rel_err_u=e["rel_err_u"],
                       rel_err_logp=e["rel_err_logp"], bole_nonfinite=e["nonfinite"])
            if closed_out is not None:
                row["closed_nonfinite"] = [int((~t.isfinite()).sum()) for t in closed_out]
    del x, ref, ref_out, closed_out
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def grid(args):
    if args.smoke:
        return [("tiny", b, T) for b in (1, 2) for T in (8,)]
    models = args.models or ["qwen3.5-9b", "qwen3.5-27b"]
    if args.quick:
        rows = [(m, b, T) for m in models[:1] for T in QUICK_TREES for b in QUICK_BATCHES]
    else:
        rows = [(m, b, T) for m in models for T in TREE_SIZES for b in BATCHES]
    trees, batches = getattr(args, "trees", None), getattr(args, "batches", None)
    rows = [(m, b, T) for m, b, T in rows if (not trees or T in trees) and (not batches or b in batches)]
    first = [r for r in BAR_ROWS if r in rows]  # bar rows first, in case the budget runs out
    return first + [r for r in rows if r not in first]


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


PEER_LABELS = {"sglang_tree": "serial", "sglang_chunk": "chunk", "sglang_fused": "fused"}


def print_table(rows):
    methods = list(dict.fromkeys(m for r in rows for m in r.get("bole_by_method") or {}))
    head = (f"{'model':<12} {'B':>3} {'T':>4} {'d':>2} "
            + "".join(f"{PEER_LABELS[p]:>9}" for p in PEERS) + f" {'torch':>9} {'bole':>8} "
            + "".join(f"{m[:9]:>10}" for m in methods)
            + f" {'floor':>7} {'xSGL':>6} {'xBest':>6} {'/floor':>6} {'snap/fac':>8} {'rel_err':>8}  config")
    print(head)
    for r in rows:
        sp = r["sglang_tree_us"] / r["bole_us"] if r["sglang_tree_us"] and r["bole_us"] else None
        best = r["best_peer_us"] / r["bole_us"] if r.get("best_peer_us") and r["bole_us"] else None
        fl = r["bole_us"] / r["floor_us"] if r["bole_us"] and r["floor_us"] else None
        per = r.get("bole_by_method") or {}
        print(f"{r['model']:<12} {r['batch']:>3} {r['tree_nodes']:>4} {r['depth']:>2} "
              + "".join(f"{fmt(r.get(f'{p}_us')):>9}" for p in PEERS)
              + f" {fmt(r['torch_closed_us']):>9} {fmt(r['bole_us']):>8} "
              + "".join(f"{fmt(per[m]['us'] if m in per else None):>10}" for m in methods)
              + f" {fmt(r['floor_us']):>7} {fmt(sp):>6} {fmt(best, '.2f'):>6} {fmt(fl, '.2f'):>6} "
              f"{r['snapshot_bytes'] / r['factor_bytes']:>8.1f} {fmt(r['rel_err'], '.1e'):>8}  "
              f"{r['bole_config'] or '-'}")
    names = [*PEERS, "torch_closed"]
    print("errors against the float64 serial recurrence, max|O - O_ref| / max|O_ref| (- : not run):")
    print(f"{'model':<12} {'B':>3} {'T':>4} " + "".join(f"{PEER_LABELS.get(p, 'torch'):>9}" for p in names)
          + f" {'bole':>9}")
    for r in rows:
        print(f"{r['model']:<12} {r['batch']:>3} {r['tree_nodes']:>4} "
              + "".join(f"{fmt(r.get(f'{p}_rel_err'), '.1e'):>9}" for p in names)
              + f" {fmt(r['rel_err'], '.1e'):>9}")
    whys = {}  # one line per distinct reason a contender has no time
    for r in rows:
        for p in names:
            if r.get(f"{p}_us") is None and r.get(f"{p}_note"):
                whys.setdefault((p, r[f"{p}_note"]), []).append(f"{r['model']} B={r['batch']} T={r['tree_nodes']}")
    for (p, why), where in whys.items():
        print(f"  {p}: {why}  [{', '.join(where[:6])}" + (f" and {len(where) - 6} more]" if len(where) > 6 else "]"))
    if methods:
        print("fastest validated config per method:")
        for r in rows:
            for m, e in (r.get("bole_by_method") or {}).items():
                print(f"  {r['model']} B={r['batch']} T={r['tree_nodes']} {m}: {fmt(e['us'])} us "
                      f"rel_err={fmt(e['rel_err'], '.1e')} rel_err_u={fmt(e['rel_err_u'], '.1e')}  {e['config']}")


def plot(rows, path):
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    models = sorted({r["model"] for r in rows})
    against = [("sglang_tree_us", "speedup over SGLang serial tree (×)"),
               ("best_peer_us", "speedup over the fastest SGLang verifier (×)")]
    fig, axes = plt.subplots(len(against), len(models), figsize=(6 * len(models), 4.5 * len(against)),
                             squeeze=False)
    for (col, ylabel), ax_row in zip(against, axes, strict=True):
        for ax, m in zip(ax_row, models, strict=True):
            plotted = False
            for b in sorted({r["batch"] for r in rows if r["model"] == m}):
                pts = sorted((r["tree_nodes"], r[col] / r["bole_us"]) for r in rows
                             if r["model"] == m and r["batch"] == b and r.get(col) and r["bole_us"])
                if pts:
                    ax.plot([t for t, _ in pts], [y for _, y in pts], marker="o", label=f"batch {b}")
                    plotted = True
            ax.set(xscale="log", yscale="log", title=m, xlabel="tree nodes T", ylabel=ylabel)
            ax.set_xticks(TREE_SIZES, [str(t) for t in TREE_SIZES])
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}×"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.grid(True, which="both", alpha=0.3)
            if plotted:
                ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def main(args):
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (use --smoke on CPU)")
    kind = "_adversarial" if args.adversarial else ""
    out = Path(args.out or (f"/tmp/gdn_verify{kind}_smoke.json" if args.smoke
                            else REPO_ROOT / f"benchmarks/results/gdn_verify{kind}_h200.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    notes = [f"{p}_us skipped: {why}" for p in PEERS if (why := peer_absent(p))]
    bole, note = (None, "--peers-only: bole_us skipped") if args.peers_only else load_bole_kernel()
    if bole is not None:
        bole.only, bole.precisions = args.methods, args.precisions
    if note:
        notes.append(note)
    for n in notes:
        print("note:", n)
    bw = copy_bandwidth(device, args.smoke)
    args.bandwidth_bps = bw["gb_per_s"] * 1e9
    print(f"copy bandwidth (read+write): {bw['gb_per_s']:.0f} GB/s")
    report = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu (TRITON_INTERPRET=1)",
                  torch=torch.__version__, triton=triton.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=shlex.join(["python", *sys.argv]), copy_bandwidth=bw,
                  sglang=(REPO_ROOT / ".peers/sglang/SOURCE").read_text().split()[0]
                  if sglang_available() else None,
                  sglang_main=peers_dev.source_summary(),
                  inputs=(f"adversarial: q, k a·c + noise (key cosine ≈ {args.key_cos}), "
                          "beta = sigmoid(N(0,1) + 2.5), g = -0.02·softplus(N(0,1))" if args.adversarial
                          else "ordinary: q, k, v ~ N(0, 1), beta = sigmoid(N(0,1)), Qwen3.5-like g"),
                  dtype=args.dtype, max_depth=args.max_depth, reference="float64 serial recurrence",
                  rel_tol=REL_TOL,
                  torch_closed_max_batch=args.torch_max_batch, sweep=args.sweep,
                  timing="triton.testing.do_bench median (L2 flushed before each run) of CUDA-graph replays; "
                         "torch_closed_us of plain calls (host syncs inside)",
                  notes=notes, rows=[], skipped_rows=[])
    t0 = time.time()
    args.deadline = t0 + args.budget_s
    rows = grid(args)
    if bole is not None and not args.smoke and args.compile_workers > 0:
        tasks, seen, firsts = [], set(), set()
        for model, batch, T in rows:
            if sglang_available():
                tasks.append(("sglang", model, batch, T, None))
            for p in ("sglang_chunk", "sglang_fused"):  # one compile per (model, T)
                if (p, model, T) not in seen and not peer_absent(p) and (p != "sglang_chunk"
                                                                         or T <= peers_dev.CHUNK_MAX_T):
                    seen.add((p, model, T))
                    tasks.append((p, model, 1, T, None))
            # what run_row will time: the first row of a (model, T) sweeps, later rows add their defaults
            if args.sweep == "full" or (model, T) not in firsts:
                firsts.add((model, T))
                kws = bole.first_row(SHAPES[model], T, batch, args.sweep)
            else:
                kws = bole.row_defaults(SHAPES[model], T, batch)
            for kw in kws:
                if (model, T, bole.label(kw)) not in seen:
                    seen.add((model, T, bole.label(kw)))
                    tasks.append(("bole", model, 1, T, kw))
        dt = precompile(tasks, args.compile_workers, bole, notes, timeout_s=0.7 * args.budget_s,
                        first_trees={T for _, _, T in BAR_ROWS})
        print(f"precompiled {len(tasks)} kernel variants in {dt:.0f}s on {args.compile_workers} workers")
        report["precompile_s"] = round(dt, 1)
    for model, batch, T in rows:
        if time.time() - t0 > args.budget_s:
            report["skipped_rows"].append(dict(model=model, batch=batch, tree_nodes=T))
            continue
        row = run_row(model, batch, T, device, args, bole, notes)
        report["rows"].append(row)
        report["rows"].sort(key=lambda r: (r["model"], r["tree_nodes"], r["batch"]))
        out.write_text(json.dumps(report, indent=1))  # after every row: a timeout keeps what ran
        per = " ".join(f"{m}={fmt(e['us'])}" for m, e in (row.get("bole_by_method") or {}).items())
        peers = " ".join(f"{PEER_LABELS[p]}={fmt(row[f'{p}_us'])}" for p in PEERS)
        print(f"[{time.time() - t0:6.1f}s] {model} batch={batch} T={T}: {peers} "
              f"torch={fmt(row['torch_closed_us'])} bole={fmt(row['bole_us'])} us [{per}] "
              f"({row['bole_candidates']} tried; {row['bole_config']})", flush=True)
    if report["skipped_rows"]:
        notes.append(f"time budget {args.budget_s:.0f}s spent: {len(report['skipped_rows'])} rows skipped")
    print_table(report["rows"])
    report["plot"] = plot(report["rows"], out.with_suffix(".png"))
    report["elapsed_s"] = round(time.time() - t0, 1)
    out.write_text(json.dumps(report, indent=1))
    for n in notes:
        print("note:", n)
    print(f"wrote {out}" + (f" and {report['plot']}" if report["plot"] else ""))
    print(json.dumps({k: report[k] for k in ("gpu", "date", "elapsed_s")} | {"rows": len(report["rows"])}))


if __name__ == "__main__":
    main(ARGS)
