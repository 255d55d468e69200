"""Per-request sampling parameters (the OpenAI / vLLM knobs), validated once on construction.

The engine turns a batch of these into per-row tensors (temperature, top_k, top_p, seed) that
``bole.spec.sampling.process_logits`` and ``accept_tree`` consume; nothing downstream re-validates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    Attributes:
        temperature: >= 0; 0 means greedy (argmax), token-identical to autoregressive decoding.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: -1 or 0 disables it; otherwise keep the k most likely tokens (k >= 1).
        max_tokens: the most tokens to generate (>= 1).
        min_tokens: EOS and stop tokens are suppressed until this many tokens exist (<= max_tokens).
        stop: strings that end generation (not included in the output); a single string is allowed.
        stop_token_ids: token ids that end generation (in addition to EOS unless ``ignore_eos``).
        seed: per-request seed for reproducible sampling, or None for a fresh random one.
        ignore_eos: keep generating past EOS (benchmarks).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        # Normalise container fields to tuples so the dataclass stays hashable and immutable.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in stop):
            raise ValueError(f"stop must not contain empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))

        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(
                f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        object.__setattr__(self, "temperature", float(t))

        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        object.__setattr__(self, "top_p", float(p))

        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or an int >= 1, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
        if self.seed is not None and (not _is_int(self.seed) or not -(1 << 63) <= self.seed < 1 << 63):
            # the per-row seed tensors are int64 (bole.spec.sampling.counter_uniforms)
            raise ValueError(f"seed must be an int in [-2**63, 2**63) or None, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        """-1 when top-k is off (top_k of 0 or -1), else top_k: the value the sampler tensors carry."""
        return -1 if self.top_k <= 0 else self.top_k

