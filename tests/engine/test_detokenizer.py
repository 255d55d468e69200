"""Streaming text: incremental detokenisation (``bole.engine.detokenizer``) against the tokenizer's
own decode of every token so far, on the embedded model's byte-level tokenizer (multibyte, emoji,
CJK, invalid UTF-8), and stop strings in the engine cutting where the first one starts."""

from __future__ import annotations

import json
import os
import random
import statistics
import tracemalloc

import pytest
from transformers import AutoTokenizer

from bole.config import EngineConfig
from bole.engine.detokenizer import IncrementalDetokenizer
from bole.engine.engine import LLMEngine
from bole.engine.output import emit
from bole.engine.sequence import Request
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


class _Counting:
    """The tokenizer, counting the tokens each decode call is given."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def decode(self, ids, **kw):
        self.calls.append(len(ids))
        return self.tok.decode(ids, **kw)


def test_window_advances_over_empty_and_incomplete_tokens(tok):
    """Runs of tokens that decode to nothing (skipped special tokens) and partial UTF-8 characters
    (byte tokens, U+FFFD until the last byte) interleaved: the deltas add up to the full decode, no
    delta shows a U+FFFD the final text lacks, and the window stays short (it skips the empty runs)."""
    eos, euro, emoji = tok.eos_token_id, tok("€")["input_ids"], tok("🎉")["input_ids"]
    assert len(euro) == 3 and len(emoji) == 4 and tok.decode(euro[:2]).endswith("\ufffd")
    lone = emoji[1:2]  # a continuation byte alone: invalid UTF-8, a U+FFFD in the final text too
    seq = tok("x = 1")["input_ids"] + [eos] * 200 + euro[:1] + [eos] * 50 + euro[1:2] + [eos] * 50 + euro[2:]
    seq += [eos] * 100 + emoji[:2] + [eos] * 30 + emoji[2:] + lone + tok(" y")["input_ids"] + [eos] * 80
    rng = random.Random(1)
    for trial in range(6):
        counting = _Counting(tok)
        detok, deltas, n = IncrementalDetokenizer(counting), [], 0
        while n < len(seq):
            n = min(len(seq), n + (1 if trial == 0 else rng.randint(1, 5)))
            deltas.append(detok.decode(seq[:n], flush=n == len(seq)))
        final = tok.decode(seq, skip_special_tokens=True)
        assert "".join(deltas) == final and "€" in final and "🎉" in final
        assert all(d.count("\ufffd") <= final.count("\ufffd") for d in deltas)
        streamed = ""
        for d in deltas:
            streamed += d
            assert streamed.count("\ufffd") <= final.count("\ufffd") == 1
        assert max(counting.calls) <= 16, max(counting.calls)   # not the 200-token run of empties


def test_emission_cost_does_not_grow_with_the_output(tok):
    """A step's work is proportional to its new tokens: over a 3000-token output (one token a step,
    stop strings on), the tokens decoded and the bytes allocated per step stay flat (a copy of the
    token list or a rebuilt text a step would add ~8 bytes / token and a character per emitted one)."""
    ids = tok("def f(x):\n    return x ** 2  # 日本 🎉\n")["input_ids"]
    seq = (ids * (3000 // len(ids) + 1))[:3000]
    counting = _Counting(tok)
    params = SamplingParams(temperature=0, max_tokens=len(seq), ignore_eos=True, stop=["never seen", "zzz"])
    req = Request("r", [1, 2, 3], params, seed=0, detokenizer=IncrementalDetokenizer(counting))
    grew, deltas, touched = [], [], []
    tracemalloc.start()
    try:
        for t in seq:
            before, calls = tracemalloc.get_traced_memory()[0], len(counting.calls)
            tracemalloc.reset_peak()
            out = emit(req, [t])
            grew.append(tracemalloc.get_traced_memory()[1] - before)
            touched.append(sum(counting.calls[calls:]))
            deltas.append(out.new_text)
    finally:
        tracemalloc.stop()
    assert out.finish_reason == "length" and out.text == "".join(deltas) == tok.decode(seq)
    assert str(req.output_text) == out.text and list(out.output_token_ids) == seq
    assert max(touched) <= 16
    early, late = statistics.median(grew[100:400]), statistics.median(grew[2600:2900])
    assert late <= early + 256, (early, late)


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
    """Every mode ends where one token a step would (ar): at the first token whose text completes a stop
    string, with that token's logprobs the last; the streamed deltas are exactly the final text (no part
    of a stop string is ever sent: a delta cannot be taken back)."""
    free, _ = _stream(engine, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    text = free.text
    later, earlier = text[12:15], text[5:9]   # spans token boundaries; listed later first
    hit = min(text.find(earlier), text.find(later))
    out, streamed = _stream(engine, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                           stop=[later, earlier], logprobs=0))
    assert out.finish_reason == "stop" and out.text == text[:hit] == streamed
    ids = out.output_token_ids
    n = next(n for n in range(1, 25) if any(s in tok.decode(free.output_token_ids[:n]) for s in (later, earlier)))
    assert list(ids) == free.output_token_ids[:n]


def _emit_steps(tok, seq, params, sizes):
    """``emit`` over ``seq`` in steps of ``sizes`` tokens (cycled; 1: ar's one token a step): the deltas,
    the emitted tokens and logprob entries, and the last output."""
    req = Request("r", [1, 2, 3], params, seed=0, detokenizer=IncrementalDetokenizer(tok))
    deltas, ids, lps, i, k, out = [], [], [], 0, 0, None
    while i < len(seq) and (out is None or not out.finished):
        step = seq[i:i + sizes[k % len(sizes)]]
        out = emit(req, step, [f"lp{i + j}" for j in range(len(step))])
        deltas.append(out.new_text)
        ids += out.new_token_ids
        lps += out.logprobs
        i, k = i + len(step), k + 1
    return deltas, ids, lps, out


@pytest.mark.parametrize("min_tokens", [0, 6])
def test_emit_stop_strings_are_step_size_independent(tok, min_tokens):
    """Stop strings over random multibyte sequences: whatever the step sizes (a speculative step emits
    several tokens), the tokens, their logprobs, the text and the finish reason are those of one token a
    step, the deltas add up to the text, and no delta ever holds a stop string's first characters
    that the final text lacks. Before token min_tokens + 1 no stop string ends the request (vLLM's rule)."""
    rng = random.Random(7)
    for seq in _sequences(tok, rng, 40):
        full = tok.decode(seq, skip_special_tokens=True)
        if len(full) < 12:
            continue
        a = rng.randrange(len(full) - 6)
        stops = [full[a:a + rng.randint(2, 5)], "zz" + full[a + 1:a + 3], "never seen"]
        if any("\ufffd" in s for s in stops):   # an incomplete character's stand-in: not a stop string
            continue
        params = SamplingParams(temperature=0, max_tokens=len(seq), ignore_eos=True, stop=stops,
                                min_tokens=min(min_tokens, len(seq)))
        ref = _emit_steps(tok, seq, params, [1])
        deltas, ids, lps, out = ref
        assert "".join(deltas) == out.text and ids == seq[:len(ids)] and lps == [f"lp{j}" for j in range(len(ids))]
        n, dec = len(ids), lambda m, seq=seq: tok.decode(seq[:m], skip_special_tokens=True)
        if min_tokens == 0:   # the first token whose text completes a stop string; none in the text
            assert not any(s in out.text for s in stops)
            assert (out.finish_reason == "stop") == any(s in dec(n) for s in stops)
            assert not any(s in dec(n - 1) for s in stops)
        else:                 # none ends the request before token min_tokens + 1
            assert out.finish_reason == "length" or n > params.min_tokens
        for sizes in ([3], [8], [2, 5, 1], [len(seq)]):
            got = _emit_steps(tok, seq, params, sizes)
            assert got[1:3] == ref[1:3] and got[3].text == out.text and got[3].finish_reason == out.finish_reason
            assert "".join(got[0]) == out.text, sizes
