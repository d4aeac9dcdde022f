"""A model's tool calling, decided once when it loads: which parser reads its calls, and
whether its chat template renders tools itself (else prompt.py describes them)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvserve.tool_calling.parsers import ToolParser, get_tool_parser, parser_for_template
from kvserve.tool_calling.prompt import template_renders_tools

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolSupport:
    """How a model calls tools (the server decides it once, when the model has loaded)."""

    parser: ToolParser
    template_renders_tools: bool  # False: tools go into the system message (prompt.py)


def tool_support(tokenizer: Any, parser_name: str | None) -> ToolSupport:
    """--tool-call-parser, else the format the chat template writes, else hermes."""
    template = tokenizer.chat_template
    name = parser_name or parser_for_template(template)
    if name is None:
        name = "hermes"
        if template is not None:
            logger.info("the chat template writes no known tool-call format; tool calls use "
                        "hermes (<tool_call> tags; --tool-call-parser chooses another)")
    renders = template is not None and template_renders_tools(
        lambda messages, tools: tokenizer.apply_chat_template(messages, tools=tools))
    return ToolSupport(get_tool_parser(name), renders)
