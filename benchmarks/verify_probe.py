"""Probe the tree verifier's launches side by side: chosen (method, config, precision) candidates at
Qwen3.5 GDN shapes, each validated before it is timed, with SGLang's serial tree verifier as the baseline
in the same process, and the registers / spills of every compiled variant.

`gdn_verify.py` is the issue's benchmark (every method's default and its neighbours, all tree sizes);
this is the narrower tool for deciding a kernel change: a fixed list of candidates (`candidates`), the
same inputs, validation and timing as gdn_verify.py (`make_inputs`, `bench_us`: CUDA-graph replays,
L2 flushed), so its numbers are comparable with that table's.

    python benchmarks/verify_probe.py --out $OUT/verify_probe_h200.json --batches 1 16 --trees 64
    python benchmarks/verify_probe.py --ncu-case LABEL --batches 16 --trees 64   # two launches, for ncu
    python benchmarks/verify_probe.py --smoke                                    # CPU interpreter check
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/verify_probe.json")
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 8, 16, 32])
    ap.add_argument("--trees", type=int, nargs="*", default=[64])
    ap.add_argument("--ncu-case", default=None, help="run only this candidate label, twice, untimed")
    ap.add_argument("--ncu-cases-out", default=None, help="write 'batch label' lines of the fastest "
                    "candidate per batch and method family, for a later ncu pass")
    ap.add_argument("--compile-workers", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(REPO_ROOT))
from benchmarks.gdn_verify import (  # noqa: E402
    REL_TOL,
    SHAPES,
    bench_us,
    copy_bandwidth,
    floor_bytes,
    load_bole_kernel,
    make_inputs,
    rel_err,
)
from benchmarks.kernel_sweep import precompile  # noqa: E402
from benchmarks.peers import SGLangTreeVerifier, sglang_available  # noqa: E402
from bole.ops import gdn as gdn_ops  # noqa: E402
from kernels.gdn_tree_verify import VerifyConfig, gdn_tree_verify  # noqa: E402

_KEYS = dict(bk="block_k", bv="block_v", w="num_warps", s="num_stages", ng="heads_per_program",
             nvt="tiles_per_program", e="early_loads")


def label(method: str, cfg: VerifyConfig, precision: str) -> str:
    return f"{method}:" + ",".join(f"{k}={int(getattr(cfg, f))}" for k, f in _KEYS.items()) + f":{precision}"


def parse_label(lab: str) -> dict:
    method, cfg, precision = lab.split(":")
    kv = dict(part.split("=") for part in cfg.split(","))
    return dict(method=method, config=VerifyConfig(**{_KEYS[k]: bool(int(v)) if k == "e" else int(v)
                                                      for k, v in kv.items()}),
                input_precision=precision)


def candidates(smoke: bool) -> list[str]:
    """The one-pass kernel's fastest validated launches of the last measurement (results/
    verify_ablation2_h200.json: inverse tf32 with 3 stages), then the grouped method over heads × tiles
    × tile sizes."""
    if smoke:
        return [label("inverse", VerifyConfig(16, 16, 4, 1), "ieee"),
                label("grouped", VerifyConfig(16, 16, 4, 1, 2, 1), "ieee")]
    out = [label("inverse", VerifyConfig(32, 32, 4, 3, early_loads=True), "tf32"),
           label("inverse", VerifyConfig(32, 128, 8, 3, early_loads=True), "tf32"),
           label("inverse", VerifyConfig(32, 128, 8, 3), "tf32"),
           label("inverse", VerifyConfig(32, 64, 4, 3), "tf32")]
    for ng, nvt, bv in ((1, 1, 64), (1, 1, 32), (1, 2, 64), (2, 1, 64), (2, 2, 64), (2, 1, 32), (2, 4, 32),
                        (2, 1, 128), (1, 1, 16), (2, 2, 32)):
        for w in (4, 8):
            for bk in (32, 64):
                out.append(label("grouped", VerifyConfig(bk, bv, w, 2, ng, nvt), "tf32"))
    out.append(label("grouped", VerifyConfig(32, 64, 8, 2, 2, 2), "ieee"))
    out.append(label("grouped", VerifyConfig(32, 64, 4, 2, 1, 1), "ieee"))
    return out


def compiled_resources() -> list[dict]:
    """Registers and spills of every variant compiled in this process (Triton's per-device caches)."""
    from kernels.gdn_tree_verify import gdn_tree_verify_kernel
    from kernels.gdn_tree_verify_grouped import gdn_tree_verify_grouped_kernel

    out = []
    for name, fn in (("one_pass", gdn_tree_verify_kernel), ("grouped", gdn_tree_verify_grouped_kernel)):
        for caches in getattr(fn, "device_caches", {}).values():
            for key, ck in caches[0].items():
                try:
                    ck._init_handles()
                    c = {k: v for k, v in ck.src.constants.items() if isinstance(v, (int, bool, str))} \
                        if hasattr(ck.src, "constants") else {}
                    out.append(dict(kernel=name, n_regs=ck.n_regs, n_spills=ck.n_spills,
                                    num_warps=ck.metadata.num_warps, num_stages=ck.metadata.num_stages,
                                    shared=ck.metadata.shared, constants=str(c)[:300] or str(key)[:300]))
                except Exception as e:  # best effort: the report, not the timing, loses a line
                    out.append(dict(kernel=name, error=f"{type(e).__name__}: {e}"))
    return out


def main(args):
    model = "tiny" if args.smoke else args.model
    device = "cpu" if args.smoke else "cuda"
    labels = [args.ncu_case] if args.ncu_case else candidates(args.smoke)
    batches = [1, 2] if args.smoke else args.batches
    trees = [8] if args.smoke else args.trees
    res = dict(gpu=None if args.smoke else torch.cuda.get_device_name(), torch=torch.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command="python " + " ".join(shlex.quote(a) for a in sys.argv), model=model, rows=[],
               notes=[])
    import triton

    res["triton"] = triton.__version__
    bole, _ = load_bole_kernel()  # its `failed` set: (model, T, label of the launch kwargs)
    if not args.smoke and not args.ncu_case and args.compile_workers > 0:
        tasks = [("bole", model, 1, T, parse_label(lab)) for T in trees for lab in labels]
        res["precompile_s"] = round(precompile(tasks, args.compile_workers, bole, res["notes"], 300, trees), 1)
        print(f"precompiled {len(tasks)} variants in {res['precompile_s']} s, {len(bole.failed)} failed")
    if not args.smoke:
        res["copy_bandwidth"] = copy_bandwidth(device, False)
    bw = res["copy_bandwidth"]["gb_per_s"] * 1e9 if "copy_bandwidth" in res else 1e9
    best_per_family: dict[int, dict[str, tuple[float, str]]] = {}
    for T in trees:
        for batch in batches:
            x = make_inputs(model, batch, T, device, seed=args.seed + 1000 * batch + T)
            common = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["forest"], x["pool"], x["state_indices"])
            N, HV, V = x["forest"].num_nodes, SHAPES[model]["HV"], SHAPES[model]["V"]
            outs = dict(o_out=torch.empty_like(x["v"]), u_out=torch.empty(N, HV, V, device=device),
                        logp_out=torch.empty(N, HV, device=device))
            if args.ncu_case:
                for _ in range(2):
                    gdn_tree_verify(*common, use_qk_l2norm=True, **outs, **parse_label(args.ncu_case))
                torch.cuda.synchronize()
                continue
            row = dict(batch=batch, tree_nodes=T, depth=int(x["forest"].depth.max()),
                       floor_us=floor_bytes(x) / bw * 1e6, sglang_tree_us=None, candidates=[])
            _, u_ref, _ = gdn_ops.gdn_tree_verify(*common, use_qk_l2norm=True)
            o_ref = None
            if sglang_available():
                peer = SGLangTreeVerifier(*common, use_qk_l2norm=True)
                o_ref = peer()
                row["sglang_tree_us"] = bench_us(peer, args.smoke)
                del peer
            else:
                o_ref = gdn_ops.gdn_tree_verify(*common, use_qk_l2norm=True)[0]
                res["notes"].append("no .peers/sglang: O compared with the torch closed form")
            for lab in labels:
                if (model, T, bole.label(parse_label(lab))) in bole.failed:
                    continue
                kw = dict(use_qk_l2norm=True, **outs, **parse_label(lab))
                call = lambda c=common, kw=kw: gdn_tree_verify(*c, **kw)
                e = dict(label=lab, us=None)
                try:
                    for t in outs.values():
                        t.fill_(float("nan"))
                    o, u, _ = call()
                    e["rel_err"], e["rel_err_u"] = rel_err(o, o_ref), rel_err(u, u_ref)
                    if e["rel_err"] is None or e["rel_err"] > REL_TOL or e["rel_err_u"] is None \
                            or e["rel_err_u"] > REL_TOL:
                        e["rejected"] = True
                    else:
                        e["us"] = bench_us(call, args.smoke)
                except Exception as ex:
                    e["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
                row["candidates"].append(e)
                if e["us"] is not None:
                    fam = lab.split(":")[0] if lab.startswith("grouped") else "one_pass"
                    cur = best_per_family.setdefault(batch, {}).get(fam)
                    if cur is None or e["us"] < cur[0]:
                        best_per_family[batch][fam] = (e["us"], lab)
            timed = sorted((c for c in row["candidates"] if c["us"] is not None), key=lambda c: c["us"])
            if timed and row["sglang_tree_us"]:
                row["best"] = dict(timed[0], x_sglang=row["sglang_tree_us"] / timed[0]["us"],
                                   x_floor=timed[0]["us"] / row["floor_us"])
            res["rows"].append(row)
            sg = row["sglang_tree_us"]
            print(f"T={T} batch={batch} depth={row['depth']} sglang={sg} floor={row['floor_us']:.1f}")
            for c in timed[:12]:
                ratio = f" x{sg / c['us']:.1f}" if sg else ""
                print(f"   {c['us']:8.1f} us{ratio}  {c['label']}  err={c['rel_err']:.1e}/{c['rel_err_u']:.1e}")
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1))
            del x, common
            if device == "cuda":
                torch.cuda.empty_cache()
    if args.ncu_case:
        return
    res["resources"] = compiled_resources() if not args.smoke else []
    Path(args.out).write_text(json.dumps(res, indent=1))
    if args.ncu_cases_out:
        with open(args.ncu_cases_out, "w") as f:
            for batch, fams in best_per_family.items():
                for _, lab in fams.values():
                    f.write(f"{batch} {lab}\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(ARGS)
