"""Emission: a step's tokens appended to a request with its stop checks, its text decoded, and the
``RequestOutput`` (the delta and where the request stands) the caller streams."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from bole.engine.detokenizer import find_stop
from bole.engine.sequence import Request
from bole.spec.logprobs import TokenLogprob


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


def emit(req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
    """Append tokens one by one with stop checks; the output is ``finished`` if one fires (or, with no
    tokens, if the request asked for none: max_tokens 0): the caller then releases the request.
    ``logprobs``: one per token, when asked."""
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
    prompt_lp = None
    if p.prompt_logprobs is not None and not req.prompt_logprobs_sent:
        prompt_lp, req.prompt_logprobs_sent = [None, *req.prompt_logprobs], True
    return RequestOutput(req.request_id, new, new_text, reason is not None, reason,
                         list(req.output_token_ids), req.output_text,
                         req.metrics.num_steps, req.metrics.num_accepted_drafts,
                         None if logprobs is None else logprobs[:len(new)], prompt_lp)
