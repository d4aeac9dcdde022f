"""Tool calling on /v1/chat/completions, in OpenAI's shape.

    tools, tool_choice, parallel_tool_calls  -> ToolUse (check_tools): what the template gets,
                                                the parser, and for "required" or a named
                                                function the grammar (tool_calling/grammar.py)
    the model's text -> message             -> content + tool_calls (tool_message), or, while
                                                streaming, delta.tool_calls (ToolDeltas)

"auto" parses whatever the model writes; text that is not a well-formed call stays content.
A call is streamed whole once it parses (OpenAI splits the arguments over several chunks;
a client's accumulator reads either): a call sent early could not be taken back if its end
turned out malformed, and the streamed answer must equal the non-streamed one.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.tool_calling.grammar import tool_call_tag
from kvserve.tool_calling.parsers import Scan, ToolCall, ToolCallStream, ToolParser, final_content


@dataclass(frozen=True)
class ToolUse:
    tools: list[dict[str, Any]]  # for the chat template, as transformers passes them
    parser: ToolParser | None  # None: tool_choice "none", the text is all content
    structured: StructuredOutputsParams | None  # "required" / a named function
    parallel: bool  # parallel_tool_calls: false allows one call


def check_tools(req: ChatCompletionRequest, parser: ToolParser) -> ToolUse | None:
    """None for a request without tools. 400s name the field: a tool_choice without tools,
    a named function that is not among them, a grammar already asked for."""
    for name in ("functions", "function_call"):
        if getattr(req, name) is not None:
            raise bad_request(f"{name} is OpenAI's deprecated form of tool calling; send "
                              f"{'tools' if name == 'functions' else 'tool_choice'} instead",
                              name)
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice needs tools: send the functions the model may call "
                              "in tools, or leave tool_choice out", "tool_choice")
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"tools must have distinct function names; {dup!r} is given twice",
                          "tools")
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolUse(tools, None, None, parallel)
    if choice is None or choice == "auto":
        return ToolUse(tools, parser, None, parallel)
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request("tool_choice required or a named function already constrains the "
                          "output; send it without response_format", "tool_choice")
    if choice == "required":
        chosen = req.tools
    else:
        chosen = [t for t in req.tools if t.function.name == choice.function.name]
        if not chosen:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, "
                              f"which is not in tools (those are {names})", "tool_choice")
    functions = [{"name": t.function.name, "parameters": t.function.parameters}
                 for t in chosen]
    tag = tool_call_tag(parser.call_format, functions,
                        parallel=parallel and choice == "required")
    return ToolUse(tools, parser, StructuredOutputsParams(structural_tag=tag), parallel)


def _wire(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def _allowed(scan: Scan, parallel: bool) -> Scan:
    # parallel_tool_calls false: one call; the ones after it are dropped, as OpenAI sends one.
    return scan if parallel or len(scan.calls) <= 1 else Scan(scan.content, scan.calls[:1])


def tool_message(text: str, finish_reason: str | None, use: ToolUse | None
                 ) -> tuple[dict[str, Any], str | None]:
    """The assistant message for a whole reply, and its finish_reason ("tool_calls" when it
    stopped after calling)."""
    if use is None or use.parser is None:
        return {"role": "assistant", "content": text, "refusal": None}, finish_reason
    scan = _allowed(use.parser.scan(text, final=True), use.parallel)
    msg: dict[str, Any] = {"role": "assistant", "content": final_content(scan),
                           "refusal": None}
    if not scan.calls:
        return msg, finish_reason
    msg["tool_calls"] = [_wire(c) for c in scan.calls]
    return msg, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolDeltas:
    """One choice's stream: the text so far -> the content delta and delta.tool_calls."""

    def __init__(self, parser: ToolParser, parallel: bool) -> None:
        self.stream = ToolCallStream(parser)
        self.parallel = parallel  # false: the calls after the first are dropped
        self.num_calls = 0

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content, calls = self.stream.update(text, final)
        if not self.parallel:
            calls = calls[:max(0, 1 - self.num_calls)]
        wired = [_wire(c, self.num_calls + i) for i, c in enumerate(calls)]
        self.num_calls += len(wired)
        return content, wired

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.num_calls and reason == "stop" else reason
