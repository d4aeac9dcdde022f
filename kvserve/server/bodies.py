"""Reading a request: its body, bounded and parsed as a JSON object (415 not JSON, 413 too
large, 400 bad JSON, NaN, too deep, lone surrogates, not an object; then pydantic's 400), and
whether its client is still there.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.types import Receive

from kvserve.server.errors import APIError, bad_request, from_validation_error

MAX_JSON_DEPTH = 32
# Bodies larger than this are parsed and validated in a worker thread, not on the event loop.
_OFFLOAD_BYTES = 64 << 10
_M = TypeVar("_M", bound=BaseModel)


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
