"""A request body -> the prompt's token ids, as `kvserve serve` builds them -> block hashes.

The ids must be the replica's own, token for token, or no block hash would ever match
(tests/e2e/test_router.py holds them to a replica's /tokenize):

    /v1/completions       prompt: text (encoded with add_special_tokens, default true) or
                          token ids; a list of prompts is routed by its first
    /v1/chat/completions  messages and tools read with the server's own models
                          (protocol.ChatMessage, Tool) and turned into the template's
                          conversation by its own serving_chat.conversation, then through
                          the model's chat template as serving_chat.render_chat does;
                          continue_final_message is rendered without the generation prompt
                          (the server cuts later, so the head matches)

Anything the router cannot read gives None: the request is routed by load alone, and the
replica answers it (with its own 400, if it is bad).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import TypeAdapter

from kvserve.kv.block_pool import hash_full_blocks
from kvserve.loader import Tokenizer
from kvserve.server.protocol import ChatMessage, Tool
from kvserve.server.serving_chat import conversation
from kvserve.tool_calling.prompt import prompt_messages
from kvserve.tool_calling.support import ToolSupport

# The server's own models of the body's parts: the router reads them as the server does.
_MESSAGES = TypeAdapter(list[ChatMessage])
_TOOLS = TypeAdapter(list[Tool])


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The engine's chained hash values of the prompt's full blocks (the partial tail block
    is never hashed, by the engine either)."""
    return [h.hash_value for h in hash_full_blocks(token_ids, block_size)]


def _first_prompt(prompt: Any) -> str | list[int] | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        return _first_prompt(prompt[0]) if isinstance(prompt[0], (str, list)) else None
    return None


def prompt_token_ids(tokenizer: Tokenizer, tools: ToolSupport | None, route: str,
                     body: Any) -> list[int] | None:
    """The prompt's token ids for a /v1/completions or /v1/chat/completions body, or None."""
    if not isinstance(body, dict):
        return None
    try:
        if route == "/v1/completions":
            prompt = _first_prompt(body.get("prompt"))
            if isinstance(prompt, str):
                return tokenizer.encode(prompt, body.get("add_special_tokens", True) is True)
            return prompt
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        conv = conversation(_MESSAGES.validate_python(messages))
        extra: dict[str, Any] = {}
        if tools is not None:
            request_tools = [t.model_dump(exclude_none=True)
                             for t in _TOOLS.validate_python(body["tools"])] \
                if body.get("tools") else None
            conv, extra = prompt_messages(conv, request_tools, tools.template_renders_tools,
                                          tools.parser.call_format)
        add_generation = (body.get("add_generation_prompt", True) is True
                          and body.get("continue_final_message") is not True)
        ids = tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation,
                                            tokenize=True, **extra)
        return ids if isinstance(ids, list) else None
    except Exception:  # noqa: BLE001 - unreadable for routing; the replica will judge it
        return None
