"""Per-request sampling parameters (the OpenAI / vLLM knobs), validated once on construction.

The engine turns a batch of these into per-row tensors (temperature, top_k, top_p, seed, and the
penalties as ``bole.spec.sampling.Penalties``) that ``process_logits`` and ``accept_tree`` consume;
nothing downstream re-validates.

Log-probabilities (``logprobs``) are those of the target's *processed* distribution at each emitted
position, the one the token was drawn from (vLLM's ``logprobs_mode="processed_logprobs"``): after
min_tokens masking, the penalties, temperature, top-k and top-p; tokens those cut off have -inf.
A greedy request's are the log-softmax of its penalised logits (temperature 1, no truncation: the
distribution whose argmax it emits). ``prompt_logprobs`` are the model's raw log-softmax over the
prompt (a prompt token is not sampled; what lm-evaluation-harness's loglikelihood needs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from bole.errors import InvalidRequest

MAX_LOGPROBS = 20  # the most alternatives per position (``logprobs``, ``prompt_logprobs``), as vLLM's default


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; a bad value raises ``InvalidRequest`` whose ``param`` names its field.

    Attributes:
        temperature: >= 0; 0 means greedy (argmax), token-identical to autoregressive decoding.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: -1 or 0 disables it; otherwise keep the k most likely tokens (k >= 1).
        max_tokens: the most tokens to generate (>= 1; 0 with ``prompt_logprobs``: score the prompt only).
        min_tokens: EOS and stop tokens are suppressed until this many tokens exist (<= max_tokens).
        stop: strings that end generation (not included in the output); a single string is allowed.
        stop_token_ids: token ids that end generation (in addition to EOS unless ``ignore_eos``).
        seed: per-request seed for reproducible sampling, or None for a fresh random one.
        ignore_eos: keep generating past EOS (benchmarks).
        presence_penalty: in [-2, 2]; subtracted from the logit of every token already in the output.
        frequency_penalty: in [-2, 2]; subtracted once per occurrence of the token in the output.
        repetition_penalty: > 0 (1 = off); the logit of a token in the prompt or the output is divided
            by it when positive, multiplied when negative (CTRL / vLLM). Applied before the two above.
        logprobs: None, or 0..20: return each emitted token's log-probability and this many most
            likely alternatives (see the module docstring for which distribution).
        prompt_logprobs: None, or 0..20: the same for every prompt token after the first.
        n: how many completions of the prompt to sample (>= 1). ``LLM.generate`` runs choice j as a request
            of its own with ``seed + j`` (when seeded), as the HTTP layer does (``deployments/choices.py``),
            and returns the n in ``outputs``; the engine itself serves one sequence per request.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self):
        # Normalise container fields to tuples so the dataclass stays hashable and immutable.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequest(f"stop must be a string or a list of strings, got {self.stop!r}", param="stop")
        if any(s == "" for s in stop):
            raise InvalidRequest(f"stop must not contain empty strings, got {self.stop!r}", param="stop")
        object.__setattr__(self, "stop", tuple(stop))

        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise InvalidRequest(
                f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}",
                param="stop_token_ids")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}",
                                 param="temperature")
        object.__setattr__(self, "temperature", float(t))

        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {p!r}", param="top_p")
        object.__setattr__(self, "top_p", float(p))

        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 or 0 (disabled) or an int >= 1, got {self.top_k!r}",
                                 param="top_k")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {v!r}",
                                     param=name)
        least = 0 if self.prompt_logprobs is not None else 1
        if not _is_int(self.max_tokens) or self.max_tokens < least:
            raise InvalidRequest(f"max_tokens must be an int >= 1 (0 only with prompt_logprobs), "
                                 f"got {self.max_tokens!r}", param="max_tokens")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be an int >= 0, got {self.min_tokens!r}", param="min_tokens")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}",
                                 param="min_tokens")
        if self.seed is not None and (not _is_int(self.seed) or not -(1 << 63) <= self.seed < 1 << 63):
            # the per-row seed tensors are int64 (bole.spec.sampling.counter_uniforms)
            raise InvalidRequest(f"seed must be an int in [-2**63, 2**63) or None, got {self.seed!r}", param="seed")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be a bool, got {self.ignore_eos!r}", param="ignore_eos")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise InvalidRequest(f"{name} must be a number in [-2, 2], got {v!r}", param=name)
            object.__setattr__(self, name, float(v))
        r = self.repetition_penalty
        if not _is_real(r) or r <= 0:
            raise InvalidRequest(f"repetition_penalty must be a finite number > 0 (1 = off), got {r!r}",
                                 param="repetition_penalty")
        object.__setattr__(self, "repetition_penalty", float(r))
        if not _is_int(self.n) or self.n < 1:
            raise InvalidRequest(f"n must be an int >= 1, got {self.n!r}", param="n")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the step then builds token counts: ``bole.spec.sampling.Penalties``)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def effective_top_k(self) -> int:
        """-1 when top-k is off (top_k of 0 or -1), else top_k: the value the sampler tensors carry."""
        return -1 if self.top_k <= 0 else self.top_k


def choice_params(params: SamplingParams) -> list[SamplingParams]:
    """The engine requests' parameters behind ``params.n`` choices (each n=1): choice j samples with
    ``seed + j`` when seeded (distinct, reproducible samples; choice 0 is the request with n=1); unseeded,
    each draws a fresh seed. The one rule of ``LLM.generate`` and the HTTP layer (``deployments/choices.py``).
    A seed pushed past int64 is refused by name."""
    if params.n == 1:
        return [params]
    try:
        return [replace(params, n=1, seed=None if params.seed is None else params.seed + j) for j in range(params.n)]
    except InvalidRequest as e:
        raise InvalidRequest(f"n={params.n} choices take seeds seed + 0 .. seed + {params.n - 1}: {e}",
                             param="seed") from None
