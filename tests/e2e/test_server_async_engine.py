"""AsyncEngine in-process on the default model: priority reaches the scheduler, cancelling a
consumer frees its KV blocks, and a dead engine thread ends every stream and turns /health
to 503 (through the real app, over httpx's ASGI transport)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from kvserve.async_engine import AsyncEngine
from kvserve.request_stream import EngineDeadError
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import QueueFullError
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


def _app(eng: AsyncEngine) -> tuple[Any, httpx.AsyncClient]:
    app = build_app(ServerConfig(model_name="m"))
    app_state(app).engine = eng
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return app, client


def test_dead_engine_fails_waiting_requests_with_503_and_reports_death(make_engine: Any
                                                                        ) -> None:
    async def run() -> None:
        engine = make_engine()
        eng = AsyncEngine(engine)
        died: list[str] = []
        eng.on_dead = died.append
        eng.start()
        _app_, http = _app(eng)
        async with http:
            real_step = engine.step
            steps = 0

            def failing_step() -> Any:  # fault injection: the forward fails mid-request
                nonlocal steps
                steps += 1
                if steps == 3:
                    raise RuntimeError("device lost")
                return real_step()

            engine.step = failing_step
            r = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 50,
                                                         "ignore_eos": True})
            # A non-streamed request cut by the engine's death: OpenAI's 503, not a 500.
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "engine_dead"
            await _wait_for(lambda: bool(died))
            assert died == ["RuntimeError: device lost"]
        await eng.shutdown()

    asyncio.run(run())


def test_watchdog_turns_health_503_while_a_step_hangs(make_engine: Any) -> None:
    async def run() -> None:
        engine = make_engine()
        eng = AsyncEngine(engine, watchdog_timeout=0.5)
        eng.start()
        _app_, http = _app(eng)
        async with http:
            real_step = engine.step
            release = threading.Event()

            def hung_step() -> Any:  # fault injection: a step that never returns (till told)
                release.wait(30)
                return real_step()

            engine.step = hung_step
            stream = await eng.add_request("stuck", "Hello", _params(4))
            await asyncio.sleep(1.2)
            assert not eng.is_healthy and eng.is_alive
            r = await http.get("/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled"
            engine.step = real_step
            release.set()
            async for out in stream:
                final = out
            assert final.finished and len(final.outputs[0].token_ids) == 4
            assert eng.is_healthy and (await http.get("/health")).status_code == 200
            # Idle with nothing in flight is never "stalled", however long it lasts.
            await asyncio.sleep(1.0)
            assert eng.stalled_for() == 0.0 and eng.is_healthy
            # Draining: 503 too, and new requests are refused with shutting_down.
            eng.begin_drain()
            r = await http.get("/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            r = await http.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        await eng.shutdown()

    asyncio.run(run())


def _schema(i: int) -> dict[str, Any]:
    return {"type": "object", "required": [f"k{i}"],
            "properties": {f"k{i}": {"type": "string"}, f"n{i}": {"type": "integer"}}}


def test_grammars_compile_after_the_cheap_checks_in_a_bounded_pool(make_engine: Any) -> None:
    from kvserve.sampling_params import StructuredOutputsParams

    def json_params(i: int, **kw: Any) -> SamplingParams:
        kw.setdefault("max_tokens", 4)
        return SamplingParams(structured_outputs=StructuredOutputsParams(json=_schema(i)),
                              **kw)

    async def run() -> None:
        engine = make_engine(max_model_len=1024, max_waiting_requests=1, max_num_seqs=1)
        so = engine.structured_output
        eng = AsyncEngine(engine, grammar_timeout=0.001, max_pending_grammars=1)
        eng.start()
        # Refused for length, a bad logit_bias id or a logprobs budget: nothing compiled.
        for prompt, kw in (([5] * 1100, {}), ("Hello", {"logit_bias": {10**7: 1.0}}),
                           ([5] * 10, {"n": 128, "logprobs": 20, "max_tokens": None})):
            with pytest.raises(ValueError, match="max_model_len|logit_bias|logprob entries"):
                p = json_params(0, **kw)
                await eng.add_request(f"bad{len(str(kw))}", prompt, p)
        assert so.num_compiled == 0
        # The queue bound comes before any work: fill it (one running, one waiting).
        held = [await eng.add_request("h0", "Hello", _params(200))]
        await _wait_for(lambda: eng.stats.num_running == 1)
        held.append(await eng.add_request("h1", "Hello", _params(200)))
        await _wait_for(lambda: eng.stats.num_waiting == 1)
        with pytest.raises(QueueFullError):
            await eng.add_request("full", "Hello", json_params(1))
        assert so.num_compiled == 0
        for s in held:
            eng.release(s)
        await _wait_for(lambda: eng.stats.num_running == 0 and eng.stats.num_waiting == 0)
        # A compile slower than its timeout is a 400-style ValueError; it keeps its slot in the
        # bounded pool until the thread is done, so the next grammar is refused meanwhile.
        with pytest.raises(ValueError, match="took longer than 0.001s to compile"):
            await eng.add_request("slow", "Hello", json_params(2))
        with pytest.raises(QueueFullError, match="grammars are being compiled"):
            await eng.add_request("next", "Hello", json_params(3))
        await _wait_for(lambda: eng.admission.grammars_pending == 0)
        eng.admission.grammar_timeout = 30.0
        stream = await eng.add_request("ok", "Hello", json_params(4, temperature=0))
        async for out in stream:
            final = out
        # "slow" and "ok" compiled, once each: the engine thread used the compiled grammar.
        assert final.finished and so.num_compiled == 2
        await eng.shutdown()

    asyncio.run(run())
