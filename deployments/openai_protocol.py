"""OpenAI request / response schemas (the subset Bole serves), as pydantic models.

Fields the engine does not implement are still declared, so a request using their default passes
and one asking for them gets a clear 400 (``unsupported``) rather than being silently ignored.
Unknown extra fields are ignored, as the OpenAI API does. Token ids are strict ints (lax parsing
would turn ``1.0`` and ``true`` into ids); a field's own validator refuses what only it can judge,
so the 400 names it (``param``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from bole.sampling_params import MAX_LOGPROBS

# an int64 id: whether the vocabulary holds it is checked where its size is known
TokenId = Annotated[StrictInt, Field(ge=0, lt=1 << 63)]


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a last chunk with the token usage of the request.")


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., description="The served model name (GET /v1/models lists it).")
    max_tokens: int | None = Field(None, ge=1, description="The most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False, description=(
        "Sampling temperature; 0 is greedy."))
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Keep the k most likely tokens (-1 or 0: off). vLLM extension.")
    min_tokens: int = Field(0, ge=0, description="No EOS / stop tokens before this many. vLLM extension.")
    n: int = Field(1, ge=1, le=16, description="Completions per prompt: independent engine requests, "
                                               "sent to one replica together.")
    stop: Union[str, list[str], None] = Field(None, description="Up to 4 strings that end generation.")
    stop_token_ids: list[TokenId] | None = Field(None, description="Token ids ending generation. vLLM extension.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS. vLLM extension.")
    seed: int | None = Field(None, description="Seed for reproducible sampling (choice i uses seed + i, "
                                               "an int64).")
    stream: bool = Field(False, description="Stream deltas as server-sent events ending in `data: [DONE]`.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options (include_usage).")
    user: str | None = Field(None, description="End-user id (accepted, unused).")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False, description=(
        "Subtracted from the logit of every token already generated (OpenAI range [-2, 2])."))
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False, description=(
        "Subtracted from a token's logit once per time it was generated (OpenAI range [-2, 2])."))
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False, description=(
        "Divides positive / multiplies negative logits of tokens in the prompt or the output (> 0; "
        "1 = off). vLLM extension."))
    logit_bias: dict[str, float] | None = Field(None, description="Not supported: must be empty.")

    @field_validator("seed")
    @classmethod
    def _seeds_fit_int64(cls, v, info: ValidationInfo):
        n = info.data.get("n", 1)
        if v is not None and not -(1 << 63) <= v <= (1 << 63) - n:
            raise PydanticCustomError("value_error", f"must be in [-2**63, 2**63 - n] (choice i samples with "
                                      f"seed + i, an int64), got {v} with n={n}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):
            raise PydanticCustomError("value_error", "only allowed with stream: true")
        return v


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[Union[StrictInt, str, list[StrictInt]]]] = Field(
        ..., description="A string, token ids, or a list of prompts (strings or token-id lists).")
    max_tokens: int | None = Field(16, ge=0, description=(
        "The most tokens to generate (OpenAI default 16); 0 only with echo (score the prompt)."))
    echo: bool = Field(False, description="Return the prompt before the completion (with logprobs: its "
                                          "tokens' logprobs too, the first null).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "Return each token's logprob and this many most likely alternatives (0..20)."))
    best_of: int | None = Field(None, description="Null or equal to n; > n is refused (400).")
    suffix: str | None = Field(None, description="Not supported: must be null.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        # checked before the union, whose errors name its branches ("prompt.str"), not the problem
        def is_ids(x):
            return isinstance(x, list) and all(type(t) is int for t in x)
        if isinstance(v, str) or is_ids(v) or (isinstance(v, list) and all(isinstance(x, str) or is_ids(x)
                                                                          for x in v)):
            return v
        raise PydanticCustomError("value_error", "must be a string, a list of strings, a list of token ids "
                                  "(integers) or a list of token-id lists")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"] = Field(..., description="Author role.")
    content: Union[str, list[dict[str, Any]], None] = Field(
        None, description="Text, or a list of content parts of type `text`.")
    name: str | None = Field(None, description="Optional author name (accepted, unused).")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer OpenAI name of max_tokens.")
    logprobs: bool = Field(False, description="Return each generated token's logprob.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "With logprobs: this many most likely alternatives per token (0..20)."))
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported: must be absent.")
    tool_choice: Union[str, dict[str, Any], None] = Field(None, description=(
        "Not supported (as tools are not): must be absent or 'none'."))
    response_format: dict[str, Any] | None = Field(None, description="Only {'type': 'text'} is supported.")

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v):
        if v not in (None, "none"):
            raise PydanticCustomError("unsupported", "tools are not supported: only 'none' is accepted")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v


class UsageInfo(BaseModel):
    prompt_tokens: int = Field(0, description="Tokens in the prompt(s).")
    completion_tokens: int = Field(0, description="Tokens generated over all choices.")
    total_tokens: int = Field(0, description="prompt_tokens + completion_tokens.")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
