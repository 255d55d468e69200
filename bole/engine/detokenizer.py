"""Incremental detokenisation: each step decodes a short window of recent tokens, not the whole output.

Re-decoding a request's whole output every step costs O(output) a step, O(output²) a request. Instead
(vLLM's technique) the detokenizer keeps a window of two token lists: ``prefix``, the tokens whose text
was emitted last (the decoding context), and ``pending``, the tokens whose text is not emitted yet. A
step's new text is decode(prefix + pending) minus decode(prefix); decoding from a token or more back
keeps what a decoder does at a sequence's start (a stripped leading space, say) out of the new text.
When the new text is emitted, ``pending`` becomes the next ``prefix``. Three cases emit nothing:
  * the window's text ends in U+FFFD (the bytes of an incomplete UTF-8 character, usually completed
    by a later token): ``pending`` waits; ``flush`` (the request finished) emits it as it is, so the
    finished text is exactly decode(all tokens);
  * the pending tokens decode to nothing after the prefix: they are dropped, so a run of them does
    not grow the window (each step stays O(new tokens)). Special tokens that decode skips
    (``skipped_token_ids``) are dropped as they are read, so a run of them inside an incomplete
    character (while the window waits) does not grow it either;
  * the window's text is shorter than the prefix's (a decoder that rewrites across tokens): it waits.

``OutputText`` holds the emitted text as appended pieces, so a step costs O(its delta) too; the text
is joined when it is read. Stop strings are searched in the new text plus the emitted text's last
characters (``find_stop``), not in the whole text.
"""

from __future__ import annotations

from typing import Sequence


def skipped_token_ids(tokenizer) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops whichever tokenizer class decodes: the
    special tokens both the added vocabulary (a fast tokenizer's rule) and ``all_special_ids`` (a slow
    one's) name. Dropping them before decoding changes no text."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(i for i, t in added.items() if getattr(t, "special", False)) & \
        frozenset(getattr(tokenizer, "all_special_ids", ()))


class IncrementalDetokenizer:
    """One request's text, decoded a window at a time (see the module docstring). ``skipped``:
    ``skipped_token_ids(tokenizer)``, computed once per tokenizer by the caller (here if None)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, skipped: frozenset[int] | None = None):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.skipped = (skipped_token_ids(tokenizer) if skipped is None else skipped) \
            if skip_special_tokens else frozenset()
        self.prefix: list[int] = []
        self.pending: list[int] = []
        self.prefix_text = ""
        self.num_read = 0      # output tokens taken into the window so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def decode(self, token_ids: Sequence[int], flush: bool = False) -> str:
        """The text of ``token_ids`` (the request's whole output so far; only the tokens past those
        read before are touched) past what was emitted before; "" while it ends in an incomplete
        character, unless ``flush``."""
        new = token_ids[self.num_read:]
        self.pending += [t for t in new if t not in self.skipped] if self.skipped else new
        self.num_read = len(token_ids)
        if not self.pending:
            return ""
        text = self._decode(self.prefix + self.pending)
        if text.endswith("\ufffd") and not flush:
            return ""
        if text == self.prefix_text:
            self.pending = []
            return ""
        if len(text) <= len(self.prefix_text):
            return ""
        self.prefix, self.pending = self.pending, []
        new, self.prefix_text = text[len(self.prefix_text):], self._decode(self.prefix)
        return new


class OutputText:
    """A request's output text as appended pieces: ``append`` touches only the new piece; ``str()``
    joins them (read once, at the end, or by a caller that asks). A ``RequestOutput`` reads its step's
    text as the first ``num_pieces`` of ``pieces``; ``truncate`` therefore never edits the list in
    place but builds a new one (once per request: a stop string's cut finishes it)."""

    __slots__ = ("pieces", "length")

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.length = 0

    def append(self, s: str) -> None:
        if s:
            self.pieces.append(s)
            self.length += len(s)

    def tail(self, n: int) -> str:
        """The last ``n`` characters (all if the text is shorter), from the last pieces only."""
        out, have, i = [], 0, len(self.pieces)
        while have < n and i > 0:
            i -= 1
            out.append(self.pieces[i])
            have += len(self.pieces[i])
        return "".join(reversed(out))[max(0, have - n):]

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` characters."""
        pieces, have = list(self.pieces), self.length
        while have > length:
            have -= len(pieces.pop())
        if have < length:
            pieces.append(self.pieces[len(pieces)][:length - have])
        self.pieces, self.length = pieces, length

    def __str__(self) -> str:
        return "".join(self.pieces)

    def __len__(self) -> int:
        return self.length


def find_stop(text: str, emitted: int, stop: Sequence[str]) -> int:
    """Where the earliest of the ``stop`` strings starts in ``text``, searching each from ``len(s)``
    before the end of the ``emitted`` characters already searched (a match across that end); -1 if none."""
    return min((i for i in (text.find(s, max(0, emitted - len(s))) for s in stop) if i >= 0), default=-1)
