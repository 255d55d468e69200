"""The drafter's lm_head at the widened shapes: one GEMM over contiguous rows against F.linear on the
strided frontier (what the drafter ran before ``MTPDrafter.compute_logits`` flattened its input).

A draft level scores each request's frontier, M rows of a [B, S, K] forest buffer sliced at its new
nodes: a strided [B, M, K] view. Under inference mode F.linear runs that as a bmm with the weight expanded
per request when the weight needs no grad (the reduced draft vocabulary's gathered rows), reading it B
times; on the flattened contiguous [B*M, K] rows it is one GEMM that reads it once. Per shape (weight
[N, K]: the reduced draft vocabulary or the full one, K the 4B / 9B / 27B hidden sizes) the median time
(CUDA events over 50 back-to-back launches, 5 repeats) of the strided call (``strided_ms``), of the GEMM on
the flattened rows, the copy included (``gemm_ms``, what compute_logits runs), and of the transposed
product ``torch.mm(W, x^T)`` (``wxt_ms``); the weight bandwidth of each; each one's largest error against
the float64 product.

    python benchmarks/draft_logits.py --out benchmarks/results/draft_logits_h200.json
    python benchmarks/draft_logits.py --smoke            # CPU, tiny shapes: the harness only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, *args, reps: int = 50, repeats: int = 5) -> float:
    """Median milliseconds per call of ``fn(*args)`` over ``repeats`` runs of ``reps`` back-to-back calls
    (CUDA events; wall time on the CPU, where it means nothing)."""
    cuda = torch.cuda.is_available()
    for _ in range(3):
        fn(*args)
    out = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        if cuda:
            b.record()
            torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / reps if cuda else (time.perf_counter() - t0) * 1e3 / reps)
    return sorted(out)[len(out) // 2]


def flat_gemm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What ``MTPDrafter.compute_logits`` runs: the rows flattened (copied when strided), one GEMM."""
    return F.linear(h.reshape(-1, h.shape[-1]), w).view(*h.shape[:-1], w.shape[0])


def max_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rows", type=int, default=16, help="frontier rows per request (topk x beam)")
    ap.add_argument("--hidden", type=int, nargs="+", default=[2560, 4096, 5120])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 248320])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, float32")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev, dt, reps = torch.device("cuda"), torch.bfloat16, 50
    if a.smoke:
        dev, dt, reps = torch.device("cpu"), torch.float32, 2
        a.batches, a.rows, a.hidden, a.vocab = [1, 4], 4, [64], [256]
    gen = torch.Generator(device=dev).manual_seed(0)
    doc = dict(gpu=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__,
               date=time.strftime("%Y-%m-%dT%H:%M:%SZ"), rows_per_request=a.rows,
               command=" ".join(sys.argv if argv is None else ["draft_logits.py", *argv]), rows=[])
    with torch.inference_mode():
        for K in a.hidden:
            for N in a.vocab:
                w = torch.randn(N, K, device=dev, dtype=dt, generator=gen) / K ** 0.5  # needs no grad
                gb, wd = N * K * w.element_size() / 1e9, w.double()
                for B in a.batches:
                    forest = torch.randn(B, 3 * a.rows, K, device=dev, dtype=dt, generator=gen)
                    h = forest[:, 2 * a.rows:]  # the last level's frontier: strided
                    ref = h.double() @ wd.T
                    t_strided = timed(F.linear, h, w, reps=reps)
                    t_gemm = timed(flat_gemm, h, w, reps=reps)
                    x = h.reshape(-1, K)
                    t_wxt = timed(torch.mm, w, x.T, reps=reps)
                    row = dict(B=B, M=a.rows, N=N, K=K, strided_ms=round(t_strided, 4), gemm_ms=round(t_gemm, 4),
                               wxt_ms=round(t_wxt, 4), speedup=round(t_strided / t_gemm, 2),
                               strided_tb_s=round(gb / t_strided, 2), gemm_tb_s=round(gb / t_gemm, 2),
                               wxt_tb_s=round(gb / t_wxt, 2), strided_max_err=max_err(F.linear(h, w), ref),
                               gemm_max_err=max_err(flat_gemm(h, w), ref),
                               wxt_max_err=max_err(torch.mm(w, x.T).T.reshape(B, a.rows, N), ref))
                    doc["rows"].append(row)
                    print(row, flush=True)
                    del ref, forest
                del w, wd
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                if a.out:
                    Path(a.out).write_text(json.dumps(doc, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
