"""AsyncEngine.snapshot() in-process on the default model: the engine thread's picture of the
block pool and its requests, held to the scheduler's own block tables and to the block
arithmetic (a shared prompt's full blocks, the cached blocks a finished request leaves)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvserve.async_engine import AsyncEngine
from kvserve.request_stream import EngineDeadError
from kvserve.sampling_params import SamplingParams

PROMPT = "Once upon a time, in a land far away, there lived a curious robot who " * 3


async def _wait_for(cond: Any, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_snapshot_pictures_blocks_and_requests(make_engine: Any) -> None:
    async def run() -> None:
        eng = AsyncEngine(make_engine(max_num_seqs=2))
        eng.start()
        bs = eng.engine.config.cache.block_size
        n_prompt = len(eng.tokenizer.encode(PROMPT))
        assert n_prompt % bs and n_prompt > 2 * bs  # full blocks then a partial one
        params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
        snap = await eng.snapshot()
        assert snap.block_states == "n" + "f" * (eng.engine.num_blocks - 1)
        assert snap.requests == () and snap.block_size == bs

        async def consume(rid: str) -> None:
            async for _ in eng.generate(PROMPT, params, rid):
                pass

        first = asyncio.create_task(consume("first"))

        async def first_running() -> bool:
            s = await eng.snapshot()
            return bool(s.requests) and s.requests[0].num_output_tokens > 0

        await _wait_for(first_running)
        # The second request finds the first's full prompt blocks in the prefix cache.
        second = asyncio.create_task(consume("second"))
        third = asyncio.create_task(consume("third"))  # waits: max_num_seqs is 2

        async def both_running() -> bool:
            s = await eng.snapshot()
            return [r.status for r in s.requests] == ["running", "running", "waiting"]

        await _wait_for(both_running)
        a, b = await asyncio.gather(eng.snapshot(), eng.snapshot())
        assert a is b  # asked at once: one snapshot, taken once
        by_id = {r.request_id: r for r in a.requests}
        assert list(by_id) == ["first", "second", "third"]
        assert a.stats.num_running == 2 and a.stats.num_waiting == 1
        held = {rid: by_id[rid].num_blocks for rid in ("first", "second")}
        for rid in held:  # between steps a request holds the blocks of its computed tokens
            r = by_id[rid]
            assert r.num_prompt_tokens == n_prompt and r.max_tokens == 3000
            assert r.num_computed_tokens == n_prompt + r.num_output_tokens - 1
            assert r.num_blocks == -(-r.num_computed_tokens // bs)
        assert by_id["second"].num_cached_tokens == (n_prompt // bs) * bs
        assert by_id["third"].num_blocks == 0 and by_id["third"].num_output_tokens == 0
        states = a.block_states
        assert states.count("s") == n_prompt // bs
        assert states.count("u") + 2 * states.count("s") == sum(held.values())

        for t in (first, second, third):
            t.cancel()
        await asyncio.gather(first, second, third, return_exceptions=True)

        async def idle() -> bool:
            s = await eng.snapshot()
            return not s.requests and s.stats.kv_cache_usage == 0

        await _wait_for(idle)
        states = (await eng.snapshot()).block_states
        assert "u" not in states and "s" not in states and states[0] == "n"
        # Every block the requests filled stays cached (free, hashed) until reused.
        cached = sum(c.num_computed_tokens // bs for c in by_id.values())
        assert states.count("c") >= cached - n_prompt // bs  # the shared blocks count once
        eng.engine.scheduler.block_pool.check_integrity()
        await eng.shutdown()
        with pytest.raises(EngineDeadError):
            await eng.snapshot()

    asyncio.run(run())
