"""OpenAI ``logprobs`` objects from the engine's ``TokenLogprob`` entries (``bole.spec.logprobs``).

Completions (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one
entry per token; ``top_logprobs`` maps token text to logprob for the ``logprobs`` most likely
tokens plus the chosen one (as vLLM does; ids whose texts coincide share a key, with the best
logprob); with ``echo`` the prompt's tokens come first, the very
first with null logprob and alternatives. Chat: ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}]}`` with exactly ``top_logprobs`` alternatives.

A token's text is the tokenizer's decoding of that one id. ``bytes`` are the token's own bytes: for
byte-level BPE tokenizers (GPT-2 / Qwen style) those its vocabulary entry stands for, so a token
holding part of a multi-byte character gives its real bytes, not U+FFFD's; otherwise the UTF-8
encoding of its text.
``text_offset`` is the character offset of each token's text in the concatenation of the tokens'
texts (the choice's text when every token decodes to whole characters). Log-probabilities the
sampler set to -inf (tokens top-k / top-p cut) are sent as -9999.0: JSON has no infinity.
"""

from __future__ import annotations

from bole.spec.logprobs import TokenLogprob

NEG_INF_LOGPROB = -9999.0


def _finite(x: float) -> float:
    return max(x, NEG_INF_LOGPROB)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character of each byte -> the byte: printable Latin-1
    bytes stand for themselves, the other 68 for code points 256, 257, ... in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_LEVEL = _byte_level_alphabet()


class TokenText:
    """Token id -> text and bytes, memoised per app (the same ids recur in every response)."""

    def __init__(self, tokenizer):
        self.tokenizer, self._text, self._bytes = tokenizer, {}, {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"

    def __call__(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id]) if self.tokenizer is not None \
                else f"token_id:{token_id}"
        return text

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) if self.byte_level else None
            if piece and all(ch in _BYTE_LEVEL for ch in piece):
                raw = [_BYTE_LEVEL[ch] for ch in piece]
            else:  # special tokens, other tokenizers: the text's encoding
                raw = list(self(token_id).encode("utf-8"))
            self._bytes[token_id] = raw
        return raw


def completion_logprobs(text_of: TokenText, token_ids: list[int], entries: list[TokenLogprob | None],
                        offset: int = 0) -> tuple[dict, int]:
    """The completions ``logprobs`` object for ``token_ids`` (entry None: a prompt's first token), its
    text offsets starting at ``offset``; returns it and the offset after the last token."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, e in zip(token_ids, entries, strict=True):
        text = text_of(t)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(e.logprob))
        top: dict[str, float] = {}
        for i, lp in ((t, e.logprob), *e.top):   # ids decoding to one text keep the best logprob
            key = text_of(i)
            top[key] = max(top.get(key, NEG_INF_LOGPROB), _finite(lp))
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(text_of: TokenText, entries: list[TokenLogprob]) -> dict:
    """The chat ``logprobs`` object ``{"content": [...]}`` for these tokens."""
    def item(token_id: int, logprob: float) -> dict:
        text = text_of(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": text_of.bytes(token_id)}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for e in entries]}


def openai_logprobs(text_of: TokenText, kind: str, entries: list[TokenLogprob], offset: int = 0,
                    prompt_ids: list[int] | None = None, prompt_entries: list | None = None) -> tuple[dict, int]:
    """A choice's (or a streamed delta's) logprobs object: ``kind`` "chat" or "completion"; for
    completions, ``prompt_ids`` (echo) put the prompt's tokens first, scored by ``prompt_entries``
    (None: unscored), offsets from ``offset``. Returns it and the next offset."""
    if kind == "chat":
        return chat_logprobs(text_of, entries), offset
    ids, ents = [e.token_id for e in entries], list(entries)
    if prompt_ids is not None:
        ids, ents = prompt_ids + ids, list(prompt_entries or [None] * len(prompt_ids)) + ents
    return completion_logprobs(text_of, ids, ents, offset)
