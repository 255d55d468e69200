"""Request state: one small typed object per request, owned by the scheduler.

Token bookkeeping (the invariant every mode keeps):
    all_token_ids = prompt_token_ids + output_token_ids   (one list: outputs are appended to the prompt,
                                                            the other two are views of it, no copies)
    num_computed  = tokens whose K/V and GDN state are committed in the target caches.
While a request decodes, num_computed == len(all_token_ids) - 1: the last token (the *root* of the
next step, sampled but not yet run through the target) is pending. A (re)prefill runs every known
token and samples the next one, so a request preempted by recompute resumes exactly where it was.

The MTP drafter keeps its own KV (same block ids, same positions): position p of the drafter holds
(target hidden at p, token p+1), so it lags the target by one position; ``mtp_computed`` counts its
filled positions and ``pending_hidden`` holds the target hiddens it has not consumed yet.

With the prefix cache (``bole.cache.prefix_cache``) a request may start with num_computed > 0: its
block table then begins with shared, immutable cached blocks (``prefix_nodes``) and its GDN state
slot holds a copy of the checkpoint at their end.

A request with ``prompt_logprobs`` keeps the scores of its prompt tokens as its prefill runs
(``prompt_logprobs``, one per prompt token after the first); while they are incomplete it needs
every prompt position's logits (``needs_prompt_logits``), so the scheduler gives it no prefix-cache
hit (cached positions would not be run).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from bole.engine.detokenizer import IncrementalDetokenizer, OutputText, StopStrings
from bole.sampling_params import SamplingParams
from bole.spec.logprobs import TokenLogprob


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenView(Sequence):
    """A read-only window ``[start, stop)`` of a token list (``stop`` None: to its end, growing with
    it), without copying: a request's prompt or output within its one token list. Compares equal to
    any sequence of the same ints; slices and concatenations are lists."""

    __slots__ = ("_ids", "_start", "_stop")

    def __init__(self, ids: list[int], start: int, stop: int | None = None):
        self._ids, self._start, self._stop = ids, start, stop

    def __len__(self) -> int:
        return (len(self._ids) if self._stop is None else self._stop) - self._start

    def __getitem__(self, i):
        n = len(self)
        if isinstance(i, slice):
            a, b, step = i.indices(n)
            if step == 1:
                return self._ids[self._start + a:self._start + max(a, b)]
            return [self._ids[self._start + j] for j in range(a, b, step)]
        if not -n <= i < n:
            raise IndexError("token index out of range")
        return self._ids[self._start + (i if i >= 0 else i + n)]

    def __iter__(self):
        return itertools.islice(self._ids, self._start, self._stop)

    def __eq__(self, other) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __add__(self, other) -> list[int]:   # concatenates like the list it views
        return self[:] + list(other)

    def __radd__(self, other) -> list[int]:
        return list(other) + self[:]

    __hash__ = None

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class RequestMetrics:
    arrival_time: float
    scheduled_time: float | None = None   # first admitted to the running batch (end of its queue wait)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_steps: int = 0            # decode / verify steps that emitted tokens
    num_accepted_drafts: int = 0  # draft tokens accepted over all steps
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(eq=False)   # a request is itself: the scheduler's list membership compares identities, not fields
class Request:
    request_id: str
    all_token_ids: list[int]              # given the prompt (copied); outputs are appended (``append_token``)
    params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...] = ()
    num_prompt_tokens: int = field(init=False)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    num_computed: int = 0
    state_slot: int | None = None
    block_table: list[int] = field(default_factory=list)
    prefix_nodes: list = field(default_factory=list)   # cached blocks it shares: block_table[:len]
    prefilled: bool = False
    mtp_computed: int = 0
    pending_hidden: torch.Tensor | None = None   # [num_computed - mtp_computed, H]
    output_text: OutputText = field(default_factory=OutputText)   # appended pieces: str() is the text
    detokenizer: IncrementalDetokenizer | None = None   # with a tokenizer: ``output_text``, a step at a time
    stop_strings: StopStrings | None = None   # with a tokenizer and ``params.stop``: their search (``emit``)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (``score_prompt``)
    prompt_logprobs_sent: bool = False   # delivered with the first output
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.all_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)

    def append_token(self, token: int) -> None:
        """Append one output token."""
        self.all_token_ids.append(token)

    def queue_hidden(self, h: torch.Tensor) -> None:
        """Append target hiddens [n, H] of newly committed positions for the drafter's catch-up."""
        self.pending_hidden = h if self.pending_hidden is None else torch.cat([self.pending_hidden, h])

    @property
    def prompt_token_ids(self) -> TokenView:
        return TokenView(self.all_token_ids, 0, self.num_prompt_tokens)

    @property
    def output_token_ids(self) -> TokenView:
        return TokenView(self.all_token_ids, self.num_prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether its next prefill must keep per-position logits (prompt logprobs still to score)."""
        return self.params.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_prefilling(self) -> bool:
        """Still running known tokens through the target (prompt, or prompt + output after preemption).

        A (re)prefill computes every known token, then samples the next one.
        """
        return not self.prefilled

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop every cached token; outputs are kept."""
        self.status = RequestStatus.WAITING
        self.num_computed = 0
        self.prefilled = False
        self.mtp_computed = 0
        self.pending_hidden = None
        self.state_slot = None
        self.block_table = []
        self.prefix_nodes = []
        self.metrics.num_preemptions += 1
