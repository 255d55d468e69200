"""fp32 GDN prefill on the GPU: flash-linear-attention's chunk against our recurrence (kernels.gdn_recurrent).

The triton backend sends every fp32 prefill to the recurrence since 2026-12-02 (bole/backend.py): fla's
chunk kernels take TF32 products for fp32 inputs. This measures, in one run, what that costs and buys:

* op level, the embedded model's GDN shapes (HK=4, HV=8, K=V=64), fp32, L2-normalised q/k, states from
  pool slots: the time of one layer's prefill (do_bench, no graph: fla plans on the host) and its error
  (max-abs relative to max |ref|, o and final state) against the float64 twin, for fla, the recurrence
  and the torch chunk, over single prompts of 13 to 2048 tokens and the 16 held-out prompts packed;
* engine level, the embedded model in fp32 (``bole`` mode, graphs on): the wall time of the prefill step
  for held-out prompt 2 (180 tokens) alone and for the 16 held-out prompts at once, with the backend's
  routing as shipped and with fp32 sent to fla (the previous routing), and whether the first tokens agree.

    python benchmarks/prefill_fp32.py --out $OUT/prefill_fp32_h200.json

The op level also runs at a target shape and dtype, for where the recurrence should hand over to fla
(``bole.backend.FLA_MIN_TOKENS``, never measured at 9B; the recurrence is what prefill graphs capture):

    python benchmarks/prefill_fp32.py --shape qwen3.5-9b --dtype bfloat16 --op-only --lens 64 128 256 512 \
        --out $OUT/prefill_9b.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import triton

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from benchmarks.gdn_verify import SHAPES, bench_us  # noqa: E402
from bole import backend as backend_mod  # noqa: E402
from bole.ops import gdn as gdn_ops  # noqa: E402
from bole.ops.gdn_chunk import gdn_chunk  # noqa: E402
from kernels.gdn_recurrent import gdn_recurrent  # noqa: E402

MODEL = REPO_ROOT / "models" / "bole-tiny-coder"
PROMPTS = REPO_ROOT / "benchmarks" / "data" / "heldout_prompts.jsonl"


def rel(a, ref) -> float:
    return float((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def op_row(fla, name, lens, HK=4, HV=8, K=64, V=64, dtype=torch.float32) -> dict:
    gen = torch.Generator().manual_seed(len(lens) * 1000 + sum(lens))
    N, B = sum(lens), len(lens)
    q, k = torch.randn(1, N, HK, K, generator=gen), torch.randn(1, N, HK, K, generator=gen)
    v = torch.randn(1, N, HV, V, generator=gen)
    g = (-torch.rand(1, N, HV, generator=gen) * 0.5).cuda()
    beta = torch.rand(1, N, HV, generator=gen)
    # activations in ``dtype`` (the reference takes the same rounded values in float64); decay in fp32
    q, k, v, beta = (t.to(dtype).cuda() for t in (q, k, v, beta))
    pool = (0.1 * torch.randn(B + 2, HV, V, K, generator=gen)).cuda()
    idx = torch.randperm(B + 2, generator=gen)[:B].cuda()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32).cuda()
    kw = dict(initial_state=pool, state_indices=idx, cu_seqlens=cu, use_qk_l2norm=True)
    o_ref, f_ref = gdn_ops.gdn_recurrent_ref(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                         initial_state=pool.double(), state_indices=idx, cu_seqlens=cu,
                                         use_qk_l2norm=True)
    row = dict(case=name, sequences=B, tokens=N, dtype=str(dtype).removeprefix("torch."), HK=HK, HV=HV, K=K, V=V)
    for impl, fn in (("fla", fla), ("recurrent", gdn_recurrent), ("torch_chunk", gdn_chunk)):
        o, f = fn(q, k, v, g, beta, **kw)
        row[f"{impl}_err_o"], row[f"{impl}_err_state"] = rel(o, o_ref), rel(f, f_ref)
        row[f"{impl}_us"] = bench_us(lambda fn=fn: fn(q, k, v, g, beta, **kw), False, graph=False)
    print(json.dumps(row), flush=True)
    return row


def engine_rows(reps: int, device: str = "cuda") -> list[dict]:
    from bole import LLM, SamplingParams

    prompts = [json.loads(line)["prompt"] for line in open(PROMPTS)][:16]
    real = backend_mod.short_to_recurrent
    rows, first = [], {}
    for routing in ("shipped", "fp32_to_fla"):
        if routing == "fp32_to_fla":  # the previous routing: fp32 prefills of >= 65 tokens through fla
            backend_mod.short_to_recurrent = lambda long, *a, **kw: real(long, *a,
                                                                          **dict(kw, fp32_to_recurrent=False))
        try:
            llm = LLM(str(MODEL), mode="bole", dtype="float32", device=device, num_blocks=4096, max_num_seqs=16,
                      calibration_table=str(REPO_ROOT / "calibration_tables" / "default.yaml"),
                      enable_cuda_graphs=device == "cuda")
        finally:
            backend_mod.short_to_recurrent = real
        eng = llm.engine
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for case, sel in (("prompt2_180tok", prompts[2:3]), ("heldout16", prompts)):
            ids = [llm.encode(p) for p in sel]
            times, toks = [], None
            for i in range(reps + 1):
                rids = [eng.add_request(p, sp) for p in ids]
                sync()
                t0 = time.perf_counter()
                steps = 0
                while eng.has_unfinished() and steps < 64:   # the engine holds only these requests
                    eng.step()
                    steps += 1
                sync()
                if i:  # the first call warms up (compiles, captures)
                    times.append((time.perf_counter() - t0) * 1e3)
                toks = [eng.pop_finished(rid).output_token_ids for rid in rids]
            first.setdefault(case, {})[routing] = toks
            row = dict(routing=routing, case=case, prompt_tokens=sum(len(x) for x in ids),
                       steps=steps, ms_median=sorted(times)[len(times) // 2], ms_all=[round(t, 3) for t in times])
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm, eng
        if device == "cuda":
            torch.cuda.empty_cache()
    for case, by in first.items():
        rows.append(dict(case=case, same_first_tokens=by["shipped"] == by["fp32_to_fla"]))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/prefill_fp32.json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shape", default="embedded", choices=["embedded", *sorted(SHAPES)],
                    help="GDN heads of the op level (embedded: HK=4, HV=8, K=V=64)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="op-level activations")
    ap.add_argument("--lens", type=int, nargs="*", default=[13, 128, 180, 512, 2048],
                    help="single-prompt lengths of the op level")
    ap.add_argument("--op-only", action="store_true", help="skip the embedded model's engine rows")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    heldout = [len(tok(json.loads(line)["prompt"])["input_ids"]) for line in open(PROMPTS)][:16]
    cases = [(f"one_{n}", [n]) for n in args.lens] + [("heldout16_packed", heldout)]
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command="python " + " ".join(sys.argv))
    fla = backend_mod.fla_prefill()
    heads = {} if args.shape == "embedded" else SHAPES[args.shape]
    res["op"] = [op_row(fla, name, lens, **heads, dtype=getattr(torch, args.dtype)) for name, lens in cases]
    Path(args.out).write_text(json.dumps(res, indent=1))
    if args.op_only:
        return
    try:
        res["engine"] = engine_rows(args.reps)
    except Exception as e:  # keep the op rows
        res["engine_error"] = f"{type(e).__name__}: {e}"
        print(res["engine_error"], flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
