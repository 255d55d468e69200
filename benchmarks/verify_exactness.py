"""Exactness of every GDN tree verifier on hard inputs: error against float64, over key cosine × tree.

Inputs from ``bole.ops.gdn_inputs.verify_inputs``: keys (and queries) a·c + noise with a shared
direction per key head (mean pairwise cosine of the normalised keys = ``--cos``), β = sigmoid(N + 2.5)
("high", ≈ 0.9) and g = −0.02·softplus(N) ("slow"), as issue 23's table; ``--gates one`` adds β → 1,
decay → 1. Trees: chains (the deepest), single-root EAGLE-like random trees (SGLang's serial kernel
takes one first-level node). The reference is the float64 closed form (``bole.ops.gdn.gdn_tree_verify_ref``
on float64 inputs: a triangular solve per request), itself checked against the float64 serial
recurrence on the first request of every row.

Contenders, each on the same bf16 q/k/v with an fp32 pool, O compared as max|O − O_ref| / max|O_ref|:
    bole_bf16        kernels.gdn_tree_verify(..., tuned=True): the engine's call (bole/layers/gdn.py)
    bole_fp32        the same on fp32 q/k/v (the fp32 engine's launch), against the fp32 inputs' reference
    sglang_serial    SGLang 0.5.23's serial tree verifier (benchmarks/peers.py)
    sglang_chunk     SGLang's dev-tree chunk verifier (benchmarks/peers_dev.py; T <= 64)
    sglang_fused     SGLang's dev-tree fused verifier (benchmarks/peers_dev.py)
A contender that is absent or refuses the shape gets null and a note.

    python benchmarks/verify_exactness.py                      # H200: 9B heads, batch 16
    python benchmarks/verify_exactness.py --smoke              # CPU, interpreter, tiny heads
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
COSINES = (0.0, 0.5, 0.69, 0.9, 0.99)
TREES = ("chain16", "random64d8", "random64d16", "chain32", "chain64", "chain128", "random256d16", "chain256")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="default benchmarks/results/verify_exactness_h200.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny heads, 2 trees")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--cos", type=float, nargs="*", default=list(COSINES))
    ap.add_argument("--trees", nargs="*", default=list(TREES))
    ap.add_argument("--gates", nargs="*", default=["high_slow", "one"], help="high_slow and/or one")
    return ap.parse_args(argv)


def make_tree(name: str, gen):
    from benchmarks.peers import single_root_tree
    from bole.spec.tree import DraftTree

    if name.startswith("chain"):
        return DraftTree.chain(int(name[5:]))
    n, d = name[6:].split("d")
    return single_root_tree(int(n), int(d), generator=gen)


def max_rel(o, ref) -> float | None:
    import torch

    o, ref = o.double(), ref.double()
    if not bool(torch.isfinite(o).all()):
        return None
    return float((o - ref).abs().max() / ref.abs().max())


def contenders(smoke: bool):
    """name -> (fn(q, k, v, g, beta, forest, pool, idx) -> O, input dtype)."""
    import torch

    from benchmarks import peers, peers_dev
    from kernels.gdn_tree_verify import gdn_tree_verify

    half = torch.float16 if smoke else torch.bfloat16  # the interpreter's bf16 dots are wrong
    ours = lambda *a: gdn_tree_verify(*a, use_qk_l2norm=True, tuned=True)[0]
    out = {"bole_bf16": (ours, half), "bole_fp32": (ours, torch.float32)}
    if peers.sglang_available():
        out["sglang_serial"] = (lambda *a: peers.SGLangTreeVerifier(*a, use_qk_l2norm=True)(), half)
    if peers_dev.chunk_available():
        out["sglang_chunk"] = (lambda *a: peers_dev.SGLangChunkTreeVerifier(*a, use_qk_l2norm=True)(), half)
    if peers_dev.fused_available():
        out["sglang_fused"] = (lambda *a: peers_dev.SGLangFusedTreeVerifier(*a, use_qk_l2norm=True)(), half)
    return out


def run(args) -> dict:
    import torch

    from bole.ops import gdn as ref_ops
    from bole.ops.gdn_inputs import mean_cosine, verify_inputs
    from bole.spec.tree import PackedForest

    device = "cpu" if args.smoke else "cuda"
    HK, HV, K, V = (1, 2, 16, 16) if args.smoke else (16, 32, 128, 128)
    batch = 2 if args.smoke else args.batch
    trees = args.trees[:2] if args.smoke else args.trees
    cands = contenders(args.smoke)
    rows, notes = [], []
    for tree in trees:
        gen = torch.Generator().manual_seed(0)
        forest = PackedForest.from_trees([make_tree(tree, gen) for _ in range(batch)], device=device)
        for gates in args.gates:
            beta, decay = ("high", "slow") if gates == "high_slow" else ("one", "one")
            for cos in args.cos:
                row = dict(tree=tree, nodes=forest.max_nodes, depth=int(forest.max_depth), gates=gates,
                           key_cos=cos)
                refs = {}
                for name, (fn, dtype) in cands.items():
                    x = verify_inputs(forest, HK, HV, K, V, key_cos=cos, beta=beta, decay=decay, dtype=dtype,
                                      seed=1, device=device)
                    if dtype not in refs:
                        d = [t.double() for t in x[:5]]
                        refs[dtype] = ref_ops.gdn_tree_verify_ref(*d, forest, x[5].double(), x[6],
                                                              use_qk_l2norm=True)[0]
                        if "measured_cos" not in row:
                            row["measured_cos"] = round(mean_cosine(x[1][0, :, 0].float()), 3)
                    try:
                        o = fn(*x[:5], forest, x[5], x[6])
                        if device == "cuda":
                            torch.cuda.synchronize()
                        row[name] = max_rel(o, refs[dtype])
                    except Exception as e:  # a limit of the contender (size, dtype): say which
                        row[name] = None
                        row[f"{name}_note"] = f"{type(e).__name__}: {str(e)[:160]}"
                # the float64 closed form against the float64 serial recurrence, first request
                one = PackedForest.from_trees([forest.tree(0)], device=device)
                x = verify_inputs(one, HK, HV, K, V, key_cos=cos, beta=beta, decay=decay, seed=2, device=device)
                d = [t.double() for t in x[:5]]
                o_cf = ref_ops.gdn_tree_verify_ref(*d, one, x[5].double(), x[6], use_qk_l2norm=True)[0]
                o_se = ref_ops.gdn_tree_serial_ref(*d, one, x[5].double(), x[6], use_qk_l2norm=True)[0]
                row["reference_vs_serial64"] = max_rel(o_cf, o_se)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return dict(rows=rows, notes=notes, contenders=list(cands), heads=dict(HK=HK, HV=HV, K=K, V=V), batch=batch)


def print_table(report):
    names = report["contenders"]
    print(f"{'tree':<13} {'gates':<9} {'cos':>5} {'meas':>5} " + " ".join(f"{n:>13}" for n in names))
    for r in report["rows"]:
        cells = " ".join(f"{'-' if r.get(n) is None else format(r[n], '.1e'):>13}" for n in names)
        print(f"{r['tree']:<13} {r['gates']:<9} {r['key_cos']:>5.2f} {r.get('measured_cos', 0):>5.2f} {cells}")


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(REPO_ROOT))
    import torch
    import triton

    report = run(args)
    report.update(gpu=torch.cuda.get_device_name() if not args.smoke else "cpu (TRITON_INTERPRET=1)",
                  torch=torch.__version__, triton=triton.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=shlex.join(["python", *sys.argv]))
    out = Path(args.out or ("/tmp/verify_exactness_smoke.json" if args.smoke
                            else REPO_ROOT / "benchmarks/results/verify_exactness_h200.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print_table(report)
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
