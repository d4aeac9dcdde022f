"""The web page at / (a chat playground and a live view of the engine) and GET /engine/state,
the JSON the page polls once a second.

    GET /               web/index.html  } no API key (the gate's public paths): the page
    GET /web/<file>     PAGE_FILES      } asks for the key and sends it on its API calls
    GET /engine/state   JSON; the API key like every API route; ?blocks=1 adds the block
                        pool's picture. Stays with --disable-web-ui: it is API, not page.

The page's files (the folder web/ beside this module) are hand-written and served from memory
as they are: no build step, nothing from another origin. The Content-Security-Policy allows
this origin only and no inline script, so a string the model writes can never run as code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.async_engine import AsyncEngine
from kvserve.engine_thread import SNAPSHOT_REQUESTS
from kvserve.outputs import EngineSnapshot
from kvserve.request_stream import EngineDeadError
from kvserve.server.errors import APIError, bad_request

if TYPE_CHECKING:
    from kvserve.server.stats_window import StatsWindow

STATIC_DIR = Path(__file__).with_suffix("")  # kvserve/server/web/
PAGE_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
# Where each file is served; the gate lets exactly these paths through without a key.
PAGE_PATHS = {"/" if name == "index.html" else f"/web/{name}": name for name in PAGE_FILES}
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self'; connect-src 'self'; object-src 'none'; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_routes(app: FastAPI, model_name: str, window: Callable[[], StatsWindow | None],
               engine: Callable[[], AsyncEngine], page: bool) -> None:
    """engine: the serving engine, or an APIError (503 while loading, draining, dead);
    window: the last minute's StatsWindow, None until the model has loaded."""

    @app.get("/engine/state", openapi_extra={"parameters": [{
        "name": "blocks", "in": "query", "required": False,
        "description": "1 or true: add kv.states, one character per block",
        "schema": {"type": "string", "enum": ["0", "1", "false", "true"]}}]})
    async def engine_state(request: Request) -> JSONResponse:
        with_blocks = _flag(request.query_params.get("blocks"), "blocks")
        eng = engine()
        try:
            snap = await eng.snapshot()
        except EngineDeadError:
            raise APIError(503, "the engine has stopped", code="engine_dead") from None
        except TimeoutError:
            raise APIError(503, "the engine loop has not come round for a snapshot in 5 s; "
                                "retry shortly", headers={"Retry-After": "1"}) from None
        tenant = request.scope.get("state", {}).get("tenant")
        last_minute = window()
        summary = last_minute.summary() if last_minute is not None else None
        body = state_json(snap, summary, model_name, tenant, with_blocks)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    if not page:
        return
    for path, name in PAGE_PATHS.items():
        content = (STATIC_DIR / name).read_bytes()
        app.add_api_route(path, _static(content, PAGE_FILES[name]), methods=["GET"],
                          include_in_schema=False)


def _static(content: bytes, media_type: str) -> Callable[[], Any]:
    async def serve() -> Response:
        return Response(content, media_type=media_type, headers=PAGE_HEADERS)

    return serve


def _flag(value: str | None, name: str) -> bool:
    if value is None or value in ("0", "false"):
        return False
    if value in ("1", "true"):
        return True
    raise bad_request(f"{name} must be 1, true, 0 or false, got {value[:50]!r}", name)


def state_json(snap: EngineSnapshot, window: dict[str, Any] | None, model: str,
               tenant: str | None, with_blocks: bool) -> dict[str, Any]:
    """The engine-state body (its shape is documented in README.md, "Web page"). A request
    of another tenant (API key) is listed without its id."""
    st = snap.stats
    states = snap.block_states
    shared = states.count("s")
    kv: dict[str, Any] = {
        "block_size": snap.block_size,
        "num_blocks": len(states) - 1,  # usable: block 0 is the null block
        "used": states.count("u") + shared, "shared": shared,
        "cached": states.count("c"), "free": states.count("f"),
        "usage": st.kv_cache_usage,
    }
    if with_blocks:
        kv["states"] = states
    return {
        "model": model,
        "time": time.time(),
        "requests": {
            "running": st.num_running, "waiting": st.num_waiting,
            "preemptions": st.num_preemptions, "list_max": SNAPSHOT_REQUESTS,
            "list": [{"id": r.request_id if r.tenant == tenant else None,
                      "mine": r.tenant == tenant, "status": r.status,
                      "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
                      "max_tokens": r.max_tokens, "computed_tokens": r.num_computed_tokens,
                      "cached_tokens": r.num_cached_tokens, "blocks": r.num_blocks}
                     for r in snap.requests]},
        "kv": kv,
        "prefix_cache": {"queries": st.prefix_cache_queries, "hits": st.prefix_cache_hits,
                         "hit_rate": (st.prefix_cache_hits / st.prefix_cache_queries
                                      if st.prefix_cache_queries else None)},
        "window": window,
    }
