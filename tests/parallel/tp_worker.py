"""What one TP rank runs in the parallel tests (importable by spawned processes)."""

from __future__ import annotations

import os
import sys

import torch

from bole.llm import build_engine
from bole.models.context import ForwardContext
from bole.sampling_params import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [3] * 11, [5, 1, 2, 9, 4, 4, 6, 1, 0, 3, 2, 2, 8]]
OPTIONS = dict(num_blocks=64, block_size=4, depth=2, topk=2, beam=2, max_num_seqs=4,
               max_num_batched_tokens=16, calibration_table="calibration_tables/default.yaml")


def prefill_logits(engine, prompt: list[int]) -> torch.Tensor:
    """Logits [T, V] of every prompt position, one prefill forward on a fresh engine's caches."""
    runner, bs = engine.runner, engine.config.cache.block_size
    blocks = list(range((len(prompt) + bs - 1) // bs))
    ctx = ForwardContext.build("prefill", [len(prompt)], [0], [1], [blocks], runner.kv_cache,
                               runner.state_pool, device=runner.device)
    with torch.inference_mode():
        return engine.model.compute_logits(engine.model(torch.tensor(prompt), ctx)).clone()


def run_case(path: str, mode: str, tp_rank: int = 0, tp_size: int = 1) -> dict:
    """Greedy outputs of PROMPTS (staggered arrivals) and the prefill logits of the first prompt."""
    engine = build_engine(path, tokenizer=False, tp_rank=tp_rank, mode=mode, tp_size=tp_size, **OPTIONS)
    logits = prefill_logits(engine, PROMPTS[0]) if mode == "ar" else None
    engine = build_engine(path, tokenizer=False, tp_rank=tp_rank, mode=mode, tp_size=tp_size, **OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, seed=1234)
    pending, ids, step = list(PROMPTS), [], 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            ids.append(engine.add_request(pending.pop(0), params))
        engine.step()
        step += 1
    tokens = [list(engine.pop_finished(i).output_token_ids) for i in ids]
    return {"tokens": tokens, "logits": logits, "steps": step}


def tp_main(rank: int, world_size: int, port: int, cases: list[tuple[str, str]], out_dir: str) -> None:
    """torch.multiprocessing.spawn target: join the gloo group on 127.0.0.1 and run every case."""
    from bole.parallel import destroy_tp_group, init_tp_group

    torch.set_num_threads(1)
    init_tp_group(rank, world_size, "127.0.0.1", port, device="cpu", timeout_s=60)
    try:
        results = [run_case(path, mode, rank, world_size) for path, mode in cases]
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        torch.distributed.barrier()   # both ranks past their last collective before either tears gloo down
    finally:
        destroy_tp_group()
    # Done (the results are on disk): leave without the interpreter's finalization. Two fresh-clone runs
    # (2026-12-06) saw a rank abort there with SIGABRT, "terminate called without an active exception",
    # after its group was destroyed: gloo's C++ threads outliving the interpreter (pytorch/pytorch#179291
    # describes the same crash). Nothing of ours runs at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
