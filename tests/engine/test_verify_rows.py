"""``max_verify_rows``: every verify forward holds at most that many (padded) tree rows, the factor buffer
is that large, the verify graphs build no larger forward, and greedy output stays ar's."""

from __future__ import annotations

import pytest
import torch

from bole import LLM, SamplingParams
from bole.llm import resolve_repo_path
from bole.spec.tree import tree_widths

MODEL = resolve_repo_path("models/bole-tiny-coder")
PROMPTS = ["def add(a, b):", "class Stack:", "import os\n\ndef walk(path):"]
OPTS = dict(device="cpu", depth=4, topk=4, beam=4, max_num_seqs=4, num_blocks=256, block_size=4,
            enable_prefix_cache=False,  # the default table: B_ver 128 at batch 3-4
            calibration_table=resolve_repo_path("calibration_tables/default.yaml"))


def test_rows_bound_every_verify_and_keep_ar_tokens():
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in LLM(MODEL, mode="ar", **OPTS).generate(PROMPTS, greedy)]
    # cap_tree_width off: the budget alone would let a tree take up to the lookahead (53 nodes)
    llm = LLM(MODEL, mode="bole", cap_tree_width=False, max_verify_rows=32, **OPTS)
    runner = llm.engine.runner
    assert llm.engine.verify_rows == llm.engine.memory_plan.verify_rows == 32 and runner.factors.k.shape[1] == 32
    rows = spy_rows(runner)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == ref
    assert rows and max(rows) <= 32 and max(rows) > 8   # bounded, and not only the floor's width
    # the default, the step's token budget (1024), holds these 4 whole trees: the same budget verifies more
    # rows on these prompts
    wide = LLM(MODEL, mode="bole", cap_tree_width=False, **OPTS)
    assert wide.engine.verify_rows == 4 * wide.engine.lookahead < wide.engine.config.max_num_batched_tokens
    wide_rows = spy_rows(wide.engine.runner)
    assert [o.token_ids for o in wide.generate(PROMPTS, greedy)] == ref
    assert max(wide_rows) > 32
    # a token budget below the whole trees bounds the rows as max_verify_rows would
    tight = LLM(MODEL, mode="bole", cap_tree_width=False, max_num_batched_tokens=32, **OPTS)
    assert tight.engine.verify_rows == tight.engine.memory_plan.verify_rows == 32
    tight_rows = spy_rows(tight.engine.runner)
    assert [o.token_ids for o in tight.generate(PROMPTS, greedy)] == ref
    assert tight_rows and max(tight_rows) <= 32


def spy_rows(runner) -> list[int]:
    """Records each verify forward's rows (requests x padded tree width) on ``runner``."""
    rows, verify = [], runner.verify

    def spy(reqs, batch):
        rows.append(batch.tokens.shape[0] * batch.tokens.shape[1])
        return verify(reqs, batch)

    runner.verify = spy
    return rows


def test_rows_below_topk_with_the_best_child_floor():
    """topk 10 over the 8-wide trees 32 rows allow 4 requests: the best_child floor (one draft) fits, the
    cap (7 drafts) binds below topk, and every forward stays within the rows."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    opts = {**OPTS, "depth": 2, "topk": 10, "beam": 1}
    ref = [o.token_ids for o in LLM(MODEL, mode="ar", **opts).generate(PROMPTS, greedy)]
    llm = LLM(MODEL, mode="bole", cap_tree_width=False, max_verify_rows=32, budget_floor="best_child", **opts)
    rows = spy_rows(llm.engine.runner)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == ref
    assert rows and max(rows) <= 32
    with pytest.raises(ValueError, match="max_verify_rows=32 is below the 64 rows"):   # children: 10 + 1 -> 16
        LLM(MODEL, mode="bole", max_verify_rows=32, budget_floor="children", **opts)


def test_rows_below_the_floor_are_refused():
    with pytest.raises(ValueError, match="max_verify_rows=31 is below the 32 rows that max_num_seqs=4"):
        LLM(MODEL, mode="bole", max_verify_rows=31, **OPTS)
    with pytest.raises(ValueError, match="max_verify_rows must be None or an int >= 1"):
        LLM(MODEL, mode="bole", max_verify_rows=0, **OPTS)


def test_verify_graphs_stop_at_the_rows():
    llm = LLM(MODEL, mode="bole", max_verify_rows=64, **OPTS)
    runner = llm.engine.runner
    widths = tree_widths(llm.engine.lookahead)
    vg = runner.enable_verify_graphs((1, 2, 4), widths, 5, capture=False, min_kv=8)
    assert vg.max_rows == 64 and vg.out_logits.shape[0] == 64 and vg.out_hidden.shape[0] == 64
    keys = vg._keys_upto(4, 32)
    assert keys and all(Bc * Tc <= 64 for Bc, Tc, _ in keys)
    assert (4, 16, keys[-1][2]) in keys and not any(k[:2] == (4, 32) for k in keys)
    assert runner.verify_batch_size(3) == 4 and runner.verify_batch_size(1) == 1
    assert torch.equal(torch.tensor(vg.draft_tokens.shape), torch.tensor([4, widths[-1]]))


@pytest.mark.gpu
def test_rows_bound_the_graphed_steps_cuda():
    """On a GPU with CUDA graphs (fp32): every verify forward within the rows replays a graph of at most
    that many rows, none runs eagerly, and greedy output stays ar's."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    opts = {**OPTS, "device": "cuda", "dtype": "float32", "enable_cuda_graphs": True}
    ref = [o.token_ids for o in LLM(MODEL, mode="ar", **opts).generate(PROMPTS, greedy)]
    llm = LLM(MODEL, mode="bole", cap_tree_width=False, max_verify_rows=32, **opts)
    vg = llm.engine.runner.verify_graphs
    assert vg is not None and vg.max_rows == 32 and vg.out_logits.shape[0] == 32
    rows = spy_rows(llm.engine.runner)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == ref
    assert rows and max(rows) <= 32 and llm.engine.stats().eager_forwards == 0
    assert vg.replays > 0 and vg.graphs and all(Bc * Tc <= 32 for Bc, Tc, _ in vg.graphs)
