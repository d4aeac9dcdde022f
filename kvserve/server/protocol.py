"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), as strict pydantic
models: "1" is not an int and 1 is not a bool, as in OpenAI's own validation.

Ranges that SamplingParams checks (temperature, top_p, n, logprobs, stop, logit_bias, ...)
are left to it, so the rules live in one place; pydantic checks only types and the fields
that never reach SamplingParams. Responses are built as plain dicts in serving.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.sampling_params import MAX_LOGPROBS

# How many prompts one /v1/completions request may carry, and prompts x n.
MAX_PROMPTS = 64
MAX_CHOICES = 256
MAX_MESSAGES = 1024
# Priorities reach the scheduler as a sort key; keep them ordinary integers.
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


class _Strict(BaseModel):
    # extra="ignore": unknown fields are dropped, as vLLM does (OpenAI clients add new fields
    # faster than servers learn them).
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    name: str = Field(default="response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Strict):
    """Fields shared by completions and chat; names and defaults as in vLLM."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = Field(default=None, max_length=256)
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    priority: int = Field(default=0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)
