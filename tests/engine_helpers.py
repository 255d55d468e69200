"""Helpers shared by the engine test modules (importable like ``checkpoints``)."""

from __future__ import annotations

from bole.llm import resolve_repo_path
from bole.sampling_params import SamplingParams


def default_table() -> str:
    """The repository's default calibration table (unmeasured defaults: every engine test uses it)."""
    return resolve_repo_path("calibration_tables/default.yaml")


def run_arrivals(eng, prompts, max_tokens) -> list[list[int]]:
    """Greedy requests arriving one per step (batch sizes vary); each request's output tokens."""
    ids, outs = [], {}
    pending = list(zip(prompts, max_tokens))
    while pending or eng.has_unfinished():
        if pending:
            p, n = pending.pop(0)
            ids.append(eng.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.output_token_ids
    return [outs[i] for i in ids]
