"""Tool calling over a real `kvserve serve` with the official openai client: forced and named
calls on the default model parse into tool_calls whose arguments validate against the
function's schema (jsonschema, independent of the grammar that produced them), streamed and
not, and the stream accumulator (the client's own) gives the non-streamed answer; "auto"
answers are the parse of what the model wrote; tool results go back in; bad tool fields are
400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.test_server_hardening import assert_error

MODEL = "smollm2-135m"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description":
                                      "The current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description":
                                      "The local time in a timezone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES: list[Any] = [{"role": "user", "content": "What's the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--kv-cache-memory", "256MiB", "--max-model-len", "2048") as srv:
        yield srv


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("choice, parallel, names", [
    ("required", False, {"get_weather", "get_time"}),
    (NAMED, False, {"get_time"}),
    (NAMED, True, {"get_time"}),
])
def test_forced_calls_match_the_schema_streamed_and_not(client: openai.OpenAI, choice: Any,
                                                        parallel: bool, names: set[str]) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                              parallel_tool_calls=parallel, max_tokens=64, temperature=0)
    whole = client.chat.completions.create(**kw)
    (c,) = whole.choices
    calls = _calls(c.message)
    assert len(calls) == 1 and calls[0][0] in names
    assert c.finish_reason == "tool_calls" and c.message.content is None
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert _calls(final.choices[0].message) == calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert not final.choices[0].message.content


def test_required_with_parallel_calls(client: openai.OpenAI) -> None:
    """Several calls are allowed; every complete one matches its schema, and a call cut by
    max_tokens is not reported as a call."""
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                       tool_choice="required", max_tokens=96, temperature=0)
    (c,) = r.choices
    calls = _calls(c.message)
    assert calls
    if c.finish_reason == "length":
        assert c.message.content is None or c.message.content.startswith("<tool_call>")
    else:
        assert c.finish_reason == "tool_calls"


def test_stream_chunks_are_shaped_as_openai_sends_them(server: ServerProcess) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED,
            "max_tokens": 64, "temperature": 0, "stream": True, "n": 2, "seed": 3}
    chunks = []
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body,
                      headers=server.headers, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    for index in (0, 1):
        choice = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == index]
        assert choice[0]["delta"] == {"role": "assistant", "content": ""}
        deltas = [d["delta"]["tool_calls"] for d in choice if "tool_calls" in d["delta"]]
        assert len(deltas) == 1 and len(deltas[0]) == 1
        call = deltas[0][0]
        assert call["index"] == 0 and call["type"] == "function" and call["id"]
        assert call["function"]["name"] == "get_time"
        jsonschema.validate(json.loads(call["function"]["arguments"]), TIME)
        assert [d["finish_reason"] for d in choice if d["finish_reason"]] == ["tool_calls"]


def test_auto_is_the_parse_of_what_the_model_wrote(client: openai.OpenAI) -> None:
    """tool_choice none returns the model's text as content; auto, for the same greedy
    request, splits that same text into content and calls (the text is the same: none and
    auto render the same prompt and neither constrains the output)."""
    from kvserve.tool_calling.parsers import HermesParser, final_content

    kw: dict[str, Any] = dict(model=MODEL, tools=TOOLS, max_tokens=48, temperature=0)
    for messages in (MESSAGES, [{"role": "user", "content": "Call get_time for Asia/Tokyo."}]):
        raw = client.chat.completions.create(messages=messages, tool_choice="none", **kw)
        auto = client.chat.completions.create(messages=messages, tool_choice="auto", **kw)
        text = raw.choices[0].message.content
        assert not raw.choices[0].message.tool_calls
        scan = HermesParser().scan(text, final=True)
        assert auto.choices[0].message.content == final_content(scan)
        assert [(c.function.name, c.function.arguments)
                for c in auto.choices[0].message.tool_calls or []] == [
            (c.name, c.arguments) for c in scan.calls]


def test_a_tool_result_goes_back_to_the_model(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=64, temperature=0)
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [*MESSAGES, message,  # the client's own message object, as agents send it
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                            max_tokens=32, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The result reached the prompt: the prompt grew by more than the call and the result.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": 3}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [TOOLS[0], {"type": "retrieval", "function": {"name": "f"}}]}, "tools[1].type"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
])
def test_bad_tool_fields_are_400s_naming_the_field(http: httpx.Client, extra: dict[str, Any],
                                                   param: str) -> None:
    assert_error(http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}), 400, param)
    assert http.get("/health").status_code == 200


def test_bad_tool_messages_are_400s(http: httpx.Client) -> None:
    no_content = [*MESSAGES, {"role": "tool", "tool_call_id": "call_1"}]
    assert_error(http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": no_content, "max_tokens": 4}), 400, "messages[1].content")
    user_calls = [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert_error(http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": user_calls, "max_tokens": 4}), 400,
        "messages[0].tool_calls")
