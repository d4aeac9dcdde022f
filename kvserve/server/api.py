"""The FastAPI app: routes, the auth / request-id gate, bounded JSON bodies, errors.

    ASGI  -> _Gate (X-Request-Id, API key, 401)  -> FastAPI routes
          -> read_json (413, bad JSON, NaN, depth, non-object) -> pydantic (-> 400)
          -> serving.py (engine) -> JSON or SSE

The model loads in the background after the socket opens, so /health answers 503 while it
loads (and after the engine dies) and 200 while serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kvserve
from kvserve.async_engine import AsyncEngine, EngineStats
from kvserve.server.errors import APIError, bad_request, from_validation_error
from kvserve.server.metrics import CONTENT_TYPE, ServerMetrics
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.server.serving import ServingContext, check_model
from kvserve.server.serving_chat import create_chat_completion, render_chat
from kvserve.server.serving_completion import create_completion

logger = logging.getLogger("kvserve.server")

MAX_JSON_DEPTH = 32
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_M = TypeVar("_M", bound=BaseModel)


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    shutdown_timeout: float = 30.0


@dataclass
class ServerState:
    """What the routes see. engine is None until the model has loaded."""

    config: ServerConfig
    engine: AsyncEngine | None = None
    metrics: ServerMetrics | None = None
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _shutdown: asyncio.Task | None = None

    def stats(self) -> EngineStats:
        return self.engine.stats if self.engine is not None else EngineStats()

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.is_healthy

    def begin_shutdown(self) -> None:
        """First step of a graceful shutdown (SIGTERM/SIGINT): refuse new requests, give the
        running ones shutdown_timeout seconds, then end them with an error event."""
        if self.engine is not None and self._shutdown is None:
            self.engine.begin_drain()
            self._shutdown = asyncio.ensure_future(
                self.engine.shutdown(self.config.shutdown_timeout))

    async def finish_shutdown(self) -> None:
        self.begin_shutdown()
        if self._shutdown is not None:
            await self._shutdown


# ---- the gate: request ids and the API key (pure ASGI, so streaming is untouched) -----------

class _Gate:
    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        rid = headers.get("x-request-id", "")
        if not _REQUEST_ID.fullmatch(rid):
            rid = uuid.uuid4().hex  # absent, or not safe to echo into headers and logs
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = rid
            await send(message)

        if self.api_key is not None and scope.get("path") != "/health" \
                and not self._authorized(headers):
            err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                "<key>'", code="invalid_api_key")
            await error_response(err).__call__(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)

    def _authorized(self, headers: Headers) -> bool:
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        assert self.api_key is not None
        # Constant time in the key: a timing side channel must not reveal a matching prefix.
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                  self.api_key)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


# ---- bounded JSON bodies -----------------------------------------------------------------

def _reject_constant(name: str) -> Any:
    raise bad_request(f"the body contains {name}, which is not valid JSON; numbers must be "
                      f"finite")


def _check_depth(value: Any, limit: int) -> None:
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            raise bad_request(f"the JSON body is nested deeper than {limit} levels")
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(413, f"the body has {length} bytes; at most {max_bytes} are allowed")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the body is larger than {max_bytes} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise bad_request("the body is empty; send a JSON object")
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels"
                          ) from None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise bad_request("the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, got a JSON "
                          f"{type(data).__name__.replace('NoneType', 'null')}")
    _check_depth(data, MAX_JSON_DEPTH)
    return data


async def parse_body(request: Request, model: type[_M], max_bytes: int) -> _M:
    data = await read_json(request, max_bytes)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


# ---- client disconnects ------------------------------------------------------------------

async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Runs work; if the client goes away first, cancels it (which aborts its engine
    requests and frees their KV blocks) and returns None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - nobody to report to
        pass
    return None


# ---- the app -----------------------------------------------------------------------------

def build_app(config: ServerConfig,
              load_engine: Callable[[], AsyncEngine] | None = None,
              on_ready: Callable[[AsyncEngine], None] | None = None,
              on_load_error: Callable[[str], None] | None = None) -> FastAPI:
    """load_engine runs in a worker thread after start-up; it builds the AsyncEngine (not
    started). on_ready runs on the loop once the engine serves; on_load_error if it fails."""
    state = ServerState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = None
        if load_engine is not None:
            loader = asyncio.ensure_future(_load(state, load_engine, on_ready, on_load_error))
        yield
        if loader is not None and not loader.done():
            loader.cancel()
        await state.finish_shutdown()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kv = state

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            msg = f"no route {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        return error_response(APIError(exc.status_code, msg, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(APIError(500, "internal server error"))

    def ctx() -> ServingContext:
        eng = state.engine
        if state.load_error is not None or (eng is not None and not eng.is_healthy):
            raise APIError(503, "the engine has stopped; the server cannot serve requests",
                           code="engine_dead")
        if eng is None:
            raise APIError(503, "the model is still loading; retry shortly", code="loading",
                           headers={"Retry-After": "5"})
        return ServingContext(eng, config.model_name, eng.max_model_len)

    def rid(request: Request) -> str:
        return request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex

    async def _generate(request: Request, fn: Callable[..., Any], model: type[BaseModel]
                        ) -> Response:
        c = ctx()
        body = await parse_body(request, model, config.max_body_bytes)
        result = await _unless_disconnected(request, fn(c, body, rid(request)))
        if result is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, create_completion, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, create_chat_completion, ChatCompletionRequest)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        c = ctx()
        return JSONResponse({"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": state.created,
            "owned_by": "kvserve", "root": config.model_name, "parent": None,
            "max_model_len": c.max_model_len}]})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        c = ctx()
        body = await parse_body(request, TokenizeRequest, config.max_body_bytes)
        check_model(c, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt or messages", "prompt")
        tok = c.engine.tokenizer
        if body.messages is not None:
            ids = await render_chat(c, body.messages, body.add_generation_prompt)
        else:
            ids = await c.engine.run_in_pool(tok.encode, body.prompt, body.add_special_tokens)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": c.max_model_len,
                               "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        c = ctx()
        body = await parse_body(request, DetokenizeRequest, config.max_body_bytes)
        check_model(c, body.model)
        vocab = c.engine.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens must be token ids in [0, {vocab - 1}], got {bad}",
                              "tokens")
        text = await c.engine.run_in_pool(c.engine.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kvserve.__version__})

    @app.get("/health")
    async def health() -> Response:
        if state.ready:
            return Response(status_code=200)
        msg = ("the model is still loading" if state.engine is None and not state.load_error
               else "the engine has stopped")
        return error_response(APIError(503, msg))

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            raise APIError(503, "the model is still loading; no metrics yet",
                           headers={"Retry-After": "5"})
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return _Gate(app, config.api_key)  # type: ignore[return-value]


async def _load(state: ServerState, load_engine: Callable[[], AsyncEngine],
                on_ready: Callable[[AsyncEngine], None] | None,
                on_load_error: Callable[[str], None] | None) -> None:
    try:
        engine = await asyncio.get_running_loop().run_in_executor(None, load_engine)
    except Exception as e:  # noqa: BLE001 - reported; /health stays 503
        logger.error("loading the model failed", exc_info=not isinstance(e, ValueError))
        state.load_error = f"{type(e).__name__}: {e}"
        if on_load_error is not None:
            on_load_error(state.load_error)
        return
    state.metrics = ServerMetrics(state.config.model_name, state.stats)
    engine.stats_listener = state.metrics.observe
    engine.start()
    state.engine = engine
    if on_ready is not None:
        on_ready(engine)


def app_state(app: Any) -> ServerState:
    """The ServerState behind an app from build_app (for the CLI's shutdown hook)."""
    inner = app.app if isinstance(app, _Gate) else app
    return inner.state.kv
