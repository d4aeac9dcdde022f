"""What /v1/completions and /v1/chat/completions share: request -> SamplingParams -> engine
requests -> cumulative outputs -> OpenAI JSON or SSE deltas (serving_completion.py and
serving_chat.py hold the two endpoints).

Every engine request of an HTTP request is added (and validated) before the response starts,
so bad input is always an HTTP 400, never an error in the middle of a stream. A streamed
response starts (status, headers, first byte) only once one of its requests has its first
output or an error (EngineStream.first_event), not while they wait in the queue: an error
before then (a drain, a dead engine) is an HTTP 503, and a proxy in front, having received
nothing yet, can still retry the request on another replica (deploy/nginx). Streaming
deltas diff the engine's cumulative outputs against what each choice has already sent:

    output text  |==== sent ====|== new, sendable ==|== held back ==|
                 0          sent_chars     len(text) - hold        len(text)

While a choice is unfinished the last max(len(stop)) - 1 characters are held back, because
a stop string that completes later cuts the text there (the engine's cumulative text
includes what its detokenizer holds back).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvserve.async_engine import AsyncEngine
from kvserve.loader.tokenizer import Tokenizer
from kvserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from kvserve.request_stream import EngineDeadError, EngineShuttingDown, RequestStream
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.scheduler import QueueFullError
from kvserve.server.errors import APIError, bad_request, from_value_error
from kvserve.server.protocol import _SamplingFields
from kvserve.tool_calling.support import ToolSupport


@dataclass
class ServingContext:
    engine: AsyncEngine
    model_name: str
    max_model_len: int
    tenant: str | None = None  # the API key's (gate.tenant_of); None without keys
    tier: str | None = None  # the API key's service tier (--api-key-file); None: default
    tools: ToolSupport | None = None  # the parser and template facts (serving_tools.py)


class PrimedStream:
    """A RequestStream whose first item (an output or an error) can be awaited without
    taking it (prime); iterating it then yields that item first. Outputs are cumulative, so
    an output held here is never stale: a later one simply follows it."""

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream
        self.primed = False
        self.error: BaseException | None = None
        self._first: RequestOutput | None = None

    async def prime(self) -> None:
        """Waits for the first item. Safe to cancel: it takes an item only when it also
        keeps it (no await between the two)."""
        if self.primed:
            return
        try:
            self._first = await self.stream.__anext__()
        except StopAsyncIteration:
            pass
        except Exception as e:  # noqa: BLE001 - kept, raised to the reader
            self.error = e
        self.primed = True

    def __aiter__(self) -> PrimedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            out, self._first = self._first, None
            return out
        if self.error is not None:
            err, self.error = self.error, None
            raise err
        return await self.stream.__anext__()


@dataclass
class EngineStream:
    """A streamed answer: the SSE body and the engine requests behind it. The HTTP response
    that sends the body owns the streams and releases them when it ends (sse.SSEResponse)."""

    body: AsyncIterator[str]
    streams: list[PrimedStream]

    async def first_event(self, engine: AsyncEngine) -> None:
        """Returns once one of the streams has its first output, so that the response starts
        only then. Raises the HTTP error (503) of an error that comes first. On either error
        or cancellation (the client left) the streams are released, since no response will
        own them."""
        try:
            waits = [asyncio.ensure_future(s.prime()) for s in self.streams]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
                # Done before the body reads the streams: one reader per stream at a time.
                await asyncio.gather(*waits, return_exceptions=True)
            error = next((s.error for s in self.streams if s.error is not None), None)
            if error is not None:
                raise stream_error(error)
        except BaseException:
            release_all(engine, self.streams)
            raise


def engine_error(err: BaseException, fields: set[str],
                 renames: dict[str, str] | None = None) -> APIError:
    """Engine-side failures -> HTTP errors."""
    if isinstance(err, QueueFullError):
        if err.tier is not None:  # the tier's own bound: this client is over its share
            return APIError(429, str(err), code="tier_queue_full",
                            headers={"Retry-After": "1"})
        return APIError(503, str(err), code="queue_full",
                        headers={"Retry-After": "1"})
    if isinstance(err, EngineShuttingDown):
        return APIError(503, "the server is shutting down", code="shutting_down",
                        headers={"Retry-After": "5"})
    if isinstance(err, EngineDeadError):
        return APIError(503, "the engine has stopped; the server cannot serve requests",
                        code="engine_dead")
    if isinstance(err, ValueError):
        return from_value_error(err, fields, renames)
    return APIError(500, "internal server error")


def check_model(ctx: ServingContext, model: str | None) -> None:
    """404 for a model this server does not serve; None means the served one."""
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"the model `{model}` does not exist; this server serves "
                            f"`{ctx.model_name}`", param="model", code="model_not_found")


def check_common(ctx: ServingContext, req: _SamplingFields) -> None:
    check_model(ctx, req.model)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          "stream_options")
    check_prompt_chars(ctx, req)


def check_prompt_chars(ctx: ServingContext, req: Any) -> None:
    """Text clearly too long for the context is refused before it is tokenized (a 4 MiB
    prompt takes seconds to tokenize only to be refused for length): the engine's own check,
    here also for the text the server tokenizes itself (chat templates, add_special_tokens
    false)."""
    field = "messages" if hasattr(req, "messages") else "prompt"
    try:
        ctx.engine.check_text_chars(text_chars(req), field)
    except ValueError as e:
        raise bad_request(str(e), field) from None


def text_chars(req: Any) -> int:
    """The characters of text a request sends to the tokenizer."""
    if getattr(req, "messages", None) is not None:
        return sum(len(m.content) if isinstance(m.content, str)
                   else sum(len(p.text) for p in m.content or []) for m in req.messages)
    p = getattr(req, "prompt", None)
    if isinstance(p, str):
        return len(p)
    if isinstance(p, list) and p and isinstance(p[0], str):
        return max(len(x) for x in p)
    return 0


def build_params(req: _SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                 prompt_logprobs: int | None, fields: set[str],
                 renames: dict[str, str] | None = None,
                 structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """SamplingParams validates every range; its ValueError becomes a 400 naming the field.
    structured: a grammar the caller built (tool calls); else response_format's."""
    rf = req.response_format
    if structured is not None:
        pass  # tool_choice's grammar; check_tools refused a response_format beside it
    elif rf is not None and rf.type == "json_object":
        structured = StructuredOutputsParams(json_object=True)
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema",
                              "response_format.json_schema")
        structured = StructuredOutputsParams(json=rf.json_schema.schema_)
    try:
        return SamplingParams(
            n=req.n if req.n is not None else 1,
            temperature=req.temperature if req.temperature is not None else 1.0,
            top_p=req.top_p if req.top_p is not None else 1.0,
            top_k=req.top_k if req.top_k is not None else -1,
            min_p=req.min_p if req.min_p is not None else 0.0,
            repetition_penalty=(req.repetition_penalty if req.repetition_penalty is not None
                                else 1.0),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=dict(req.logit_bias) if req.logit_bias else None,  # type: ignore[arg-type]
            seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos, stop=req.stop, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens, structured_outputs=structured)
    except ValueError as e:
        raise from_value_error(e, fields, renames) from None


async def add_all(ctx: ServingContext, prompts: list[Any], params: SamplingParams,
                  priority: int, base_id: str, fields: set[str],
                  renames: dict[str, str] | None = None) -> list[PrimedStream]:
    """All or nothing: on any failure the streams already added are aborted."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(await ctx.engine.add_request(f"{base_id}-{i}", prompt, params,
                                                        priority, tenant=ctx.tenant,
                                                        tier=ctx.tier))
    except BaseException as e:
        for s in streams:
            ctx.engine.release(s)
        if isinstance(e, (ValueError, QueueFullError, EngineShuttingDown, EngineDeadError)):
            raise engine_error(e, fields, renames) from None
        raise
    return [PrimedStream(s) for s in streams]


async def merged(streams: list[PrimedStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, cumulative output) from several streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: PrimedStream) -> None:
        try:
            async for out in s:
                await q.put((i, out))
            await q.put((i, None))
        except BaseException as e:  # noqa: BLE001 - forwarded to the reader
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def collect(streams: list[PrimedStream]) -> list[RequestOutput]:
    """The final output of each stream. A drain or a dead engine ends a waiting request with
    OpenAI's 503, as it ends a stream (not with a 500)."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in merged(streams):
            finals[i] = out
    except (EngineShuttingDown, EngineDeadError) as e:
        raise engine_error(e, set()) from None
    assert all(f is not None for f in finals)
    return finals  # type: ignore[return-value]


def release_all(engine: AsyncEngine, streams: list[PrimedStream]) -> None:
    for s in streams:
        engine.release(s.stream)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    """OpenAI's usage; cached_tokens = prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def stream_error(err: BaseException) -> APIError:
    if isinstance(err, (EngineShuttingDown, EngineDeadError)):
        return engine_error(err, set())
    return APIError(500, "internal server error")


# ---- logprobs in OpenAI's two formats ------------------------------------------------------

# Token strings are decoded here, lazily and cached (Tokenizer.decode_token), not on the
# engine thread: only the tokens a response shows are ever decoded.

def _top(lp: PositionLogprobs, k: int) -> list[tuple[int, Any]]:
    return sorted(lp.items(), key=lambda kv: kv[1].rank)[:k]


def completion_logprobs(token_ids: list[int], lps: list[PositionLogprobs | None], k: int,
                        text_offset: int, tok: Tokenizer) -> dict[str, Any]:
    """{tokens, token_logprobs, top_logprobs, text_offset}; a None position (the first prompt
    token under echo) has no logprob."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    for t, lp in zip(token_ids, lps, strict=True):
        if lp is None:
            out["tokens"].append("")
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            text = tok.decode_token(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp[t].logprob)
            top = {tok.decode_token(i): v.logprob for i, v in _top(lp, k)}
            top.setdefault(text, lp[t].logprob)
            out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(out["tokens"][-1])
    return out


def chat_logprobs(token_ids: list[int], lps: list[PositionLogprobs], k: int, tok: Tokenizer
                  ) -> dict[str, Any]:
    content = []
    for t, lp in zip(token_ids, lps, strict=True):
        text = tok.decode_token(t)
        content.append({
            "token": text, "logprob": lp[t].logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": tok.decode_token(i), "logprob": v.logprob,
                              "bytes": list(tok.decode_token(i).encode())}
                             for i, v in _top(lp, k)]})
    return {"content": content}


# ---- streaming state --------------------------------------------------------------------------

@dataclass
class ChoiceCursor:
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_offset: int = 0  # completions logprobs: text_offset of the next token
    finished: bool = False


@dataclass
class Streamer:
    """Per-choice cursors; hold = characters kept back while a choice is unfinished."""

    hold: int
    cursors: dict[int, ChoiceCursor] = field(default_factory=dict)

    def delta(self, index: int, c: CompletionOutput) -> tuple[str, int, int, bool]:
        """(new text, first new token, end token, finished now) for choice index."""
        cur = self.cursors.setdefault(index, ChoiceCursor())
        done = c.finish_reason is not None
        limit = len(c.text) if done else max(len(c.text) - self.hold, 0)
        text = c.text[cur.sent_chars:limit] if limit > cur.sent_chars else ""
        t0, t1 = cur.sent_tokens, len(c.token_ids)
        cur.sent_chars = max(cur.sent_chars, limit)
        cur.sent_tokens = t1
        newly = done and not cur.finished
        cur.finished = cur.finished or done
        return text, t0, t1, newly


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def hold_back(params: SamplingParams) -> int:
    if params.include_stop_str_in_output:
        return 0
    return max((len(s) for s in params.stop_strings), default=1) - 1
