"""An OpenAI request as engine requests: one ``Choice`` per (prompt, n), and the usage they add up to.

A choice is its own engine request with its own id; seeded choice j of a prompt samples with
``seed + j`` (``bole.sampling_params.choice_params``). Everything a client can get wrong is refused here as
an ``APIError`` 400 naming the field, before anything reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bole.errors import InvalidRequest
from bole.sampling_params import SamplingParams, choice_params
from deployments.engine_client import EngineClient, SubRequest
from deployments.http_guards import APIError
from deployments.openai_protocol import UsageInfo, new_id


@dataclass
class Choice:
    """One engine request behind one OpenAI choice."""

    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None
    hardware_class: str = "unknown"   # the serving replica's, from its outputs (scoring ones too)
    num_steps: int = 0
    counts_prompt: bool = True     # False for the 2nd..nth sample of a prompt (usage counts it once)
    logprobs: list = field(default_factory=list)   # ``TokenLogprob`` of every token so far (when asked)
    prompt_logprobs: list | None = None            # echo: the prompt's, from the first output
    echo: str | None = None                        # echo: the prompt's text, sent before the completion
    text_offset: int = 0                           # completions logprobs: where the next token starts

    @property
    def sub(self) -> SubRequest:
        return SubRequest(self.prompt_token_ids, self.params, self.request_id)


def check_ids(ids: list[int], param: str, vocab_size: int) -> list[int]:
    if not ids:
        raise APIError(400, "the prompt is empty", param=param)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"token ids out of range [0, {vocab_size}): {bad[:5]}", param=param)
    return ids


def make_choices(client: EngineClient, req, prompts: list[list[int]], max_tokens: int | None, kind: str,
                 default_max_tokens: int | None, logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> list[Choice]:
    """``req.n`` choices per prompt, each within the client's ``max_model_len``. An unset max_tokens
    (chat's default; completions' explicit null) is ``default_max_tokens`` capped at the room left, or
    the room; an explicit 0 (completions' echo: scoring the prompt) needs no room."""
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise APIError(400, "at most 4 stop sequences", param="stop")
    if len(prompts) * req.n > client.max_choices:
        raise APIError(400, f"{len(prompts)} prompt(s) x n={req.n} is more than the {client.max_choices} "
                       "sequences one request may ask for", param="n")
    choices = []
    for p_index, ids in enumerate(prompts):
        room = client.max_model_len - len(ids)
        want = max_tokens if max_tokens is not None else min(default_max_tokens or room, room)
        if want > room or room < 0 or (room == 0 and max_tokens != 0):
            asks = f"asks for {want} more" if room >= 1 else "leaves no room to generate"
            raise APIError(400, f"this model's maximum context length is {client.max_model_len} tokens; "
                           f"the request has {len(ids)} prompt tokens and {asks}",
                           param="max_tokens" if room >= 1 else "prompt", code="context_length_exceeded")
        try:
            per_choice = choice_params(SamplingParams(
                temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, max_tokens=want,
                min_tokens=req.min_tokens, stop=tuple(stop), stop_token_ids=tuple(req.stop_token_ids or ()),
                seed=req.seed, ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=req.n))
        except InvalidRequest as e:
            raise APIError(400, str(e), param=e.param) from None
        for j, params in enumerate(per_choice):
            choices.append(Choice(p_index * req.n + j, ids, params, new_id(kind), counts_prompt=j == 0))
    return choices


def usage(choices: list[Choice]) -> dict:
    """The OpenAI usage object: each prompt counted once, every choice's tokens."""
    prompt = sum(len(c.prompt_token_ids) for c in choices if c.counts_prompt)
    completion = sum(c.num_tokens for c in choices)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion).model_dump()
