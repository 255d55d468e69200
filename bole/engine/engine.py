"""The engine step loop: schedule, run the forwards of the step's mode, sample, commit, emit.

One ``step()``:
  1. ``Scheduler.schedule(lookahead)`` picks prefill chunks and decoding requests (preempting by
     recompute when KV blocks run out).
  2. Prefill chunks run in one forward; requests whose prefill completed sample their next token.
  3. Decoding requests advance by the engine's mode:
       ar           one decode forward, sample one token;
       bole         MTP draft -> batch budget (Algorithm 3) -> one verify forward over the forest
                    (closed-form GDN verification) -> lossless tree sampling -> factorized commit;
       serial_tree  the same trees, verified with per-node state snapshots and committed by copying
                    the accepted node's snapshot (the SGLang-style baseline).
  4. Emitted tokens are appended with stop / length checks; finished requests free their memory.

With the prefix cache on, every forward is followed (before emission, which may free the request) by
``_cache_committed``: newly committed full blocks join the cache and GDN checkpoints are taken at
block boundaries (speculative commits that jump over a boundary are checkpointed along the accepted
path first: ``bole.cache.checkpoints`` plans them).

Sampling randomness is keyed by (request seed, token index): the token at index i of a request
is always drawn with the uniform U(seed, i), whichever mode produced it, so greedy AND seeded
stochastic outputs are identical across modes. The logits processing (``bole.engine.sampler``:
min_tokens, penalties with a tree row's own path, temperature, top-k / top-p) is the same in every
mode too. A step with min_tokens or penalised requests accepts eagerly (the verify forward may still
replay its graph; the graphs' tails carry neither); logprobs come from the logits the step holds, on
every path but the opt-in whole-step graph, which such steps skip.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field

import torch

from bole.cache.checkpoints import CheckpointPlanner, PendingCheckpoint, TailPlan
from bole.cache.prefix_cache import PrefixCache
from bole.config import EngineConfig
from bole.engine import sampler
from bole.engine.detokenizer import IncrementalDetokenizer, find_stop
from bole.engine.metrics import EngineMetrics, StepStats
from bole.engine.runner import ModelRunner
from bole.engine.scheduler import Scheduler
from bole.engine.sequence import Request, RequestStatus
from bole.engine.spec_graphs import tree_widths
from bole.hardware import resolve_calibration
from bole.sampling_params import SamplingParams
from bole.spec.budget import CalibrationTable
from bole.spec.drafter import tree_size
from bole.spec.logprobs import TokenLogprob, path_rows
from bole.spec.sampling import accept_tree, counter_uniforms
from bole.spec.tree import MAX_TREE_NODES

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request (the delta) and where the request stands."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_steps: int = 0             # decode / verify steps so far (MAT = emitted tokens / steps)
    num_accepted_drafts: int = 0
    logprobs: list[TokenLogprob] | None = None   # one per new token, when the request asked (``logprobs``)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only: None, then prompt tokens 1..


class LLMEngine:
    def __init__(self, model, config: EngineConfig, tokenizer=None, calibration: CalibrationTable | None = None):
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.mode = config.mode
        if self.mode != "ar" and model.mtp is None:
            raise ValueError(f"mode {self.mode!r} needs a checkpoint with an MTP drafter (mtp.* tensors)")
        spec = config.spec
        if model.mtp is not None:
            model.mtp.fast_math = spec.draft_fast_math
        V = model.config.vocab_size
        self.max_draft_nodes = tree_size(V, spec.depth, spec.topk, spec.beam) if self.mode != "ar" else 0
        self.lookahead = 1 + self.max_draft_nodes
        # "auto" picks a table for (hardware class, model shapes) with fallbacks (bole.hardware);
        # bole.calibrate.recalibrate swaps this attribute between steps.
        self.calibration = calibration or resolve_calibration(config.calibration_table, model.config,
                                                              config.device, config.dtype)
        graphs, spec_graphs = config.enable_cuda_graphs, config.enable_cuda_graphs and self.mode != "ar"
        spec_sizes = sorted({b for b in config.cuda_graph_batch_sizes if b < config.max_num_seqs}
                            | {config.max_num_seqs})
        self.runner = ModelRunner(model, config.cache.num_blocks, config.cache.block_size,
                                  config.max_num_seqs + 1, config.max_num_seqs * self.lookahead,
                                  config.torch_dtype, config.device,
                                  snapshot_verify=self.mode == "serial_tree",
                                  cuda_graph_batch_sizes=config.cuda_graph_batch_sizes
                                  if graphs and self.mode == "ar" else None,
                                  verify_graph_spec=dict(batch_sizes=spec_sizes, tree_sizes=tree_widths(self.lookahead),
                                                         max_depth=spec.depth + 1, sampled_tail=True)
                                  if spec_graphs else None,
                                  draft_graph_spec=dict(batch_sizes=spec_sizes, depth=spec.depth, topk=spec.topk,
                                                        beam=spec.beam, max_per_request=MAX_TREE_NODES - 1)
                                  if spec_graphs else None,
                                  # the same buckets in every mode: a prefill runs at the same padded shapes
                                  prefill_graph_sizes=spec_sizes if graphs and config.cuda_graph_prefill else None)
        if config.cuda_graph_whole_step and self.runner.draft_graphs is not None and \
                self.runner.verify_graphs is not None:
            self.runner.enable_step_graphs()
        cc = config.cache
        self.prefix_cache = PrefixCache(self.runner.allocator, self.runner.state_pool, cc.block_size,
                                        cc.checkpoint_interval_blocks, cc.num_checkpoint_slots,
                                        track_mtp=self.mode != "ar") if cc.enable_prefix_cache else None
        self.checkpoints = CheckpointPlanner(self.prefix_cache) if self.prefix_cache is not None else None
        if self.prefix_cache is not None and self.runner.verify_graphs is not None:
            self.runner.verify_graphs.enable_checkpoints(self.prefix_cache.checkpoints, cc.checkpoint_interval,
                                                         self.prefix_cache.scratch_slot)
        self.scheduler = Scheduler(self.runner.allocator, self.runner.state_pool, config.cache.block_size,
                                   config.max_num_seqs, config.max_num_batched_tokens, self.prefix_cache)
        self.capacity_tokens = config.cache.num_blocks * config.cache.block_size
        self.metrics = EngineMetrics()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._finishing: list[tuple[Request, str]] = []  # finished during this step (``_finish``)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.eos_token_ids = tuple(config.eos_token_ids) or ((eos,) if eos is not None else ())

    # -- requests --------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      request_id: str | None = None) -> None:
        """Raise ``ValueError`` naming the problem if ``add_request`` would refuse this request; queues
        nothing (``bole.LLM.generate`` checks a whole batch before adding any of it)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of ints, got {type(prompt_token_ids).__name__}")
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        not_int = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool)]
        if not_int:
            raise ValueError(f"prompt token ids must be ints, got {not_int[:5]!r} "
                             f"({', '.join(sorted({type(t).__name__ for t in not_int}))})")
        V = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {V}): {bad[:5]}")
        P, M, L, C = len(prompt_token_ids), params.max_tokens, self.lookahead, self.capacity_tokens
        if P + M > C:
            raise ValueError(f"prompt ({P} tokens) + max_tokens ({M}) does not fit the KV cache ({C} tokens = "
                             f"num_blocks {self.config.cache.num_blocks} x block_size {self.config.cache.block_size})")
        if P + M + L > C:
            # the request fits, but not with the draft tree each speculative step reserves past it
            spec = self.config.spec
            raise ValueError(f"prompt ({P} tokens) + max_tokens ({M}) + the tree lookahead reserved per request "
                             f"({L} tokens: 1 + {self.max_draft_nodes} draft nodes for depth {spec.depth}, topk "
                             f"{spec.topk}, beam {spec.beam}) = {P + M + L} does not fit the KV cache ({C} tokens); "
                             "use a narrower tree (depth / topk / beam) or more num_blocks")
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        self.check_request(prompt_token_ids, params, request_id)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        req = Request(rid, prompt_token_ids, params, seed, self.eos_token_ids,
                      detokenizer=IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id)
        self.requests.pop(request_id, None)
        return req is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def cached_prefix_hashes(self, limit: int | None = None) -> list[int]:
        """Chain hashes (``deployments.routing_policy.prefix_block_hashes``) of the prefix blocks this
        engine has cached, least recently used first; [] without a prefix cache. For routing stats."""
        return self.prefix_cache.summary(limit) if self.prefix_cache is not None else []

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._finish()  # requests a failed step left finishing
        sched = self.scheduler.schedule(self.lookahead)
        outputs: list[RequestOutput] = []
        stats = StepStats(time.perf_counter())
        spec = self.mode != "ar"
        if sched.prefill:
            starts = {r.request_id: r.num_computed for r, _ in sched.prefill}
            scored = {} if any(r.needs_prompt_logits for r, _ in sched.prefill) else None
            last = self.runner.prefill(sched.prefill, keep_hidden=spec, position_logits=scored)
            for rid, lg in (scored or {}).items():
                sampler.score_prompt(self.requests[rid], starts[rid], lg)
            self._cache_committed([r for r, _ in sched.prefill])
            done = [r for r, _ in sched.prefill if r.request_id in last]
            for r in done:
                r.prefilled = True
                if r.params.max_tokens == 0:  # prompt scoring only (echo with max_tokens 0)
                    outputs.append(self._emit(r, []))
            done = [r for r in done if r.params.max_tokens > 0]
            if done:
                toks, lps = sampler.sample_next(done, torch.stack([last[r.request_id] for r in done]),
                                                self._penalties(done))
                for i, (r, t) in enumerate(zip(done, toks)):
                    outputs.append(self._emit(r, [t], lps and lps[i]))
            stats.prefill_tokens = sum(n for _, n in sched.prefill)
        ending = {id(r) for r, _ in self._finishing}  # finished by this step's prefill sampling
        decode = [r for r in sched.decode if not r.is_finished and id(r) not in ending]
        if decode:
            t0 = time.perf_counter()
            if self.mode == "ar":
                logits = self.runner.decode(decode, keep_hidden=False)
                self._cache_committed(decode)
                toks, lps = sampler.sample_next(decode, logits, self._penalties(decode))
                emitted = [[t] for t in toks]
                stats.tree_nodes = len(decode)
            else:
                emitted, lps = self._speculative_step(decode, stats)
            stats.verify_time = time.perf_counter() - t0
            for i, (r, toks) in enumerate(zip(decode, emitted)):
                r.metrics.num_steps += 1
                r.metrics.num_accepted_drafts += len(toks) - 1
                outputs.append(self._emit(r, toks, lps and lps[i]))
            stats.decode_requests = len(decode)
            stats.emitted_tokens = sum(len(t) for t in emitted)
        self._finish()
        stats.preempted = len(sched.preempted)
        stats.end = time.perf_counter()
        self.metrics.record_step(stats)
        return outputs

    def _penalties(self, reqs: list[Request]):
        return sampler.penalties(reqs, self.model.config.vocab_size, self.runner.device)

    def _speculative_step(self, reqs: list[Request], stats: StepStats
                          ) -> tuple[list[list[int]], list[list[TokenLogprob] | None] | None]:
        """Draft, verify, accept, commit; per request the emitted tokens, and their logprobs (None
        overall when no request asked)."""
        spec = self.config.spec
        kv_len = max(r.num_computed for r in reqs)
        B = len(reqs)
        _, b_ver = self.calibration.lookup(B, kv_len, spec.depth + 1)
        stats.b_ver = int(b_ver)
        # Trees are padded to one width for verification. A host bound on every tree's size (the
        # budget, or the depth-1 floor if larger) avoids reading the widest tree from the device when
        # padding to it costs little (at most twice the budget's nodes); else read it (one sync).
        bound = min(self.max_draft_nodes, max(int(b_ver), min(spec.topk, self.model.config.vocab_size)),
                    MAX_TREE_NODES - 1)
        no_sync = B * (bound + 1) <= 2 * (int(b_ver) + B)
        greedy = all(r.params.temperature <= 0 for r in reqs)
        no_min = not any(r.params.min_tokens for r in reqs)  # min_tokens masks logits: eager acceptance
        pen = self._penalties(reqs)   # penalties too (the tails would need [B, V] counts): eager acceptance
        plain = no_min and pen is None
        want_lp = any(r.params.logprobs is not None for r in reqs)
        if greedy and plain and not want_lp and no_sync and self.runner.step_graph_supports(reqs, bound + 1):
            # the whole step in one graph replay (bole.engine.step_graphs), one device-to-host read
            done = self._step_in_graph(reqs, stats, lambda slots: self.runner.step_in_graph(
                reqs, int(b_ver), bound + 1, slots))
            if done is not None:
                return done[0], None
        # the root (the pending token) is verified too: drafts <= MAX_TREE_NODES - 1 per request
        batch = self.runner.draft_batch(reqs, spec.depth, spec.topk, spec.beam, b_ver,
                                        max_per_request=MAX_TREE_NODES - 1)
        batch = batch.trimmed(bound if no_sync else None)
        res = self.runner.verify(reqs, batch)
        D = spec.depth
        B, T1 = res.logits.shape[:2]
        if plain and self.runner.can_accept_in_graph(res, sampled=not greedy):
            # acceptance (greedy, or sampled with each request's parameters and seed), commit and
            # checkpoints inside the verify graph's captured tail
            sampling = None if greedy else sampler.sampling_rows(reqs)
            done = self._step_in_graph(reqs, stats, lambda slots: self.runner.accept_commit_in_graph(
                reqs, res, slots, sampling))
            if done is not None:  # the tail leaves the verify logits in place: logprobs read them
                return done[0], self._path_logprobs(reqs, res, res.logits, done[1], done[0], None)
        row_depth = torch.cat([torch.zeros_like(batch.depth[:, :1]), batch.depth], 1).clamp(max=D)
        if greedy:  # argmax walk: no uniforms, no per-request parameters (no host-to-device copies)
            temp = top_k = top_p = 0.0
            uniforms = torch.zeros(B, T1, device=res.logits.device)
        else:
            temp, top_k, top_p, seed = sampler.param_tensors(reqs, self.runner.device)
            # Row 0 draws token index n+1 (n = num_computed), row i+1 draws index n+1+depth(i).
            n = torch.tensor([r.num_computed for r in reqs], device=seed.device)
            u_by_depth = counter_uniforms(seed, n + 1, D + 1)  # [B, D+1]
            uniforms = u_by_depth.gather(1, row_depth)
        logits = res.logits
        if not no_min:
            # row r samples output index len(output) + depth(r) (the root x_n is the last output so far)
            n_out = torch.tensor([r.num_output_tokens for r in reqs], device=logits.device)
            logits = sampler.mask_early_stops(reqs, logits, n_out[:, None] + row_depth.to(logits.device))
        acc = accept_tree(batch.tokens, batch.parents, uniforms, logits=logits if greedy else logits.float(),
                          temperature=temp, top_k=top_k, top_p=top_p, max_depth=D, penalties=pen)
        # the step's one device-to-host read: accepted node, emitted count and tokens of every request
        host = torch.cat([acc.accepted_node[:, None], acc.num_emitted[:, None], acc.tokens], 1).tolist()
        accepted, num = [h[0] for h in host], [h[1] for h in host]
        emitted = [h[2:2 + h[1]] for h in host]
        pending = self._checkpoint_paths(reqs, res, accepted, num)
        # path length (root + accepted drafts) = emitted tokens
        self.runner.commit(reqs, res, acc.accepted_node, keep_hidden=True, lengths=num)
        self._cache_committed(reqs, pending, emitted)
        stats.tree_nodes = int(batch.num_nodes.sum()) + len(reqs)
        return emitted, self._path_logprobs(reqs, res, logits, accepted, emitted, pen)

    def _path_logprobs(self, reqs: list[Request], res, logits: torch.Tensor, accepted: list[int],
                       emitted: list[list[int]], pen) -> list[list[TokenLogprob] | None] | None:
        """Logprobs of a speculative step's emitted tokens from the verify logits [B, 1 + T, V] along
        each accepted path (the root's row, then each accepted node's): no extra forward."""
        if not any(r.params.logprobs is not None for r in reqs):
            return None
        rows = path_rows(res.forest, accepted, len(reqs)).to(logits.device)       # [B, D]
        along = logits[torch.arange(len(reqs), device=logits.device)[:, None], rows.clamp(min=0)]
        return sampler.step_logprobs(reqs, along, emitted, pen)

    def _step_in_graph(self, reqs: list[Request], stats: StepStats, run
                       ) -> tuple[list[list[int]], list[int]] | None:
        """Acceptance, commit and prefix-cache checkpoints in a graph's tail: ``run(checkpoint slots)``
        (the step graph, or the verify graph's tail) returns the tail's rows (one device-to-host read);
        returns the emitted tokens and accepted nodes. None when the tail cannot take this step's
        checkpoints (the caller goes on eagerly)."""
        starts = [r.num_computed for r in reqs]
        plan = TailPlan()
        if self.checkpoints is not None:
            plan = self.checkpoints.reserve_tail(starts, self.config.spec.depth + 1,
                                                 self.runner.verify_graphs.checkpoints is not None)
            if plan is None:
                return None
        try:
            host = run(plan.slots)
        except BaseException:
            if self.checkpoints is not None:
                self.checkpoints.cancel(plan)
            raise
        emitted = [h[2:2 + h[1]] for h in host]
        pending = self.checkpoints.settle_tail(plan, starts, [h[1] for h in host]) if plan.reserved else None
        self._cache_committed(reqs, pending, emitted)
        stats.tree_nodes = sum(h[-1] for h in host) + len(reqs)
        return emitted, [h[0] for h in host]

    # -- prefix cache ----------------------------------------------------------------------------
    def _checkpoint_paths(self, reqs: list[Request], res, accepted: list[int], lengths: list[int]
                          ) -> list[PendingCheckpoint | None] | None:
        """Before an eager commit: checkpoint the block boundary each accepted path of ``lengths``
        nodes jumps over, by committing the path cut there into a checkpoint slot."""
        plan = self.checkpoints and self.checkpoints.plan_paths([r.num_computed for r in reqs], lengths)
        if plan is None:
            return None
        cache = self.prefix_cache
        self.runner.commit_path_prefix(res, accepted, list(plan.keep), cache.checkpoints, list(plan.targets),
                                       cache.scratch_slot)
        return list(plan.pending)

    def _cache_committed(self, reqs: list[Request], pending: list[PendingCheckpoint | None] | None = None,
                         emitted: list[list[int]] | None = None) -> None:
        """After a forward: publish newly committed full blocks, then attach / take GDN checkpoints.

        ``emitted``: a speculative step's tokens, not yet appended (its accepted drafts are committed)."""
        cache = self.prefix_cache
        if cache is None:
            return
        for i, r in enumerate(reqs):
            cache.publish(r, None if emitted is None else r.all_token_ids + emitted[i])
            if pending is not None and pending[i] is not None:
                cache.attach(r, pending[i].end, pending[i].slot)
            cache.checkpoint(r)

    def _finish(self) -> None:
        """Release the requests that finished this step. With a prefix cache in a speculative mode,
        first complete the drafter KV of their cached blocks (so speculative matches can use them),
        in one drafter forward for all of them."""
        done, self._finishing = self._finishing, []
        if not done:
            return
        if self.prefix_cache is not None and self.mode != "ar":
            self.runner.catch_up_drafter([r for r, _ in done])
            for r, _ in done:
                self.prefix_cache.mark_drafted(r)
        for r, reason in done:
            r.metrics.finish_time = time.monotonic()
            self.scheduler.finish(r, reason)
            self.metrics.record_finish(r)

    # -- emission --------------------------------------------------------------------------------
    def _emit(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        """Append tokens one by one with stop checks; finish the request if one fires (or, with no
        tokens, if it asked for none: max_tokens 0). ``logprobs``: one per token, when asked."""
        p = req.params
        new, reason = [], None
        if not tokens and req.num_output_tokens >= p.max_tokens:
            reason = "length"
        for t in tokens:
            req.append_token(t)
            new.append(t)
            n_out = req.num_output_tokens
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = time.monotonic()
            if n_out >= p.min_tokens and ((t in req.eos_token_ids and not p.ignore_eos) or t in p.stop_token_ids):
                reason = "stop"
                break
            if n_out >= p.max_tokens:
                reason = "length"
                break
        new_text = ""
        if req.detokenizer is not None:
            # a finished request's text is all of its tokens' (``flush``), an incomplete character included
            full = req.output_text + req.detokenizer.decode(req.output_token_ids, flush=reason is not None)
            if p.stop and reason is None:
                hit = find_stop(full, len(req.output_text), p.stop)
                if hit >= 0:
                    full, reason = full[:hit], "stop"
            new_text, req.output_text = full[len(req.output_text):], full
        if reason is not None:
            self._finishing.append((req, reason))  # released at the end of the step (``_finish``)
        prompt_lp = None
        if p.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt_lp, req.prompt_logprobs_sent = [None, *req.prompt_logprobs], True
        return RequestOutput(req.request_id, new, new_text, reason is not None, reason,
                             list(req.output_token_ids), req.output_text,
                             req.metrics.num_steps, req.metrics.num_accepted_drafts,
                             None if logprobs is None else logprobs[:len(new)], prompt_lp)

    def pop_finished(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None and req.status == RequestStatus.FINISHED:
            return self.requests.pop(request_id)
        return None
