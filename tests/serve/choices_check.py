"""The n / best_of / batch-prompt checks, shared by the in-process (uvicorn) and the Ray Serve tests:
every request completes, greedy choices equal the single request, seeded choice i equals a single
request with seed + i (the documented seeds)."""

from __future__ import annotations

import time

PROMPT = "def add(a, b):"


def _texts(oai, model, n, stream, **kw) -> list[str]:
    args = dict(model=model, prompt=PROMPT, n=n, max_tokens=2, extra_body={"ignore_eos": True}, **kw)
    if not stream:
        r = oai.completions.create(**args)
        assert len(r.choices) == n and r.usage.completion_tokens == 2 * n
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    texts, finished = [""] * n, [None] * n
    for chunk in oai.completions.create(stream=True, **args):
        for c in chunk.choices:
            texts[c.index] += c.text
            finished[c.index] = c.finish_reason or finished[c.index]
    assert finished == ["length"] * n, finished
    return texts


def check_choices(oai, model, repeats: int = 20) -> dict:
    """n=2 and n=3, streamed and not, greedy and seeded, ``repeats`` times each; returns timings."""
    greedy_ref = _texts(oai, model, 1, False, temperature=0)[0]
    seeded_ref = [_texts(oai, model, 1, False, temperature=1.0, seed=7 + i)[0] for i in range(3)]
    timings = {}
    for n in (2, 3):
        for stream in (False, True):
            for seeded in (False, True):
                kw = dict(temperature=1.0, seed=7) if seeded else dict(temperature=0)
                t0 = time.perf_counter()
                for _ in range(repeats):
                    texts = _texts(oai, model, n, stream, **kw)
                    assert texts == (seeded_ref[:n] if seeded else [greedy_ref] * n), (n, stream, seeded, texts)
                timings[(n, stream, seeded)] = (time.perf_counter() - t0) / repeats
    return timings


def check_best_of_and_batch(oai, model, token_ids: list[int]) -> None:
    import openai
    import pytest

    ref = _texts(oai, model, 1, False, temperature=0)[0]
    r = oai.completions.create(model=model, prompt=PROMPT, n=2, best_of=2, temperature=0, max_tokens=2,
                               extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [ref, ref]
    for best_of in (1, 3):   # best_of < n is wrong; > n needs logprobs the engine does not return yet
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model=model, prompt=PROMPT, n=2, best_of=best_of, max_tokens=2)
        assert e.value.body["param"] == "best_of"
    # a batch of two identical token lists: two independent engine requests, the same greedy text
    r = oai.completions.create(model=model, prompt=[token_ids, token_ids], temperature=0, max_tokens=3,
                               extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text
    single = oai.completions.create(model=model, prompt=token_ids, temperature=0, max_tokens=3,
                                    extra_body={"ignore_eos": True})
    assert r.choices[0].text == single.choices[0].text
    assert r.usage.prompt_tokens == 2 * len(token_ids) and r.usage.completion_tokens == 6
