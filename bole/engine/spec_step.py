"""One speculative step of a batch of decoding requests: draft, budget, verify, accept, commit.

The budget B_ver comes from the calibration table's bucket (docs/DESIGN.md §5); the MTP drafter's
trees are verified in one forward over the packed forest and accepted losslessly (docs/DESIGN.md §6).
Acceptance and commit are one function, ``bole.engine.acceptance.accept_and_commit``: captured in
the verify graph's tail, or called eagerly (min_tokens, penalties, or no graph) after the eager-only
logits preprocessing. Prefix-cache checkpoints of boundaries a commit jumps over are reserved and
settled by ``bole.cache.checkpoints`` around it on both paths.
"""

from __future__ import annotations

from typing import Callable

import torch

from bole.cache.checkpoints import CheckpointPlanner, TailPlan, publish_committed
from bole.cache.prefix_cache import PrefixCache
from bole.config import SpecConfig
from bole.engine import sampler
from bole.engine.metrics import StepStats
from bole.engine.runner import ModelRunner
from bole.engine.sequence import Request
from bole.spec.budget import CalibrationTable, goodput_rows, rows_width, width_cap
from bole.spec.logprobs import TokenLogprob, path_rows
from bole.spec.tree import MAX_TREE_NODES, tree_widths


class SpeculativeStep:
    """The speculative modes' decode step over ``runner`` (``bole`` and ``serial_tree`` differ in the
    runner's verifier only)."""

    def __init__(self, runner: ModelRunner, spec: SpecConfig, vocab_size: int, max_draft_nodes: int,
                 prefix_cache: PrefixCache | None, verify_rows: int):
        self.runner, self.spec, self.vocab_size, self.max_draft_nodes = runner, spec, vocab_size, max_draft_nodes
        self.prefix_cache = prefix_cache
        # the most rows a verify forward holds across the batch (bole.spec.budget.engine_verify_rows)
        self.verify_rows = verify_rows
        self.checkpoints = CheckpointPlanner(prefix_cache) if prefix_cache is not None else None
        self.widths = tree_widths(1 + max_draft_nodes)  # the verify graphs' tree widths (root included)

    def run(self, reqs: list[Request], stats: StepStats, calibration: CalibrationTable,
            between: Callable[[], None] | None = None, during: Callable[[], None] | None = None
            ) -> tuple[list[list[int]], list[list[TokenLogprob] | None] | None]:
        """Draft, verify, accept, commit, with ``calibration``'s budget; per request the emitted tokens,
        and their logprobs (None overall when no request asked). ``between`` runs after the draft, before
        the verify forward (the engine's mid-step admission: other requests' prefills, which touch
        neither these requests' memory nor the drafted trees); ``during`` right after the verify forward is
        launched, before the acceptance tail and its checkpoint reservations (the engine's admission while
        the GPU verifies: their prefills touch neither the verify outputs nor the commit factors)."""
        spec = self.spec
        kv_len = max(r.num_computed for r in reqs)
        B = len(reqs)
        bucket, b_ver = calibration.lookup(B, kv_len, spec.depth + 1)
        pairs = None
        if spec.budget_rule == "goodput":
            # the budget is chosen on the device from the bucket's timed capacities, the largest the
            # bound; stats.b_ver is then the one it chose (read with the widest tree, below)
            pairs = calibration.goodput_curves[bucket]
            b_ver = pairs[-1][0]
        stats.b_ver = int(b_ver)
        # drafts a request may keep: the verifier's limit, or (cap_tree_width) the width the calibration
        # timed B_ver at, so padding every tree to the widest stays within the rows the budget assumed
        cap = MAX_TREE_NODES - 1
        if spec.cap_tree_width:
            cap = width_cap(int(b_ver), B, self.widths, cap)
        rows_cap = None   # the verify rows: every tree padded to one width, the batch to its graph's size
        w = rows_width(self.verify_rows, self.runner.verify_batch_size(B), self.widths)
        if w < self.widths[-1]:   # binds only below whole trees; it holds the fairness floor
            cap = rows_cap = min(cap, w - 1)
        # goodput: each capacity with its own width cap (what eq. 12's rule takes at its B_ver), at most cap
        costs = None if pairs is None else goodput_rows(pairs, B, self.widths, cap, spec.cap_tree_width)
        # Trees are padded to one width for verification. A host bound on every tree's size (the
        # budget or the cap, or the depth-1 floor if larger) avoids reading the widest tree from the
        # device when padding to it costs little (at most twice the budget's nodes); else read it (one sync).
        bound = min(self.max_draft_nodes, max(min(int(b_ver), cap), min(spec.topk, self.vocab_size)),
                    MAX_TREE_NODES - 1 if rows_cap is None else rows_cap)
        # (goodput: the kept count is the device's choice, so the widest tree is always read)
        no_sync = costs is None and B * (bound + 1) <= 2 * (int(b_ver) + B)
        greedy = all(r.params.temperature <= 0 for r in reqs)
        no_min = not any(r.params.min_tokens for r in reqs)  # min_tokens masks logits: eager acceptance
        # penalties too (the tails would need [B, V] counts): eager acceptance
        pen = sampler.penalties(reqs, self.vocab_size, self.runner.device)
        plain = no_min and pen is None
        # the root (the pending token, node 0) is verified too: drafts <= MAX_TREE_NODES - 1 per request
        batch = self.runner.draft_batch(reqs, spec.depth, spec.topk, spec.beam, b_ver, max_per_request=cap,
                                        floor=spec.budget_floor, costs=costs)
        if costs is not None:   # one read: the widest kept tree and the capacity the device chose
            widest, stats.b_ver = torch.stack([batch.num_nodes.max(), batch.budget]).tolist()
            batch = batch.trimmed(widest)
        else:
            batch = batch.trimmed(bound + 1 if no_sync else None)
        if between is not None:
            between()
        res = self.runner.verify(reqs, batch)
        if during is not None:
            during()
        stats.eager_draft, stats.eager_forward = not self.runner.draft_graphed, res.graph is None
        if plain and self.runner.can_accept_in_graph(res, sampled=not greedy):
            # acceptance (greedy, or sampled with each request's parameters and seed), commit and
            # checkpoints inside the verify graph's captured tail
            sampling = None if greedy else sampler.SamplingTensors.of(reqs, "cpu")
            done = self._accept_commit(reqs, stats, True, lambda slots: self.runner.accept_commit_in_graph(
                reqs, res, slots, sampling))
            if done is not None:  # the tail leaves the verify logits in place: logprobs read them
                return done[0], self._path_logprobs(reqs, res, res.logits, done[1], done[0], None)
        # eagerly: the same acceptance and commit (``accept_and_commit``) after the logits' preprocessing
        stats.eager_tail = True
        sampling = None if greedy else sampler.SamplingTensors.of(reqs, self.runner.device)
        logits = res.logits
        if not no_min:
            # node r samples output index len(output) + depth(r) (the root x_n is the last output so far)
            n_out = torch.tensor([r.num_output_tokens for r in reqs], device=logits.device)
            logits = sampler.mask_early_stops(reqs, logits, n_out[:, None] + batch.depth.to(logits.device))
        cache = self.prefix_cache

        def eager(slots):  # slots per request; a graph forward's padding rows write the scratch slot
            pad = res.forest.num_requests - len(reqs)
            ckpt = None if slots is None else (cache.checkpoints, cache.interval, torch.tensor(
                [cache.scratch_slot if s is None else s for s in slots] + [cache.scratch_slot] * pad,
                device=logits.device))
            return self.runner.accept_commit(reqs, res, logits, spec.depth, sampling, pen, ckpt)

        emitted, accepted = self._accept_commit(reqs, stats, False, eager)
        return emitted, self._path_logprobs(reqs, res, logits, accepted, emitted, pen)

    def _path_logprobs(self, reqs: list[Request], res, logits: torch.Tensor, accepted: list[int],
                       emitted: list[list[int]], pen) -> list[list[TokenLogprob] | None] | None:
        """Logprobs of a speculative step's emitted tokens from the verify logits [B, T, V] along each
        accepted path (the root's row, then each accepted node's): no extra forward."""
        if not any(r.params.logprobs is not None for r in reqs):
            return None
        rows = path_rows(res.forest, accepted, len(reqs)).to(logits.device)       # [B, D]
        along = logits[torch.arange(len(reqs), device=logits.device)[:, None], rows.clamp(min=0)]
        return sampler.step_logprobs(reqs, along, emitted, pen)

    def _accept_commit(self, reqs: list[Request], stats: StepStats, in_graph: bool, run
                       ) -> tuple[list[list[int]], list[int]] | None:
        """Acceptance, commit and prefix-cache checkpoints: ``run(checkpoint slots)`` (the verify graph's
        tail when ``in_graph``, else the eager ``accept_commit``) returns the step's rows (one
        device-to-host read); returns the emitted tokens and accepted nodes. Checkpoint slots are
        reserved before (acceptance happens on the device), settled after. None when the graph's tail
        cannot take this step's checkpoints (the caller goes on eagerly); eagerly, a step without a
        slot to write takes no checkpoint."""
        starts = [r.num_computed for r in reqs]
        plan = TailPlan()
        if self.checkpoints is not None:
            takes = self.runner.verify_graphs.checkpoints is not None if in_graph else True
            plan = self.checkpoints.reserve_tail(starts, self.spec.depth + 1, takes)
            if plan is None and in_graph:
                return None
            plan = plan or TailPlan()
        try:
            host = run(plan.slots)
        except BaseException:
            if self.checkpoints is not None:
                self.checkpoints.cancel(plan)
            raise
        emitted = [h[2:2 + h[1]] for h in host]
        pending = self.checkpoints.settle_tail(plan, starts, [h[1] for h in host]) if plan.reserved else None
        publish_committed(self.prefix_cache, reqs, pending, emitted)
        stats.tree_nodes = sum(h[-1] for h in host)
        return emitted, [h[0] for h in host]
