"""The engine's GDN verify launches on fp32 activations: closed form against the serial_tree kernel.

The embedded model's engine runs in fp32 (``benchmarks/e2e.py --tiny-dtype float32``), where the
one-pass verifier's products were exact fp32 FMA dots ("ieee"): at its shapes (HK=4, HV=8, K=V=64)
and 59-node trees that measured 38 µs per layer at batch 1 (results/profile_h200.json, 2026-12-01),
slower than its own serial_tree baseline needs to be. This sweep times, in one process, at those
shapes and the engine's tree depth (16 = drafting depth 15 + the root):

* ``serial``: ``kernels.gdn_tree_serial`` as the serial_tree mode launches it (block_v 16), and 32;
* ``closed``: ``kernels.gdn_tree_verify`` over configs × {blocked, horner} × {ieee, tf32x3}
  (3xTF32: tensor-core products with a split low word, about fp32-exact), and the engine's launch
  (``tuned=True``).

Every closed-form launch is validated first against the float64 torch closed form (max-abs error of
O and U relative to max |ref|); above ``FP32_TOL`` it is rejected, not timed. Timing is
``gdn_verify.bench_us`` (CUDA-graph replays, L2 flushed).

    python benchmarks/verify_fp32.py --out $OUT/verify_fp32_h200.json

``--smoke`` runs the same code on the CPU (Triton interpreter, one small tree, two closed-form jobs,
wall-clock times that mean nothing): tests/bench/test_verify_fp32.py.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gdn_verify import bench_us, rel_err  # noqa: E402
from bole.ops import gdn as gdn_ops  # noqa: E402
from bole.spec.tree import DraftTree, PackedForest  # noqa: E402

SHAPE = dict(HK=4, HV=8, K=64, V=64)  # models/bole-tiny-coder
DEPTH = 16
FP32_TOL = 1e-4  # fp32-grade: ieee measures ~1e-6; tf32 (~1e-3) would not pass
CONFIGS = [(64, bv, w, 1) for bv in (16, 32, 64) for w in (4, 8)]
METHODS = ("blocked", "horner")
PRECISIONS = ("ieee", "tf32x3")


def tree(T: int, gen: torch.Generator) -> DraftTree:
    """A chain of DEPTH nodes (the drafter's best path) with the other T - DEPTH nodes hung at random
    below nodes of depth < DEPTH: every tree has the engine's depth bound as its depth."""
    parents = [-1] + list(range(min(T, DEPTH) - 1))
    depth = list(range(1, len(parents) + 1))
    while len(parents) < T:
        cand = [i for i, d in enumerate(depth) if d < DEPTH]
        p = cand[int(torch.randint(len(cand), (1,), generator=gen))]
        parents.append(p)
        depth.append(depth[p] + 1)
    return DraftTree(parents, max_depth=DEPTH)


class Case:
    def __init__(self, batch: int, T: int, device="cuda", seed=0):
        HK, HV, K, V = (SHAPE[n] for n in ("HK", "HV", "K", "V"))
        gen = torch.Generator().manual_seed(seed + 1000 * batch + T)
        self.forest = f = PackedForest.from_trees([tree(T, gen) for _ in range(batch)], device=device,
                                                  max_depth=DEPTH)
        N = f.num_nodes
        rnd = lambda *s: torch.randn(*s, generator=gen)
        x = dict(q=rnd(1, N, HK, K), k=rnd(1, N, HK, K), v=rnd(1, N, HV, V),
                 g=-torch.exp(rnd(HV) * 0.5 - 2.0) * torch.nn.functional.softplus(rnd(1, N, HV)),
                 beta=torch.sigmoid(rnd(1, N, HV)))
        pool = 0.05 * rnd(2 * batch, HV, V, K)
        slots = torch.randperm(2 * batch, generator=gen)[:batch].to(torch.int32)
        self.x = {n: t.to(device) for n, t in x.items()}
        self.pool, self.slots = pool.to(device), slots.to(device)
        self.o = torch.empty_like(self.x["v"])
        self.u, self.logp = torch.empty(N, HV, V, device=device), torch.empty(N, HV, device=device)
        self.snaps = torch.empty(N, HV, V, K, device=device)
        self.args = (self.x["q"], self.x["k"], self.x["v"], self.x["g"], self.x["beta"], f, self.pool, self.slots)

    def reference(self):
        d = lambda t: t.double()
        x = self.x
        o, u, _ = gdn_ops.gdn_tree_verify_ref(d(x["q"]), d(x["k"]), d(x["v"]), d(x["g"]), d(x["beta"]), self.forest,
                                          d(self.pool), self.slots, use_qk_l2norm=True)
        return o, u

    def closed(self, kw):
        from kernels.gdn_tree_verify import gdn_tree_verify
        from kernels.gdn_tree_verify_launch import VerifyConfig

        kw = dict(kw)
        if "config" in kw:
            kw["config"] = VerifyConfig(*kw["config"])
        return gdn_tree_verify(*self.args, use_qk_l2norm=True, u_out=self.u, logp_out=self.logp, o_out=self.o, **kw)

    def serial(self, block_v):
        from kernels.gdn_tree_serial import gdn_tree_serial

        return gdn_tree_serial(*self.args, use_qk_l2norm=True, snapshots_out=self.snaps, o_out=self.o,
                               block_v=block_v)


def closed_jobs(smoke: bool = False) -> list[dict]:
    if smoke:
        return [dict(config=(64, 16, 4, 1), method="blocked", input_precision="tf32x3"), dict(tuned=True)]
    jobs = [dict(config=c, method=m, input_precision=p) for c, m, p in itertools.product(CONFIGS, METHODS, PRECISIONS)]
    return jobs + [dict(tuned=True)]


def label(kw) -> str:
    return "tuned" if kw.get("tuned") else f"{kw['method']}/{kw['input_precision']}/{kw['config']}"


def _compile(kw, T):
    try:
        Case(1, T).closed(kw)
        torch.cuda.synchronize()  # fills Triton's disk cache for the main process
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/verify_fp32.json")
    ap.add_argument("--trees", type=int, nargs="*", default=None, help="nodes per tree (16 32 59)")
    ap.add_argument("--batches", type=int, nargs="*", default=None, help="(1 2 4 8 16)")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--compile-s", type=float, default=150.0, help="precompile budget; unfinished jobs skipped")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, one small tree")
    a = ap.parse_args(argv)
    a.trees = a.trees or ([DEPTH] if a.smoke else [16, 32, 59])
    a.batches = a.batches or ([1] if a.smoke else [1, 2, 4, 8, 16])
    device = "cpu" if a.smoke else "cuda"
    res = dict(gpu="cpu (smoke)" if a.smoke else torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command="python " + " ".join(sys.argv if argv is None else ["verify_fp32.py", *argv]), shape=SHAPE,
               depth=DEPTH, tol=FP32_TOL, rows=[], compile_failed=[])
    jobs = closed_jobs(a.smoke)
    failed: dict = {}
    if not a.smoke:
        precompile(jobs, a, failed, res)
    for T, B in itertools.product(a.trees, a.batches):
        c = Case(B, T, device=device)
        run_row(c, T, B, jobs, failed, a.smoke, res)
        Path(a.out).write_text(json.dumps(res, indent=1))
    Path(a.out).write_text(json.dumps(res, indent=1))
    return res


def precompile(jobs, a, failed, res):
    """Every (job, tree) compiled once in worker processes (Triton's disk cache); failures and what has
    not compiled within ``--compile-s`` are skipped, never launched here."""
    ctx = multiprocessing.get_context("spawn")
    pool = cf.ProcessPoolExecutor(max_workers=a.workers, mp_context=ctx)
    futs = {(label(kw), T): pool.submit(_compile, kw, T) for T in a.trees for kw in jobs}
    done, _ = cf.wait(futs.values(), timeout=a.compile_s)
    for key, fu in futs.items():
        err = fu.result() if fu in done else f"not compiled within {a.compile_s:.0f}s"
        if err:
            failed[key] = err
            res["compile_failed"].append(dict(job=key[0], tree=key[1], error=err))
    for p in list(getattr(pool, "_processes", {}).values()):  # a stalled compile must not hold the run
        p.terminate()
    pool.shutdown(wait=False, cancel_futures=True)
    print(f"compiled {len(futs) - len(failed)} of {len(futs)}", flush=True)


def run_row(c, T, B, jobs, failed, smoke, res):
    """One (tree size, batch): the serial kernel timed, every closed-form job validated, then timed."""
    o_ref, u_ref = c.reference()
    row = dict(tree_nodes=T, batch=B, serial={}, closed=[])
    for bv in (16, 32):
        row["serial"][str(bv)] = bench_us(lambda bv=bv, c=c: c.serial(bv), smoke)
        if bv == 16:
            row["serial_rel_err"] = rel_err(c.serial(16)[0], o_ref)
    for kw in jobs:
        if (label(kw), T) in failed:
            continue
        e = dict(job=label(kw), us=None)
        c.o.fill_(float("nan"))
        c.u.fill_(float("nan"))
        o, u, _ = c.closed(kw)
        e["rel_err"], e["rel_err_u"] = rel_err(o, o_ref), rel_err(u, u_ref)
        if None in (e["rel_err"], e["rel_err_u"]) or max(e["rel_err"], e["rel_err_u"]) > FP32_TOL:
            e["rejected"] = True
        else:
            e["us"] = bench_us(lambda kw=kw, c=c: c.closed(kw), smoke)
        row["closed"].append(e)
    res["rows"].append(row)
    timed = sorted((e for e in row["closed"] if e["us"] is not None), key=lambda e: e["us"])
    tuned = next((e for e in row["closed"] if e["job"] == "tuned"), {})
    print(f"T={T:3d} B={B:2d} serial16={row['serial']['16']:7.1f} serial32={row['serial']['32']:7.1f} "
          f"tuned={tuned.get('us') or float('nan'):7.1f} us; best: "
          + "; ".join(f"{e['job']} {e['us']:.1f} ({e['rel_err']:.0e})" for e in timed[:3]), flush=True)


if __name__ == "__main__":
    main()
