"""GPU correctness sweep of kernels.gdn_tree_verify over its launch configurations.

Every (tree size, config, method, precision) variant runs at Qwen3.5-9B GDN shapes (batch 2, bf16
q/k/v, fp32 pool) with NaN-poisoned outputs and is compared with the torch closed form
(bole.ops.gdn) on the same inputs. Variants compile in parallel worker processes. Writes JSON with
one object per variant and prints the failures: a configuration that is fast but wrong must never be
a default or a benchmark's pick.

    python benchmarks/kernel_check.py --out results.json [--trees 16 32 64 128 256] [--methods horner]

Block_k defaults to the kernel's default for the chunk tile (``DEFAULT_TILES[BC]``).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check(T, cfg, method, precision):
    import torch

    from benchmarks.gdn_verify import make_inputs, rel_err
    from bole.ops import gdn as gdn_ops
    from kernels.gdn_tree_verify import gdn_tree_verify
    from kernels.gdn_tree_verify_launch import VerifyConfig

    x = make_inputs("qwen3.5-9b", 2, T, "cuda", seed=T)
    common = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["forest"], x["pool"], x["state_indices"])
    ref_o, ref_u, _ = gdn_ops.gdn_tree_verify_ref(*common, use_qk_l2norm=True)
    N, HV, V = x["forest"].num_nodes, 32, 128
    outs = dict(o_out=torch.full_like(x["v"], float("nan")),
                u_out=torch.full((N, HV, V), float("nan"), device="cuda"),
                logp_out=torch.full((N, HV), float("nan"), device="cuda"))
    try:
        o, u, _ = gdn_tree_verify(*common, use_qk_l2norm=True, config=VerifyConfig(**cfg), method=method,
                                  input_precision=precision, **outs)
        torch.cuda.synchronize()
    except Exception as e:
        return dict(T=T, config=cfg, method=method, precision=precision, error=f"{type(e).__name__}: {e}"[:300])
    return dict(T=T, config=cfg, method=method, precision=precision, rel_err_o=rel_err(o, ref_o),
                rel_err_u=rel_err(u, ref_u), nonfinite_o=int((~o.isfinite()).sum()),
                nonfinite_u=int((~u.isfinite()).sum()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--trees", type=int, nargs="*", default=[16, 32, 64, 128, 256])
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--stages", type=int, nargs="*", default=[2])
    ap.add_argument("--block-k", type=int, nargs="*", default=None,
                    help="default: the kernel's per-BT default of each method")
    ap.add_argument("--methods", nargs="*", default=None, help="default: every method of the kernel")
    ap.add_argument("--precisions", nargs="*", default=["ieee", "tf32"])
    a = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    from kernels.gdn_tree_verify_launch import DEFAULT_TILES, METHODS, chunk_tile

    tasks = []
    for T in a.trees:
        BC = chunk_tile(T)[0]
        for method in a.methods or METHODS:
            for bk in a.block_k or [DEFAULT_TILES[BC][0]]:
                for st in a.stages:
                    for bv in (16, 32, 64, 128):
                        for w in (4, 8):
                            for prec in a.precisions:
                                tasks.append((T, dict(block_k=bk, block_v=bv, num_warps=w, num_stages=st),
                                              method, prec))
    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=a.workers, mp_context=ctx) as pool:
        results = list(pool.map(_check, *zip(*tasks)))
    bad = [r for r in results if r.get("error") or r["rel_err_o"] is None or r["rel_err_o"] > 1e-2
           or r["rel_err_u"] is None or r["rel_err_u"] > 1e-2]
    json.dump({"elapsed_s": time.time() - t0, "results": results, "failures": bad}, open(a.out, "w"), indent=1)
    print(f"{len(results)} variants in {time.time() - t0:.0f}s, {len(bad)} wrong:")
    for r in bad:
        print(" ", json.dumps(r))


if __name__ == "__main__":
    main()
