"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), as strict pydantic
models: "1" is not an int and 1 is not a bool, as in OpenAI's own validation.

Ranges that SamplingParams checks (temperature, top_p, n, logprobs, stop, logit_bias, ...)
are left to it, so the rules live in one place; pydantic checks only types and the fields
that never reach SamplingParams. Responses are built as plain dicts in serving.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import MaxLen
from pydantic import BaseModel, ConfigDict, FailFast, Field, field_validator

from kvserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS

# How many prompts one /v1/completions request may carry, and prompts x n.
MAX_PROMPTS = 64
MAX_CHOICES = 256
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 256
MAX_TOOLS = 128  # OpenAI's bound on tools; also on one message's tool_calls
MAX_FUNCTION_NAME = 64
# Token ids in one prompt or one /detokenize call: more than any context kvserve serves.
MAX_TOKEN_IDS = 1 << 17


class _FailFast(FailFast):
    """pydantic's FailFast, hashable so that it can sit inside a Union on Python 3.10/3.11.

    Why fail fast: a strict list reports one error per bad item and per union member, so a
    4 MiB body of 150k wrongly typed prompt items made 450k errors, and formatting them held
    the event loop (and /health) for over a second. Stopping at the first bad item keeps the
    cost of a bad body at one error per list."""

    def __hash__(self) -> int:
        return hash(_FailFast)


def _list(item: Any, max_len: int) -> Any:
    """list[item], at most max_len long (checked before any item), stopping at the first bad
    item."""
    return Annotated[list[item], _FailFast(), MaxLen(max_len)]  # type: ignore[valid-type]


TokenIds = _list(int, MAX_TOKEN_IDS)
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
    stop: str | _list(str, 1024) | None = None  # type: ignore[valid-type]
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
    stop_token_ids: _list(int, 64) | None = None  # type: ignore[valid-type]
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    priority: int = Field(default=0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bounded_logit_bias(cls, v: Any) -> Any:
        # A dict's max_length is checked only after every value: bound it first (the same
        # cap as SamplingParams', so the message is the same).
        if isinstance(v, dict) and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got "
                             f"{len(v)}")
        return v


class CompletionRequest(_SamplingFields):
    prompt: (str | Annotated[list[str], _FailFast()] | TokenIds  # type: ignore[valid-type]
             | Annotated[list[TokenIds], _FailFast()])  # type: ignore[valid-type]
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        check_prompt_shape(v)
        return v


def _kind(x: Any) -> str:
    return {str: "a string", int: "a token id", list: "a list"}.get(type(x), "")


def check_prompt_shape(v: Any) -> None:
    """One pass over the prompt, with one precise error: pydantic's union would report each
    bad item once per member, and name the wrong member ("prompt[0] should be a string" for a
    list of 200k token ids). Item types follow prompt[0]; bool is not an int (strict)."""
    if isinstance(v, str) or not isinstance(v, list) or not v:
        return  # pydantic's own checks (type errors, and empty lists later) say the rest
    if type(v[0]) is list:
        if len(v) > MAX_PROMPTS:
            raise ValueError(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(v)}")
        for i, p in enumerate(v):
            if type(p) is not list:
                raise ValueError(f"prompt[{i}] must be a list of token ids like prompt[0], "
                                 f"got {_kind(p) or type(p).__name__}")
            _check_same(p, int, f"prompt[{i}]")
        return
    if type(v[0]) is int:
        _check_same(v, int, "prompt")
    elif type(v[0]) is str:
        if len(v) > MAX_PROMPTS:
            raise ValueError(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(v)}")
        _check_same(v, str, "prompt")
    else:
        raise ValueError(f"prompt[0] must be a string, a token id or a list of token ids, got "
                         f"{type(v[0]).__name__.replace('NoneType', 'null')}")


def _check_same(items: list[Any], kind: type, name: str) -> None:
    if kind is int and len(items) > MAX_TOKEN_IDS:
        raise ValueError(f"{name} may hold at most {MAX_TOKEN_IDS} token ids, got {len(items)}")
    for i, x in enumerate(items):
        if type(x) is not kind:
            want = "a token id (an integer)" if kind is int else "a string"
            raise ValueError(f"{name}[{i}] must be {want}, got "
                             f"{_kind(x) or type(x).__name__.replace('NoneType', 'null')}")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(max_length=MAX_FUNCTION_NAME)
    arguments: str  # a JSON object's text, as OpenAI sends it


class ToolCallItem(_Strict):
    id: str | None = Field(default=None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system" (the chat template sees "system").
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | _list(TextPart, MAX_CONTENT_PARTS) | None = None  # type: ignore[valid-type]
    name: str | None = Field(default=None, max_length=256)
    tool_calls: _list(ToolCallItem, MAX_TOOLS) | None = None  # type: ignore[valid-type]
    tool_call_id: str | None = Field(default=None, max_length=256)


class FunctionDefinition(_Strict):
    # OpenAI's rule for names; they are written into prompts and grammars.
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(max_length=MAX_FUNCTION_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: _list(ChatMessage, MAX_MESSAGES) = Field(min_length=1)  # type: ignore[valid-type]
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: _list(Tool, MAX_TOOLS) | None = None  # type: ignore[valid-type]
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated forms of tools / tool_choice: refused by name (serving_tools.py),
    # since a silently dropped function list gives a client prose as if it had been read.
    functions: list[Any] | None = None
    function_call: Any = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: _list(ChatMessage, MAX_MESSAGES) | None = None  # type: ignore[valid-type]
    tools: _list(Tool, MAX_TOOLS) | None = None  # type: ignore[valid-type]  # as chat renders them
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: TokenIds  # type: ignore[valid-type]
