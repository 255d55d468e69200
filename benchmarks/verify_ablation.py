"""Where the one-pass verifier's time goes, and which of its load/product variants is fastest.

Launches the engine's kernel (`gdn_tree_verify_kernel`) directly with constexpr switches, at Qwen3.5-9B
GDN shapes, same inputs and timing as gdn_verify.py (CUDA-graph replays, L2 flushed):

* ``--sweep``: the variants (loads issued before the K-loop ``EARLY``, fp16 T×T products ``LOWP_TT``)
  × a few launch configs × methods, each validated against the torch closed form (max-abs error
  relative to max |ref| on O and U) before it is timed. The results of 2026-12-01
  (results/verify_ablation*_h200.json) also hold variants of the kernel as it was then: "anc" (M⁺
  gathered from anc[i, depth(j) − 1]) against "bits" (the bitmask, since the only path) and "_r"
  (fp16 W R with R scaled, dropped: wrong results at BV=32 on the H200).
  ``--configs 32,128,8,3,128`` takes other launch configs, a 5th entry capping registers per thread
  (ptxas ``.maxnreg``: more programs per SM, at the price of spills). The results of 2026-12-02
  (results/verify_ablation4-6_h200.json, verify_persistent_h200.json) hold variants that commit 437e3d5
  had and the next one removed, none faster at batch 16: "cu" (O = C U), "kk" (‖k‖² from K Kᵀ's
  diagonal), "s2" (S in two bf16 parts), "pf*" (L2 prefetch of the program one wave on), "tree" (tree
  loads before the K-loop, the relation after it), "fx" (ex2.approx.ftz), and ``--persistent``
  (kernels/gdn_tree_verify_persistent.py: one flattened loop over (item, K chunk) per SM).
  ``--kernel-times N`` adds the profiler's (CUPTI) kernel time of the N fastest rows per batch.
* ``--ablate``: whole stages compiled out (state products, squarings, the series). Those outputs are
  WRONG by design; only their times mean anything. A trivial kernel on the same grid (loads the depths,
  stores logp) gives the floor of launch + graph replay + one wave.

    python benchmarks/verify_ablation.py --sweep --ablate --out $OUT/verify_ablation_h200.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import itertools
import json
import multiprocessing
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gdn_verify import REL_TOL, SHAPES, bench_us, make_inputs, rel_err  # noqa: E402
from bole.ops import gdn as gdn_ops  # noqa: E402
from kernels.gdn_tree_verify import gdn_tree_verify_kernel, squarings_for  # noqa: E402

MODEL = "qwen3.5-9b"
ABLATIONS = {  # name: constexpr overrides of the inverse launch; outputs wrong by design
    "full": {},
    "no_squarings": dict(N_SQUARINGS=0),
    "no_state": dict(HAS_H0=False),
    "no_state_no_squarings": dict(HAS_H0=False, N_SQUARINGS=0),
    "qk_kk_only": dict(HAS_H0=False, INVERSE=False, N_ROUNDS=1),
}
VARIANTS = {  # name: constexpr flags; every one exact (validated)
    "base": dict(),
    "early": dict(EARLY=True),
    "tt": dict(LOWP_TT=True),
    "early_tt": dict(EARLY=True, LOWP_TT=True),
}
CONFIGS = [(32, 64, 4, 3), (32, 32, 4, 3), (32, 32, 4, 2), (32, 128, 8, 3), (32, 128, 8, 2), (32, 64, 8, 3)]
METHODS = ("inverse",)


@triton.jit
def _trivial(depth, logp, cu_seqlens, HV: tl.constexpr, BT: tl.constexpr):
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_seqlens + i_b)
    T = tl.load(cu_seqlens + i_b + 1) - bos
    o_t = tl.arange(0, BT)
    d = tl.load(depth + bos + o_t, mask=o_t < T, other=0)
    if tl.program_id(2) == 0:
        tl.store(logp + (bos + o_t) * HV + i_h, d.to(tl.float32), mask=o_t < T)


class Case:
    """Inputs and output buffers of one (batch, tree size) row."""

    def __init__(self, batch: int, tree: int, device="cuda"):
        s = SHAPES[MODEL]
        self.HK, self.HV, self.K, self.V = s["HK"], s["HV"], s["K"], s["V"]
        self.x = x = make_inputs(MODEL, batch, tree, device, seed=1000 * batch + tree)
        self.f = f = x["forest"]
        self.BT = max(16, triton.next_power_of_2(f.max_nodes))
        N = f.num_nodes
        self.o, self.u = torch.empty_like(x["v"]), torch.empty(N, self.HV, self.V, device=device)
        self.logp = torch.empty(N, self.HV, device=device)
        self.common = (x["q"], x["k"], x["v"], x["g"], x["beta"], f, x["pool"], x["state_indices"])

    def kwargs(self, cfg, method, flags) -> dict:
        bk, bv, w, st, *reg = cfg  # an optional 5th entry: the register cap (ptxas .maxnreg)
        n_rounds = int(self.f.max_depth)
        n_sq = squarings_for(n_rounds)
        kw = dict(HK=self.HK, HV=self.HV, K=self.K, V=self.V, N_WORDS=self.f.anc_bits.shape[1], BT=self.BT,
                  BK=bk, BV=bv, USE_L2NORM=True, HAS_H0=True, HAS_INDICES=True, INVERSE=method == "inverse",
                  LOWP_QK=True, LOWP_S=False, SPLIT_S=False, PRECISION="tf32", N_ROUNDS=n_rounds,
                  N_SQUARINGS=n_sq, EARLY=False, LOWP_TT=False, num_warps=w, num_stages=st)
        if reg and reg[0]:
            kw["maxnreg"] = reg[0]
        return dict(kw, **flags)

    def launch(self, kw):
        x, f = self.x, self.f
        grid = (f.num_requests, self.HV, triton.cdiv(self.V, kw["BV"]))
        gdn_tree_verify_kernel[grid](
            x["q"][0], x["k"][0], x["v"][0], x["g"][0], x["beta"][0], x["pool"], x["state_indices"],
            f.cu_seqlens, f.anc_bits, self.o[0], self.u, self.logp, self.K ** -0.5, **kw)
        return self.o, self.u


def _compile_one(cfg, method, flags, tree):
    c = Case(1, tree)
    try:
        c.launch(c.kwargs(cfg, method, flags))
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"


def kernel_us(fn, name: str, n: int = 50) -> float:
    """Median device time of the kernels named `name` over n launches, from the profiler (CUPTI), L2
    flushed before each launch as do_bench does: the kernel alone, without the launch and event
    overhead that the event-timed `us` carries (a few µs at these sizes, see the "trivial" ablation)."""
    from torch.profiler import ProfilerActivity, profile
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    times = sorted(e.time_range.elapsed_us() for e in prof.events()
                   if name in e.name and e.device_type == torch.autograd.DeviceType.CUDA)
    return times[len(times) // 2] if times else float("nan")


def sweep(args, res):
    variants = {n: f for n, f in VARIANTS.items() if not args.variants or n in args.variants}
    jobs = list(itertools.product(args.configs or CONFIGS, METHODS, variants.items()))
    errs = [None] * len(jobs)
    if args.workers > 0:  # compile in parallel (Triton's disk cache); failures are skipped below
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx) as pool:
            errs = list(pool.map(_compile_one, *zip(*[(c, m, fl, args.tree) for c, m, (_, fl) in jobs])))
    failed = {(c, m, n): e for (c, m, (n, _)), e in zip(jobs, errs) if e}
    res["compile_failed"] = [dict(config=c, method=m, variant=n, error=e) for (c, m, n), e in failed.items()]
    for batch in args.batches:
        case = Case(batch, args.tree)
        o_ref, u_ref, _ = gdn_ops.gdn_tree_verify(*case.common, use_qk_l2norm=True)
        rows = []
        for cfg, method, (name, flags) in jobs:
            if (cfg, method, name) in failed:
                continue
            kw = case.kwargs(cfg, method, flags)
            e = dict(batch=batch, config=list(cfg), method=method, variant=name, us=None)
            try:
                case.o.fill_(float("nan"))
                case.u.fill_(float("nan"))
                o, u = case.launch(kw)
                e["rel_err"], e["rel_err_u"] = rel_err(o, o_ref), rel_err(u, u_ref)
                if None in (e["rel_err"], e["rel_err_u"]) or max(e["rel_err"], e["rel_err_u"]) > REL_TOL:
                    e["rejected"] = True
                else:
                    e["us"] = bench_us(lambda kw=kw, c=case: c.launch(kw), False)
            except Exception as ex:
                e["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
            rows.append(e)
        res["sweep"] += rows
        timed = sorted((r for r in rows if r["us"] is not None), key=lambda r: r["us"])
        print(f"batch {batch}: {len(timed)} timed, {sum(1 for r in rows if r.get('rejected'))} rejected")
        for r in timed[:10]:
            print(f"   {r['us']:7.1f} us  {r['variant']:14s} {r['method']:8s} {r['config']}  "
                  f"err={r['rel_err']:.1e}/{r['rel_err_u']:.1e}")
        for r in timed[:args.kernel_times]:
            kw = case.kwargs(tuple(r["config"]), r["method"], variants[r["variant"]])
            r["kernel_us"] = kernel_us(lambda kw=kw, c=case: c.launch(kw), "gdn_tree_verify_kernel")
            print(f"   kernel time {r['kernel_us']:7.1f} us (event-timed {r['us']:.1f})  {r['variant']} {r['config']}")
        best = {}
        for r in timed:
            best.setdefault(r["variant"], r)
        print("   best per variant: " + ", ".join(f"{n} {r['us']:.1f}" for n, r in best.items()), flush=True)


def ablate(args, res):
    for batch in args.batches_ablate:
        case = Case(batch, args.tree)
        for bv in (64, 16):
            kw0 = case.kwargs((32, bv, 4, 2), "inverse", {})
            grid = (case.f.num_requests, case.HV, triton.cdiv(case.V, bv))
            row = dict(batch=batch, tree_nodes=args.tree, block_v=bv, programs=grid[0] * grid[1] * grid[2])
            for name, over in ABLATIONS.items():
                row[name + "_us"] = bench_us(lambda kw=dict(kw0, **over), c=case: c.launch(kw), False)
            row["trivial_us"] = bench_us(lambda c=case, gr=grid: _trivial[gr](c.f.depth, c.logp, c.f.cu_seqlens,
                                                                              HV=c.HV, BT=c.BT), False)
            res["ablation"].append(row)
            print(json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/verify_ablation.json")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--ablate", action="store_true")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 8, 16, 32])
    ap.add_argument("--batches-ablate", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--tree", type=int, default=64)
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--configs", nargs="*", default=None, type=lambda c: tuple(int(x) for x in c.split(",")),
                    help="BK,BV,warps,stages[,maxnreg] each (default: CONFIGS)")
    ap.add_argument("--variants", nargs="*", default=None, choices=list(VARIANTS))
    ap.add_argument("--kernel-times", type=int, default=0,
                    help="profiler (CUPTI) kernel times of the N fastest rows of each batch")
    args = ap.parse_args()
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command="python " + " ".join(sys.argv), model=MODEL, tree_nodes=args.tree, sweep=[], ablation=[])
    if args.ablate:
        ablate(args, res)
    if args.sweep:
        sweep(args, res)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
