"""Bole: tree speculative decoding for hybrid-attention LLMs."""

from bole.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):  # keep `import bole` light: the engine loads torch models on demand
    if name == "LLM":
        from bole.llm import LLM

        return LLM
    raise AttributeError(name)
