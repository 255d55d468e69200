"""The budget's options on the embedded model: MAT and verified rows of the fairness floor, width cap and rule.

Per batch, bole runs the held-out prompts[:B] (greedy, ``--max-tokens`` each, fp32, depth 8 / topk 4 /
beam 4 unless set) with the budgets of ``--table`` (the H200 9B table, the budgets the 9B-cost runs
verify; each step looks its own batch up there, as the engine does), once per option set: the paper's
(``budget_floor="children"``), ``cap_tree_width``, ``budget_floor="best_child"``, both, and both with
``budget_rule="goodput"`` (each step's budget chosen from the table's timings and the drafts' ρ);
``--tables`` runs each table in turn (``--options`` picks the sets). Columns:
MAT; draft nodes and padded verify rows per step, the rows being the batch x the smallest captured tree
width (``bole.engine.graphs.tree.tree_widths``) holding the width the step verifies (what the verify
graphs run; a step trims to its host bound without a sync when that costs little, so this can exceed
the widest tree); and whether the tokens equal ar's. MAT is the drafter's acceptance, the same on the
9B-cost widening up to its bf16 rounding; this CPU run's times mean nothing and are not reported.

    python benchmarks/budget_options.py --out benchmarks/results/budget_options_cpu.json
    python benchmarks/budget_options.py --tables calibration_tables/h200-qwen3.5-35b-a3b.yaml \
        calibration_tables/h200-qwen3.5-9b.yaml --options best_child+cap goodput --out /tmp/moe.json
    python benchmarks/budget_options.py --smoke --out /tmp/b.json      # tests/bench/test_budget_options.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bole import LLM, SamplingParams  # noqa: E402
from bole.spec.budget import CalibrationTable  # noqa: E402
from bole.spec.tree import tree_widths  # noqa: E402

# every option set names both options (the engine's defaults are "best_child+cap")
OPTIONS = {"paper": dict(budget_floor="children", cap_tree_width=False),
           "cap": dict(budget_floor="children", cap_tree_width=True),
           "best_child": dict(budget_floor="best_child", cap_tree_width=False),
           "best_child+cap": dict(budget_floor="best_child", cap_tree_width=True),
           "goodput": dict(budget_floor="best_child", cap_tree_width=True, budget_rule="goodput")}


def run(model: str, batch: int, table: str, prompts: list[str], max_tokens: int, depth: int, topk: int,
        beam: int, **options) -> dict:
    llm = LLM(model, mode="bole", depth=depth, topk=topk, beam=beam, device="cpu", dtype="float32",
              num_blocks=4096, max_num_seqs=batch, calibration_table=table,
              max_verify_rows=1 << 20, **options)   # every request's whole tree: the options alone bound the rows
    eng = llm.engine   # every step's budget is ``table``'s at its batch
    widths, runner, steps = tree_widths(eng.lookahead), eng.runner, []
    verify = runner.verify

    def counted(reqs, batch, *a, **kw):   # the trimmed batch the step verifies: its width, its drafts
        width = batch.tokens.shape[1]
        steps.append((int(batch.num_nodes.sum()) - len(reqs), len(reqs) * next(w for w in widths if w >= width)))
        return verify(reqs, batch, *a, **kw)
    runner.verify = counted
    outs = llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    m = eng.metrics
    return dict(mat=round(m.emitted_tokens / max(m.request_steps, 1), 3), steps=len(steps),
                drafts_per_step=round(sum(d for d, _ in steps) / len(steps), 1),
                rows_per_step=round(sum(r for _, r in steps) / len(steps), 1),
                tokens=[list(o.token_ids) for o in outs])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO_ROOT / "models" / "bole-tiny-coder"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--tables", nargs="+", default=[str(REPO_ROOT / "calibration_tables" / "h200-qwen3.5-9b.yaml")])
    ap.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="batch 2, 8 tokens, depth 3")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.batches, a.max_tokens, a.depth = [2], 8, 3
    torch.set_num_threads(1)
    tables = {t: CalibrationTable.load(t) for t in a.tables}
    prompts = [json.loads(line)["prompt"] for line in open(REPO_ROOT / "benchmarks" / "data" / "heldout_prompts.jsonl")]
    doc = dict(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), torch=torch.__version__, device="cpu",
               command=" ".join(sys.argv if argv is None else ["budget_options.py", *argv]), tables=a.tables,
               settings=dict(depth=a.depth, topk=a.topk, beam=a.beam, max_tokens=a.max_tokens, dtype="float32"),
               rows=[])
    for batch in a.batches:
        ar = LLM(a.model, mode="ar", device="cpu", dtype="float32", num_blocks=4096, max_num_seqs=batch).generate(
            prompts[:batch], SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True))
        ar_tokens = [list(o.token_ids) for o in ar]
        for (path, table), name in ((t, o) for t in tables.items() for o in a.options):
            r = run(a.model, batch, path, prompts, a.max_tokens, a.depth, a.topk, a.beam, **OPTIONS[name])
            b_ver = int(table.lookup(batch, 256, a.depth + 1)[1])   # the full batch's (fewer requests: theirs)
            row = dict(batch=batch, table=Path(path).name, b_ver=b_ver, option=name,
                       **{k: v for k, v in r.items() if k != "tokens"}, exact_vs_ar=r["tokens"] == ar_tokens)
            doc["rows"].append(row)
            print(row, flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
