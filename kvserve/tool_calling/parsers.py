"""Tool-call parsers: a model's text -> prose and OpenAI tool calls, in the model's own format.

A parser reads the whole text generated so far, `scan(text, final)`, and returns the prose it
is sure of and the calls that are complete. Both only grow as text is appended, which is what
makes streaming exact: `ToolCallStream` sends the growth, and the non-streaming answer is the
same scan with final=True, so the two always agree.

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen2.5, Hermes)
    llama3_json   {"name": "f", "parameters": {...}}; {...}   the whole reply, or after
                  <|python_tag|>                                               (Llama 3.1-3.3)
    mistral       [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]   or
                  [TOOL_CALLS]f[ARGS]{...}                                     (Mistral v3+, v11+)

A call that does not parse (bad JSON, no name, arguments not an object) is prose, never an
error: the client sees what the model wrote. Text still inside an unfinished call, or that
may be the start of a call marker, is held back until it is decided.

Each parser also names its format for the grammar (`CallFormat`), so that tool_choice
"required" or a named function makes the model write exactly what the same parser reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

_DECODER = json.JSONDecoder()
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names (and "." for namespaces)


@dataclass(frozen=True)
class ToolCall:
    """A parsed call (the server gives it an id when it sends it)."""

    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


@dataclass(frozen=True)
class Scan:
    content: str  # the prose decided so far
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class CallFormat:
    """How a parser's calls are written, for the grammar (tool_calling/grammar.py):

        prefix  begin(name) <arguments JSON> end  [separator begin(name) ... end]  suffix
    """

    begin: str  # with {name} where the function name goes
    end: str
    separator: str
    prefix: str = ""
    suffix: str = ""


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """{"name": str, "arguments": {...}} -> a call; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _decode(text: str, pos: int) -> tuple[Any, int] | None:
    """One JSON value starting at text[pos:] (after whitespace) and where it ends, or None."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def held_marker(text: str, marker: str) -> int:
    """The length of the longest end of text that is a proper start of marker: it may become
    the marker as text arrives, so it is not yet prose."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolParser:
    name: ClassVar[str]
    # Markers that only this format writes, for picking a parser from a chat template.
    template_markers: ClassVar[tuple[str, ...]]
    call_format: ClassVar[CallFormat]

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError


class _MarkedBlocks(ToolParser):
    """Calls in blocks that open with a marker (the earliest of `starts` in the text); prose
    around them. A block is closed by `block_end(text, start, body)` (its end index, or None
    while incomplete) and read by `block_calls(start, body)` (None: not a call, so the
    block's text is prose)."""

    starts: ClassVar[tuple[str, ...]]

    def block_end(self, text: str, start: str, body: int) -> int | None:
        raise NotImplementedError

    def block_calls(self, start: str, body: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def scan(self, text: str, final: bool) -> Scan:
        prose: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            found = [(i, m) for m in self.starts if (i := text.find(m, pos)) >= 0]
            if not found:
                tail = text[pos:]
                held = max(held_marker(tail, m) for m in self.starts)
                prose.append(tail if final else tail[:len(tail) - held])
                break
            i, start = min(found, key=lambda f: (f[0], -len(f[1])))
            prose.append(text[pos:i])
            body = i + len(start)
            end = self.block_end(text, start, body)
            if end is None:  # an open block: held back, or prose if the model stopped in it
                if final:
                    prose.append(text[i:])
                break
            got = self.block_calls(start, text[body:end])
            if got is None:
                prose.append(text[i:end])
            else:
                calls.extend(got)
            pos = end
        return Scan("".join(prose), tuple(calls))


class HermesParser(_MarkedBlocks):
    """<tool_call> blocks; also a call object in a ```json fence, which Qwen2.5-Coder writes
    instead of the tags its template asks for (llama.cpp and ollama read it too). A fence
    that holds anything but one {"name", "arguments"} object is prose."""

    name = "hermes"
    template_markers = ("<tool_call>",)
    starts = ("<tool_call>", "```json")
    closes = {"<tool_call>": "</tool_call>", "```json": "```"}
    call_format = CallFormat(begin='<tool_call>\n{{"name": "{name}", "arguments": ',
                             end="}\n</tool_call>", separator="\n")

    def block_end(self, text: str, start: str, body: int) -> int | None:
        close = self.closes[start]
        j = text.find(close, body)
        return None if j < 0 else j + len(close)

    def block_calls(self, start: str, body: str) -> list[ToolCall] | None:
        body = body[:-len(self.closes[start])]
        got = _decode(body, 0)
        if got is None or body[got[1]:].strip():
            return None
        if start != "<tool_call>" and (not isinstance(got[0], dict) or set(got[0]) - {
                "name", "arguments", "parameters"}):
            return None
        call = _call(got[0])
        return None if call is None else [call]


class MistralParser(_MarkedBlocks):
    name = "mistral"
    template_markers = ("[TOOL_CALLS]",)
    starts = ("[TOOL_CALLS]",)
    args_marker = "[ARGS]"
    call_format = CallFormat(begin='{{"name": "{name}", "arguments": ', end="}",
                             separator=", ", prefix="[TOOL_CALLS][", suffix="]")

    def block_end(self, text: str, start: str, body: int) -> int | None:
        got = _decode(text, body)
        if got is not None:
            return got[1]  # [TOOL_CALLS][...]: the array's end
        # [TOOL_CALLS]name[ARGS]{...}: the arguments object's end
        a = text.find(self.args_marker, body)
        if a < 0 or not _NAME.fullmatch(text[body:a].strip()):
            return None
        got = _decode(text, a + len(self.args_marker))
        return None if got is None else got[1]

    def block_calls(self, start: str, body: str) -> list[ToolCall] | None:
        got = _decode(body, 0)
        if got is not None:
            items = got[0] if isinstance(got[0], list) else [got[0]]
            calls = [_call(x) for x in items]
            return None if not calls or None in calls else calls  # type: ignore[return-value]
        name, _, args = body.partition(self.args_marker)
        got = _decode(args, 0)
        call = None if got is None else _call({"name": name.strip(), "arguments": got[0]})
        return None if call is None else [call]


class Llama3JsonParser(ToolParser):
    """Llama 3.1's JSON tool calls: the reply is one or more call objects separated by ';'
    (optionally after <|python_tag|>, which reaches the text only with skip_special_tokens
    false). A reply that starts with prose has no calls, as in vLLM; prose after the calls
    is prose."""

    name = "llama3_json"
    template_markers = ("<|python_tag|>", '"parameters": dictionary of argument name')
    python_tag = "<|python_tag|>"
    call_format = CallFormat(begin='{{"name": "{name}", "parameters": ', end="}",
                             separator="; ")

    def scan(self, text: str, final: bool) -> Scan:
        pos = len(text) - len(text.lstrip())
        if text.startswith(self.python_tag, pos):
            pos += len(self.python_tag)
        elif not final and self.python_tag.startswith(text[pos:]):
            return Scan("", ())  # nothing yet, or what may become the tag
        if not text[pos:].lstrip().startswith("{"):
            return Scan(text, ()) if final or text[pos:].strip() else Scan("", ())
        calls: list[ToolCall] = []
        while True:
            got = _decode(text, pos)
            call = None if got is None else _call(got[0])
            if got is None or call is None:
                # Not (yet) a call: incomplete JSON is held back; once final, it is prose.
                return Scan(text[pos:] if final else "", tuple(calls))
            calls.append(call)
            rest = got[1]
            while rest < len(text) and text[rest].isspace():
                rest += 1
            if rest == len(text):
                return Scan("", tuple(calls))  # a ';' and another call may still follow
            if text[rest] != ";":
                return Scan(text[rest:], tuple(calls))  # prose after the calls
            pos = rest + 1


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}  # type: ignore[misc]


def parser_for_template(template: str | None) -> str | None:
    """The parser whose call markers the chat template writes (None: no known format)."""
    for name, cls in TOOL_PARSERS.items():
        if template and any(m in template for m in cls.template_markers):
            return name
    return None


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[name]()


class ToolCallStream:
    """The growth of a parser's scan as text arrives: content deltas and new calls.

    Trailing whitespace of the prose is held back until prose follows it: a reply that ends
    in calls has its content stripped (as in the non-streaming answer), one without calls
    keeps it."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content_sent = 0
        self.calls_sent = 0

    def update(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        scan = self.parser.scan(text, final)
        content = (final_content(scan) or "") if final else scan.content.rstrip()
        delta = content[self.content_sent:] if len(content) > self.content_sent else ""
        self.content_sent = max(self.content_sent, len(content))
        new = list(scan.calls[self.calls_sent:])
        self.calls_sent = len(scan.calls)
        return delta, new


def final_content(scan: Scan) -> str | None:
    """The message's content: the prose, stripped of trailing whitespace when there are calls
    (None when nothing is left, as OpenAI sends a calls-only message)."""
    if not scan.calls:
        return scan.content
    return scan.content.rstrip() or None
