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
is joined when it is read. ``StopStrings`` searches a request's stop strings token by token in the text
held back plus the new text (``find_stop``), not in the whole text; it holds back the text's last
characters that could begin a stop string, so that no part of one is ever emitted (a streamed delta
cannot be taken back), as vLLM does.
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
    text as the first ``num_pieces`` of ``pieces``, so the list only grows."""

    __slots__ = ("pieces", "length")

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.length = 0

    def append(self, s: str) -> None:
        if s:
            self.pieces.append(s)
            self.length += len(s)

    def __str__(self) -> str:
        return "".join(self.pieces)

    def __len__(self) -> int:
        return self.length


def find_stop(text: str, searched: int, stop: Sequence[str]) -> int:
    """Where the earliest of the ``stop`` strings that ends past ``text[:searched]`` (the characters
    already searched) starts in ``text``; -1 if none."""
    return min((i for i in (text.find(s, max(0, searched - len(s) + 1)) for s in stop) if i >= 0), default=-1)


class StopStrings:
    """A request's stop strings over its text, fed a token's new text at a time (``feed``): what may be
    emitted, and whether a stop string ended in it. The last ``max(len(s)) - 1`` characters are held
    back (``held``), since the next token's text may complete a stop string that begins in them, and
    text once streamed cannot be taken back; ``flush`` releases them when the request ends otherwise.
    Each check searches the held text plus the new text only: a stop string that began in text already
    emitted would have ended within the held characters, and been found."""

    __slots__ = ("stop", "hold", "held")

    def __init__(self, stop: Sequence[str]):
        self.stop, self.hold, self.held = tuple(stop), max(len(s) for s in stop) - 1, ""

    def feed(self, text: str, check: bool = True) -> tuple[str, bool]:
        """``text``, a token's new text: the text now safe to emit, and whether a stop string ended in
        ``text`` (then the emitted text ends where it starts, and nothing stays held). ``check`` False
        (before ``min_tokens``): the text only passes through."""
        window = self.held + text
        hit = find_stop(window, len(self.held), self.stop) if check and text else -1
        if hit >= 0:
            self.held = ""
            return window[:hit], True
        cut = max(len(window) - self.hold, 0)
        self.held = window[cut:]
        return window[:cut], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
