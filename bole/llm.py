"""Offline API: ``bole.LLM(model_path, **options).generate(prompts, SamplingParams)``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from bole.config import EngineConfig
from bole.engine.engine import LLMEngine
from bole.sampling_params import SamplingParams
from bole.spec.logprobs import TokenLogprob

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None          # per generated token (``SamplingParams.logprobs``)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # None, then prompt tokens 1.. (``prompt_logprobs``)


def resolve_repo_path(path: str) -> str:
    """Paths such as ``calibration_tables/default.yaml`` are relative to the repository when not found."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return os.path.join(REPO_ROOT, path)


def build_engine(model_path: str, tokenizer: bool = True, tp_rank: int = 0, tp_group=None,
                 **options) -> LLMEngine:
    """Load a checkpoint folder and build an engine from flat options (see ``EngineConfig``).

    Tensor parallel (``tp_size`` > 1 in the options): this process is rank ``tp_rank`` and loads its
    weight slice; ``tp_group`` is its torch.distributed group (None: the default group, which must
    be initialised, e.g. by ``bole.parallel.init_tp_group``). Every rank must then be driven with the
    same requests and steps (SPMD engines, ``bole.parallel``).
    """
    from bole.models.loader import load_model
    from bole.parallel import make_tp_reduce

    cfg = EngineConfig.from_options(**options)
    cfg = EngineConfig(**{**cfg.__dict__, "calibration_table": resolve_repo_path(cfg.calibration_table)})
    tp_reduce = None
    if cfg.tp_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError(f"tp_size={cfg.tp_size} needs an initialised process group "
                             "(bole.parallel.init_tp_group) in every rank's process")
        tp_reduce = make_tp_reduce(tp_group)
    model = load_model(resolve_repo_path(model_path), dtype=cfg.dtype, device=cfg.device, tp_rank=tp_rank,
                       tp_size=cfg.tp_size, tp_reduce=tp_reduce)
    tok = None
    if tokenizer and os.path.exists(os.path.join(resolve_repo_path(model_path), "tokenizer.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(resolve_repo_path(model_path))
    return LLMEngine(model, cfg, tokenizer=tok)


class LLM:
    def __init__(self, model_path: str, **options):
        self.engine = build_engine(model_path, **options)
        self.tokenizer = self.engine.tokenizer

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer in the model folder; pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(self, prompts: str | Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [self.engine.add_request(self._encode(p), sp) for p, sp in zip(prompts, plist)]
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        logprobs, prompt_logprobs = {}, {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.logprobs is not None:
                    logprobs.setdefault(out.request_id, []).extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        results = []
        for rid in ids:
            req = self.engine.pop_finished(rid)
            asked = req.params.logprobs is not None
            results.append(CompletionOutput(rid, req.prompt_token_ids, list(req.output_token_ids),
                                            req.output_text, req.finish_reason,
                                            logprobs.get(rid, []) if asked else None, prompt_logprobs.get(rid)))
        return results
