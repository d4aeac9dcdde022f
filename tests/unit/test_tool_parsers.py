"""Tool-call parsers on crafted model text: one call, several in a row, calls mixed with prose,
malformed calls (which stay prose), and streaming: the text fed a character at a time gives
exactly the whole reply's content and calls."""

from __future__ import annotations

import json

import pytest

from kvserve.tool_calling.parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
    ToolCallStream,
    ToolParser,
    final_content,
    get_tool_parser,
    parser_for_template,
)


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


W = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))
T = ToolCall("get_time", json.dumps({"tz": "Europe/Paris"}))
W_ARGS = '{"city": "Paris", "unit": "celsius"}'
T_ARGS = '{"tz":"Europe/Paris"}'

# (parser, model text, expected content, expected calls)
CASES = [
    # hermes (Qwen2.5): one call; two in a row; prose around them
    (HermesParser, _hermes("get_weather", W_ARGS), None, [W]),
    (HermesParser, _hermes("get_weather", W_ARGS) + "\n" + _hermes("get_time", T_ARGS),
     None, [W, T]),
    (HermesParser, "Let me look that up.\n" + _hermes("get_weather", W_ARGS) + "\nDone <tool",
     "Let me look that up.\n\nDone <tool", [W]),
    (HermesParser, "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    (HermesParser, "Trailing space kept without calls.  ", "Trailing space kept without calls.  ",
     []),
    # the arguments as a JSON string, and "parameters" instead of "arguments"
    (HermesParser, '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"Europe/Paris\\"}"}'
     '</tool_call>', None, [T]),
    (HermesParser, '<tool_call>{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}'
     '</tool_call>', None, [T]),
    # malformed: bad JSON, no name, arguments not an object, unclosed -> prose, nothing lost
    (HermesParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', []),
    (HermesParser, 'A <tool_call>{"arguments": {}}</tool_call> B ' + _hermes("get_time", T_ARGS),
     'A <tool_call>{"arguments": {}}</tool_call> B', [T]),
    (HermesParser, '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', []),
    (HermesParser, '<tool_call>{"name": "f", "arguments": {}} extra</tool_call>',
     '<tool_call>{"name": "f", "arguments": {}} extra</tool_call>', []),
    (HermesParser, _hermes("get_time", T_ARGS) + '\n<tool_call>\n{"name": "get_weather", "arg',
     '\n<tool_call>\n{"name": "get_weather", "arg', [T]),
    # a call in a ```json fence (Qwen2.5-Coder's habit); other JSON in a fence is prose
    (HermesParser, '```json\n{\n  "name": "get_weather",\n  "arguments": ' + W_ARGS
     + '\n}\n```', None, [W]),
    (HermesParser, 'Here:\n```json\n{"name": "Ann", "age": 3}\n```\n```python\nx = 1\n```',
     'Here:\n```json\n{"name": "Ann", "age": 3}\n```\n```python\nx = 1\n```', []),
    # llama3_json (Llama 3.1): the reply is the calls, ';'-separated, maybe after the tag
    (Llama3JsonParser, '{"name": "get_weather", "parameters": ' + W_ARGS + "}", None, [W]),
    (Llama3JsonParser, '<|python_tag|>{"name": "get_weather", "parameters": ' + W_ARGS
     + '}; {"name": "get_time", "parameters": ' + T_ARGS + "}", None, [W, T]),
    (Llama3JsonParser, 'Sure: {"name": "get_weather", "parameters": ' + W_ARGS + "}",
     'Sure: {"name": "get_weather", "parameters": ' + W_ARGS + "}", []),
    (Llama3JsonParser, '{"name": "get_time", "parameters": ' + T_ARGS + "} and then some prose",
     "and then some prose", [T]),
    (Llama3JsonParser, '{"name": "get_time", "parameters": {"tz": ', '{"name": "get_time", '
     '"parameters": {"tz": ', []),
    (Llama3JsonParser, '{"answer": 42}', '{"answer": 42}', []),
    (Llama3JsonParser, "   ", "   ", []),
    # mistral: [TOOL_CALLS] then a JSON array (v3), or name[ARGS]{...} per call (v11)
    (MistralParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + W_ARGS
     + '}, {"name": "get_time", "arguments": ' + T_ARGS + "}]", None, [W, T]),
    (MistralParser, "Checking. [TOOL_CALLS]get_weather[ARGS]" + W_ARGS
     + "[TOOL_CALLS]get_time[ARGS]" + T_ARGS, "Checking.", [W, T]),
    (MistralParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"', []),
    (MistralParser, '[TOOL_CALLS][{"name": "get_weather"}, 7]',
     '[TOOL_CALLS][{"name": "get_weather"}, 7]', []),
]


@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_whole_reply(cls: type[ToolParser], text: str, content: str | None,
                     calls: list[ToolCall]) -> None:
    scan = cls().scan(text, final=True)
    assert list(scan.calls) == calls
    assert final_content(scan) == content
    for c in scan.calls:
        assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_streaming_equals_the_whole_reply(cls: type[ToolParser], text: str,
                                          content: str | None, calls: list[ToolCall]) -> None:
    """Every split point: a character at a time, then in chunks of 7 (several markers'
    worth), the deltas add up to the whole reply's answer and never take anything back."""
    for step in (1, 7):
        stream = ToolCallStream(cls())
        got_content, got_calls = "", []
        cuts = list(range(step, len(text), step)) + [len(text)]
        for cut in cuts:
            delta, new = stream.update(text[:cut], final=cut == len(text))
            got_content += delta
            got_calls += new
            # Nothing is sent that a later scan could contradict.
            whole = cls().scan(text, final=True)
            assert (final_content(whole) or "").startswith(got_content)
            assert list(whole.calls[:len(got_calls)]) == got_calls
        assert got_content == (content or "")
        assert got_calls == calls


def test_marker_prefix_is_held_back_until_decided() -> None:
    stream = ToolCallStream(HermesParser())
    assert stream.update("Hello <tool", final=False) == ("Hello", [])
    assert stream.update("Hello <tools are fun", final=False) == (" <tools are fun", [])


def test_parser_from_template_and_by_name() -> None:
    assert parser_for_template("... <tool_call>\\n{{ tool_call.name }} ...") == "hermes"
    assert parser_for_template("{{- '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert parser_for_template("{{ messages[0]['content'] }}") is None
    assert parser_for_template(None) is None
    assert isinstance(get_tool_parser("mistral"), MistralParser)
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        get_tool_parser("pythonic")
