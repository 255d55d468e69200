"""The engine's drafter (``ModelRunner.draft`` -> ``grow_draft_tree``) against a naive reference: every
frontier node's MTP output computed on its own, by one forward over its ancestor chain alone (root
child first), so no forest bookkeeping is shared with the engine. The candidates must agree: tokens,
parents, depths exactly, log-probabilities within rounding."""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_checkpoint

from bole.cache.kv_cache import blocks_needed
from bole.engine.drafting import empty_factors
from bole.engine.runner import ModelRunner
from bole.engine.sequence import Request
from bole.models.context import ForwardContext
from bole.models.loader import load_model
from bole.sampling_params import SamplingParams
from bole.spec.drafter import Frontier, expand_tree
from bole.spec.tree import PackedForest

PROMPTS = [[1, 2, 3, 9], [7, 8, 9, 10, 11, 12], [3] * 5]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft_ref")
    make_checkpoint(path, "dense", 64)
    return load_model(str(path), dtype="float32")


def _runner(model):
    runner = ModelRunner(model, num_blocks=64, block_size=4, num_state_slots=6, max_batch_nodes=256,
                         kv_dtype=torch.float32, device="cpu")
    reqs = []
    for i, p in enumerate(PROMPTS):
        r = Request(f"r{i}", list(p), SamplingParams(), seed=0)
        r.block_table = runner.allocator.allocate(blocks_needed(len(p) + 64, runner.block_size))
        r.state_slot = runner.state_pool.allocate()
        reqs.append(r)
    runner.prefill([(r, len(r.prompt_token_ids) - 1) for r in reqs], keep_hidden=True)
    return runner, reqs


@torch.inference_mode()
def reference_draft(runner, reqs, depth, topk, beam):
    mtp, B = runner.model.mtp, len(reqs)
    h_root = runner._mtp_catch_up(reqs)
    out: dict[int, torch.Tensor] = {}         # candidate id -> MTP output [B, H]
    tokens: dict[int, torch.Tensor] = {}      # candidate id -> token [B]
    parent: dict[int, int] = {}               # candidate id -> parent id (the same in every row)

    def step(fr: Frontier) -> torch.Tensor:
        logits = []
        for m in range(fr.node_ids.shape[1]):
            ids = fr.node_ids[:, m].tolist()
            pars = fr.parent_ids[:, m].tolist()
            # the chain root child .. node, per row (rows may pick different candidates)
            chains = []
            for b in range(B):
                chain, c = [ids[b]], pars[b]
                while c >= 0:
                    chain.append(c)
                    c = parent[b, c]
                chains.append(chain[::-1])
            n = len(chains[0])
            for b in range(B):
                tokens[b, ids[b]] = fr.tokens[b, m]
                parent[b, ids[b]] = pars[b]
            tok = torch.stack([torch.stack([tokens[b, c] for c in chains[b]]) for b in range(B)])     # [B, n]
            hid = torch.stack([torch.stack([h_root[b]] + [out[b, c] for c in chains[b][:-1]]) for b in range(B)])
            par = (torch.arange(n) - 1)[None].expand(B, n)
            forest = PackedForest.from_padded(par, torch.full((B,), n), n)
            ctx = ForwardContext.build("verify", None, [r.num_computed for r in reqs], [0] * B,
                                       [r.block_table for r in reqs], runner.mtp_cache, None, forest=forest,
                                       factors=empty_factors(forest.num_nodes, "cpu"), device="cpu")
            h = mtp(tok.reshape(-1), hid.reshape(B * n, -1), ctx, step=fr.depth).view(B, n, -1)[:, -1]
            for b in range(B):
                out[b, ids[b]] = h[b]
            logits.append(mtp.compute_logits(h))
        return torch.log_softmax(torch.stack(logits, 1).float(), -1)

    return expand_tree(torch.log_softmax(mtp.compute_logits(h_root).float(), -1), step, depth, topk, beam)


@pytest.mark.parametrize("depth,topk,beam", [(4, 2, 2), (3, 3, 2), (5, 1, 1), (3, 2, 4)])
def test_draft_matches_chain_reference(model, depth, topk, beam):
    (ra, qa), (rb, qb) = _runner(model), _runner(model)
    got = ra.draft(qa, depth, topk, beam)
    want = reference_draft(rb, qb, depth, topk, beam)
    for f in ("tokens", "parents", "depth", "valid"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert float((got.rho - want.rho).nan_to_num(0, 0, 0).abs().max()) <= 1e-4
