"""Request's one token list: the prompt and output views see appends without copies."""

from __future__ import annotations

import pytest

from bole.engine.sequence import Request, TokenView
from bole.sampling_params import SamplingParams


def test_one_list_with_prompt_and_output_views():
    prompt = [5, 6, 7]
    r = Request("r", prompt, SamplingParams(), seed=0)
    ids = r.all_token_ids
    assert ids == prompt and ids is not prompt          # the prompt is copied once
    out = r.output_token_ids
    assert out == [] and len(out) == 0 and r.num_output_tokens == 0
    for t in (8, 9):
        r.append_token(t)
    assert r.all_token_ids is ids and ids == [5, 6, 7, 8, 9] and prompt == [5, 6, 7]
    assert out == [8, 9] and list(out) == [8, 9] and [8, 9] == out   # a view: it sees the appends
    assert r.prompt_token_ids == (5, 6, 7) and r.num_prompt_tokens == 3 and r.num_tokens == 5
    assert out[0] == 8 and out[-1] == 9 and out[:1] == [8] and out[::-1] == [9, 8] and out[5:] == []
    assert isinstance(out[:], list) and r.prompt_token_ids[1:] == [6, 7] and r.prompt_token_ids[-1] == 7
    with pytest.raises(IndexError):
        out[2]
    assert out != [8] and out != "89" and repr(out) == "[8, 9]"
    assert [1] + out == [1, 8, 9] and out + (1,) == [8, 9, 1] and isinstance([1] + out, list)
    r.reset_for_recompute()
    assert r.output_token_ids == [8, 9] and r.needs_prompt_logits is False


def test_views_are_windows():
    ids = [1, 2, 3, 4]
    assert TokenView(ids, 1, 3) == [2, 3] and TokenView(ids, 2) == [3, 4]
    ids.append(5)
    assert TokenView(ids, 1, 3) == [2, 3] and TokenView(ids, 2) == [3, 4, 5] and len(TokenView(ids, 5)) == 0
