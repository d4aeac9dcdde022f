"""EngineStream.first_event and PrimedStream (server/serving.py) on bare RequestStreams: the
response waits for the first output, an error that comes first is an HTTP 503 with the
streams released, a cancelled wait (the client left) releases them, and priming takes no
output away from the body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.request_stream import EngineShuttingDown, RequestStream
from kvserve.server.errors import APIError
from kvserve.server.serving import EngineStream, PrimedStream


def _out(rid: str, text: str, finished: bool = False) -> RequestOutput:
    c = CompletionOutput(index=0, text=text, token_ids=list(range(len(text))),
                         cumulative_logprob=None, logprobs=None,
                         finish_reason="length" if finished else None)
    return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[1], prompt_logprobs=None,
                         outputs=[c], finished=finished)


class _Engine:
    """What EngineStream needs of AsyncEngine: release (recorded)."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, stream: RequestStream) -> None:
        self.released.append(stream.request_id)


async def _body(streams: list[PrimedStream]) -> AsyncIterator[str]:
    for s in streams:
        async for out in s:
            yield out.outputs[0].text


def _engine_stream(*ids: str) -> tuple[EngineStream, list[RequestStream]]:
    raw = [RequestStream(i) for i in ids]
    primed = [PrimedStream(s) for s in raw]
    return EngineStream(_body(primed), primed), raw


def test_first_event_waits_for_the_first_output_and_keeps_it() -> None:
    async def run() -> None:
        es, (a, b) = _engine_stream("a", "b")
        eng = _Engine()
        wait = asyncio.ensure_future(es.first_event(eng))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert not wait.done()  # nothing yet: the response must not start
        b.put(_out("b", "x"))  # the second prompt's request comes first
        await asyncio.wait_for(wait, 1)
        assert eng.released == []
        # a's prime was cancelled while it waited; its outputs still reach the body.
        a.put(_out("a", "hello", finished=True))
        b.put(_out("b", "xy", finished=True))
        # The body sees every output: "x" was held by the prime, "xy" followed it.
        assert [t async for t in es.body] == ["hello", "x", "xy"]

    asyncio.run(run())


def test_an_error_before_the_first_output_is_a_503_and_releases_the_streams() -> None:
    async def run() -> None:
        es, (a, b) = _engine_stream("a", "b")
        eng = _Engine()
        wait = asyncio.ensure_future(es.first_event(eng))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        a.fail(EngineShuttingDown("the server is shutting down"))
        with pytest.raises(APIError) as e:
            await asyncio.wait_for(wait, 1)
        assert e.value.status == 503 and e.value.code == "shutting_down"
        assert eng.released == ["a", "b"]

    asyncio.run(run())


def test_a_cancelled_wait_releases_the_streams() -> None:
    async def run() -> None:
        es, _raw = _engine_stream("a", "b")
        eng = _Engine()
        wait = asyncio.ensure_future(es.first_event(eng))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        wait.cancel()  # the client left while its requests waited in the queue
        with pytest.raises(asyncio.CancelledError):
            await wait
        assert eng.released == ["a", "b"]

    asyncio.run(run())


def test_a_stream_that_ends_without_output_primes_to_its_end() -> None:
    async def run() -> None:
        raw = RequestStream("a")
        s = PrimedStream(raw)
        raw.put(_out("a", "done", finished=True))
        await s.prime()
        await s.prime()  # idempotent: takes nothing more
        assert [o.outputs[0].text async for o in s] == ["done"]

    asyncio.run(run())
