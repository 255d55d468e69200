"""SamplingParams validation (bole/sampling_params.py)."""

import dataclasses

import pytest

from bole.sampling_params import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens) == (1.0, 1.0, -1, 16, 0)
    assert p.stop == () and p.stop_token_ids == () and p.seed is None and not p.ignore_eos
    q = SamplingParams(temperature=0, top_k=0, stop="\n\n", stop_token_ids=[7, 9], seed=3)
    assert q.greedy and q.temperature == 0.0 and q.effective_top_k == -1
    assert q.stop == ("\n\n",) and q.stop_token_ids == (7, 9)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(top_k=5).effective_top_k == 5
    hash(q)  # immutable and hashable
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.temperature = 1.0


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature .* got -0.1"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p must be in \\(0, 1\\], got 0.0"),
    ({"top_p": 1.5}, "top_p .* got 1.5"),
    ({"top_k": -2}, "top_k .* got -2"),
    ({"top_k": 2.5}, "top_k .* got 2.5"),
    ({"max_tokens": 0}, "max_tokens .* got 0"),
    ({"min_tokens": -1}, "min_tokens .* got -1"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens=5 must not exceed max_tokens=4"),
    ({"stop": [1]}, "stop must be"),
    ({"stop": [""]}, "empty strings"),
    ({"stop_token_ids": [-1]}, "stop_token_ids .* got \\[-1\\]"),
    ({"seed": 1.5}, "seed .* got 1.5"),
    ({"seed": 1 << 63}, "seed .* got 9223372036854775808"),
    ({"seed": -(1 << 63) - 1}, "seed .* got -9223372036854775809"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in \\[-2, 2\\], got 2.5"),
    ({"frequency_penalty": -2.01}, "frequency_penalty .* got -2.01"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"presence_penalty": True}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0 .* got 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logprobs": 21}, "logprobs must be None or an int in \\[0, 20\\], got 21"),
    ({"logprobs": -1}, "logprobs .* got -1"),
    ({"prompt_logprobs": 2.0}, "prompt_logprobs .* got 2.0"),
    ({"max_tokens": 0, "logprobs": 2}, "max_tokens .*0 only with prompt_logprobs"),
])
def test_invalid_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_penalties_and_logprobs_fields():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.3, logprobs=0,
                       prompt_logprobs=20)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-2.0, 2.0, 1.3)
    assert p.penalized and not SamplingParams().penalized and SamplingParams(repetition_penalty=0.9).penalized
    assert (p.logprobs, p.prompt_logprobs) == (0, 20)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0   # score the prompt only
