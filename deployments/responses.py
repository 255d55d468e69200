"""OpenAI response objects of one request: the whole body, or its server-sent-event chunks.

``ResponseWriter`` knows the response's id, creation time, model and kind ("completion" or "chat")
and renders choices (``deployments.choices.Choice``) into them, with their logprobs objects
(``deployments.logprobs``) when the request asked.
"""

from __future__ import annotations

import json

from deployments.choices import Choice
from deployments.logprobs import TokenText, openai_logprobs
from deployments.openai_protocol import new_id, now

DONE = "data: [DONE]\n\n"


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class ResponseWriter:
    def __init__(self, kind: str, model_name: str, text_of: TokenText, include_usage: bool = False):
        self.kind, self.model_name, self.text_of, self.include_usage = kind, model_name, text_of, include_usage
        self.id, self.created = new_id("chatcmpl" if kind == "chat" else "cmpl"), now()

    def logprobs(self, c: Choice, entries: list, with_prompt: bool) -> dict | None:
        """The OpenAI logprobs object of these tokens of ``c``; with_prompt: the echoed prompt's
        tokens first. None when the request did not ask."""
        if c.params.logprobs is None:
            return None
        obj, c.text_offset = openai_logprobs(self.text_of, self.kind, entries, c.text_offset,
                                             c.prompt_token_ids if with_prompt else None, c.prompt_logprobs)
        return obj

    def body(self, choices: list[Choice], usage: dict) -> dict:
        """The non-streaming response of finished choices."""
        if self.kind == "chat":
            body = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "logprobs": self.logprobs(c, c.logprobs, False), "finish_reason": c.finish_reason}
                    for c in choices]
        else:
            body = [{"index": c.index, "text": (c.echo or "") + c.text,
                     "logprobs": self.logprobs(c, c.logprobs, c.echo is not None),
                     "finish_reason": c.finish_reason} for c in choices]
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name, "choices": body,
                "usage": usage}

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def chunk(self, c: Choice, text: str, finish: str | None, role: bool = False,
              logprobs: dict | None = None) -> str:
        """One SSE event of one choice's delta."""
        if self.kind == "chat":
            delta = {"content": text} if text else {}
            if role:
                delta = {"role": "assistant", "content": text}
            ch = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            ch = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        out = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model_name,
               "choices": [ch]}
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def delta(self, c: Choice, out) -> str | None:
        """The SSE event of an engine output of ``c`` (the echoed prompt once, first); None when
        there is nothing to send."""
        entries, echo, c.echo = out.logprobs or [], c.echo, None
        if out.new_text or out.finished or entries or echo is not None:
            return self.chunk(c, (echo or "") + out.new_text, c.finish_reason if out.finished else None,
                              logprobs=self.logprobs(c, entries, echo is not None))
        return None

    def usage_chunk(self, usage: dict) -> str:
        return sse({"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model_name,
                    "choices": [], "usage": usage})
