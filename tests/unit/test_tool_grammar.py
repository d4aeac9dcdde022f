"""The grammar for tool_choice "required" / a named function, compiled by xgrammar on the
default model's vocabulary: it accepts calls in the parser's own format whose arguments match
the schema, refuses prose, other functions, bad arguments and a second call when parallel
calls are off, and what it accepts the same parser reads back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output import StructuredOutputManager
from kvserve.tool_calling.grammar import tool_call_tag
from kvserve.tool_calling.parsers import TOOL_PARSERS, ToolCall

xgr = pytest.importorskip("xgrammar")

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"], "additionalProperties": False}}
NOOP = {"name": "noop"}  # no parameters: any object


@pytest.fixture(scope="module")
def manager(smollm2: Any) -> StructuredOutputManager:
    tok = smollm2[1].tokenizer
    return StructuredOutputManager(tok, smollm2[1].model_config.vocab_size)


def _accepts(manager: StructuredOutputManager, tag: dict[str, Any], text: str) -> bool:
    matcher = xgr.GrammarMatcher(manager.compile(StructuredOutputsParams(structural_tag=tag)))
    eos = manager.tokenizer.eos_token_ids[0]
    return bool(matcher.accept_string(text) and matcher.accept_token(eos))


def _write(parser: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    fmt = TOOL_PARSERS[parser].call_format
    body = fmt.separator.join(fmt.begin.format(name=n) + json.dumps(a) + fmt.end
                              for n, a in calls)
    return fmt.prefix + body + fmt.suffix


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_required_accepts_calls_in_the_parsers_format(manager: StructuredOutputManager,
                                                      parser: str) -> None:
    both = tool_call_tag(TOOL_PARSERS[parser].call_format, [WEATHER, NOOP], parallel=True)
    one = tool_call_tag(TOOL_PARSERS[parser].call_format, [WEATHER, NOOP], parallel=False)
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("noop", {"x": [1]})]
    text = _write(parser, calls)
    assert _accepts(manager, both, text)
    assert TOOL_PARSERS[parser]().scan(text, final=True).calls == tuple(
        ToolCall(n, json.dumps(a)) for n, a in calls)
    assert not _accepts(manager, one, text)  # parallel_tool_calls false: one call
    assert _accepts(manager, one, _write(parser, calls[:1]))
    for bad in ("Sure, let me check.",  # prose, no call
                _write(parser, [("get_time", {})]),  # not a given function
                _write(parser, [("get_weather", {"city": "Paris"})]),  # a required key missing
                _write(parser, [("get_weather", {"city": "Paris", "days": "2"})]),  # wrong type
                ""):  # nothing: at least one call
        assert not _accepts(manager, both, bad), bad


def test_named_function_only(manager: StructuredOutputManager) -> None:
    fmt = TOOL_PARSERS["hermes"].call_format
    tag = tool_call_tag(fmt, [WEATHER], parallel=False)
    assert _accepts(manager, tag, _write("hermes", [("get_weather", {"city": "Oslo", "days": 1})]))
    assert not _accepts(manager, tag, _write("hermes", [("noop", {})]))


def test_a_bad_parameters_schema_is_a_clear_error(manager: StructuredOutputManager) -> None:
    tag = tool_call_tag(TOOL_PARSERS["hermes"].call_format,
                        [{"name": "f", "parameters": {"type": "object", "properties": 3}}],
                        parallel=False)
    with pytest.raises(ValueError, match="^tools: "):
        manager.compile(StructuredOutputsParams(structural_tag=tag))
