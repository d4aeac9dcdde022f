"""AsyncEngine in-process on the default model: priority reaches the scheduler, cancelling a
consumer frees its KV blocks, and a dead engine thread ends every stream and turns /health
to 503 (through the real app, over httpx's ASGI transport)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from kvserve.async_engine import AsyncEngine, EngineDeadError
from kvserve.sampling_params import SamplingParams
from kvserve.server.api import ServerConfig, app_state, build_app


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def _wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_priority_orders_waiting_requests(make_engine: Any) -> None:
    async def run() -> list[str]:
        eng = AsyncEngine(make_engine(max_num_seqs=1))
        eng.start()
        done: list[str] = []

        async def go(rid: str, priority: int, max_tokens: int) -> None:
            async for out in eng.generate("Hello there", _params(max_tokens), rid, priority):
                if out.finished:
                    done.append(rid)

        first = asyncio.create_task(go("first", 0, 12))
        await _wait_for(lambda: eng.stats.num_running == 1)
        # Both wait behind "first"; the smaller priority value runs first, though it came last.
        low = asyncio.create_task(go("low", 5, 2))
        await _wait_for(lambda: eng.stats.num_waiting == 1)
        high = asyncio.create_task(go("high", -5, 2))
        await asyncio.gather(first, low, high)
        await eng.shutdown()
        return done

    assert asyncio.run(run()) == ["first", "high", "low"]


def test_cancelled_consumer_frees_blocks(make_engine: Any) -> None:
    async def run() -> None:
        eng = AsyncEngine(make_engine())
        eng.start()

        async def consume() -> None:
            async for _ in eng.generate("Tell me a story", _params(2000), "long"):
                pass

        task = asyncio.create_task(consume())
        await _wait_for(lambda: eng.stats.kv_cache_usage > 0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_for(lambda: eng.stats.num_running == 0 and eng.stats.kv_cache_usage == 0)
        eng.engine.scheduler.block_pool.check_integrity()
        assert eng.num_in_flight == 0
        await eng.shutdown()

    asyncio.run(run())


def test_dead_engine_ends_streams_and_health(make_engine: Any) -> None:
    async def run() -> None:
        engine = make_engine()
        eng = AsyncEngine(engine)
        app = build_app(ServerConfig(model_name="m"))
        state = app_state(app)
        state.engine = eng
        eng.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            assert (await http.get("/health")).status_code == 200
            stream = await eng.add_request("doomed", "Hello", _params(500))
            await stream.__anext__()
            real_step = engine.step

            def broken_step() -> Any:  # fault injection: the forward pass fails
                engine.step = real_step
                raise RuntimeError("device lost")

            engine.step = broken_step
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            assert not eng.is_healthy
            assert (await http.get("/health")).status_code == 503
            r = await http.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            with pytest.raises(EngineDeadError):
                await eng.add_request("late", "Hello", _params(5))
        await eng.shutdown()

    asyncio.run(run())
