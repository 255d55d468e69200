"""The embedded checkpoint (models/bole-tiny-coder, issue 6): transformers and our engine agree greedily,
and its trained MTP head makes drafts that the target accepts."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bole.config import EngineConfig
from bole.engine.engine import LLMEngine
from bole.llm import resolve_repo_path
from bole.models.loader import load_model
from bole.sampling_params import SamplingParams

MODEL = resolve_repo_path("models/bole-tiny-coder")
PROMPTS_FILE = resolve_repo_path("benchmarks/data/heldout_prompts.jsonl")
N_NEW = 20

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "model.safetensors")),
                                reason="the embedded checkpoint has no weights in this checkout")


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    with open(PROMPTS_FILE) as f:
        texts = [json.loads(line)["prompt"] for line in f][:3]
    return [tok(t)["input_ids"] for t in texts]


def _engine(mode: str) -> LLMEngine:
    cfg = EngineConfig.from_options(mode=mode, device="cpu", dtype="float32", depth=4, topk=3, beam=3,
                                    num_blocks=256, block_size=16, max_num_seqs=4,
                                    calibration_table=resolve_repo_path("calibration_tables/default.yaml"))
    return LLMEngine(load_model(MODEL, dtype="float32"), cfg)


def _run(eng: LLMEngine, prompts):
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return [eng.pop_finished(i).output_token_ids for i in ids]


@torch.no_grad()
def test_engine_matches_transformers_and_drafts_are_accepted(prompts):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ref = []
    for p in prompts:  # uncached full forward at every step: the model's definition (see test_engine.hf_greedy)
        ids = list(p)
        for _ in range(N_NEW):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        ref.append(ids[len(p):])
    assert _run(_engine("ar"), prompts) == ref
    eng = _engine("bole")
    assert _run(eng, prompts) == ref
    # a trained drafter: more than one token per verification step on held-out code (random: ~1.0)
    assert eng.metrics.snapshot()["mat"] > 1.5
