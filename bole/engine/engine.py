"""The engine step loop: schedule, run the forwards of the step's mode, sample, commit, emit.

One ``step()``:
  1. ``Scheduler.schedule(lookahead)`` picks prefill chunks and decoding requests (preempting by
     recompute when KV blocks run out).
  2. Prefill chunks run in one forward (a prompt past a checkpoint boundary too: the boundary's GDN
     state is written from inside it, ``_one_forward``); requests whose prefill completed sample their
     next token.
  3. Decoding requests advance by the engine's mode:
       ar           one decode forward, sample one token;
       bole         MTP draft -> batch budget (Algorithm 3) -> one verify forward over the forest
                    (closed-form GDN verification) -> lossless tree sampling -> factorized commit;
       serial_tree  the same trees, verified with per-node state snapshots and committed by copying
                    the accepted node's snapshot (the SGLang-style baseline).
  4. Emitted tokens are appended with stop / length checks; finished requests free their memory.

The speculative step is ``bole.engine.spec_step``; emission (stop checks, incremental text) is
``bole.engine.output``. With the prefix cache on, every forward is followed (before emission, which
may free the request) by ``publish_committed``: newly committed full blocks join the cache and GDN
checkpoints are taken at block boundaries (speculative commits that jump over a boundary are
checkpointed along the accepted path first: ``bole.cache.checkpoints`` plans them).

Sampling randomness is keyed by (request seed, token index): the token at index i of a request
is always drawn with the uniform U(seed, i), whichever mode produced it, so greedy AND seeded
stochastic outputs are identical across modes. The logits processing (``bole.engine.sampler``:
min_tokens, penalties with a tree row's own path, temperature, top-k / top-p) is the same in every
mode too. A step with min_tokens or penalised requests accepts eagerly (the verify forward may still
replay its graph; the graphs' tails carry neither); logprobs come from the logits the step holds, on
every path.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from typing import Callable

import torch

from bole import recalibration
from bole.backend import FLA_MIN_TOKENS
from bole.cache.checkpoints import PendingCheckpoint, publish_committed
from bole.cache.memory_plan import plan_engine_memory
from bole.cache.prefix_cache import PrefixCache
from bole.config import EngineConfig
from bole.engine import sampler
from bole.engine.core import EngineLimits, EngineStats, RequestTimings, budget_stats
from bole.engine.detokenizer import IncrementalDetokenizer, skipped_token_ids
from bole.engine.metrics import EngineMetrics, StepStats
from bole.engine.output import RequestOutput, emit
from bole.engine.runner import ModelRunner
from bole.engine.scheduler import Scheduler
from bole.engine.sequence import Request, RequestStatus
from bole.engine.spec_step import SpeculativeStep
from bole.errors import InvalidRequest
from bole.hardware import resolve_calibration
from bole.sampling_params import SamplingParams
from bole.spec.budget import CalibrationTable, engine_verify_rows, resolve_budget_rule
from bole.spec.draft_vocab import read_draft_vocab
from bole.spec.drafter import tree_size
from bole.spec.logprobs import TokenLogprob
from bole.spec.tree import MAX_TREE_NODES, tree_widths

logger = logging.getLogger(__name__)

# the polling interval of ``LLMEngine._admit_while_busy`` (Linux sleeps ~50 µs longer); it releases the GIL
# for the event loop that receives the requests
ADMIT_POLL_S = 50e-6


class LLMEngine:
    """The continuous-batching engine over one model: requests in, ``step()`` -> their output deltas."""

    @property
    def calibration(self) -> CalibrationTable:
        """The budget table the speculative step looks up (B_ver per bucket)."""
        return self._calibration

    @calibration.setter
    def calibration(self, table: CalibrationTable) -> None:
        """Install ``table`` (at start, by recalibration or a replica's reconfigure): with
        ``SpecConfig.budget_epsilon`` set, a speculative engine re-derives its B_ver at that ε from the
        table's timings; with ``budget_rule="goodput"`` it chooses from them each step (either: ValueError
        naming a table without them)."""
        spec = self.config.spec
        eps = spec.budget_epsilon
        table = table if eps is None or self.mode == "ar" else table.with_epsilon(eps)
        if self.mode != "ar" and spec.budget_rule == "goodput":
            _ = table.goodput_curves   # formed (or refused) at install, not mid-run
        self._calibration = table

    def __init__(self, model, config: EngineConfig, tokenizer=None, calibration: CalibrationTable | None = None):
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.mode = config.mode
        have, want = next(model.parameters()).device, torch.device(config.device)
        if have.type != want.type or want.index not in (None, have.index):
            raise ValueError(f"the model is on {have} but the engine's device is {config.device!r}: "
                             f"load it with device={config.device!r} (bole.models.loader.load_model)")
        if self.mode != "ar" and model.mtp is None:
            raise ValueError(f"mode {self.mode!r} needs a checkpoint with an MTP drafter (mtp.* tensors)")
        spec, V = config.spec, model.config.vocab_size
        if model.mtp is not None:
            model.mtp.fast_math = spec.draft_fast_math
            # the reduced draft vocabulary's [N, H] lm_head rows, gathered before memory is planned
            model.mtp.restrict_vocab(None if spec.draft_vocab is None else
                                     read_draft_vocab(model.source_path, spec.draft_vocab, V))
        # KV blocks and checkpoint slots planned once from the free memory (bole.cache.memory_plan)
        self.memory_plan, config = plan_engine_memory(model, config)
        self.config = config
        self.max_draft_nodes = tree_size(model.mtp.vocab_width, spec.depth, spec.topk, spec.beam) \
            if self.mode != "ar" else 0
        self.lookahead = 1 + self.max_draft_nodes
        # the verify forward's rows across the batch: the factor buffer's nodes, each step capped to them
        self.verify_rows = engine_verify_rows(config, config.max_num_seqs, self.lookahead)
        # "auto" picks a table for (hardware class, model shapes) with fallbacks (bole.hardware);
        # bole.recalibration.recalibrate swaps this attribute between steps (the ``calibration`` setter).
        table = calibration or resolve_calibration(config.calibration_table, model.config, config.device,
                                                   config.dtype)
        if self.mode != "ar":   # the budget rule, fixed for the engine's life (its draft graphs are built for it)
            moe = model.config.num_experts > 0
            rule = resolve_budget_rule(spec.budget_rule, moe, table)
            if rule != spec.budget_rule:
                logger.info("budget rule %s: %s (%s model, table %s)", spec.budget_rule, rule,
                            "routed-expert" if moe else "dense", table.table_id)
            self.config = config = dataclasses.replace(config, spec=dataclasses.replace(spec, budget_rule=rule))
            spec = config.spec
        self.calibration = table
        graphs, spec_graphs = config.enable_cuda_graphs, config.enable_cuda_graphs and self.mode != "ar"
        spec_sizes = sorted({b for b in config.cuda_graph_batch_sizes if b < config.max_num_seqs}
                            | {config.max_num_seqs})
        self.runner = ModelRunner(model, config.cache.num_blocks, config.cache.block_size,
                                  config.max_num_seqs + 1, self.verify_rows,
                                  config.torch_dtype, config.device,
                                  snapshot_verify=self.mode == "serial_tree",
                                  cuda_graph_batch_sizes=config.cuda_graph_batch_sizes
                                  if graphs and self.mode == "ar" else None,
                                  verify_graph_spec=dict(batch_sizes=spec_sizes, tree_sizes=tree_widths(self.lookahead),
                                                         max_depth=spec.depth + 1, sampled_tail=True)
                                  if spec_graphs else None,
                                  draft_graph_spec=dict(batch_sizes=spec_sizes, depth=spec.depth, topk=spec.topk,
                                                        beam=spec.beam, max_per_request=MAX_TREE_NODES - 1,
                                                        floor=spec.budget_floor,
                                                        goodput=spec.budget_rule == "goodput")
                                  if spec_graphs else None,
                                  # the same buckets in every mode: a prefill runs at the same padded shapes
                                  prefill_graph_sizes=spec_sizes if config.prefill_graphs else None,
                                  prefill_graph_tokens=config.prefill_graph_tokens,
                                  prefill_beside=config.prefills_beside_forward)
        cc = config.cache
        self.prefix_cache = PrefixCache(self.runner.allocator, self.runner.state_pool, cc.block_size,
                                        cc.checkpoint_interval_blocks, cc.num_checkpoint_slots,
                                        track_mtp=self.mode != "ar") if cc.enable_prefix_cache else None
        if self.prefix_cache is not None:   # a prompt's boundary state written from inside its one forward
            self.runner.enable_prefill_checkpoints(self.prefix_cache.checkpoints)
        if self.prefix_cache is not None and self.runner.verify_graphs is not None:
            self.runner.verify_graphs.enable_checkpoints(self.prefix_cache.checkpoints, cc.checkpoint_interval,
                                                         self.prefix_cache.scratch_slot)
        if self.runner.device.type == "cuda":
            self.warm_up()
        if config.cuda_graph_capture_len is not None:  # after enable_checkpoints: it must precede any graph
            self.capture_graphs(config.cuda_graph_capture_len)
        # recorded before a step's forwards: prefills beside them (``_admit_while_busy``) follow it
        self._fence = torch.cuda.Event() if self.runner.prefill_stream is not None else None
        self.spec_step = SpeculativeStep(self.runner, spec, V, self.max_draft_nodes, self.prefix_cache,
                                         self.verify_rows) \
            if self.mode != "ar" else None
        self.scheduler = Scheduler(self.runner.allocator, self.runner.state_pool, config.cache.block_size,
                                   config.max_num_seqs, config.max_num_batched_tokens, self.prefix_cache)
        self.capacity_tokens = config.cache.num_blocks * config.cache.block_size
        self.metrics = EngineMetrics()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._finishing: list[tuple[Request, str]] = []  # finished during this step (``_finish``)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.eos_token_ids = tuple(config.eos_token_ids) or ((eos,) if eos is not None else ())
        self._skipped = skipped_token_ids(tokenizer) if tokenizer is not None else frozenset()

    # -- requests --------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      request_id: str | None = None) -> None:
        """Raise ``InvalidRequest`` naming the problem if ``add_request`` would refuse this request; queues
        nothing (``bole.LLM.generate`` checks a whole batch before adding any of it)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:   # else served once, silently
            raise InvalidRequest(f"n={params.n}: an engine request is one sequence; LLM.generate and the endpoint "
                                 "send n choices as n requests (bole.sampling_params.choice_params)", param="n")
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise InvalidRequest(f"prompt_token_ids must be a list of ints, got {type(prompt_token_ids).__name__}")
        if not prompt_token_ids:
            raise InvalidRequest("prompt is empty: at least one token is needed")
        not_int = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool)]
        if not_int:
            raise InvalidRequest(f"prompt token ids must be ints, got {not_int[:5]!r} "
                             f"({', '.join(sorted({type(t).__name__ for t in not_int}))})")
        V = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < V]
        if bad:
            raise InvalidRequest(f"prompt token ids out of range [0, {V}): {bad[:5]}", param="prompt")
        bad = [t for t in params.stop_token_ids if t >= V]   # never sampled: a client's mistake
        if bad:
            raise InvalidRequest(f"stop_token_ids out of range [0, {V}): {bad[:5]}", param="stop_token_ids")
        P, M, L, C = len(prompt_token_ids), params.max_tokens, self.lookahead, self.capacity_tokens
        if P + M > C:
            raise InvalidRequest(f"prompt ({P} tokens) + max_tokens ({M}) does not fit the KV cache ({C} tokens = "
                             f"num_blocks {self.config.cache.num_blocks} x block_size {self.config.cache.block_size})")
        if P + M + L > C:
            # the request fits, but not with the draft tree each speculative step reserves past it
            spec = self.config.spec
            raise InvalidRequest(f"prompt ({P} tokens) + max_tokens ({M}) + the tree lookahead reserved per request "
                             f"({L} tokens: 1 + {self.max_draft_nodes} draft nodes for depth {spec.depth}, topk "
                             f"{spec.topk}, beam {spec.beam}) = {P + M + L} does not fit the KV cache ({C} tokens); "
                             "use a narrower tree (depth / topk / beam) or more num_blocks")
        if request_id is not None and request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        self.check_request(prompt_token_ids, params, request_id)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        detok = IncrementalDetokenizer(self.tokenizer, skipped=self._skipped) if self.tokenizer is not None else None
        req = Request(rid, prompt_token_ids, params, seed, self.eos_token_ids, detokenizer=detok)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> bool:
        # a request a failed step left finishing is released here, not again by the next step's _finish
        self._finishing = [(r, why) for r, why in self._finishing if r.request_id != request_id]
        req = self.scheduler.abort(request_id)
        self.requests.pop(request_id, None)
        return req is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def cached_prefix_hashes(self, limit: int | None = None) -> list[int]:
        """Chain hashes (``deployments.routing_policy.prefix_block_hashes``) of the prefix blocks this
        engine has cached, least recently used first; [] without a prefix cache. For routing stats."""
        return self.prefix_cache.summary(limit) if self.prefix_cache is not None else []

    def warm_up(self) -> float:
        """Run the eager forwards of long prefills once, before any request (``ModelRunner.warm_up``), so
        their kernels compile here and not in a served step: on a fresh machine fla's autotuned chunk
        kernels took 50 s in the first 128-token prefill of a 9B-cost model (H100), stalling every request
        in flight. The rows cover a single and a packed long prefill, with token totals on and off a
        multiple of 16 (Triton's specialisation of integer arguments), and two short ones (the recurrent
        path, eager when prefill graphs are off). Returns the seconds it took (logged)."""
        t0 = time.perf_counter()
        cap, F = self.config.max_num_batched_tokens, FLA_MIN_TOKENS
        rows = [(min(2 * (F - 1), cap),)] if cap >= F else []
        rows += [r for r in ((F, F + 1), (F - 1,), (3, 4)) if sum(r) <= cap]   # packed; short (graphs off)
        self.runner.warm_up(rows, drafter=self.mode != "ar")
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        dt = time.perf_counter() - t0
        logger.info("warmed up the eager prefill forwards (%s tokens) in %.1f s", rows, dt)
        return dt

    def capture_graphs(self, max_len: int) -> int:
        """Capture now every graph a step of <= max_num_seqs requests with <= ``max_len`` tokens each can
        need (every family the runner enabled: decode, draft, verify with each tree width, short prefill),
        so no step waits on a capture; returns how many were new (0 without graphs, e.g. on the CPU)."""
        t0, n = time.perf_counter(), 0
        for family in self.runner.all_graphs():
            n += family.capture_all(self.config.max_num_seqs, max_len)
        if n:
            logger.info("captured %d CUDA graphs at start (<= %d requests of <= %d tokens) in %.1f s", n,
                        self.config.max_num_seqs, max_len, time.perf_counter() - t0)
        return n

    # -- the step --------------------------------------------------------------------------------
    def step(self, emit_early: Callable[[list[RequestOutput]], None] | None = None,
             admit: Callable[[], int] | None = None) -> list[RequestOutput]:
        """Run one step; its outputs. With ``emit_early``, the prefills' first tokens of requests that go on
        go there as soon as they are sampled, before the decode / speculative forwards, and are not
        returned (``AsyncEngine`` streams them at once: a bole step's draft and verify then add nothing to
        TTFT); an output that finishes its request is returned at the end, after the request's release.

        ``admit`` (with ``emit_early`` and ``EngineConfig.admit_mid_step``) adds the requests that arrived
        since the step began and returns how many (``AsyncEngine`` applies its inbox's adds): it is called
        before the decode forward and, in the speculative modes, between the draft and the verify forward.
        The arrivals are prefilled there, within what is left of the step's token budget, and their first
        tokens emitted early; the step's decode batch is not changed (``Scheduler.admit_arrivals``). An
        arrival then waits for the step's next admission point, not its end. With
        ``EngineConfig.admit_during_forward`` there is one more, while the GPU runs the decode or verify
        forward (``_admit_while_busy``)."""
        self._finish()  # requests a failed step left finishing
        sched = self.scheduler.schedule(self.lookahead)
        outputs: list[RequestOutput] = []
        stats = StepStats(time.perf_counter())
        V = self.model.config.vocab_size
        if sched.prefill:
            outputs += self._prefill(sched.prefill, sched.prefill_tails, stats, emit_early, stats.start)
        ending = {id(r) for r, _ in self._finishing}  # finished by this step's prefill sampling
        decode = [r for r in sched.decode if not r.is_finished and id(r) not in ending]
        between = during = None
        if admit is not None and emit_early is not None and self.config.admit_mid_step:
            def between() -> None:   # requests sent since the step began: prefilled here, not after it
                n = stats.admitted_mid_step
                outputs.extend(self._admit(admit, len(decode), stats, emit_early))
                if self._fence is not None and stats.admitted_mid_step > n:
                    self._mark_fence()   # a prefill beside the forward starts after this one
            between()
            if self.config.admit_during_forward:
                def during() -> None:   # while the GPU runs the decode / verify forward
                    outputs.extend(self._admit_while_busy(admit, len(decode), stats, emit_early))
                if self._fence is not None:
                    self._mark_fence()   # what a prefill beside this step's forwards must follow
        if decode:
            t0 = time.perf_counter()
            if self.mode == "ar":
                logits = self.runner.decode(decode, keep_hidden=False)
                if during is not None:
                    during()
                publish_committed(self.prefix_cache, decode)
                toks, lps = sampler.sample_next(decode, logits, sampler.penalties(decode, V, self.runner.device))
                emitted = [[t] for t in toks]
                stats.tree_nodes = len(decode)
                stats.eager_forward = not self.runner.decode_graphed
            else:
                emitted, lps = self.spec_step.run(decode, stats, self.calibration, between=between, during=during)
            stats.verify_time = time.perf_counter() - t0   # admissions between draft and verify included
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

    def _admit(self, admit: Callable[[], int], num_decode: int, stats: StepStats,
               emit_early: Callable[[list[RequestOutput]], None], polled: bool = False) -> list[RequestOutput]:
        """An admission point inside a step: ``admit()`` adds the requests sent since the step began (or,
        ``polled``, the caller has just added some); the scheduler admits those that fit what is left of
        the step's token budget without touching the step's batch (``Scheduler.admit_arrivals``); they
        are prefilled now (``_prefill``)."""
        if not polled and not admit():
            return []
        t0 = time.perf_counter()
        late = self.scheduler.admit_arrivals(self.config.max_num_batched_tokens - num_decode - stats.prefill_tokens)
        stats.admitted_mid_step += len(late.prefill)   # one chunk per admitted request
        return self._prefill(late.prefill, late.prefill_tails, stats, emit_early, t0) if late.prefill else []

    def _mark_fence(self) -> None:
        """Record the fence on the engine device's current stream (not the thread's current device's)."""
        self._fence.record(torch.cuda.current_stream(self.runner.device))

    def _admit_while_busy(self, admit: Callable[[], int], num_decode: int, stats: StepStats,
                          emit_early: Callable[[list[RequestOutput]], None]) -> list[RequestOutput]:
        """The admission point while the GPU runs the step's forwards (the draft and verify, or the decode),
        called right after the last is launched: until that work is done (a CUDA event), poll for arrivals
        and prefill each at once on the runner's prefill stream (``ModelRunner.beside``), whose highest
        priority lets its blocks go ahead of the forwards' blocks not yet scheduled: an arrival waits for
        its own prefill (slowed by what it shares the GPU with), not for the step. The forwards' requests
        wait for the prefill as they would at the next step's start. The price, every step: the GPU idles
        between the forward and what follows (the sampling, or the acceptance tail) for up to a polling
        interval and that launch. Safe at this point: the verify forward hands the tail its outputs in
        buffers outside the graph pool and its factors in the runner's buffer, which prefills never
        touch; the tail's checkpoint slots (which may be cached checkpoints an arrival could hit or evict)
        are reserved after it, and ar's step checkpoints after it too. On the CPU (no prefill stream) the
        forward has run already: one admission point, the prefill after it."""
        if self.runner.prefill_stream is None:
            return self._admit(admit, num_decode, stats, emit_early)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.runner.device))
        out: list[RequestOutput] = []
        while True:
            if admit():
                before = stats.admitted_mid_step
                # the whole admission inside: its slot zeroing and checkpoint restores are GPU work the
                # prefill reads, so they go on the prefill stream too (not behind the forward on the main one)
                with self.runner.beside(self._fence):
                    out += self._admit(admit, num_decode, stats, emit_early, polled=True)
                stats.admitted_beside += stats.admitted_mid_step - before
            if done.query():
                return out
            time.sleep(ADMIT_POLL_S)

    def _prefill(self, chunks: list[tuple[Request, int]], tails: list[tuple[Request, int]], stats: StepStats,
                 emit_early: Callable[[list[RequestOutput]], None] | None, t0: float) -> list[RequestOutput]:
        """Prefill ``chunks`` and their ``tails`` (the prompts' rest past the checkpoint boundary their
        chunks end at): joined, the boundaries' states written into checkpoint slots from inside the
        forward that passes them, when the runner can (``_one_forward``); else the chunks, then the tails
        (publish_committed has checkpointed the boundaries by then). Each as one forward or, with
        ``cuda_graph_prefill_split``, as the runner's graphed waves; sample the first tokens of the
        prompts that completed (``StepStats.prefill_time`` counts the seconds from ``t0`` to them). Their
        outputs: those that go on go to ``emit_early`` when given (and are not returned); a request that
        ended on its first token is handed back at the end of the step, once released."""
        spec, V = self.mode != "ar", self.model.config.vocab_size
        split = self.config.cuda_graph_prefill_split
        outputs: list[RequestOutput] = []
        last = {}
        one = self._one_forward(chunks, tails, split)
        pending = one[1] if one is not None else {}   # request id -> its boundary's reserved checkpoint

        def waves():   # each part's waves planned when it starts (a chunk's forward moves the tail's keys)
            if one is not None:
                yield from one[0]
                return
            for part in (chunks, tails):
                if part:
                    yield from self.runner.prefill_waves(part) if split else [part]
        try:
            for wave in waves():
                starts = {r.request_id: r.num_computed for r, _ in wave}
                scored = {} if any(r.needs_prompt_logits for r, _ in wave) else None
                inside, attach = self._wave_checkpoints(wave, starts, pending) if one is not None else (None, None)
                last.update(self.runner.prefill(wave, keep_hidden=spec, position_logits=scored, checkpoints=inside))
                stats.eager_prefill |= not self.runner.prefill_graphed
                for rid, lg in (scored or {}).items():
                    sampler.score_prompt(self.requests[rid], starts[rid], lg)
                for (r, _), p, ck in zip(wave, attach or (), inside or ()):
                    if p is None:
                        continue
                    if ck is None:   # the part ended on its boundary: the state is the request's slot
                        self.prefix_cache.state_pool.copy_slot(r.state_slot, self.prefix_cache.checkpoints, p.slot)
                    del pending[r.request_id]   # written: ``publish_committed`` attaches it (or gives it back)
                publish_committed(self.prefix_cache, [r for r, _ in wave], attach)
        finally:
            for p in pending.values():   # reserved, never written (a failed forward)
                self.prefix_cache.checkpoints.free(p.slot)
        done = [r for r, _ in chunks if r.request_id in last]
        for r in done:
            r.prefilled = True
            if r.params.max_tokens == 0:  # prompt scoring only (echo with max_tokens 0)
                outputs.append(self._emit(r, []))
        done = [r for r in done if r.params.max_tokens > 0]
        if done:
            toks, lps = sampler.sample_next(done, torch.stack([last[r.request_id] for r in done]),
                                            sampler.penalties(done, V, self.runner.device))
            for i, (r, t) in enumerate(zip(done, toks)):
                outputs.append(self._emit(r, [t], lps and lps[i]))
            # toks are host ints: the clock includes the prefill's GPU work
            stats.first_tokens += len(done)
            stats.prefill_time += time.perf_counter() - t0
        stats.prefill_tokens += sum(n for _, n in chunks + tails)
        early = [o for o in outputs if not o.finished] if emit_early is not None else []
        if early:
            emit_early(early)
            outputs = [o for o in outputs if o.finished]
        return outputs

    def _one_forward(self, chunks: list[tuple[Request, int]], tails: list[tuple[Request, int]], split: bool
                     ) -> tuple[list[list[tuple[Request, int]]], dict[str, PendingCheckpoint]] | None:
        """Each chunk joined with its tail, as the forwards that will run them (one, or with ``split`` the
        runner's graphed waves), and the checkpoint slot reserved now for each boundary that needs one
        (none where the block has one already, cached or another request's in this step, or no slot
        could be had: as ``PrefixCache.checkpoint`` would take none); these reservations evict no checkpoint
        that another boundary planned here relies on (the step's later ones, ``publish_committed``'s
        and a speculative tail's, evict in the cache's order as before). The forward passing a boundary
        writes its state there (``ModelRunner.checkpoints_in_forward``): the tail's forward, a read of
        every weight, is saved. None: no tails, or the runner cannot write them inside every forward."""
        if not tails:
            return None
        tail_of = {id(r): n for r, n in tails}
        joined = [(r, n + tail_of.get(id(r), 0)) for r, n in chunks]
        waves = self.runner.prefill_waves(joined) if split else [joined]
        if not all(self.runner.checkpoints_in_forward(w) for w in waves):
            return None
        cache = self.prefix_cache
        boundaries = [(r, tuple(r.all_token_ids[:r.num_computed + n])) for r, n in chunks if id(r) in tail_of]
        found = {prefix: cache.checkpointed(prefix) for _, prefix in boundaries}
        # a reservation evicts none of these: a request here counts on its boundary's checkpoint
        keep = {node for node in found.values() if node is not None}
        pending, seen = {}, set()
        for r, prefix in boundaries:
            # no live checkpoint is evicted for a slot that ``attach`` would give back
            slot = None if prefix in seen or found[prefix] is not None else cache.reserve_checkpoint(keep=keep)
            seen.add(prefix)
            if slot is not None:
                pending[r.request_id] = PendingCheckpoint(len(prefix), slot)
        return waves, pending

    def _wave_checkpoints(self, wave: list[tuple[Request, int]], starts: dict[str, int],
                          pending: dict[str, PendingCheckpoint]):
        """For one forward of ``_one_forward``'s plan: per row, (tokens to its boundary, slot) where the
        boundary lies inside the row's part (the runner's ``checkpoints``), and the checkpoints to attach
        after it (``publish_committed``). A part that ends on its boundary leaves the state in the
        request's slot: attached too (no checkpoint written inside: ``_prefill`` copies the slot into it)."""
        inside, attach = [], []
        for r, k in wave:
            p, s = pending.get(r.request_id), starts[r.request_id]
            inside.append((p.end - s, p.slot) if p is not None and s < p.end < s + k else None)
            attach.append(p if p is not None and s < p.end <= s + k else None)
        return inside, attach

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

    def _emit(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        """``bole.engine.output.emit``; a request it finishes is released at the end of the step."""
        out = emit(req, tokens, logprobs)
        if out.finished:
            self._finishing.append((req, out.finish_reason))
        return out

    def pop_finished(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None and req.status == RequestStatus.FINISHED:
            return self.requests.pop(request_id)
        return None

    # -- the engine contract (bole.engine.core.EngineCore) ---------------------------------------
    @property
    def model_config(self):
        return self.model.config

    def stats(self) -> EngineStats:
        """Metrics, queue and budget state as of the last step (between steps)."""
        running = [(r.request_id, r.num_computed) for r in self.scheduler.running]
        captures, capture_s = self.runner.graph_captures()
        return budget_stats({**self.metrics.snapshot(), "graph_captures": captures, "capture_time_s": capture_s},
                            self.calibration, self.config.spec.depth, running, len(self.scheduler.waiting),
                            len(self.requests))

    def limits(self) -> EngineLimits:
        """The model's positions or the KV capacity less one step's lookahead, whichever is smaller,
        bound a request (RoPE past the trained positions is not served)."""
        cfg = self.config
        kv = self.capacity_tokens - self.lookahead
        max_len = min(kv, int(getattr(self.model.config, "max_position_embeddings", kv)))
        graphed = any(g is not None and g.capturing for g in (self.runner.graphs, self.runner.verify_graphs))
        return EngineLimits(cfg.max_num_seqs, max_len, kv, self.model.config.vocab_size, cfg.cache.block_size,
                            cfg.device, cfg.dtype, cfg.tp_size, self.memory_plan.categories(), graphed)

    def request_timings(self, request_id: str) -> RequestTimings | None:
        """A request's engine clock at its first token; None before it. Its floats are written once,
        so they may be read while a step runs; the request stays until ``pop_finished``."""
        req = self.requests.get(request_id)
        m = None if req is None else req.metrics
        if m is None or m.scheduled_time is None or m.first_token_time is None:
            return None
        return RequestTimings(m.first_token_time - m.scheduled_time, m.scheduled_time - m.arrival_time)

    def recalibrate(self, quick: bool = True, **kw) -> CalibrationTable:
        """Two validated sweeps (``bole.recalibration.recalibrate``'s keywords); the new table, not
        installed (set ``calibration`` to install it)."""
        return recalibration.recalibrate(self, quick=quick, install=False, **kw)

    def shutdown(self) -> None:
        """Nothing to release: the caches go with the engine object (TP drivers stop their ranks)."""
