"""Tools and tool-call turns in the prompt: through Qwen2.5's own template exactly as
transformers' apply_chat_template renders the same conversation, and, for a template that
ignores tools (the default model's), described in the system message in the parser's format,
which the parser reads back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvserve.loader import Tokenizer
from kvserve.server.protocol import ChatMessage
from kvserve.server.serving_chat import conversation
from kvserve.tool_calling.parsers import HermesParser
from kvserve.tool_calling.prompt import prompt_messages
from kvserve.tool_calling.support import tool_support

# Qwen2.5-Instruct's chat template, as its GGUF files carry it (tokenizer.chat_template).
QWEN_TEMPLATE = (Path(__file__).parents[1] / "data" / "qwen2.5-chat-template.jinja").read_text()

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}},
]
ARGS = {"city": "Paris", "unit": "c"}

# A multi-turn exchange as an OpenAI client sends it: arguments as JSON text, tool results.
OPENAI_MESSAGES: list[dict[str, Any]] = [
    {"role": "developer", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": '{"tz": "Europe/Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "assistant", "content": "It is 21 C and 14:05."},
    {"role": "user", "content": "Thanks!"},
]
# The same conversation as transformers' docs pass it: arguments as objects.
HF_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": ARGS}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "assistant", "content": "It is 21 C and 14:05."},
    {"role": "user", "content": "Thanks!"},
]


def _ours(tok: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
          ) -> str:
    support = tool_support(tok, None)
    conv = conversation([ChatMessage.model_validate(m) for m in messages])
    conv, extra = prompt_messages(conv, tools, support.template_renders_tools,
                                  support.parser.call_format)
    text = tok.apply_chat_template(conv, add_generation_prompt=True, **extra)
    assert isinstance(text, str)
    return text


@pytest.fixture(scope="module")
def qwen_tok(smollm2: Any) -> Tokenizer:
    base = smollm2[1].tokenizer
    return Tokenizer(base.backend, bos_token_id=None, eos_token_ids=base.eos_token_ids,
                     add_bos_token=False, chat_template=QWEN_TEMPLATE,
                     all_special_ids=base.all_special_ids)


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_tool_exchange_renders_as_transformers_does(qwen_tok: Tokenizer, tools: Any) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=qwen_tok.backend,
                                              eos_token="<|im_end|>")
    theirs = hf.apply_chat_template(HF_MESSAGES, tools=tools, chat_template=QWEN_TEMPLATE,
                                    add_generation_prompt=True, tokenize=False)
    ours = _ours(qwen_tok, OPENAI_MESSAGES, tools)
    assert ours == theirs
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
            in ours)  # the arguments as an object, not a string quoted twice
    assert ("# Tools" in ours) == (tools is not None)


def test_qwen_template_picks_hermes_and_renders_tools(qwen_tok: Tokenizer) -> None:
    support = tool_support(qwen_tok, None)
    assert support.parser.name == "hermes" and support.template_renders_tools


def test_template_without_tools_gets_them_described(smollm2: Any) -> None:
    tok = smollm2[1].tokenizer  # SmolLM2's template: no tools, no tool role
    support = tool_support(tok, None)
    assert support.parser.name == "hermes" and not support.template_renders_tools
    text = _ours(tok, OPENAI_MESSAGES, TOOLS)
    # The tools, in the system turn (after the client's system prompt).
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a weather bot.\n\n# Tools")
    for t in TOOLS:
        assert json.dumps(t) in system
    # Earlier calls in the format the parser reads, tool results as one user turn.
    turns = text.split("<|im_start|>")[1:]
    roles = [t.split("\n", 1)[0] for t in turns]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    calls = HermesParser().scan(turns[2].removeprefix("assistant\n").split("<|im_end|>")[0],
                                final=True).calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", ARGS), ("get_time", {"tz": "Europe/Paris"})]
    assert turns[3] == ('user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
                        "<tool_response>\n14:05\n</tool_response><|im_end|>\n")
    # Without tools and tool turns, the conversation is the template's alone.
    plain = [{"role": "user", "content": "Hi"}]
    assert _ours(tok, plain, None) == tok.apply_chat_template(plain, add_generation_prompt=True)
