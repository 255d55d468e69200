"""A MoE block's routed experts at the Qwen3.5-35B-A3B shape: kernels.moe_experts against the torch loop.

Per token count N (decode batches, and the verify forward's tree nodes), random routings as a trained
router spreads them (top-8 of softmax(randn) over 256 experts), bf16 weights of the shape (256 experts of
512, hidden 2048): milliseconds of the loop over the routed experts (bole.ops.moe, the torch backend's: a
host read per call, so it cannot be graphed), of the kernel eagerly, and of the kernel replayed in a CUDA
graph (how the engine runs it); the distinct experts the routing reads and their weight bytes; the floor
(those bytes at this GPU's measured device-to-device copy bandwidth, timed in the same run) and each path
against it; the kernel's largest error against the float64 twin, beside the loop's.

    python benchmarks/moe_dispatch.py --sweep --out benchmarks/results/moe_dispatch_h200.json
    python benchmarks/moe_dispatch.py --smoke --sweep   # CPU, Triton interpreter, tiny shapes: the harness only
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv:  # before triton is imported: the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.draft_logits import timed  # noqa: E402
from bole.calibrate_sweep import SHAPES  # noqa: E402
from bole.ops.moe import moe_experts_ref  # noqa: E402
from kernels.moe_experts import moe_experts  # noqa: E402

SHAPE = "qwen3.5-35b-a3b"
CONFIGS = [dict(block_n=64, block_k=64, num_warps=4), dict(block_n=32, block_k=128, num_warps=4),
           dict(block_n=128, block_k=64, num_warps=4), dict(block_n=64, block_k=128, num_warps=8),
           dict(block_n=128, block_k=128, num_warps=8)]  # the first is the kernel's default


def copy_bandwidth(dev) -> float:
    """Bytes per ms of a device-to-device copy (read + write) of 1 GiB (CPU: 64 MiB)."""
    n = (1 << 30) if dev.type == "cuda" else (64 << 20)
    src, dst = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    return 2 * n / timed(lambda: dst.copy_(src), reps=10 if dev.type == "cuda" else 1)


def graphed(fn):
    """``fn`` captured once in a CUDA graph; the replay (on the CPU: ``fn`` itself)."""
    if not torch.cuda.is_available():
        return fn
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--sweep", action="store_true",
                    help="first the kernel's launch configurations (block_n, block_k, num_warps), graphed, at 16 and "
                         "256 tokens")
    ap.add_argument("--smoke", action="store_true", help="CPU (Triton interpreter), tiny shapes, fp16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    s = SHAPES[SHAPE]
    E, H, I, k = s["num_experts"], s["hidden_size"], s["moe_intermediate_size"], s["num_experts_per_tok"]
    dev, dt = torch.device("cuda"), torch.bfloat16
    if a.smoke:
        if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--smoke runs Triton's interpreter on CPU tensors: set TRITON_INTERPRET=1 before "
                             "triton is imported (running the script with --smoke does)")
        dev, dt, E, H, I, k, a.tokens = torch.device("cpu"), torch.float16, 8, 32, 16, 2, [1, 5]
    gen = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=gen) / H ** 0.5
    down = torch.randn(E, H, I, device=dev, dtype=dt, generator=gen) / I ** 0.5
    expert_bytes = 3 * I * H * gate_up.element_size()
    bw = copy_bandwidth(dev)
    doc = dict(gpu=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__,
               date=time.strftime("%Y-%m-%dT%H:%M:%SZ"),
               command=" ".join(sys.argv if argv is None else ["moe_dispatch.py", *argv]),
               shape=dict(name=SHAPE if not a.smoke else "smoke", experts=E, hidden=H, moe_intermediate=I, top_k=k,
                          dtype=str(dt).replace("torch.", "")),
               copy_gb_s=round(bw / 1e6, 1), sweep=[], rows=[])
    reps = 1 if a.smoke else 20
    for N in (((4, 16) if a.smoke else (16, 256)) if a.sweep else ()):
        x = torch.randn(N, H, device=dev, dtype=dt, generator=gen)
        top_w, top_idx = torch.softmax(torch.randn(N, E, device=dev, generator=gen), -1).topk(k, dim=-1)
        for c in CONFIGS:
            kernel = functools.partial(moe_experts, x, gate_up, down, top_idx, top_w, **c)
            doc["sweep"].append(dict(tokens=N, **c, kernel_graph_ms=round(timed(graphed(kernel), reps=reps), 4)))
            print("sweep", doc["sweep"][-1], flush=True)
    for N in a.tokens:
        x = torch.randn(N, H, device=dev, dtype=dt, generator=gen)
        logits = torch.randn(N, E, device=dev, generator=gen)
        top_w, top_idx = torch.softmax(logits, -1).topk(k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        distinct = int(torch.unique(top_idx).numel())
        floor = distinct * expert_bytes / bw
        loop = functools.partial(moe_experts_ref, x, gate_up, down, top_idx, top_w)  # fp32 weights, as the layer
        kernel = functools.partial(moe_experts, x, gate_up, down, top_idx, top_w)
        loop_ms, kernel_ms = timed(loop, reps=reps), timed(kernel, reps=reps)
        graph_ms = timed(graphed(kernel), reps=reps)
        ref = moe_experts_ref(x.double(), gate_up.double(), down.double(), top_idx, top_w.double())
        scale = float(ref.abs().max())
        row = dict(tokens=N, distinct_experts=distinct, expert_mb=round(distinct * expert_bytes / 1e6, 1),
                   floor_ms=round(floor, 4), loop_ms=round(loop_ms, 4), kernel_ms=round(kernel_ms, 4),
                   kernel_graph_ms=round(graph_ms, 4), graph_over_floor=round(graph_ms / floor, 2),
                   loop_over_graph=round(loop_ms / graph_ms, 2),
                   kernel_rel_err=round(float((kernel().double() - ref).abs().max()) / scale, 6),
                   loop_rel_err=round(float((loop().double() - ref).abs().max()) / scale, 6))
        doc["rows"].append(row)
        print(row, flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(doc, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
