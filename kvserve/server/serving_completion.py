"""/v1/completions: prompts as text, token ids or lists of either; echo, logprobs, n."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import bad_request
from kvserve.server.protocol import MAX_CHOICES, MAX_PROMPTS, CompletionRequest
from kvserve.server.serving import (
    EngineStream,
    PrimedStream,
    ServingContext,
    Streamer,
    add_all,
    build_params,
    check_common,
    collect,
    completion_logprobs,
    hold_back,
    merged,
    release_all,
    sse,
    stream_error,
    usage,
)

_COMPLETION_FIELDS = set(CompletionRequest.model_fields)


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request("prompt must not be empty: a string, a list of strings, a list of "
                          "token ids, or a list of lists of token ids", "prompt")
    if isinstance(p[0], int):
        return [p]  # type: ignore[list-item]
    if len(p) > MAX_PROMPTS:
        raise bad_request(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(p)}",
                          "prompt")
    return list(p)  # type: ignore[arg-type]


async def create_completion(ctx: ServingContext, req: CompletionRequest, request_id: str
                            ) -> dict[str, Any] | EngineStream:
    check_common(ctx, req)
    if req.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request(f"best_of must equal n ({req.n}) or be omitted, got {req.best_of}",
                          "best_of")
    prompts = _prompts(req)
    n = req.n if req.n is not None else 1
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(f"prompts x n may be at most {MAX_CHOICES}, got "
                          f"{len(prompts)} x {n}", "n")
    params = build_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                          prompt_logprobs=(req.logprobs if req.echo and req.logprobs is not None
                                           else req.prompt_logprobs),
                          fields=_COMPLETION_FIELDS)
    tok = ctx.engine.tokenizer
    engine_prompts: list[Any] = []
    for p in prompts:
        if isinstance(p, str) and not req.add_special_tokens:
            ids = await ctx.engine.run_in_pool(tok.encode, p, False)
            engine_prompts.append({"prompt": p, "prompt_token_ids": ids})
        else:
            engine_prompts.append(p)
    base = uuid.uuid4().hex
    streams = await add_all(ctx, engine_prompts, params, req.priority, base,
                            _COMPLETION_FIELDS)
    created = int(time.time())
    rid = f"cmpl-{request_id}"
    head = {"id": rid, "object": "text_completion", "created": created,
            "model": ctx.model_name}
    if req.stream:
        return EngineStream(_stream_completion(ctx, req, streams, params, head, n), streams)
    try:
        finals = await collect(streams)
    finally:
        release_all(ctx.engine, streams)
    choices = []
    n_prompt = n_gen = n_cached = 0
    for i, out in enumerate(finals):
        n_prompt += len(out.prompt_token_ids)
        n_cached += out.num_cached_tokens
        prompt_text = await _prompt_text(ctx, out) if req.echo else ""
        for c in out.outputs:
            n_gen += len(c.token_ids)
            lp = None
            if req.logprobs is not None:
                lp = _completion_choice_logprobs(req, out, c, prompt_text,
                                                 ctx.engine.tokenizer)
            choices.append({"index": i * n + c.index, "text": prompt_text + c.text,
                            "logprobs": lp, "finish_reason": c.finish_reason})
    return {**head, "choices": choices, "usage": usage(n_prompt, n_gen, n_cached),
            "system_fingerprint": None}


async def _prompt_text(ctx: ServingContext, out: RequestOutput) -> str:
    if out.prompt is not None:
        return out.prompt
    return await ctx.engine.run_in_pool(ctx.engine.tokenizer.decode, out.prompt_token_ids)


def _completion_choice_logprobs(req: CompletionRequest, out: RequestOutput,
                                c: CompletionOutput, prompt_text: str, tokenizer: Any
                                ) -> dict[str, Any]:
    k = req.logprobs or 0
    gen = completion_logprobs(c.token_ids, list(c.logprobs or []), k, len(prompt_text),
                              tokenizer)
    if not req.echo:
        return gen
    prompt_lp = _prompt_logprobs(out, k, tokenizer)
    return {key: prompt_lp[key] + gen[key] for key in gen}


def _prompt_logprobs(out: RequestOutput, k: int, tokenizer: Any) -> dict[str, Any]:
    """The echoed prompt's logprobs in the completions format (offsets from 0)."""
    plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    prompt_lp = completion_logprobs(out.prompt_token_ids, plp, k, 0, tokenizer)
    if plp and plp[0] is None and out.prompt_token_ids:
        # The first prompt token has no logprob (nothing precedes it) but still has text.
        first = tokenizer.decode(out.prompt_token_ids[:1], skip_special_tokens=False)
        prompt_lp["tokens"][0] = first
        prompt_lp["text_offset"] = [0] + [o + len(first) for o in prompt_lp["text_offset"][1:]]
    return prompt_lp


async def _stream_completion(ctx: ServingContext, req: CompletionRequest,
                             streams: list[PrimedStream], params: SamplingParams,
                             head: dict[str, Any], n: int) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    st = Streamer(hold_back(params))
    n_prompt: dict[int, int] = {}
    n_gen: dict[int, int] = {}
    n_cached: dict[int, int] = {}
    echoed: set[int] = set()
    try:
        async for i, out in merged(streams):
            n_prompt[i] = len(out.prompt_token_ids)
            n_cached[i] = out.num_cached_tokens
            for c in out.outputs:
                idx = i * n + c.index
                text, t0, t1, done = st.delta(idx, c)
                prompt_text = ""
                if req.echo and idx not in echoed:
                    echoed.add(idx)
                    prompt_text = await _prompt_text(ctx, out)
                if not prompt_text and not text and t0 == t1 and not done:
                    continue
                lp = None
                if req.logprobs is not None:
                    # text_offset counts from the start of the choice's text, across chunks.
                    cur = st.cursors[idx]
                    plp = None
                    if prompt_text:
                        # The echoed prompt's logprobs lead, as in the non-streamed answer.
                        plp = _prompt_logprobs(out, req.logprobs, ctx.engine.tokenizer)
                        cur.sent_offset = len(prompt_text)
                    lp = completion_logprobs(c.token_ids[t0:t1], list(c.logprobs or [])[t0:t1],
                                             req.logprobs, cur.sent_offset,
                                             ctx.engine.tokenizer)
                    cur.sent_offset += sum(len(t) for t in lp["tokens"])
                    if plp is not None:
                        lp = {key: plp[key] + lp[key] for key in lp}
                text = prompt_text + text
                choice = {"index": idx, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason if done else None}
                chunk: dict[str, Any] = {**head, "choices": [choice]}
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
            n_gen[i] = sum(len(c.token_ids) for c in out.outputs)
        if include_usage:
            yield sse({**head, "choices": [],
                        "usage": usage(sum(n_prompt.values()), sum(n_gen.values()),
                                       sum(n_cached.values()))})
    except Exception as e:  # engine died or shut down mid-stream: a clean error event
        yield stream_error(e).sse()
    yield "data: [DONE]\n\n"


