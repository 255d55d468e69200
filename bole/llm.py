"""Offline API: ``bole.LLM(model_path, **options).generate(prompts, SamplingParams)``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Sequence

from bole.config import EngineConfig
from bole.engine.engine import LLMEngine
from bole.errors import InvalidRequest
from bole.option_checks import is_integral
from bole.sampling_params import SamplingParams, choice_params
from bole.spec.logprobs import TokenLogprob

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class CompletionOutput:
    """One prompt's completion. ``outputs`` holds all ``SamplingParams.n`` of them (choice j has ``index`` j
    and an engine request of its own), as vLLM's ``RequestOutput.outputs``; the fields here are choice 0's, so
    code written for one completion per prompt reads them unchanged."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None          # per generated token (``SamplingParams.logprobs``)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # None, then prompt tokens 1.. (``prompt_logprobs``)
    index: int = 0
    outputs: list[CompletionOutput] = field(default_factory=list, repr=False)


def resolve_repo_path(path: str) -> str:
    """Paths such as ``calibration_tables/default.yaml`` are relative to the repository when not found."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return os.path.join(REPO_ROOT, path)


def build_engine(model_path: str, tokenizer: bool = True, tp_rank: int = 0, tp_group=None, model=None,
                 **options) -> LLMEngine:
    """Load a checkpoint folder and build an engine from flat options (see ``EngineConfig``).

    ``model``: that folder's model already loaded (``load_model``, the options' dtype and device, no tensor
    parallelism), which engines built one after another may share (a benchmark's cells: one load);
    each engine sets the drafter's options on it anew.

    Tensor parallel (``tp_size`` > 1 in the options): this process is rank ``tp_rank`` and loads its
    weight slice; ``tp_group`` is its torch.distributed group (None: the default group, which must
    be initialised, e.g. by ``bole.parallel.init_tp_group``). Every rank must then be driven with the
    same requests and steps (SPMD engines, ``bole.parallel``).
    """
    from bole.models.loader import load_model, read_config, resolve_dtype
    from bole.parallel import make_tp_reduce
    from bole.spec.draft_vocab import check_draft_vocab

    cfg = EngineConfig.from_options(**options)
    cfg = EngineConfig(**{**cfg.__dict__, "calibration_table": resolve_repo_path(cfg.calibration_table)})
    tp_reduce = None
    if cfg.tp_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError(f"tp_size={cfg.tp_size} needs an initialised process group "
                             "(bole.parallel.init_tp_group) in every rank's process")
        tp_reduce = make_tp_reduce(tp_group)
    if cfg.spec.draft_vocab is not None:  # refused before the weights load
        vocab_size = (model.config if model is not None else read_config(resolve_repo_path(model_path))[1]).vocab_size
        check_draft_vocab(cfg.spec.draft_vocab, vocab_size)
    if model is None:
        model = load_model(resolve_repo_path(model_path), dtype=cfg.dtype, device=cfg.device, tp_rank=tp_rank,
                           tp_size=cfg.tp_size, tp_reduce=tp_reduce)
    else:
        import torch

        weight = next(model.parameters())
        if cfg.tp_size != 1 or weight.dtype != resolve_dtype(cfg.dtype, model.config) or \
                weight.device.type != torch.device(cfg.device).type:
            raise ValueError(f"model: a loaded model is shared only at the options' dtype {cfg.dtype} and device "
                             f"{cfg.device} without tensor parallelism, got {weight.dtype} on {weight.device}")
    tok = None
    if tokenizer and os.path.exists(os.path.join(resolve_repo_path(model_path), "tokenizer.json")):
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(resolve_repo_path(model_path))
        except Exception as e:   # the tokenizers library raises a bare Exception on a malformed file
            raise ValueError(f"{model_path}: its tokenizer files could not be loaded "
                             f"({type(e).__name__}: {e})") from e
    return LLMEngine(model, cfg, tokenizer=tok)


class LLM:
    def __init__(self, model_path: str, **options):
        self.engine = build_engine(model_path, **options)
        self.tokenizer = self.engine.tokenizer

    def encode(self, prompt) -> list[int]:
        """A prompt's token ids as ``generate`` sees them: a string through the model's tokenizer,
        token ids (list, numpy or torch) checked and returned as a list of ints."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("a text prompt needs a tokenizer in the model folder; pass token ids")
            return self.tokenizer.encode(prompt)
        return token_ids(prompt)

    def generate(self, prompts: str | Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        """Run prompts to completion; one output per prompt, in input order (its ``n`` choices in ``outputs``).

        ``prompts``: a string, a list of token ids, or a list of those; a 1-D integer numpy array /
        torch tensor is one prompt, a 2-D one a batch of equal-length prompts. Float ids are refused
        (``1.7`` is not a token). The call is atomic: every prompt and parameter is checked before any
        request is queued, and if anything fails later the batch's requests are aborted, so nothing
        is left queued for the next call.
        """
        prompts = _prompt_list(prompts)
        params = SamplingParams() if params is None else params
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequest(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        encoded, choices = [], []   # choices[i]: the engine requests' parameters of prompt i's n choices
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            try:
                ids = self.encode(p)
                cs = choice_params(sp) if isinstance(sp, SamplingParams) else [sp]
                for c in cs:
                    self.engine.check_request(ids, c)
            except InvalidRequest as e:
                raise InvalidRequest(f"prompt {i}: {e}", param=e.param) from None
            encoded.append(ids)
            choices.append(cs)
        ids = []
        try:
            for p, cs in zip(encoded, choices):
                for c in cs:
                    ids.append(self.engine.add_request(p, c))
            results = self._run(ids, use_tqdm)
        except BaseException:  # KeyboardInterrupt included: the next call must not find them queued
            for rid in ids:
                self.engine.abort(rid)
                self.engine.pop_finished(rid)
            raise
        outputs, start = [], 0
        for cs in choices:
            group = [replace(r, index=j) for j, r in enumerate(results[start:start + len(cs)])]
            outputs.append(replace(group[0], outputs=group))
            start += len(cs)
        return outputs

    def _run(self, ids: list[str], use_tqdm: bool) -> list[CompletionOutput]:
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
            results.append(CompletionOutput(rid, list(req.prompt_token_ids), list(req.output_token_ids),
                                            str(req.output_text), req.finish_reason,
                                            logprobs.get(rid, []) if asked else None, prompt_logprobs.get(rid)))
        return results


def token_ids(prompt) -> list[int]:
    """One prompt's token ids as Python ints: a sequence of ints (numpy / torch integer scalars
    allowed) or a 1-D integer array / tensor; floats and bools raise ``InvalidRequest`` naming them."""
    if _is_array(prompt):
        if prompt.ndim != 1:
            raise InvalidRequest(f"a prompt array must be 1-D, got shape {tuple(prompt.shape)}")
        if not _integer_dtype(prompt.dtype):
            raise InvalidRequest(f"prompt token ids must be integers, got an array of dtype {prompt.dtype}")
        return [int(t) for t in prompt.tolist()]
    if not isinstance(prompt, (list, tuple)):
        raise InvalidRequest(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    bad = [t for t in prompt if not is_integral(t)]
    if bad:
        raise InvalidRequest(f"prompt token ids must be ints, got {bad[:5]!r} "
                         f"({', '.join(sorted({type(t).__name__ for t in bad}))})")
    return [int(t) for t in prompt]


def _is_array(x) -> bool:
    """A numpy array or a torch tensor (without importing numpy when it is not in use)."""
    return hasattr(x, "ndim") and hasattr(x, "dtype") and hasattr(x, "tolist") and not isinstance(x, (list, tuple))


def _integer_dtype(dtype) -> bool:
    name = str(dtype).replace("torch.", "")
    return ("int" in name) and name != "bool"


def _prompt_list(prompts) -> list:
    """``generate``'s prompts as a list of single prompts (see its docstring)."""
    if isinstance(prompts, str):
        return [prompts]
    if _is_array(prompts):
        if prompts.ndim == 1:
            return [prompts]
        if prompts.ndim == 2:
            return list(prompts)
        raise InvalidRequest(f"a prompt array must be 1-D (one prompt) or 2-D (a batch), got shape "
                         f"{tuple(prompts.shape)}")
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequest(f"prompts must be a string, a list of token ids or a list of prompts, got "
                         f"{type(prompts).__name__}")
    if not prompts:
        raise InvalidRequest("prompts is empty")
    if not isinstance(prompts[0], (str, list, tuple)) and not _is_array(prompts[0]):
        return [prompts]  # one prompt given as a flat list of token ids (floats are refused later)
    return list(prompts)
