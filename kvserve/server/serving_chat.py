"""/v1/chat/completions: messages through the model's chat template; the role streams
first; logprobs in the chat format; response_format json_object / json_schema."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2

from kvserve.async_engine import RequestStream
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage
from kvserve.server.serving import (
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

_CHAT_FIELDS = set(ChatCompletionRequest.model_fields)


_CHAT_RENAMES = {"prompt": "messages", "max_tokens": "max_completion_tokens"}


def _conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    conv = []
    for m in messages:
        if isinstance(m.content, list):
            content = "\n".join(p.text for p in m.content)
        else:
            content = m.content or ""
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        conv.append(msg)
    return conv


async def render_chat(ctx: ServingContext, messages: list[ChatMessage],
                      add_generation_prompt: bool, continue_final: bool = False) -> list[int]:
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            raise bad_request(f"messages[{i}].content is required for role {m.role}",
                              f"messages[{i}].content")
    tok = ctx.engine.tokenizer
    conv = _conversation(messages)

    def render() -> list[int]:
        if continue_final:
            text = tok.apply_chat_template(conv, add_generation_prompt=False)
            assert isinstance(text, str)
            # Continue the final (assistant) message: drop what the template closes it with.
            last = conv[-1]["content"]
            cut = text.rfind(last) + len(last) if last else len(text)
            return tok.encode(text[:cut], add_special_tokens=False)
        ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                      tokenize=True)
        assert isinstance(ids, list)
        return ids

    try:
        return await ctx.engine.run_in_pool(render)
    except (ValueError, jinja2.TemplateError) as e:
        # Template errors carry the template's own message (e.g. roles must alternate).
        raise bad_request(f"the chat template rejected the messages: {str(e)[:300]}",
                          "messages") from None


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 request_id: str) -> dict[str, Any] | AsyncIterator[str]:
    check_common(ctx, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                  else req.max_tokens)
    params = build_params(req, max_tokens=max_tokens,
                          logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                          prompt_logprobs=req.prompt_logprobs, fields=_CHAT_FIELDS,
                          renames=_CHAT_RENAMES)
    ids = await render_chat(ctx, req.messages, req.add_generation_prompt,
                            req.continue_final_message)
    streams = await add_all(ctx, [{"prompt_token_ids": ids}], params, req.priority,
                            uuid.uuid4().hex, _CHAT_FIELDS, _CHAT_RENAMES)
    head = {"id": f"chatcmpl-{request_id}", "created": int(time.time()),
            "model": ctx.model_name}
    if req.stream:
        return _stream_chat(ctx, req, streams[0], params, head)
    try:
        (out,) = await collect(streams)
    finally:
        release_all(ctx, streams)
    choices = []
    for c in out.outputs:
        lp = (chat_logprobs(c.token_ids, list(c.logprobs or []), req.top_logprobs or 0)
              if req.logprobs else None)
        choices.append({"index": c.index,
                        "message": {"role": "assistant", "content": c.text, "refusal": None},
                        "logprobs": lp, "finish_reason": c.finish_reason})
    n_gen = sum(len(c.token_ids) for c in out.outputs)
    return {**head, "object": "chat.completion", "choices": choices,
            "usage": usage(len(out.prompt_token_ids), n_gen), "system_fingerprint": None}


async def _stream_chat(ctx: ServingContext, req: ChatCompletionRequest, stream: RequestStream,
                       params: SamplingParams, head: dict[str, Any]) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    head = {**head, "object": "chat.completion.chunk"}
    st = Streamer(hold_back(params))

    def chunk(choice: dict[str, Any]) -> str:
        obj: dict[str, Any] = {**head, "choices": [choice]}
        if include_usage:
            obj["usage"] = None
        return sse(obj)

    n = params.n
    for i in range(n):  # the role comes first, one chunk per choice
        yield chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None})
    last: RequestOutput | None = None
    try:
        async for out in stream:
            last = out
            for c in out.outputs:
                text, t0, t1, done = st.delta(c.index, c)
                if not text and t0 == t1 and not done:
                    continue
                lp = None
                if req.logprobs:
                    lp = chat_logprobs(c.token_ids[t0:t1], list(c.logprobs or [])[t0:t1],
                                       req.top_logprobs or 0)
                delta = {"content": text} if text or not done else {}
                yield chunk({"index": c.index, "delta": delta, "logprobs": lp,
                             "finish_reason": c.finish_reason if done else None})
        if include_usage and last is not None:
            n_gen = sum(len(c.token_ids) for c in last.outputs)
            yield sse({**head, "choices": [],
                        "usage": usage(len(last.prompt_token_ids), n_gen)})
    except Exception as e:
        yield stream_error(e).sse()
    finally:
        ctx.engine.release(stream)
    yield "data: [DONE]\n\n"

