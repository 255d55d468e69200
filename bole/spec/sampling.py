"""Logit processing, sampling and the lossless tree acceptance rule, as pure tensor functions.

Nothing here calls ``.item()``, ``.tolist()``, boolean-mask indexing or anything else that waits for
the device: every shape is fixed by Python ints known before the step (batch size, node count,
vocabulary, max depth), so a verification step can be queued (or CUDA-graph captured) without a
host sync. Randomness is passed in as pre-drawn uniforms, one per (request, target row), never
drawn from a global generator inside the hot path.

Reproducible per-request seeds: ``counter_uniforms(seed, offset, n)`` is a counter-based hash
(splitmix64) of (seed, offset + j), so request b's uniforms depend only on its own seed and
counter, not on which other requests share the batch or on the device. Recommended convention:
one uniform per absolute token position. A step whose root sits at sequence length n draws
``u = counter_uniforms(seed, n, D + 1)`` and gives tree node r (its target row r) the uniform of its
depth (``uniforms[b, r] = u[b, depth(r)]``, depth 0 for the root, node 0). A path visits one row per depth, so
its draws stay independent; each position's uniform is used exactly once over the whole
generation; and because inverse-CDF sampling is a deterministic function of (distribution,
uniform), a seeded request emits the same tokens with or without speculation (tested).

Lossless tree acceptance (DESIGN.md §2). At the current node (the committed root first) draw x
from the processed target distribution; if x is the token of one of the node's children, move to
that child and repeat; otherwise emit x and stop (a correction, or the bonus token at a leaf).
Why this is exact when the children of a node carry distinct tokens (deterministic top-k drafts):
the token emitted at each position is the draw x itself, and x ~ p_target(· | path so far); the
tree only decides whether the *next* draw conditions on a node that the target has already
evaluated (x matched a child) or ends the step (the next step's root is then exactly the context
prefix + x). By induction every emitted token is drawn from the target conditional on all
earlier emitted tokens, which is autoregressive sampling. Greedy rows have a one-hot target, so
x is the argmax and the walk is autoregressive greedy decoding.

Penalties (presence / frequency / repetition, ``Penalties``) make a row's distribution depend on the
tokens before it. In a tree, the row of a node conditions on the committed output AND the node's
own path (its ancestors and itself), not on the batch row's other branches. The walk above visits,
at depth j, the node whose path tokens are exactly the j draws emitted before it, so ``accept_tree``
penalises each visited row with the committed counts plus those draws: the same counts an
autoregressive step would see at that position, hence the same (greedy: identical) tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# splitmix64 constants as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _per_row(x, rows: int, dtype, device) -> torch.Tensor:
    """Broadcast a Python scalar or a [R] tensor to a [R] tensor of ``dtype`` on ``device``."""
    t = torch.as_tensor(x, dtype=dtype, device=device)
    return t.expand(rows) if t.dim() == 0 else t.to(dtype)


@dataclass(frozen=True)
class Penalties:
    """The token penalties of B requests (row b = request b), built from their committed tokens
    (``bole.engine.sampler.penalties``); ``apply_penalties`` is the rule, in every mode alike.

    output_counts: float32 [B, V] occurrences of each token in the request's output so far.
    prompt_mask:   bool [B, V] tokens of its prompt (the repetition penalty also covers these).
    repetition, frequency, presence: float32 [B]; 1, 0, 0 leave a row's logits bit-identical.
    """

    output_counts: torch.Tensor
    prompt_mask: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor


def apply_penalties(logits: torch.Tensor, penalties: Penalties, path_tokens: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """float32 [B, V] logits after vLLM's penalty rule, for rows whose context is the committed tokens
    plus ``path_tokens``.

    Args:
        logits: [B, V] (any float dtype).
        penalties: the B rows' ``Penalties``.
        path_tokens: int64 [B, K] tokens after the committed output that this row's context also holds
            (a tree node's path; negative entries are padding), or None.
    A token seen in the prompt or the output has its logit divided by ``repetition`` when positive and
    multiplied by it otherwise; then ``frequency`` * its output count and ``presence`` (if counted at
    all) are subtracted. Fixed shapes, no host sync.
    """
    counts = penalties.output_counts
    if path_tokens is not None and path_tokens.shape[-1]:
        valid = (path_tokens >= 0).to(counts.dtype)
        counts = counts.scatter_add(1, path_tokens.clamp(min=0).long(), valid)
    present = counts > 0
    x = logits.float()
    rep = penalties.repetition[:, None]
    x = torch.where(present | penalties.prompt_mask, torch.where(x > 0, x / rep, x * rep), x)
    return x - penalties.frequency[:, None] * counts - penalties.presence[:, None] * present.to(x.dtype)


def _truncated_scores(logits: torch.Tensor, temperature, top_k, top_p) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy [R] bool, float32 [R, V] logits / temperature with the tokens top-k / top-p drop at
    -inf): what ``process_logits`` softmaxes and ``processed_logprobs`` log-softmaxes."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got shape {tuple(logits.shape)}")
    R, V = logits.shape
    dev = logits.device
    temperature = _per_row(temperature, R, torch.float32, dev)
    top_k = _per_row(top_k, R, torch.int64, dev)
    top_p = _per_row(top_p, R, torch.float32, dev)

    greedy = temperature <= 0
    x = logits.float() / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    sorted_x = x.sort(dim=-1, descending=True).values                      # [R, V]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))  # [R]
    kth = sorted_x.gather(-1, (k - 1)[:, None])                             # [R, 1]
    in_top_k = sorted_x >= kth                                              # a prefix, ties kept
    sorted_p = torch.softmax(sorted_x.masked_fill(~in_top_k, float("-inf")), dim=-1)
    mass_before = sorted_p.cumsum(-1) - sorted_p                            # exclusive cumsum
    n_p = (mass_before < top_p[:, None]).sum(-1).clamp(min=1)
    n_p = torch.where(top_p >= 1, torch.full_like(n_p, V), n_p)
    n_keep = torch.minimum(in_top_k.sum(-1), n_p)                           # [R], >= 1
    threshold = sorted_x.gather(-1, (n_keep - 1)[:, None])                  # [R, 1]
    return greedy, x.masked_fill(x < threshold, float("-inf"))


def process_logits(logits: torch.Tensor, temperature, top_k, top_p, penalties: Penalties | None = None,
                   path_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Target probabilities after the penalties, temperature, top-k and top-p, one set of parameters per row.

    Args:
        logits: [R, V] (any float dtype; computed in float32).
        temperature: [R] float or a scalar; rows with temperature <= 0 are greedy and get the
            one-hot of the argmax of the raw logits (first index on ties).
        top_k: [R] int or a scalar; <= 0 disables it.
        top_p: [R] float in (0, 1] or a scalar; 1 disables it.
        penalties, path_tokens: ``apply_penalties`` first (rows = requests), when given.
    Returns:
        float32 [R, V] probabilities, each row summing to 1.

    Tie semantics (deterministic whatever order the sort leaves equal logits in): top-k keeps every
    token whose logit is >= the k-th largest; top-p keeps the smallest prefix of the (top-k
    truncated, sorted) distribution whose mass reaches top_p, then every token whose logit is >=
    the last kept one. Top-p is applied to the top-k renormalised distribution, as vLLM does.
    """
    if penalties is not None:
        logits = apply_penalties(logits, penalties, path_tokens)
    greedy, scores = _truncated_scores(logits, temperature, top_k, top_p)
    probs = torch.softmax(scores, dim=-1)
    one_hot = F.one_hot(logits.argmax(-1), logits.shape[-1]).to(probs.dtype)
    return torch.where(greedy[:, None], one_hot, probs)


def processed_logprobs(logits: torch.Tensor, temperature, top_k, top_p, penalties: Penalties | None = None,
                       path_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [R, V] log-probabilities of the distribution ``process_logits`` samples from (vLLM's
    ``processed_logprobs``; -inf where top-k / top-p cut), same arguments. Greedy rows, whose
    processed distribution is a one-hot, get the log-softmax of their penalised logits instead:
    the distribution whose argmax they emit."""
    if penalties is not None:
        logits = apply_penalties(logits, penalties, path_tokens)
    greedy, scores = _truncated_scores(logits, temperature, top_k, top_p)
    return torch.where(greedy[:, None], torch.log_softmax(logits.float(), -1), torch.log_softmax(scores, -1))


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling without a host sync: int64 [R] tokens from probs [R, V], uniforms [R] in [0,1).

    Returns the first token whose cumulative mass exceeds ``u * total``; a zero-probability token is
    never returned (its CDF step is empty, and the result is clamped to the last positive token
    against float rounding at the top end). One-hot rows return their hot index for every u.
    """
    V = probs.shape[-1]
    cdf = probs.float().cumsum(-1)
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    last_positive = V - 1 - (probs > 0).flip(-1).to(torch.int64).argmax(-1)
    return torch.minimum(idx, last_positive)


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def counter_uniforms(seed: torch.Tensor, offset: torch.Tensor, n: int) -> torch.Tensor:
    """Reproducible per-request uniforms: float32 [B, n] in [0, 1), a hash of (seed[b], offset[b] + j).

    Args:
        seed: int64 [B] per-request seeds (draw one at admission for requests without a seed).
        offset: int64 [B] counters (see the module docstring for the engine's convention).
        n: uniforms per request (``max_nodes + 1`` for ``accept_tree``).
    Runs on the device of ``seed`` with int64 wrap-around arithmetic; 24 random bits per value, so
    every value is exactly representable in float32 and strictly below 1.
    """
    j = torch.arange(n, device=seed.device, dtype=torch.int64)
    z = _mix64(seed.long())[:, None] + (offset.long()[:, None] + j[None]) * _GOLDEN
    return _srl(_mix64(z), 40).to(torch.float32) * (1.0 / (1 << 24))


def position_uniforms(seed: torch.Tensor, first: torch.Tensor, depth: torch.Tensor, max_depth: int) -> torch.Tensor:
    """The module's seeding convention, the one place it is spelled out: float32 [B, T] uniforms of
    tree nodes whose depth-0 node draws the token at absolute position ``first[b]`` (int [B]); node r
    at depth d (``depth`` int [B, T], clamped to 0..max_depth) draws position first + d's uniform,
    ``counter_uniforms(seed, first, max_depth + 1)[:, d]``. An ``ar`` step is the one-node tree."""
    u = counter_uniforms(seed, first, max_depth + 1)
    return u.gather(1, depth.long().clamp(0, max_depth))


@dataclass(frozen=True)
class TreeAcceptance:
    """Result of ``accept_tree`` for B requests (all int64 tensors on the input device).

    accepted_path: [B, D] local indices of the accepted drafts, the depth-1 node first, -1 padded.
    num_accepted:  [B] accepted draft nodes (0..D).
    accepted_node: [B] deepest accepted node (0 when only the root): what
                   ``PackedForest.accepted_path_nodes`` and the state commit take.
    tokens:        [B, D+1] emitted tokens: the accepted nodes' tokens then the correction / bonus
                   token, padded with ``pad_token``.
    num_emitted:   [B] = num_accepted + 1.
    """

    accepted_path: torch.Tensor
    num_accepted: torch.Tensor
    accepted_node: torch.Tensor
    tokens: torch.Tensor
    num_emitted: torch.Tensor


def accept_tree(tokens: torch.Tensor, parents: torch.Tensor, uniforms: torch.Tensor,
                probs: torch.Tensor | None = None, *, logits: torch.Tensor | None = None,
                temperature=None, top_k=None, top_p=None, max_depth: int | None = None,
                pad_token: int = -1, penalties: Penalties | None = None) -> TreeAcceptance:
    """Walk every request's draft tree with the lossless acceptance rule, without host syncs.

    Args:
        tokens:   int64 [B, T] token of each tree node: node 0 is the root (the pending token, never
                  matched), then the drafts; padding nodes have a negative token (they can never
                  match a draw, so their parent entry is ignored). Nodes are in topological order
                  and the children of one node carry distinct tokens (docs/DESIGN.md §7).
        parents:  int64 [B, T] local parent index (-1 for the root; drafts >= 0).
        uniforms: float [B, T] in [0, 1): node r's draw uses uniforms[b, r]. A path visits each node
                  at most once, so draws along it are independent.
        probs:    float [B, T, V] processed target probabilities: row i is the next-token
                  distribution after node i (row 0: after the committed prefix and the root).
        logits, temperature, top_k, top_p: instead of ``probs``, raw target logits [B, T, V] and
                  per-request [B] parameters; then only the max_depth+1 rows the walk visits are
                  processed (T full-vocabulary sorts and softmaxes would dominate at V ~ 150k).
                  A Python ``temperature`` <= 0 means every row is greedy: argmax, no sort.
        max_depth: depth bound of every tree's drafts (default T - 1). The walk runs exactly
                  max_depth + 1 gather-based iterations, whatever the trees look like.
        pad_token: fill value of ``TreeAcceptance.tokens`` beyond the emitted ones.
        penalties: with ``logits``, the requests' ``Penalties`` for their committed tokens; the row
                  visited at depth j is penalised with those plus the j draws before it (its path).
    """
    if (probs is None) == (logits is None):
        raise ValueError("pass exactly one of probs or logits")
    target = probs if probs is not None else logits
    if tokens.dim() != 2 or parents.shape != tokens.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} must be [B, T]")
    B, T = tokens.shape
    if T < 1:
        raise ValueError("trees of 0 nodes: node 0 (the root) is needed")
    if target.dim() != 3 or target.shape[:2] != (B, T):
        raise ValueError(f"target must be [B, T, V] = [{B}, {T}, V], got {tuple(target.shape)}")
    if uniforms.shape != (B, T):
        raise ValueError(f"uniforms must be [B, T] = [{B}, {T}], got {tuple(uniforms.shape)}")
    if logits is not None and (temperature is None or top_k is None or top_p is None):
        raise ValueError("logits need temperature, top_k and top_p")
    if penalties is not None and logits is None:
        raise ValueError("penalties apply to logits, not to processed probs")
    D = T - 1 if max_depth is None else max_depth
    if D < 0:
        raise ValueError(f"max_depth must be >= 0, got {D}")

    dev = tokens.device
    tokens, parents = tokens.long(), parents.long()
    rows = torch.arange(B, device=dev)
    # every row greedy, known on the host (a Python temperature <= 0): the argmax of the raw logits is
    # what process_logits' one-hot and sample_from_probs return, without the vocabulary sort
    all_greedy = logits is not None and isinstance(temperature, (int, float)) and temperature <= 0
    cur = torch.zeros(B, dtype=torch.int64, device=dev)           # current node (its target row), 0 = root
    alive = torch.ones(B, dtype=torch.bool, device=dev)           # still walking
    path, emitted = [], []
    for step in range(D + 1):
        p = target[rows, cur]                                      # [B, V]
        # an alive row's path so far is the draws emitted before (dead rows' draws are discarded)
        path_tokens = torch.stack(emitted, 1) if penalties is not None and emitted else None
        if all_greedy:
            if penalties is not None:
                p = apply_penalties(p, penalties, path_tokens)
            x = p.argmax(-1)                                       # = sampling the one-hot target
        else:
            if logits is not None:
                p = process_logits(p, temperature, top_k, top_p, penalties, path_tokens)
            x = sample_from_probs(p, uniforms[rows, cur])          # [B]
        hit = (parents == cur[:, None]) & (tokens == x[:, None]) & (tokens >= 0)   # [B, T]
        matched = hit.any(-1) & alive
        if step == D:  # depth bound reached: only a leaf can be here
            matched = torch.zeros_like(matched)
        child = hit.to(torch.int64).argmax(-1)
        emitted.append(torch.where(alive, x, torch.full_like(x, pad_token)))
        if step < D:
            path.append(torch.where(matched, child, torch.full_like(child, -1)))
        cur = torch.where(matched, child, cur)
        alive = matched

    accepted_path = torch.stack(path, 1) if path else torch.empty(B, 0, dtype=torch.int64, device=dev)
    num_accepted = (accepted_path >= 0).sum(-1)
    return TreeAcceptance(accepted_path=accepted_path, num_accepted=num_accepted, accepted_node=cur,
                          tokens=torch.stack(emitted, 1), num_emitted=num_accepted + 1)
