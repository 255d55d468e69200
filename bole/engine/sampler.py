"""The engine's sampling glue: a batch of requests' parameters as the tensors ``bole.spec.sampling``
takes, and the log-probabilities of what a step emitted or a prefill scored.

Every mode goes through these, so the logits a token is drawn from are processed the same way
whichever forward produced them (prefill, ar decode, a tree's verify row): min_tokens masking
(``mask_early_stops``), then the penalties (``penalties`` -> ``apply_penalties``, with a tree row's
path tokens), then temperature / top-k / top-p. That is what keeps greedy output token-identical
across modes with penalties on, and seeded sampling too.

Penalised steps build two [B, V] tensors from the requests' tokens (output counts, prompt mask);
requests without penalties get rows that leave their logits bit-identical. Log-probabilities are
computed only for requests that ask (``SamplingParams.logprobs`` / ``prompt_logprobs``), from logits
the step already holds (``bole.spec.logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bole.engine.sequence import Request
from bole.spec.logprobs import TokenLogprob, emitted_logprobs, prompt_logprobs, to_entries
from bole.spec.sampling import Penalties, apply_penalties, position_uniforms, process_logits, sample_from_probs


@dataclass(frozen=True)
class SamplingTensors:
    """A batch's sampling parameters, one [B] tensor each: what the eager step's processing and
    uniforms take, and what the verify graph's sampled tail loads into its static rows."""
    temperature: torch.Tensor   # float32; <= 0: greedy
    top_k: torch.Tensor         # int64; 0: off
    top_p: torch.Tensor         # float32; 1: off
    seed: torch.Tensor          # int64: the request's key of its counter-based uniforms

    @staticmethod
    def of(reqs: list[Request], device) -> "SamplingTensors":
        return SamplingTensors(
            temperature=torch.tensor([r.params.temperature for r in reqs], device=device),
            top_k=torch.tensor([r.params.top_k for r in reqs], device=device),
            top_p=torch.tensor([r.params.top_p for r in reqs], device=device),
            seed=torch.tensor([r.seed for r in reqs], dtype=torch.int64, device=device))

    def __len__(self) -> int:
        return self.temperature.shape[0]


def mask_early_stops(reqs: list[Request], logits: torch.Tensor, out_index: torch.Tensor) -> torch.Tensor:
    """min_tokens: forbid EOS / stop tokens for rows that would emit output token < min_tokens.

    logits [B, R, V]; out_index [B, R]: the output index (0-based) row r would sample. Applied to
    the target logits before sampling, in every mode alike, so exactness across modes holds.
    """
    if not any(r.params.min_tokens for r in reqs):
        return logits
    V = logits.shape[-1]
    stop = torch.zeros(len(reqs), V, dtype=torch.bool, device=logits.device)
    for b, r in enumerate(reqs):
        ids = [t for t in (() if r.params.ignore_eos else r.eos_token_ids) + tuple(r.params.stop_token_ids)
               if 0 <= t < V]
        stop[b, ids] = True
    min_tok = torch.tensor([r.params.min_tokens for r in reqs], device=logits.device)
    early = out_index < min_tok[:, None]  # [B, R]
    return logits.masked_fill(early[..., None] & stop[:, None, :], float("-inf"))


def penalties(reqs: list[Request], vocab_size: int, device) -> Penalties | None:
    """The step's ``Penalties`` over each request's committed output (and prompt, for the repetition
    penalty); None when no request has a penalty on (the common case costs nothing)."""
    if not any(r.params.penalized for r in reqs):
        return None
    B = len(reqs)
    counts = torch.zeros(B, vocab_size, dtype=torch.float32, device=device)
    prompt = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
    out_rows, out_ids, p_rows, p_ids = [], [], [], []
    for b, r in enumerate(reqs):
        if r.params.penalized:
            out_rows += [b] * len(r.output_token_ids)
            out_ids += r.output_token_ids
            if r.params.repetition_penalty != 1.0:
                p_rows += [b] * len(r.prompt_token_ids)
                p_ids += r.prompt_token_ids
    if out_ids:
        idx = (torch.tensor(out_rows, device=device), torch.tensor(out_ids, device=device))
        counts.index_put_(idx, torch.ones(len(out_ids), device=device), accumulate=True)
    if p_ids:
        prompt[torch.tensor(p_rows, device=device), torch.tensor(p_ids, device=device)] = True
    f = lambda name: torch.tensor([getattr(r.params, name) for r in reqs], dtype=torch.float32, device=device)
    return Penalties(counts, prompt, f("repetition_penalty"), f("frequency_penalty"), f("presence_penalty"))


def sample_next(reqs: list[Request], logits: torch.Tensor, pen: Penalties | None
                ) -> tuple[list[int], list[list[TokenLogprob] | None] | None]:
    """One token per request from logits [B, V] (the token at index num_tokens), and each request's
    logprobs of it (None overall when no request asks)."""
    out_index = torch.tensor([[len(r.output_token_ids)] for r in reqs], device=logits.device)
    logits = mask_early_stops(reqs, logits[:, None], out_index)[:, 0]
    if all(r.params.temperature <= 0 for r in reqs):  # greedy: the one-hot's index, no vocabulary sort
        scores = logits if pen is None else apply_penalties(logits, pen)
        tokens = scores.argmax(-1)
    else:
        st = SamplingTensors.of(reqs, logits.device)
        offset = torch.tensor([r.num_tokens for r in reqs], device=st.seed.device)
        u = position_uniforms(st.seed, offset, torch.zeros_like(offset)[:, None], 0)[:, 0]  # the token at num_tokens
        tokens = sample_from_probs(process_logits(logits.float(), st.temperature, st.top_k, st.top_p, pen), u)
    toks = tokens.tolist()
    return toks, step_logprobs(reqs, logits[:, None], [[t] for t in toks], pen)


def step_logprobs(reqs: list[Request], rows: torch.Tensor, emitted: list[list[int]], pen: Penalties | None
                  ) -> list[list[TokenLogprob] | None] | None:
    """Logprobs of each request's emitted tokens: ``rows`` [B, J, V] are the target rows they were
    drawn from, in order (min_tokens-masked, not yet penalised); None where a request did not ask,
    None overall when none did."""
    want = [r.params.logprobs for r in reqs]
    if all(k is None for k in want):
        return None
    J = rows.shape[1]
    tokens = torch.tensor([e + [-1] * (J - len(e)) for e in emitted], device=rows.device)
    st = SamplingTensors.of(reqs, rows.device)
    k = max(k for k in want if k is not None)
    entries = to_entries(*emitted_logprobs(rows, tokens, k, st.temperature, st.top_k, st.top_p, pen), emitted,
                         [k or 0 for k in want])
    return [e if k is not None else None for e, k in zip(entries, want, strict=True)]


def score_prompt(req: Request, start: int, logits: torch.Tensor) -> None:
    """Append the prompt logprobs that a prefill chunk's per-position logits [n, V] (positions
    ``start``..``start + n - 1``) give: position p scores prompt token p + 1. Positions already
    scored (a prefill recomputed after preemption) are skipped."""
    P, have = len(req.prompt_token_ids), len(req.prompt_logprobs)
    first, last = max(start, have), min(start + logits.shape[0], P - 1)
    if first >= last:
        return
    if first != have:
        raise RuntimeError(f"request {req.request_id}: prompt positions {have}..{first} were not scored "
                           "(a prefix-cache hit skipped them)")
    nxt = torch.tensor(req.prompt_token_ids[first + 1:last + 1], device=logits.device)
    k = req.params.prompt_logprobs
    chosen, ids, lps = prompt_logprobs(logits[first - start:last - start], nxt, k)
    req.prompt_logprobs += to_entries(chosen[None], ids[None], lps[None], [nxt.tolist()], [k])[0]
