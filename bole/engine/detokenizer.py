"""Incremental detokenisation: each step decodes a short window of recent tokens, not the whole output.

Re-decoding a request's whole output every step costs O(output) a step, O(output²) a request. Instead
(vLLM's technique) two offsets into the output tokens, ``prefix_offset`` <= ``read_offset``, mark a
window: the text of every token before ``read_offset`` has been emitted, and both offsets sit where
the text decoded so far ends in a complete character, so decoding restarts cleanly there. A step's new
text is decode(tokens[prefix_offset:]) minus decode(tokens[prefix_offset:read_offset]); decoding from
a token or more back, not from ``read_offset``, keeps what a decoder does at a sequence's start (a
stripped leading space, say) out of the new text. While the window's text ends in U+FFFD (the bytes
of an incomplete UTF-8 character, usually completed by the next token) nothing is emitted; ``flush``
(the request finished) emits it as it is, so the finished text is exactly decode(all tokens).
"""

from __future__ import annotations

from typing import Sequence


class IncrementalDetokenizer:
    """One request's text, decoded a window at a time (see the module docstring)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.prefix_offset = self.read_offset = 0

    def decode(self, token_ids: Sequence[int], flush: bool = False) -> str:
        """The text of ``token_ids`` (the request's whole output so far) past what was emitted before;
        "" while it ends in an incomplete character, unless ``flush``."""
        window = token_ids[self.prefix_offset:]
        prefix = self.tokenizer.decode(window[:self.read_offset - self.prefix_offset],
                                       skip_special_tokens=self.skip_special_tokens)
        text = self.tokenizer.decode(window, skip_special_tokens=self.skip_special_tokens)
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not flush):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return text[len(prefix):]


def find_stop(text: str, emitted: int, stop: Sequence[str]) -> int:
    """Where the earliest of the ``stop`` strings starts in ``text``, searching each from ``len(s)``
    before the end of the ``emitted`` characters already searched (a match across that end); -1 if none."""
    return min((i for i in (text.find(s, max(0, emitted - len(s))) for s in stop) if i >= 0), default=-1)
