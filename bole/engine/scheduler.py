"""Continuous-batching scheduler: admission by free memory, chunked prefill, preemption by recompute.

Each engine step asks ``schedule(lookahead)`` for a ``SchedulerOutput``:

1. Decoding requests first (they hold memory; letting them finish frees it). Each needs KV blocks
   for ``num_computed + lookahead`` positions (lookahead = the most tree nodes a request may verify,
   1 for autoregressive decoding). When blocks run out, the newest running request is preempted by
   recompute (its blocks and state slot freed, pushed to the FRONT of the waiting queue, outputs
   kept); a request that cannot grow even alone is preempted itself.
2. Prefill with the rest of the step's token budget (``max_num_batched_tokens``): requests already
   prefilling continue, then waiting requests are admitted in FIFO order while a state slot, the KV
   blocks of their chunk and a seat in ``max_num_seqs`` are free. Prompts longer than the budget are
   split into chunks over several steps.

Inside a step under way, ``admit_arrivals(budget)`` admits waiting requests the same way (step 2 for
new requests only, with what is left of the step's token budget) but touches nothing running and never
preempts: the engine prefills them before the step's decode forward or between its draft and verify
(``EngineConfig.admit_mid_step``), so an arrival does not wait for the whole step in flight.

No starvation: admission is strictly FIFO (a request that does not fit blocks those behind it), and
preempted requests are re-admitted before new ones. No deadlock: when requests in the middle of chunked
prefills hold every free block and none can take its next chunk, the newest is preempted.

With a ``PrefixCache``: an admitted request first takes the longest restorable cached chain (shared
blocks + GDN checkpoint) and prefills only the rest; a preempted request usually finds its own
blocks there. Cached blocks nobody uses are evicted (LRU) before anything is preempted or refused,
and prefill chunks end at GDN checkpoint boundaries (``PrefixCache.align_chunk``). A chunk cut there
that would otherwise have completed its prompt gets the rest (under one checkpoint interval) as a
``prefill_tails`` entry of the same step: the engine runs it in the chunk's forward, which writes the
boundary's checkpoint from inside it, or, where the runner cannot, right after the chunks, once the
boundary's checkpoint is taken; the first token does not wait a whole step for a few tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from bole.cache.kv_cache import BlockAllocator, blocks_needed
from bole.engine.sequence import Request, RequestStatus


@dataclass
class SchedulerOutput:
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this step)
    # (request, tokens): the rest of a prompt whose ``prefill`` chunk was cut at a checkpoint boundary,
    # run in the same step (in the chunk's forward when the runner can write the checkpoint there)
    prefill_tails: list[tuple[Request, int]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, allocator: BlockAllocator, state_pool, block_size: int,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, prefix_cache=None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} and max_num_batched_tokens="
                             f"{max_num_batched_tokens} must be >= 1")
        self.allocator, self.state_pool, self.block_size = allocator, state_pool, block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # -- bookkeeping -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, req: Request, num_positions: int) -> bool:
        need = blocks_needed(num_positions, self.block_size) - len(req.block_table)
        if need <= 0:
            return True
        short = need - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        if not self.allocator.can_allocate(need):
            return False
        req.block_table.extend(self.allocator.allocate(need))
        return True

    def _release(self, req: Request) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(req)
        elif req.block_table:
            self.allocator.free(req.block_table)
        if req.state_slot is not None:
            self.state_pool.free(req.state_slot)

    def finish(self, req: Request, reason: str) -> None:
        """Mark finished and free everything it holds (idempotent)."""
        if req.is_finished:
            return
        self._release(req)
        req.block_table, req.state_slot = [], None
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def abort(self, request_id: str) -> Request | None:
        for req in list(self.running) + list(self.waiting):
            if req.request_id == request_id:
                self.finish(req, "abort")
                return req
        return None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self._release(req)
        self.running.remove(req)
        req.reset_for_recompute()
        self.waiting.appendleft(req)
        out.preempted.append(req)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self, lookahead: int = 1) -> SchedulerOutput:
        out = self._schedule(lookahead)
        # Requests in the middle of a chunked prefill can hold every free block between them with none
        # able to take its next chunk: nothing would ever run. Preempt the newest until one can (a request
        # alone always fits: the engine refuses one that cannot, ``LLMEngine.check_request``).
        while out.is_empty and len(self.running) > 1:
            self._preempt(self.running[-1], out)
            again = self._schedule(lookahead)
            again.preempted[:0] = out.preempted
            out = again
        return out

    def _schedule(self, lookahead: int) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if req not in self.running or req.is_prefilling:
                continue
            while not self._grow(req, req.num_computed + lookahead):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req in self.running:
                out.decode.append(req)
                budget -= 1

        for req in self.running:
            if req.is_prefilling and budget > 0:
                budget -= self._take_chunk(req, out, budget)
        self._admit(out, budget)
        return out

    def admit_arrivals(self, budget: int) -> SchedulerOutput:
        """Admit waiting requests (FIFO, as ``schedule``) into a step already under way, within
        ``budget`` prefill tokens: the engine runs their prefill before the step's decode forward, or
        between its draft and verify (``EngineConfig.admit_mid_step``). Nothing running is touched: no
        decode request, no continuing chunked prefill, and nothing is preempted (only free or evictable
        blocks are taken), so the step's decode batch keeps everything the scheduler gave it."""
        out = SchedulerOutput()
        if budget > 0:
            self._admit(out, budget)
        return out

    def _take_chunk(self, req: Request, out: SchedulerOutput, budget: int) -> int:
        """Schedule ``req``'s next prefill chunk (and tail) within ``budget``; the tokens taken (0: none)."""
        remaining = req.num_tokens - req.num_computed
        chunk = min(remaining, budget)
        tail = 0
        if chunk > 0 and self.prefix_cache is not None:
            whole, chunk = chunk, self.prefix_cache.align_chunk(req.num_computed, chunk)
            # prompt logprobs are scored per chunk: one chunk per step for those
            tail = whole - chunk if whole == remaining and not req.needs_prompt_logits else 0
        if tail and not self._grow(req, req.num_computed + chunk + tail):
            tail = 0   # no blocks for the tail: it runs in a later step
        if chunk <= 0 or not self._grow(req, req.num_computed + chunk):
            return 0
        out.prefill.append((req, chunk))
        if tail:
            out.prefill_tails.append((req, tail))
        return chunk + tail

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in FIFO order while a state slot, the KV blocks of their first chunk
        and a seat in ``max_num_seqs`` are free; their chunks go to ``out``."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.state_pool.can_allocate(1):
                break
            cache = self.prefix_cache
            if cache is not None and not req.needs_prompt_logits:  # prompt logprobs need every position run
                cache.share(req, cache.match(req.all_token_ids))
            took = self._take_chunk(req, out, budget)
            if not took:
                if cache is not None:
                    cache.release(req)
                    req.num_computed = req.mtp_computed = 0
                break
            budget -= took
            self.waiting.popleft()
            req.state_slot = self.state_pool.allocate(zero=not req.prefix_nodes)
            if cache is not None:
                cache.restore(req)
            if req.metrics.num_preemptions == 0:
                req.metrics.prefix_hit_tokens = min(req.num_computed, req.num_prompt_tokens)
                req.metrics.scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
