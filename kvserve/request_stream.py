"""One request's outputs as the event loop reads them (RequestStream), and the errors that end
a stream early. async_engine.py writes them from the engine thread's outputs (through
call_soon_threadsafe: a stream is touched on the event loop only)."""

from __future__ import annotations

import asyncio

from kvserve.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; nothing more will be generated."""


class EngineShuttingDown(RuntimeError):
    """The engine is draining for shutdown and takes no new requests."""


class RequestStream:
    """One request's outputs. Written on the event loop (via call_soon_threadsafe) only."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._done = False
        self._event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self._latest = output
        self._done = output.finished
        self._event.set()

    def fail(self, error: BaseException) -> None:
        if not self._done:
            self._error = error
            self._done = True
            self._event.set()

    @property
    def finished(self) -> bool:
        return self._done and self._latest is None and self._error is None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest is not None:
                out, self._latest = self._latest, None
                return out
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            if self._done:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()
