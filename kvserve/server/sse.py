"""Streamed answers (server-sent events) that own their engine requests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.async_engine import AsyncEngine
from kvserve.server.serving import EngineStream, release_all


async def started(work: Awaitable[dict[str, Any] | EngineStream], engine: AsyncEngine
                  ) -> dict[str, Any] | EngineStream:
    """work's answer; a stream only once it has its first output (EngineStream.first_event),
    so that nothing is sent while its requests wait in the queue."""
    result = await work
    if isinstance(result, EngineStream):
        await result.first_event(engine)
    return result


class SSEResponse(StreamingResponse):
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


def _encode(chunk: str | bytes | memoryview, charset: str) -> bytes | memoryview:
    return chunk.encode(charset) if isinstance(chunk, str) else chunk
