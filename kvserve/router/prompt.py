"""A request body -> the prompt's token ids, as `kvserve serve` builds them -> block hashes.

The ids must be the replica's own, token for token, or no block hash would ever match
(tests/e2e/test_router.py holds them to a replica's /tokenize):

    /v1/completions       prompt: text (encoded with add_special_tokens, default true) or
                          token ids; a list of prompts is routed by its first
    /v1/chat/completions  messages through the model's chat template, as
                          serving_chat.render_chat does: roles mapped (developer -> system),
                          list content joined by newlines, tools as the server's tool
                          support renders them (from the body as sent: the server renders
                          its validated copy, so a tool written with nulls or unknown keys
                          renders differently from there on, which costs only the match
                          past that point); continue_final_message is rendered without
                          the generation prompt (the server cuts later, so the head matches)

Anything the router cannot read gives None: the request is routed by load alone, and the
replica answers it (with its own 400, if it is bad).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.kv.block_pool import hash_full_blocks
from kvserve.loader import Tokenizer
from kvserve.tool_calling.prompt import prompt_messages
from kvserve.tool_calling.support import ToolSupport

# OpenAI's roles -> what chat templates know (as serving_chat).
_TEMPLATE_ROLES = {"developer": "system"}
_MESSAGE_KEYS = ("name", "tool_call_id")


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


def _conversation(messages: list[Any]) -> list[dict[str, Any]] | None:
    conv = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
                return None
            content = "\n".join(p["text"] for p in content)
        msg: dict[str, Any] = {"role": _TEMPLATE_ROLES.get(m["role"], m["role"]),
                               "content": content or ""}
        calls = m.get("tool_calls")
        if content is None and calls:
            msg["content"] = None
        for key in _MESSAGE_KEYS:
            if m.get(key) is not None:
                msg[key] = m[key]
        if calls:
            msg["tool_calls"] = calls
        conv.append(msg)
    return conv


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
        conv = _conversation(messages)
        if conv is None:
            return None
        extra: dict[str, Any] = {}
        if tools is not None:
            request_tools = body.get("tools") or None
            conv, extra = prompt_messages(conv, request_tools, tools.template_renders_tools,
                                          tools.parser.call_format)
        add_generation = (body.get("add_generation_prompt", True) is True
                          and body.get("continue_final_message") is not True)
        ids = tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation,
                                            tokenize=True, **extra)
        return ids if isinstance(ids, list) else None
    except Exception:  # noqa: BLE001 - unreadable for routing; the replica will judge it
        return None
