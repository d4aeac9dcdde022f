"""The FastAPI app: its routes, its errors and its lifespan (the model's background load).

    ASGI  -> gate.Gate (X-Request-Id, Host, API key: 401; the key's tenant) -> FastAPI routes
          -> bodies.parse_body (415 not JSON, 413, bad JSON, NaN, depth, lone surrogates,
             non-object; pydantic -> 400) -> serving.py (engine) -> JSON, or SSE
             (sse.SSEResponse)

The model loads in the background after the socket opens, so /health answers 503 while it
loads, while it drains for shutdown, after the engine dies, and while the engine loop is
stalled (the watchdog); 200 while serving. docs/security.md says what the gate guarantees.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvserve
from kvserve.async_engine import AsyncEngine
from kvserve.iteration_stats import IterationStats
from kvserve.outputs import EngineStats
from kvserve.server import web
from kvserve.server.bodies import parse_body, unless_disconnected
from kvserve.server.errors import APIError, bad_request, check_can_serve, error_response
from kvserve.server.gate import Gate
from kvserve.server.metrics import CONTENT_TYPE, ServerMetrics, render_merged
from kvserve.server.model_pool import ModelPool, ServedModel
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.server.serving import ServingContext, check_model
from kvserve.server.serving_chat import create_chat_completion, render_chat
from kvserve.server.serving_completion import create_completion
from kvserve.server.sse import SSEResponse, started
from kvserve.server.stats_window import StatsWindow
from kvserve.tool_calling.support import ToolSupport, tool_support

logger = logging.getLogger("kvserve.server")


@dataclass
class ServerConfig:
    model_name: str
    # One key or several (clients may send any); each key is a tenant (gate.tenant_of).
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


# ---- the app -----------------------------------------------------------------------------

def _no_release() -> None:
    """One model's requests hold nothing (acquire)."""

def _openapi_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> Callable[[], Any]:
    """FastAPI's own OpenAPI document, with the request bodies that the routes parse by hand
    (bodies.parse_body: pydantic, for OpenAI-shaped errors) declared from the same models."""

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
                return await started(fn(c, body, rid(request)), c.engine), c, release
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
        return SSEResponse(result, c.engine, on_close=release)

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
    return Gate(app, config.api_key, config.allowed_hosts, public,  # type: ignore[return-value]
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
    inner = app.app if isinstance(app, Gate) else app
    return inner.state.kv
