"""The drafter's lm_head at the widened shapes: kernels.few_rows_linear against torch's GEMM (cuBLAS).

Per shape (rows M: batch x topk, weight [N, K]: the reduced draft vocabulary or the full one, K the
hidden size of the 4B / 9B / 27B shapes) the median time of a launch (CUDA events over 50 back-to-back
launches, 5 repeats), the weight bandwidth it reaches, and the kernel's largest error against the
float64 product next to cuBLAS's. Beside them cuBLAS on the transposed problem, ``torch.mm(W, x^T)``
(logits [N, M], read as their transpose): the same product with the weight as the GEMM's M side, where
cuBLAS may pick a tile that reads it once (``wxt_ms``), the kernel-free alternative. ``--sweep`` first
times the kernel's launch configurations at K = 4096, N = 32768 (M 16 and 64).

    python benchmarks/draft_logits.py --out benchmarks/results/draft_logits_h200.json [--sweep]
    python benchmarks/draft_logits.py --smoke --sweep      # CPU, Triton interpreter: the harness only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv:  # before triton is imported: the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.few_rows_linear import few_rows_linear  # noqa: E402

CONFIGS = [dict(block_n=128, block_k=64, num_warps=4, num_stages=4),
           dict(block_n=64, block_k=128, num_warps=4, num_stages=4),
           dict(block_n=128, block_k=128, num_warps=8, num_stages=3),
           dict(block_n=256, block_k=64, num_warps=8, num_stages=3),
           dict(block_n=64, block_k=64, num_warps=4, num_stages=6)]


def timed(fn, *args, reps: int = 50, repeats: int = 5, **kw) -> float:
    """Median milliseconds per call of ``fn(*args, **kw)`` over ``repeats`` runs of ``reps`` back-to-back
    calls (CUDA events; wall time on the CPU, where it means nothing)."""
    cuda = torch.cuda.is_available()
    for _ in range(3):
        fn(*args, **kw)
    out = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(*args, **kw)
        if cuda:
            b.record()
            torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / reps if cuda else (time.perf_counter() - t0) * 1e3 / reps)
    return sorted(out)[len(out) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128])
    ap.add_argument("--hidden", type=int, nargs="+", default=[2560, 4096, 5120])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 248320])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU (Triton interpreter), tiny shapes, fp16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    sweep_n, sweep_k = 32768, 4096
    if a.smoke:
        if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--smoke runs Triton's interpreter on CPU tensors: set TRITON_INTERPRET=1 before "
                             "triton is imported (running the script with --smoke does)")
        dev, dt, sweep_n, sweep_k = torch.device("cpu"), torch.float16, 256, 64
        a.rows, a.hidden, a.vocab = [1, 16], [64], [256]
    gen = torch.Generator(device=dev).manual_seed(0)
    doc = dict(gpu=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__,
               date=time.strftime("%Y-%m-%dT%H:%M:%SZ"),
               command=" ".join(sys.argv if argv is None else ["draft_logits.py", *argv]), sweep=[], rows=[])
    if a.sweep:
        w = torch.randn(sweep_n, sweep_k, device=dev, dtype=dt, generator=gen)
        for M in (16, 64):
            x = torch.randn(M, sweep_k, device=dev, dtype=dt, generator=gen)
            ref = x.double() @ w.double().T
            base = timed(F.linear, x, w, reps=3 if a.smoke else 50)
            for c in CONFIGS:
                ms = timed(few_rows_linear, x, w, reps=1 if a.smoke else 50, **c)
                err = float((few_rows_linear(x, w, **c).double() - ref).abs().max())
                base_err = float((F.linear(x, w).double() - ref).abs().max())
                doc["sweep"].append(dict(M=M, N=sweep_n, K=sweep_k, **c, ms=round(ms, 4), cublas_ms=round(base, 4),
                                         max_err=err, cublas_max_err=base_err))
                print("sweep", doc["sweep"][-1], flush=True)
        del w
    for K in a.hidden:
        for N in a.vocab:
            w = (torch.randn(N, K, device=dev, dtype=dt, generator=gen) / K ** 0.5)
            gb, wd = N * K * 2 / 1e9, w.double()
            for M in a.rows:
                x = torch.randn(M, K, device=dev, dtype=dt, generator=gen)
                ref = x.double() @ wd.T
                t_cublas = timed(F.linear, x, w, reps=3 if a.smoke else 50)
                t_kernel = timed(few_rows_linear, x, w, reps=1 if a.smoke else 50)
                t_wxt = timed(torch.mm, w, x.T, reps=3 if a.smoke else 50)
                row = dict(M=M, N=N, K=K, cublas_ms=round(t_cublas, 4), kernel_ms=round(t_kernel, 4),
                           wxt_ms=round(t_wxt, 4), speedup=round(t_cublas / t_kernel, 2),
                           kernel_tb_s=round(gb / t_kernel, 2), cublas_tb_s=round(gb / t_cublas, 2),
                           wxt_max_err=float((torch.mm(w, x.T).T.double() - ref).abs().max()),
                           kernel_max_err=float((few_rows_linear(x, w).double() - ref).abs().max()),
                           cublas_max_err=float((F.linear(x, w).double() - ref).abs().max()))
                doc["rows"].append(row)
                print(row, flush=True)
                del ref
            del w, wd
            torch.cuda.empty_cache()
            if a.out:
                Path(a.out).write_text(json.dumps(doc, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
