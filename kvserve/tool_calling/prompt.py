"""Tools and tool-call turns in the prompt.

The chat template renders them when it knows how (Qwen2.5, Llama 3.1, Mistral, ... take
`tools=` and assistant `tool_calls` as transformers passes them). OpenAI sends a call's
arguments as a JSON string; templates write them with `tojson`, so they get the object
(as vLLM does), not a string quoted twice.

A template that ignores tools (SmolLM2's, say) would leave the model unaware of them. Then,
as llama.cpp does for such templates, the tools are described in the system message in the
parser's own format, earlier calls are written out as that format's text, and tool results
go back as user turns wrapped in <tool_response> (Hermes' convention).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvserve.tool_calling.parsers import CallFormat

_PROBE = "kvserve_probe_function"


def prompt_messages(conv: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    template_renders: bool, fmt: CallFormat
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """OpenAI messages (and tools) -> the messages and keyword arguments for the chat
    template: tools= for a template that renders them, else described in the messages."""
    if template_renders:
        return template_messages(conv), ({"tools": tools} if tools else {})
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in conv):
        return describe_tools(conv, tools or [], fmt), {}
    return conv, {}


def template_messages(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> what templates expect: a call's arguments as an object."""
    out = []
    for m in conv:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_template_call(c) for c in calls]}
        out.append(m)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # not JSON: the template gets the text the client sent
    return {**call, "function": fn}


def template_renders_tools(render: Callable[..., str]) -> bool:
    """Whether a template writes the tools it is given: render a probe with one tool and
    look for its name (render(messages, tools=...) -> text)."""
    tool = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                             "parameters": {"type": "object"}}}
    try:
        return _PROBE in render([{"role": "user", "content": "hi"}], tools=[tool])
    except ValueError:
        return False


def describe_tools(conv: list[dict[str, Any]], tools: list[dict[str, Any]], fmt: CallFormat
                   ) -> list[dict[str, Any]]:
    """The conversation for a template that ignores tools: the tools in the system message,
    calls as text, tool results as user turns."""
    example = (fmt.prefix + fmt.begin.format(name="<function-name>")
               + "<arguments-json-object>" + fmt.end + fmt.suffix)
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    preamble = ("# Tools\n\nYou may call one or more functions to help with the user's "
                "request. The functions are described in JSON Schema within <tools></tools> "
                f"tags:\n<tools>\n{listing}\n</tools>\n\nTo call a function, reply with:\n"
                f"{example}")
    out: list[dict[str, Any]] = []
    if conv and conv[0]["role"] == "system":
        out.append({**conv[0], "content": f"{conv[0].get('content') or ''}\n\n{preamble}"})
        conv = conv[1:]
    else:
        out.append({"role": "system", "content": preamble})
    for m in conv:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [fmt.begin.format(name=json.dumps(c["function"]["name"])[1:-1])
                     + _arguments_text(c["function"].get("arguments")) + fmt.end
                     for c in m["tool_calls"]]
            text = fmt.prefix + fmt.separator.join(calls) + fmt.suffix
            body = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{body}\n{text}" if body else text})
        elif m["role"] == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{result}"}
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def _arguments_text(args: Any) -> str:
    if isinstance(args, str):
        return args
    return json.dumps(args if args is not None else {}, ensure_ascii=False)
