"""The drafter's reduced vocabulary (``SpecConfig.draft_vocab``, as FR-Spec does).

The MTP drafter's lm_head product over the full vocabulary V is a large part of a draft step when V is
large (Qwen3.5: 248k rows). With ``draft_vocab`` = N the drafter scores only the N most frequent
tokens of the training data instead: their lm_head rows are gathered once into a contiguous
[N, H] weight (``MTPDrafter.restrict_vocab``), the draft logits are h @ W_sub^T [.., N], the
log-softmax top-k runs over those N, and the local indices map back to token ids by a device gather.
Drafts only propose: the target verifies every node and the acceptance rule never reads draft
probabilities, so outputs stay exact (greedy and sampled); only the acceptance rate can change.

The list is ``token_frequencies.json`` in the model folder (``scripts/token_frequencies.py``): its
``token_ids`` are the vocabulary by descending count in the training data; the first N are used.
"""

from __future__ import annotations

import json
import os

FREQUENCIES_FILE = "token_frequencies.json"


def check_draft_vocab(n: int | None, vocab_size: int) -> None:
    """ValueError naming draft_vocab and the vocabulary size when ``n`` exceeds the vocabulary: a reduced
    vocabulary larger than the whole is a mistake, not a request for all of it (None is that). ``build_engine``
    checks it before the weights load; ``SpecConfig`` has checked n >= topk."""
    if n is not None and n > vocab_size:
        raise ValueError(f"draft_vocab={n} is larger than the model's vocabulary (vocab_size={vocab_size}): use at "
                         f"most {vocab_size}, or None (the default) for the whole vocabulary")


def read_draft_vocab(folder: str | None, n: int, vocab_size: int) -> list[int]:
    """The first min(n, vocab_size) ids of ``folder``'s ``token_frequencies.json``.

    ValueError naming the file when it is missing or not JSON, or when its ``token_ids`` is not a
    list of distinct ints in [0, vocab_size) at least that long; naming ``n`` when n < 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"draft_vocab must be an int >= 1, got {n!r}")
    if folder is None:
        raise ValueError(f"draft_vocab={n} needs the model's folder (its {FREQUENCIES_FILE}); this model was "
                         "not loaded from one (bole.models.loader.load_model)")
    path = os.path.join(folder, FREQUENCIES_FILE)
    if not os.path.exists(path):
        raise ValueError(f"draft_vocab={n} needs {path} (the training data's token frequencies: "
                         "scripts/token_frequencies.py); it does not exist")
    try:
        with open(path) as fh:
            ids = json.load(fh)["token_ids"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a token frequency list (a JSON object with 'token_ids'): {e}") from None
    take = min(n, vocab_size)
    if not isinstance(ids, list) or len(ids) < take:
        raise ValueError(f"{path}: 'token_ids' must be a list of at least {take} ids for draft_vocab={n}, got "
                         f"{len(ids) if isinstance(ids, list) else type(ids).__name__}")
    ids = ids[:take]
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{path}: token ids must be ints in [0, vocab_size={vocab_size}), got {bad[:5]!r}")
    if len(set(ids)) != take:
        raise ValueError(f"{path}: the first {take} token ids repeat some ids (draft children must be distinct)")
    return ids
