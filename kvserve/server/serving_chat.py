"""/v1/chat/completions: messages through the model's chat template; the role streams
first; logprobs in the chat format; response_format json_object / json_schema.

continue_final_message renders the conversation with a sentinel after the final message's
content and cuts the text there, so the template's own closing of that message is dropped
wherever the template puts it, and however it rewrites (trims) the content:

    <|im_start|>assistant\nThe answer is SENTINEL<|im_end|>\n
    |============ prompt =============|  cut
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2

from kvserve.outputs import RequestOutput
from kvserve.sampling_params import ParamError, SamplingParams
from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage
from kvserve.server.serving import (
    EngineStream,
    PrimedStream,
    ServingContext,
    Streamer,
    add_all,
    build_params,
    chat_logprobs,
    check_common,
    collect,
    hold_back,
    release_all,
    sse,
    stream_error,
    usage,
)
from kvserve.server.serving_tools import ToolDeltas, ToolUse, check_tools, tool_message
from kvserve.tool_calling.prompt import prompt_messages

_CHAT_FIELDS = set(ChatCompletionRequest.model_fields)


_CHAT_RENAMES = {"prompt": "messages"}
# OpenAI's roles -> what chat templates know.
_TEMPLATE_ROLES = {"developer": "system"}


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Validated messages as chat templates take them (the router renders with it too)."""
    conv = []
    for m in messages:
        if isinstance(m.content, list):
            content = "\n".join(p.text for p in m.content)
        else:
            content = m.content or ""
        msg: dict[str, Any] = {"role": _TEMPLATE_ROLES.get(m.role, m.role), "content": content}
        if m.content is None and m.tool_calls:
            msg["content"] = None  # a calls-only turn: templates test `message.content`
        for key in ("name", "tool_call_id"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        conv.append(msg)
    return conv


async def render_chat(ctx: ServingContext, messages: list[ChatMessage],
                      add_generation_prompt: bool, continue_final: bool = False,
                      tools: list[dict[str, Any]] | None = None) -> list[int]:
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            raise bad_request(f"messages[{i}].content is required for role {m.role}",
                              f"messages[{i}].content")
        if m.tool_calls and m.role != "assistant":
            raise bad_request(f"messages[{i}].tool_calls is for assistant messages, not role "
                              f"{m.role}", f"messages[{i}].tool_calls")
    if continue_final:
        if add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both "
                              "be true: set add_generation_prompt to false to continue the "
                              "final message", "continue_final_message")
        if messages[-1].role != "assistant":
            raise bad_request(f"continue_final_message needs an assistant message last, got "
                              f"role {messages[-1].role}", "continue_final_message")
    tok = ctx.engine.tokenizer
    conv = conversation(messages)
    extra: dict[str, Any] = {}
    if ctx.tools is not None:
        conv, extra = prompt_messages(conv, tools, ctx.tools.template_renders_tools,
                                      ctx.tools.parser.call_format)

    def render() -> list[int]:
        if continue_final:
            return tok.encode(_continue_final_text(tok, conv, extra), add_special_tokens=False)
        ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                      tokenize=True, **extra)
        assert isinstance(ids, list)
        return ids

    try:
        return await ctx.engine.run_in_pool(render)
    except (ValueError, jinja2.TemplateError) as e:
        # Template errors carry the template's own message (e.g. roles must alternate).
        raise bad_request(f"the chat template rejected the messages: {str(e)[:300]}",
                          "messages") from None


def _continue_final_text(tok: Any, conv: list[dict[str, Any]],
                         extra: dict[str, Any] | None = None) -> str:
    """The rendered conversation up to the end of the final message's content."""
    sentinel = f"KVSERVE_CONTINUE_{secrets.token_hex(8)}"
    marked = [*conv[:-1], {**conv[-1], "content": (conv[-1]["content"] or "") + sentinel}]
    text = tok.apply_chat_template(marked, add_generation_prompt=False, **(extra or {}))
    assert isinstance(text, str)
    cut = text.find(sentinel)
    if cut < 0 or text.find(sentinel, cut + 1) >= 0:
        raise ParamError("continue_final_message", "continue_final_message: the chat template "
                         "does not render the final message's content once, as written, so "
                         "there is no place to continue it from")
    return text[:cut]


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 request_id: str) -> dict[str, Any] | EngineStream:
    check_common(ctx, req)
    use = check_tools(req, ctx.tools.parser) if ctx.tools is not None else None
    if use is None and req.tools:
        raise bad_request("tool calling is not set up on this server", "tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    # Errors about the limit name the field the client sent (OpenAI's newer name by default).
    use_new = req.max_completion_tokens is not None or req.max_tokens is None
    max_tokens = req.max_completion_tokens if use_new else req.max_tokens
    renames = {**_CHAT_RENAMES, "max_tokens": "max_completion_tokens"} if use_new \
        else _CHAT_RENAMES
    params = build_params(req, max_tokens=max_tokens,
                          logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                          prompt_logprobs=req.prompt_logprobs, fields=_CHAT_FIELDS,
                          renames=renames, structured=use.structured if use else None)
    ids = await render_chat(ctx, req.messages, req.add_generation_prompt,
                            req.continue_final_message, use.tools if use else None)
    streams = await add_all(ctx, [{"prompt_token_ids": ids}], params, req.priority,
                            uuid.uuid4().hex, _CHAT_FIELDS, renames)
    head = {"id": f"chatcmpl-{request_id}", "created": int(time.time()),
            "model": ctx.model_name}
    if req.stream:
        return EngineStream(_stream_chat(ctx, req, streams[0], params, head, use), streams)
    try:
        (out,) = await collect(streams)
    finally:
        release_all(ctx.engine, streams)
    choices = []
    for c in out.outputs:
        lp = (chat_logprobs(c.token_ids, list(c.logprobs or []), req.top_logprobs or 0,
                            ctx.engine.tokenizer) if req.logprobs else None)
        message, finish_reason = tool_message(c.text, c.finish_reason, use)
        choices.append({"index": c.index, "message": message, "logprobs": lp,
                        "finish_reason": finish_reason})
    n_gen = sum(len(c.token_ids) for c in out.outputs)
    return {**head, "object": "chat.completion", "choices": choices,
            "usage": usage(len(out.prompt_token_ids), n_gen, out.num_cached_tokens),
            "system_fingerprint": None}


async def _stream_chat(ctx: ServingContext, req: ChatCompletionRequest, stream: PrimedStream,
                       params: SamplingParams, head: dict[str, Any], use: ToolUse | None
                       ) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    head = {**head, "object": "chat.completion.chunk"}
    st = Streamer(hold_back(params))
    parse = use is not None and use.parser is not None
    tool_deltas: dict[int, ToolDeltas] = {}

    def chunk(choice: dict[str, Any]) -> str:
        obj: dict[str, Any] = {**head, "choices": [choice]}
        if include_usage:
            obj["usage"] = None
        return sse(obj)

    last: RequestOutput | None = None
    try:
        for i in range(params.n):  # the role comes first, one chunk per choice
            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None})
        async for out in stream:
            last = out
            for c in out.outputs:
                text, t0, t1, done = st.delta(c.index, c)
                if not text and t0 == t1 and not done:
                    continue
                lp = None
                if req.logprobs:
                    lp = chat_logprobs(c.token_ids[t0:t1], list(c.logprobs or [])[t0:t1],
                                       req.top_logprobs or 0, ctx.engine.tokenizer)
                finish = c.finish_reason if done else None
                delta: dict[str, Any] = {"content": text} if text or not done else {}
                if parse:
                    assert use is not None and use.parser is not None
                    td = tool_deltas.setdefault(c.index, ToolDeltas(use.parser, use.parallel))
                    text, calls = td.update(c.text[:st.cursors[c.index].sent_chars], done)
                    delta = {"content": text} if text else {}
                    if calls:
                        delta["tool_calls"] = calls
                    finish = td.finish_reason(finish)
                    if not delta and lp is None and not done:
                        continue
                yield chunk({"index": c.index, "delta": delta, "logprobs": lp,
                             "finish_reason": finish})
        if include_usage and last is not None:
            n_gen = sum(len(c.token_ids) for c in last.outputs)
            yield sse({**head, "choices": [],
                        "usage": usage(len(last.prompt_token_ids), n_gen,
                                       last.num_cached_tokens)})
    except Exception as e:
        yield stream_error(e).sse()
    yield "data: [DONE]\n\n"

