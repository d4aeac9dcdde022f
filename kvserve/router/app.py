"""The router's FastAPI app: OpenAI routes relayed to the replicas, byte for byte.

    POST /v1/completions, /v1/chat/completions   routed by prompt prefix (policy.py)
    GET  /v1/models; POST /tokenize, /detokenize  to the least loaded healthy replica
    GET  /health                                  200 while any replica is routable
    GET  /metrics                                 the router's own (metrics.py)

One request's path:

    body read (bounded) -> prompt ids and block hashes (prompt.py, in a thread)
      -> BackendPool.choose -> send, headers and all (Authorization passes through)
      -> the connection fails, or the backend dies before its first body byte, or it
         answers 503 -> that backend is excluded and the request decides again
      -> the first body byte has come: status, headers and then every chunk as it arrives
         (SSE events are relayed as the replica writes them, nothing buffered)

Nothing is retried once a byte has gone to the client: a replica that dies mid-stream ends
the stream with an error event (SSE) or a cut body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvserve.loader import Tokenizer
from kvserve.router.metrics import CONTENT_TYPE, RouterMetrics
from kvserve.router.policy import RoutingConfig
from kvserve.router.pool import BackendPool
from kvserve.router.prompt import block_hashes, prompt_token_ids
from kvserve.server.bodies import read_bounded, unless_disconnected, wait_disconnect
from kvserve.server.errors import APIError, error_response
from kvserve.tool_calling.support import ToolSupport

logger = logging.getLogger("kvserve.router")

# Hop-by-hop headers (RFC 9110 7.6.1) are the connection's, not the message's; host and
# content-length are rewritten by the client for the new connection and body.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate",
                         "proxy-authorization", "te", "trailer", "transfer-encoding",
                         "upgrade"})
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-length"}
# The replicas' addresses and states go to the log and /metrics, not to clients.
_NO_BACKEND = APIError(503, "no backend is available; retry shortly", code="no_backend",
                       headers={"Retry-After": "1"})


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[str, ...]
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    health_interval: float = 2.0  # seconds between /health polls
    health_timeout: float = 5.0  # seconds a /health poll waits
    connect_timeout: float = 5.0  # seconds to open a connection to a backend
    max_body_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("backends: at least one --backend URL is needed")
        for url in self.backends:
            if not url.startswith(("http://", "https://")) or url.endswith("/"):
                raise ValueError(f"backends: {url!r} must be http(s)://HOST:PORT without a "
                                 "trailing slash")
        for name in ("health_interval", "health_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")


class _Relay(Response):
    """A backend's response, relayed as it arrives; the first body chunk is already read.
    The backend's connection and its in-flight count are released however the relay ends
    (finished, the client gone, the backend gone)."""

    def __init__(self, upstream: httpx.Response, first: bytes, rest: AsyncIterator[bytes],
                 release: Callable[[], None]) -> None:
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = [(k, v) for k, v in upstream.headers.raw
                            if k.decode("latin-1").lower() not in _HOP_BY_HOP]
        self._upstream = upstream
        self._first = first
        self._rest = rest
        self._release = release
        self._sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def _relay(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        if self._first:
            await send({"type": "http.response.body", "body": self._first, "more_body": True})
        try:
            async for chunk in self._rest:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as e:
            logger.warning("backend %s failed mid-response: %s", self._upstream.url, e)
            if self._sse:
                err = APIError(502, "the backend serving this stream failed", code="backend")
                await send({"type": "http.response.body", "body": err.sse().encode(),
                            "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # uvicorn drops what is sent to a client that has gone (ASGI spec 2.3), so the relay
        # would read the backend to its end: a disconnect is watched for instead.
        relay = asyncio.ensure_future(self._relay(send))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({relay, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            relay.cancel()
            watcher.cancel()
            try:
                await relay
            except (asyncio.CancelledError, OSError):
                pass  # the client went away (OSError: a server on ASGI spec 2.4 says so)
            finally:
                # Closing the upstream connection aborts the backend's engine request.
                await self._upstream.aclose()
                self._release()


class RouterApp:
    """What the routes share: the pool, the tokenizer, one httpx client."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None,
                 tools: ToolSupport | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.tools = tools
        self.metrics = RouterMetrics()
        self.pool = BackendPool(config.backends, config.routing, self.metrics)
        self.client: httpx.AsyncClient | None = None

    def _hashes(self, route: str, body: bytes) -> tuple[list[int], int]:
        """(block hashes, prompt tokens) of a generation body; ([], 0) when unreadable."""
        if self.tokenizer is None:
            return [], 0
        try:
            parsed = json.loads(body)
        except ValueError:
            return [], 0
        ids = prompt_token_ids(self.tokenizer, self.tools, route, parsed)
        if not ids:
            return [], 0
        return block_hashes(ids, self.config.routing.block_size), len(ids)

    async def proxy(self, request: Request, routed: bool) -> Response:
        """Relays the request; if the client goes away before the response starts (a long
        prefill), the attempt is cancelled, which closes the backend's connection and so
        aborts its engine request."""
        body = await read_bounded(request, self.config.max_body_bytes)
        response = await unless_disconnected(request, self._proxy(request, body, routed))
        return Response(status_code=499) if response is None else response  # nobody reads a 499

    async def _proxy(self, request: Request, body: bytes, routed: bool) -> Response:
        path = request.url.path
        hashes, num_tokens = ((await asyncio.to_thread(self._hashes, path, body)) if routed
                              else ([], 0))
        url = path + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.raw
                   if k.decode("latin-1").lower() not in _REQUEST_DROP]
        tried: set[str] = set()
        while True:
            if routed:
                d = self.pool.choose(hashes, num_tokens, tried)
                target = d.backend if d is not None else None
            else:
                target = self.pool.least_loaded(tried)
            if target is None:
                logger.warning("no backend for %s: %s", path, self.pool.describe())
                return error_response(_NO_BACKEND)
            tried.add(target)
            response = await self._attempt(request.method, target, url, headers, body,
                                           last=self.pool.least_loaded(tried) is None)
            if response is not None:
                self.metrics.requests.labels(target).inc()
                return response
            self.metrics.retries.labels(target).inc()

    async def _attempt(self, method: str, target: str, url: str, headers: list[Any],
                       body: bytes, last: bool) -> Response | None:
        """One backend's try: its relayed response, or None to try another (the connection
        failed before any body byte, or a 503 while another backend is left)."""
        assert self.client is not None
        backend = self.pool.backends[target]
        backend.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                backend.in_flight -= 1

        upstream: httpx.Response | None = None
        relay: _Relay | None = None
        try:
            req = self.client.build_request(method, target + url, headers=headers,
                                            content=body)
            upstream = await self.client.send(req, stream=True)
            if upstream.status_code == 503 and not last:
                return None  # draining or full there; the health poll decides about it
            rest = upstream.aiter_raw()
            try:
                first = await anext(rest)
            except StopAsyncIteration:
                first = b""
            relay = _Relay(upstream, first, rest, release)
            upstream = None  # the relay owns it now, and releases the backend when done
            return relay
        except httpx.TransportError as e:
            self.pool.set_health(target, False, f"request failed: {type(e).__name__}: {e}")
            return None
        finally:
            # However the try ended, the relay's or a failure's or a cancellation's (the
            # client gone while the backend had not answered yet: a replica sends its status
            # line with the first token, after the prefill), the backend is released once.
            try:
                if upstream is not None:
                    await upstream.aclose()
            finally:
                if relay is None:
                    release()

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        c = self.config
        timeout = httpx.Timeout(connect=c.connect_timeout, read=None, write=60.0, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            self.client = client
            await self.pool.check_health(client, c.health_timeout)
            poller = asyncio.create_task(self.pool.poll_health(client, c.health_interval,
                                                               c.health_timeout))
            try:
                yield
            finally:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller


def build_app(config: RouterConfig, tokenizer: Tokenizer | None,
              tools: ToolSupport | None = None) -> FastAPI:
    """tokenizer None: no prompt is read, every request is routed by load alone."""
    state = RouterApp(config, tokenizer, tools)
    app = FastAPI(title="kvserve router", lifespan=state.lifespan, openapi_url=None)
    app.state.router = state

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    def relay(routed: bool) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await state.proxy(request, routed=routed)
        return endpoint

    for method, path, routed in (("POST", "/v1/completions", True),
                                 ("POST", "/v1/chat/completions", True),
                                 ("GET", "/v1/models", False),
                                 ("POST", "/tokenize", False),
                                 ("POST", "/detokenize", False)):
        app.add_api_route(path, relay(routed), methods=[method], response_model=None)

    @app.get("/health", response_model=None)
    async def health() -> Response:
        if any(b.healthy for b in state.pool.backends.values()):
            return Response(status_code=200)
        return error_response(_NO_BACKEND)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app
