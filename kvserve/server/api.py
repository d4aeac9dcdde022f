"""The FastAPI app: routes, the auth / request-id gate, bounded JSON bodies, errors.

    ASGI  -> _Gate (X-Request-Id, Host, API key: 401; the key's tenant) -> FastAPI routes
          -> read_json (415 not JSON, 413, bad JSON, NaN, depth, lone surrogates, non-object)
          -> pydantic (-> 400) -> serving.py (engine) -> JSON, or SSE (_SSEResponse)

The model loads in the background after the socket opens, so /health answers 503 while it
loads, while it drains for shutdown, after the engine dies, and while the engine loop is
stalled (the watchdog); 200 while serving. docs/security.md says what the gate guarantees.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kvserve
from kvserve.async_engine import AsyncEngine, IterationStats
from kvserve.outputs import EngineStats
from kvserve.server import web
from kvserve.server.errors import (
    APIError,
    bad_request,
    check_can_serve,
    from_validation_error,
)
from kvserve.server.metrics import CONTENT_TYPE, ServerMetrics, render_merged
from kvserve.server.model_pool import ModelPool, ServedModel
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.server.serving import EngineStream, ServingContext, check_model, release_all
from kvserve.server.serving_chat import create_chat_completion, render_chat
from kvserve.server.serving_completion import create_completion
from kvserve.server.stats_window import StatsWindow
from kvserve.tool_calling.support import ToolSupport, tool_support

logger = logging.getLogger("kvserve.server")

MAX_JSON_DEPTH = 32
# Bodies larger than this are parsed and validated in a worker thread, not on the event loop.
_OFFLOAD_BYTES = 64 << 10
LOOPBACK_NAMES = ("localhost",)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_M = TypeVar("_M", bound=BaseModel)


@dataclass
class ServerConfig:
    model_name: str
    # One key or several (clients may send any); each key is a tenant (tenant_of).
    api_key: str | Sequence[str] | None = None
    # --api-key-file: more keys, each in a service tier (key -> tier name); the keys above
    # are in the default tier.
    api_key_tiers: Mapping[str, str] = field(default_factory=dict)
    max_body_bytes: int = 4 << 20
    shutdown_timeout: float = 30.0
    # Host header values accepted (names or IP literals, no port); None: any. A server bound
    # to loopback takes loopback names only, so a DNS-rebinding page cannot read answers.
    allowed_hosts: tuple[str, ...] | None = None
    # --tool-call-parser; None: the chat template's format, else hermes (serving_tools.py)
    tool_call_parser: str | None = None
    web_ui: bool = True  # the page at / and its files (server/web.py); --disable-web-ui


@dataclass
class ServerState:
    """What the routes see. engine is None until the model has loaded."""

    config: ServerConfig
    engine: AsyncEngine | None = None
    metrics: ServerMetrics | None = None
    window: StatsWindow | None = None  # the last minute, for GET /engine/state
    load_error: str | None = None
    tools: ToolSupport | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _shutdown: asyncio.Task | None = None
    # Several models (model tiers, model_pool.py): the pool holds their engines, and
    # `engine` stays None; metrics is the primary model's once it serves.
    pool: ModelPool | None = None

    def stats(self) -> EngineStats:
        return self.engine.stats if self.engine is not None else EngineStats()

    @property
    def ready(self) -> bool:
        if self.pool is not None:
            return self.pool.ready
        return (self.engine is not None and self.engine.is_healthy
                and not self.engine.is_draining)

    def begin_shutdown(self) -> None:
        """First step of a graceful shutdown (SIGTERM/SIGINT): refuse new requests, give the
        running ones shutdown_timeout seconds, then end them with an error event."""
        if self.pool is not None and self._shutdown is None:
            self.pool.begin_shutdown()
            self._shutdown = asyncio.ensure_future(
                self.pool.shutdown(self.config.shutdown_timeout))
        if self.engine is not None and self._shutdown is None:
            self.engine.begin_drain()
            self._shutdown = asyncio.ensure_future(
                self.engine.shutdown(self.config.shutdown_timeout))

    async def finish_shutdown(self) -> None:
        self.begin_shutdown()
        if self._shutdown is not None:
            await self._shutdown


# ---- the gate: request ids and the API key (pure ASGI, so streaming is untouched) -----------

def tenant_of(api_key: str) -> str:
    """The tenant an API key stands for (Request.tenant): a stable hash, never the key, since
    it reaches the engine's per-tenant state (the suffix proposer's cache of past outputs)."""
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


class _Gate:
    def __init__(self, app: ASGIApp, api_key: str | Sequence[str] | None,
                 allowed_hosts: tuple[str, ...] | None = None,
                 public_paths: Sequence[str] = ("/health",),
                 key_tiers: Mapping[str, str] | None = None) -> None:
        """public_paths: exact paths answered without a key (/health; the web page's files,
        which hold no data and ask for the key themselves). key_tiers: more keys, each with
        its service tier (the others are in the default tier)."""
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        tiers: dict[str, str | None] = dict.fromkeys((k for k in keys if k), None)
        tiers.update(key_tiers or {})
        self.api_keys = [(k.encode(), tenant_of(k), t) for k, t in tiers.items()]
        self.allowed_hosts = allowed_hosts
        self.public_paths = frozenset(public_paths)

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

        host = headers.get("host")
        if host is not None and not host_allowed(host, self.allowed_hosts):
            # Before the key: a rebinding page must learn nothing, not even that a key is due.
            err = APIError(421, f"the Host header {host[:100]!r} is not one this server "
                                f"answers to (see --allowed-host)", code="invalid_host")
            await error_response(err).__call__(scope, receive, send_with_id)
            return
        if self.api_keys and scope.get("path") not in self.public_paths:
            found = self._tenant(headers)
            if found is None:
                err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                    "<key>'", code="invalid_api_key")
                await error_response(err).__call__(scope, receive, send_with_id)
                return
            scope["state"]["tenant"], scope["state"]["tier"] = found
        await self.app(scope, receive, send_with_id)

    def _tenant(self, headers: Headers) -> tuple[str, str | None] | None:
        """(tenant, tier) of the key the request sends; None when it sends none of the
        keys."""
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        sent = token.strip().encode()
        found = None
        # Constant time in the key, and every key compared: a timing side channel must not
        # reveal a matching prefix.
        for key, tenant, tier in self.api_keys:
            if hmac.compare_digest(sent, key) and found is None:
                found = tenant, tier
        return found if scheme.lower() == "bearer" else None


def host_allowed(host: str, allowed: tuple[str, ...] | None) -> bool:
    """host: a Host header ("name", "name:port", "[::1]:port"). allowed: names or IP literals;
    "loopback" stands for localhost and every loopback address."""
    if allowed is None:
        return True
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    if name in allowed:
        return True
    if "loopback" in allowed:
        if name in LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False
    return False


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


def _check_json_content_type(request: Request) -> None:
    """JSON bodies only. A web page can POST text/plain (or a form) to a local server without
    a CORS preflight; application/json needs one, which this server never grants."""
    ctype = request.headers.get("content-type", "")
    media = ctype.partition(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/")
                                            and media.endswith("+json")):
        raise APIError(415, f"the body must be JSON with 'Content-Type: application/json', got "
                            f"{(ctype or 'no Content-Type')[:100]!r}", param="Content-Type")


def _find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string (or key) holding a lone UTF-16 surrogate, which JSON's
    \\uXXXX escapes can express but no Unicode text (and no tokenizer) accepts."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return p or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                kp = f"{p}.{k}" if p else str(k)
                stack.append((k, kp))
                stack.append((x, kp))
        elif isinstance(v, list):
            stack.extend((x, f"{p}[{i}]") for i, x in enumerate(v))
    return None


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object: 400 for anything else (CPU-bound; any thread)."""
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
    # Only a \uD800-\uDFFF escape can make one (raw bytes must be valid UTF-8), so the
    # walk runs only when the body has such an escape.
    if b"\\ud" in body or b"\\uD" in body:
        where = _find_lone_surrogate(data)
        if where is not None:
            raise bad_request(f"{where} contains a lone UTF-16 surrogate (a \\uD800-\\uDFFF "
                              f"escape without its pair), which is not valid Unicode text",
                              where.split("[")[0].split(".")[0] if where != "body" else None)
    return data


async def read_body(request: Request, max_bytes: int) -> bytes:
    _check_json_content_type(request)
    return await read_bounded(request, max_bytes)


async def read_bounded(request: Request, max_bytes: int) -> bytes:
    """The body, 413 past max_bytes (announced or sent)."""
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
    return b"".join(chunks)


def _validate(body: bytes, model: type[_M]) -> _M:
    data = parse_json(body)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def parse_body(request: Request, model: type[_M], max_bytes: int) -> _M:
    """Parsing and validating a large body takes tens of milliseconds: off the event loop, so
    that streams, /health and /metrics do not stall behind it."""
    body = await read_body(request, max_bytes)
    if len(body) <= _OFFLOAD_BYTES:
        return _validate(body, model)
    return await asyncio.get_running_loop().run_in_executor(None, _validate, body, model)


# ---- client disconnects ------------------------------------------------------------------

async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has gone (called once the body is read, so the next
    message can only be the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Runs work; if the client goes away first, cancels it (which aborts its engine
    requests and frees their KV blocks) and returns None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()  # this handler was cancelled itself: the work must not outlive it
        raise
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

async def _started(work: Awaitable[dict[str, Any] | EngineStream], engine: AsyncEngine
                   ) -> dict[str, Any] | EngineStream:
    """work's answer; a stream only once it has its first output (EngineStream.first_event),
    so that nothing is sent while its requests wait in the queue."""
    result = await work
    if isinstance(result, EngineStream):
        await result.first_event(engine)
    return result


class _SSEResponse(StreamingResponse):
    """An SSE body that owns its engine requests: they are released when the response ends,
    however it ends (finished, client gone before the first byte or mid-stream, cancelled),
    not in the body generator's finally, which never runs if the body never started."""

    def __init__(self, result: EngineStream, engine: AsyncEngine,
                 on_close: Callable[[], None] | None = None) -> None:
        """on_close: called last, once the response has ended (a model tier's lease)."""
        super().__init__(result.body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._result = result
        self._engine = engine
        self._on_close = on_close

    async def stream_response(self, send: Send) -> None:
        """Starlette's, but the first chunk is made before the status line goes, and the two
        are sent back to back, with no await between them that could let the loop run. A
        process killed between the two would leave a proxy holding a 200 with no byte of
        body, a request it may no longer retry (deploy/nginx)."""
        chunks = aiter(self.body_iterator)
        first = await anext(chunks, None)
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        if first is not None:
            await send({"type": "http.response.body", "body": _encode(first, self.charset),
                        "more_body": True})
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": _encode(chunk, self.charset),
                            "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            release_all(self._engine, self._result.streams)
            try:
                await self._result.body.aclose()  # type: ignore[attr-defined]
            finally:
                if self._on_close is not None:
                    self._on_close()


def _no_release() -> None:
    """One model's requests hold nothing (acquire)."""


def _encode(chunk: str | bytes | memoryview, charset: str) -> bytes | memoryview:
    return chunk.encode(charset) if isinstance(chunk, str) else chunk


def _openapi_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> Callable[[], Any]:
    """FastAPI's own OpenAPI document, with the request bodies that the routes parse by hand
    (read_json + pydantic, for OpenAI-shaped errors) declared from the same models."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        refs, defs = models_json_schema([(m, "validation") for m in bodies.values()],
                                        ref_template="#/components/schemas/{model}")
        doc.setdefault("components", {}).setdefault("schemas", {}).update(
            defs.get("$defs", {}))
        for path, model in bodies.items():
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[(model, "validation")]}}}
        app.openapi_schema = doc
        return doc

    return openapi


def build_app(config: ServerConfig,
              load_engine: Callable[[], AsyncEngine] | None = None,
              on_ready: Callable[[AsyncEngine], None] | None = None,
              on_load_error: Callable[[str], None] | None = None,
              on_engine_dead: Callable[[str], None] | None = None,
              pool: ModelPool | None = None) -> FastAPI:
    """load_engine runs in a worker thread after start-up; it builds the AsyncEngine (not
    started). on_ready runs on the loop once the engine serves; on_load_error if it fails;
    on_engine_dead (on the loop) once the engine thread has died: the CLI exits non-zero, so
    that a supervisor restarts a process that can never serve again. pool: several models
    instead of load_engine's one (model tiers); the callbacks are about its primary model,
    on_engine_dead about any."""
    state = ServerState(config, pool=pool)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = None
        if load_engine is not None:
            loader = asyncio.ensure_future(_load(state, load_engine, on_ready, on_load_error,
                                                 on_engine_dead))
        if pool is not None:
            loader = asyncio.ensure_future(_start_pool(state, pool, on_ready, on_load_error,
                                                       on_engine_dead))
        yield
        if loader is not None and not loader.done():
            loader.cancel()
        await state.finish_shutdown()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json")
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
        check_can_serve(draining=eng is not None and eng.is_draining,
                        stopped=state.load_error is not None
                        or (eng is not None and not eng.is_alive),
                        loading=eng is None)
        assert eng is not None
        return ServingContext(eng, config.model_name, eng.max_model_len, tools=state.tools)

    def rid(request: Request) -> str:
        return request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex

    # ---- several models (model tiers): the body names the model -------------------------

    def precheck() -> ServingContext | None:
        """Before a body is read: the single model's context (ctx); with several models, the
        server-wide checks only, since the model is the body's to name."""
        if state.pool is None:
            return ctx()
        state.pool.check_serving()
        return None

    async def acquire(c: ServingContext | None, model: str | None
                      ) -> tuple[ServingContext, Callable[[], None]]:
        """The context of the model a body names, and its release. With several models: a
        lease on it (waited for while it loads; 404 for one not served), held until the
        release, so that the model is never torn down under the request. With one: c (the
        name is checked by the caller: check_model), nothing to release."""
        if state.pool is None:
            assert c is not None
            return c, _no_release
        lease = await state.pool.acquire(model)
        return ServingContext(lease.engine, lease.model.name, lease.engine.max_model_len,
                              tools=lease.model.tools), lease.release

    @asynccontextmanager
    async def serving(c0: ServingContext | None, model: str | None
                      ) -> AsyncIterator[ServingContext]:
        """acquire's context for the block, its name checked."""
        c, release = await acquire(c0, model)
        try:
            check_model(c, model)
            yield c
        finally:
            release()

    async def _generate(request: Request, fn: Callable[..., Any], model: type[BaseModel]
                        ) -> Response:
        c0 = precheck()
        body = await parse_body(request, model, config.max_body_bytes)
        scope_state = request.scope.get("state", {})

        async def work() -> tuple[Any, ServingContext, Callable[[], None]]:
            c, release = await acquire(c0, getattr(body, "model", None))
            try:
                c = dataclasses.replace(c, tenant=scope_state.get("tenant"),
                                        tier=scope_state.get("tier"))
                return await _started(fn(c, body, rid(request)), c.engine), c, release
            except BaseException:
                release()
                raise

        done = await unless_disconnected(request, work())
        if done is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        result, c, release = done
        if isinstance(result, dict):
            release()
            return JSONResponse(result)
        # The response releases (a lease) once it has ended, the stream included.
        return _SSEResponse(result, c.engine, on_close=release)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await _generate(request, create_completion, CompletionRequest)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, create_chat_completion, ChatCompletionRequest)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        if state.pool is not None:  # every model, with its state (model_pool.py)
            return JSONResponse({"object": "list", "data": state.pool.listing(state.created)})
        c = ctx()
        return JSONResponse({"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": state.created,
            "owned_by": "kvserve", "root": config.model_name, "parent": None,
            "max_model_len": c.max_model_len}]})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        c0 = precheck()
        body = await parse_body(request, TokenizeRequest, config.max_body_bytes)
        async with serving(c0, body.model) as c:
            if (body.prompt is None) == (body.messages is None):
                raise bad_request("send exactly one of prompt or messages", "prompt")
            tok = c.engine.tokenizer
            if body.messages is not None:
                tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
                ids = await render_chat(c, body.messages, body.add_generation_prompt,
                                        tools=tools)
            else:
                ids = await c.engine.run_in_pool(tok.encode, body.prompt,
                                                 body.add_special_tokens)
            out: dict[str, Any] = {"count": len(ids), "max_model_len": c.max_model_len,
                                   "tokens": ids}
            if body.return_token_strs:
                out["token_strs"] = tok.convert_ids_to_tokens(ids)
            return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        c0 = precheck()
        body = await parse_body(request, DetokenizeRequest, config.max_body_bytes)
        async with serving(c0, body.model) as c:
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
        eng = state.engine
        if state.pool is not None:
            if state.pool.draining:
                return error_response(APIError(503, "the server is shutting down",
                                               code="shutting_down"))
            eng = state.pool.unhealthy_engine()  # None while the primary loads
        if eng is None and not state.load_error:
            err = APIError(503, "the model is still loading", code="loading",
                           headers={"Retry-After": "5"})
        elif eng is not None and eng.is_draining:
            err = APIError(503, "the server is shutting down", code="shutting_down")
        elif eng is not None and eng.is_alive:
            err = APIError(503, f"the engine loop has not come round for "
                                f"{eng.stalled_for():.0f}s with requests in flight (the "
                                f"watchdog's limit is {eng.watchdog_timeout:g}s)",
                           code="engine_stalled")
        else:
            err = APIError(503, "the engine has stopped", code="engine_dead")
        return error_response(err)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            raise APIError(503, "the model is still loading; no metrics yet",
                           headers={"Retry-After": "5"})
        if state.pool is not None:  # every model that has been hot, by model_name
            return Response(render_merged(m.metrics for m in state.pool.models.values()
                                          if m.metrics is not None), media_type=CONTENT_TYPE)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def web_engine() -> AsyncEngine:
        if state.pool is None:
            return ctx().engine
        state.pool.check_serving()
        return state.pool.primary_engine()  # the page shows the primary model

    web.add_routes(app, config.model_name, lambda: state.window, web_engine,
                   page=config.web_ui)

    app.openapi = _openapi_bodies(app, {  # type: ignore[method-assign]
        "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
        "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})
    public = ("/health", *web.PAGE_PATHS) if config.web_ui else ("/health",)
    return _Gate(app, config.api_key, config.allowed_hosts, public,  # type: ignore[return-value]
                 config.api_key_tiers)


async def _load(state: ServerState, load_engine: Callable[[], AsyncEngine],
                on_ready: Callable[[AsyncEngine], None] | None,
                on_load_error: Callable[[str], None] | None,
                on_engine_dead: Callable[[str], None] | None = None) -> None:
    try:
        engine = await asyncio.get_running_loop().run_in_executor(None, load_engine)
    except Exception as e:  # noqa: BLE001 - reported; /health stays 503
        logger.error("loading the model failed", exc_info=not isinstance(e, ValueError))
        state.load_error = f"{type(e).__name__}: {e}"
        if on_load_error is not None:
            on_load_error(state.load_error)
        return
    state.tools = tool_support(engine.tokenizer, state.config.tool_call_parser)
    metrics = state.metrics = ServerMetrics(state.config.model_name, state.stats)
    window = state.window = StatsWindow(lambda: engine.stats)

    def observe(it: IterationStats) -> None:  # engine thread, after every step
        metrics.observe(it)
        window.observe(it)

    engine.stats_listener = observe
    if on_engine_dead is not None:
        engine.on_dead = on_engine_dead
    engine.start()
    state.engine = engine
    if on_ready is not None:
        on_ready(engine)


async def _start_pool(state: ServerState, pool: ModelPool,
                      on_ready: Callable[[AsyncEngine], None] | None,
                      on_load_error: Callable[[str], None] | None,
                      on_engine_dead: Callable[[str], None] | None) -> None:
    """_load with several models: the pool loads the primary; as each model goes hot, its
    tools, metrics (kept across its swaps) and, for the primary, the web page's window."""

    def on_hot(m: ServedModel) -> None:
        assert m.engine is not None
        m.tools = tool_support(m.engine.tokenizer, state.config.tool_call_parser)
        if m.metrics is None:
            m.metrics = ServerMetrics(m.name, m.stats)
        observers = [m.metrics.observe]
        if m.name == pool.primary:
            # m's stats, not this engine's: the window must not keep a torn-down engine.
            window = state.window = StatsWindow(lambda: m.stats() or EngineStats())
            observers.append(window.observe)

        def observe(it: IterationStats) -> None:  # engine thread, after every step
            for o in observers:
                o(it)

        m.engine.stats_listener = observe

    pool.on_hot = on_hot
    pool.on_dead = on_engine_dead
    await pool.start()
    if pool.load_error is not None:
        state.load_error = pool.load_error
        if on_load_error is not None:
            on_load_error(state.load_error)
        return
    primary = pool.models[pool.primary]
    state.metrics = primary.metrics
    if on_ready is not None and primary.engine is not None:
        on_ready(primary.engine)


def app_state(app: Any) -> ServerState:
    """The ServerState behind an app from build_app (for the CLI's shutdown hook)."""
    inner = app.app if isinstance(app, _Gate) else app
    return inner.state.kv
