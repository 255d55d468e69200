"""Emission: a step's tokens appended to a request with its stop checks, its text decoded, and the
``RequestOutput`` (the delta and where the request stands) the caller streams.

A step costs O(its new tokens), not O(the output so far): the detokenizer decodes a short window
(``bole.engine.detokenizer``), the text is kept as appended pieces, stop strings are searched in the
new text plus the characters held back, and a ``RequestOutput``'s cumulative fields are
views: ``output_token_ids`` a window of the request's one token list, ``text`` joined from the text
pieces when read. Pickled (to another process), an output carries them as a plain list and string.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from bole.engine.detokenizer import StopStrings
from bole.engine.sequence import Request, TokenView
from bole.spec.logprobs import TokenLogprob


@dataclass
class RequestOutput:
    """What one step produced for one request (the delta) and where the request stands."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    output_token_ids: Sequence[int] = ()   # every output token so far (a view; compares equal to a list)
    text_pieces: list[str] = field(default_factory=list, repr=False)   # ``text``: the first num_text_pieces
    num_text_pieces: int = 0
    num_steps: int = 0             # decode / verify steps so far (MAT = emitted tokens / steps)
    num_accepted_drafts: int = 0
    logprobs: list[TokenLogprob] | None = None   # one per new token, when the request asked (``logprobs``)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only: None, then prompt tokens 1..

    @property
    def text(self) -> str:
        """The request's text so far (joined on each read: read it once, at the end)."""
        return "".join(self.text_pieces[:self.num_text_pieces])

    def __getstate__(self) -> dict:
        state = dict(vars(self))
        state.update(output_token_ids=list(self.output_token_ids), text_pieces=[self.text], num_text_pieces=1)
        return state


def emit(req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
    """Append tokens one by one with stop checks; the output is ``finished`` if one fires (or, with no
    tokens, if the request asked for none: max_tokens 0): the caller then releases the request.
    ``logprobs``: one per token, when asked.

    Stop strings are checked token by token (from token ``min_tokens`` + 1, as vLLM does), so that a
    speculative step's several tokens end where one token a step would: at the token whose text
    completes a stop string, the tokens past it dropped with their logprobs. The text emitted never
    holds any part of a stop string (``StopStrings`` holds back what could begin one)."""
    p = req.params
    new, reason = [], None
    if not tokens and req.num_output_tokens >= p.max_tokens:
        reason = "length"
    detok, text, pieces = req.detokenizer, req.output_text, []
    scan = None
    if detok is not None and p.stop:
        scan = req.stop_strings = req.stop_strings or StopStrings(p.stop)
    cut = False   # a stop string ended: the text is complete
    for t in tokens:
        req.append_token(t)
        new.append(t)
        n_out = req.num_output_tokens
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.monotonic()
        if n_out >= p.min_tokens and ((t in req.eos_token_ids and not p.ignore_eos) or t in p.stop_token_ids):
            reason = "stop"
            break
        if scan is not None:
            piece, cut = scan.feed(detok.decode(req.output_token_ids), check=n_out > p.min_tokens)
            pieces.append(piece)
            if cut:
                reason = "stop"
                break
        if n_out >= p.max_tokens:
            reason = "length"
            break
    if detok is not None and not cut:
        # a finished request's text is all of its tokens' (``flush``), an incomplete character included
        rest = detok.decode(req.output_token_ids, flush=reason is not None)
        if scan is None:
            pieces.append(rest)
        else:
            piece, cut = scan.feed(rest, check=req.num_output_tokens > p.min_tokens)
            pieces.append(piece)
            if cut:
                reason = "stop"
            elif reason is not None:
                pieces.append(scan.flush())
    new_text = "".join(pieces)
    text.append(new_text)
    prompt_lp = None
    if p.prompt_logprobs is not None and not req.prompt_logprobs_sent:
        prompt_lp, req.prompt_logprobs_sent = [None, *req.prompt_logprobs], True
    P = req.num_prompt_tokens
    return RequestOutput(req.request_id, new, new_text, reason is not None, reason,
                         output_token_ids=TokenView(req.all_token_ids, P, P + req.num_output_tokens),
                         text_pieces=text.pieces, num_text_pieces=len(text.pieces),
                         num_steps=req.metrics.num_steps, num_accepted_drafts=req.metrics.num_accepted_drafts,
                         logprobs=None if logprobs is None else logprobs[:len(new)], prompt_logprobs=prompt_lp)
