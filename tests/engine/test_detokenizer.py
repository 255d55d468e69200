"""Streaming text: incremental detokenisation (``bole.engine.detokenizer``) against the tokenizer's
own decode of every token so far, on the embedded model's byte-level tokenizer (multibyte, emoji,
CJK, invalid UTF-8), and stop strings in the engine cutting where the first one starts."""

from __future__ import annotations

import json
import os
import random

import pytest
from transformers import AutoTokenizer

from bole.config import EngineConfig
from bole.engine.detokenizer import IncrementalDetokenizer
from bole.engine.engine import LLMEngine
from bole.llm import resolve_repo_path
from bole.models.loader import load_model
from bole.sampling_params import SamplingParams

MODEL = resolve_repo_path("models/bole-tiny-coder")

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "model.safetensors")),
                                reason="the embedded checkpoint has no weights in this checkout")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def prompt(tok):
    with open(resolve_repo_path("benchmarks/data/heldout_prompts.jsonl")) as f:
        return tok(json.loads(f.readline())["prompt"])["input_ids"]


TEXTS = ["naïve café — déjà vu", "日本語のテキストと中文字符",
         "emoji 🎉👩‍💻🇯🇵 and ∑ ≤ ∞", "def f(x):\n    return x ** 2  # ✓"]


def _sequences(tok, rng: random.Random, count: int):
    """Token sequences: encoded multibyte texts spliced together, random ids (byte tokens that split
    characters, invalid UTF-8, special tokens) mixed in."""
    pieces = [tok(t)["input_ids"] for t in TEXTS]
    for _ in range(count):
        seq = []
        while len(seq) < 40:
            if rng.random() < 0.6:
                p = rng.choice(pieces)
                a = rng.randrange(len(p))
                seq += p[a:a + rng.randint(1, 8)]
            else:
                seq += [rng.randrange(len(tok)) for _ in range(rng.randint(1, 3))]
        yield seq


def test_incremental_deltas_concatenate_to_the_full_decode(tok):
    rng = random.Random(0)
    for seq in _sequences(tok, rng, 60):
        detok, text, n = IncrementalDetokenizer(tok), "", 0
        while n < len(seq):
            n = min(len(seq), n + rng.randint(1, 4))   # one token a step, or a speculative step's several
            text += detok.decode(seq[:n], flush=n == len(seq))
            full = tok.decode(seq[:n], skip_special_tokens=True)
            assert full.startswith(text)
            if not full.endswith("\ufffd") or n == len(seq):
                assert text == full, (seq[:n], text, full)


def _stream(eng: LLMEngine, prompt, params):
    rid = eng.add_request(prompt, params)
    deltas, last = [], None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid:
                deltas.append(out.new_text)
                last = out
    return last, "".join(deltas)


@pytest.fixture(scope="module", params=["ar", "bole"])
def engine(request, tok):
    cfg = EngineConfig.from_options(mode=request.param, device="cpu", dtype="float32", depth=3, topk=2, beam=2,
                                    num_blocks=128, block_size=16, max_num_seqs=2,
                                    calibration_table=resolve_repo_path("calibration_tables/default.yaml"))
    return LLMEngine(load_model(MODEL, dtype="float32"), cfg, tokenizer=tok)


def test_streamed_text_is_the_decode_of_the_output(engine, tok, prompt):
    out, streamed = _stream(engine, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.output_token_ids) == 24
    assert streamed == out.text == tok.decode(out.output_token_ids, skip_special_tokens=True)


def test_stop_strings_cut_where_the_first_one_starts(engine, tok, prompt):
    free, _ = _stream(engine, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    text = free.text
    later, earlier = text[12:15], text[5:9]   # spans token boundaries; listed later first
    hit = min(text.find(earlier), text.find(later))
    out, streamed = _stream(engine, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                           stop=[later, earlier]))
    assert out.finish_reason == "stop" and out.text == text[:hit]
    assert streamed.startswith(out.text)   # a stop string's start may have streamed a step earlier
    ids = out.output_token_ids
    assert ids == free.output_token_ids[:len(ids)]
    if engine.mode == "ar":  # one token a step: the first token whose text completes a stop string
        n = next(n for n in range(1, 25) if any(s in tok.decode(free.output_token_ids[:n]) for s in (later, earlier)))
        assert len(ids) == n
