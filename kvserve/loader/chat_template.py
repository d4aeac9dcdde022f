"""Chat templates rendered the way HF transformers' apply_chat_template renders them.

Templates come from model files, so they are untrusted code: they run in jinja2's
ImmutableSandboxedEnvironment with the same options and helpers as transformers
(trim_blocks, lstrip_blocks, loopcontrols, a `{% generation %}` block, `raise_exception`,
`strftime_now`, and a `tojson` that does not HTML-escape), so a prompt renders byte for byte as
it does there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant spans for training masks in
    transformers; for inference it renders its body unchanged, but templates using it must
    still parse."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes <, >, & and ', which would change prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _content_to_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise ValueError(f"messages[{index}].content[{j}] must be an object like "
                                 f"{{'type': 'text', 'text': '...'}}, got {type(part).__name__}")
            if part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}].content[{j}] must be a text part "
                                 f"{{'type': 'text', 'text': str}}; only text is supported, "
                                 f"got type {part.get('type')!r}")
            texts.append(part["text"])
        # Same joiner as vLLM's "string" content format: parts read as separate lines.
        return "\n".join(texts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts, "
                     f"got {type(content).__name__}")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate chat messages and turn list-of-parts content into one string.

    Keys whose value is None are dropped (as transformers does), so a template testing
    `message.content is defined` sees the same thing it sees there.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} "
                         f"objects, got {messages!r:.100}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', "
                             f"got {type(message).__name__}")
        msg = {k: v for k, v in message.items() if v is not None}
        if not isinstance(msg.get("role"), str):
            raise ValueError(f"messages[{i}].role must be a string, got {msg.get('role')!r:.100}")
        if "content" in msg:
            msg["content"] = _content_to_text(msg["content"], i)
        elif not msg.get("tool_calls"):
            # Only an assistant turn that calls tools may come without content.
            raise ValueError(f"messages[{i}] (role {msg['role']!r}) has no content")
        out.append(msg)
    return out


def render_chat_template(source: str, messages: Any, add_generation_prompt: bool,
                         special_tokens: Mapping[str, str], **kwargs: Any) -> str:
    """Render like transformers: template variables are messages, tools, documents,
    add_generation_prompt, the named special tokens (bos_token, eos_token, ...) and kwargs,
    kwargs winning over special tokens."""
    chat = normalize_messages(messages)
    variables: dict[str, Any] = {"tools": None, "documents": None, **special_tokens, **kwargs}
    try:
        return compile_template(source).render(messages=chat,
                                               add_generation_prompt=add_generation_prompt,
                                               **variables)
    except jinja2.exceptions.TemplateError as e:
        # raise_exception() in a template reports a bad conversation (e.g. roles not
        # alternating); a bad request must surface as a ValueError, never crash the caller.
        raise ValueError(f"chat template error: {e}") from e
