"""Torch ops per phase of one speculative engine step, counted on the CPU (no GPU needed).

On a GPU the speculative step of a small model is launch bound: its time follows the number of
kernels, not the FLOPs. This script drives the engine's static (graph-shaped, uncaptured) path on the
CPU and counts the torch ops each phase dispatches (views and allocations excluded), a proxy for the
kernels a captured graph replays. Phases: the forest layouts (``StaticTree.fill``), the drafter's
forwards, the target's forward, the commit, the LM heads, and everything else (tree expansion,
selection, compaction, acceptance). On the CPU the model runs the torch twins: a fused Triton
kernel on the GPU is one op where its twin here is several, so the model-forward counts are upper
bounds; the bookkeeping counts are what the GPU replays.

With ``--backend triton`` the model runs the Triton kernels (interpreted, so slow) and each kernel
launch counts as one op (the torch ops inside an interpreted launch are not counted): the count then
follows the GPU's kernel structure.

    python benchmarks/op_count.py                  # bole, batch 1, the embedded model
    python benchmarks/op_count.py --mode serial_tree --batch 4
    python benchmarks/op_count.py --backend triton --depth 12 --topk 2 --beam 2
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

FREE = {"view", "_unsafe_view", "slice", "select", "as_strided", "expand", "unsqueeze", "squeeze", "t",
        "transpose", "permute", "split", "split_with_sizes", "unbind", "alias", "detach", "empty", "empty_like",
        "empty_strided", "_local_scalar_dense", "lift_fresh", "_reshape_alias"}


class _Counter(TorchDispatchMode):
    def __init__(self, phase: list[str], counts: collections.Counter):
        super().__init__()
        self.phase, self.counts, self.in_kernel = phase, counts, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in FREE and not self.in_kernel:
            self.counts[self.phase[-1], func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def count_triton(self):
        """Count each interpreted Triton launch as one op (and nothing inside it)."""
        import triton.runtime.interpreter as ti

        run = ti.GridExecutor.__call__

        def launch(executor, *a, **k):
            self.counts[self.phase[-1], "triton:" + executor.fn.__name__] += 1
            self.in_kernel += 1
            try:
                return run(executor, *a, **k)
            finally:
                self.in_kernel -= 1
        ti.GridExecutor.__call__ = launch
        return run


def _label(owner, name: str, label: str, phase: list[str]) -> None:
    fn = getattr(owner, name)

    def wrapped(*a, **k):
        phase.append(label)
        try:
            return fn(*a, **k)
        finally:
            phase.pop()
    setattr(owner, name, wrapped)


def count(mode: str = "bole", batch: int = 1, depth: int = 4, topk: int = 4, beam: int = 4,
          backend: str = "torch") -> dict:
    from bole import LLM, SamplingParams
    from bole.engine.graphs.tree import StaticTree
    from bole.models import qwen3_5
    from bole.spec.tree import MAX_TREE_NODES, tree_widths

    if backend == "triton":  # the model's "auto" backend resolves to the Triton kernels, interpreted
        # (the process stays in interpreter mode: Triton reads the variable when kernels launch)
        os.environ["TRITON_INTERPRET"] = "1"
        resolve = qwen3_5.resolve_backend
        qwen3_5.resolve_backend = lambda name="auto", device=None: resolve("triton")
    phase = ["other"]
    # labelled before the graphs are built, so their closures call the labelled methods
    for owner, name, label in ((StaticTree, "fill", "forest layout"), (qwen3_5.MTPDrafter, "forward", "drafter"),
                               (qwen3_5.HybridModel, "forward", "target"), (qwen3_5.HybridForCausalLM, "commit_paths",
                                                                            "commit"),
                               (qwen3_5.HybridForCausalLM, "compute_logits", "lm head"),
                               (qwen3_5.MTPDrafter, "compute_logits", "lm head")):
        _label(owner, name, label, phase)
    torch.set_num_threads(1)
    try:
        llm = LLM(str(REPO_ROOT / "models" / "bole-tiny-coder"), mode=mode, depth=depth, topk=topk, beam=beam,
                  device="cpu", dtype="float32", num_blocks=1024, max_num_seqs=batch,
                  calibration_table="calibration_tables/default.yaml")
    finally:  # the model holds its backend now: later models of this process resolve as usual
        if backend == "triton":
            qwen3_5.resolve_backend = resolve
    eng, spec = llm.engine, llm.engine.config.spec
    vg = eng.runner.enable_verify_graphs(list(range(1, batch + 1)), tree_widths(eng.lookahead), spec.depth + 1,
                                         capture=False)
    eng.runner.enable_draft_graphs(list(range(1, batch + 1)), spec.depth, spec.topk, spec.beam, capture=False,
                                   max_per_request=MAX_TREE_NODES - 1,
                                   floor=spec.budget_floor)
    if eng.prefix_cache is not None:
        vg.enable_checkpoints(eng.prefix_cache.checkpoints, eng.config.cache.checkpoint_interval,
                              eng.prefix_cache.scratch_slot)
    lines = open(REPO_ROOT / "benchmarks" / "data" / "heldout_prompts.jsonl").readlines()
    for i in range(batch):
        eng.add_request(llm.encode(json.loads(lines[i])["prompt"]),
                        SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(4):  # prefill and a few speculative steps
        eng.step()
    counts: collections.Counter = collections.Counter()
    counter = _Counter(phase, counts)
    restore = counter.count_triton() if backend == "triton" else None
    try:
        with counter:
            eng.step()
    finally:
        if restore is not None:
            import triton.runtime.interpreter as ti
            ti.GridExecutor.__call__ = restore
    per_phase = collections.Counter()
    for (p, _), n in counts.items():
        per_phase[p] += n
    return dict(mode=mode, batch=batch, backend=backend, depth=depth, topk=topk, beam=beam,
                total=sum(per_phase.values()), per_phase=dict(per_phase.most_common()),
                top_ops={p: dict(sorted(((o, n) for (q, o), n in counts.items() if q == p), key=lambda x: -x[1])[:12])
                         for p in per_phase})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="bole", choices=["bole", "serial_tree"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--backend", default="torch", choices=["torch", "triton"])
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    doc = count(args.mode, args.batch, args.depth, args.topk, args.beam, args.backend)
    print(json.dumps(doc["per_phase"]), "total", doc["total"])
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
