"""LLMEngine.load / from_loaded: a model in memory without a KV cache, and engines built
around it in turn (what a server's warm model is), each giving the tokens of an engine
loaded from scratch."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from kvserve import SamplingParams
from kvserve.engine_args import EngineArgs
from kvserve.llm_engine import LLMEngine
from tests.e2e.test_tensor_parallel import save_tiny

PROMPTS = [[5, 17, 99, 3, 42], [200, 201, 9, 9]]


def _greedy(engine: LLMEngine) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[str(i)] for i in range(len(PROMPTS))]


def test_engines_built_in_turn_on_one_loaded_model(tmp_path: Path) -> None:
    save_tiny(tmp_path, "llama", seed=5)
    args = EngineArgs(model=str(tmp_path), kv_cache_memory="8MiB")
    want = _greedy(LLMEngine.from_engine_args(args))
    loaded = LLMEngine.load(args)
    first = LLMEngine.from_loaded(loaded)
    assert _greedy(first) == want
    kv = weakref.ref(first.runner.kv_cache)
    del first  # a warm model: its engine (and KV cache) gone, the weights kept
    gc.collect()
    assert kv() is None
    second = LLMEngine.from_loaded(loaded)
    assert second.model is loaded.model  # shared, not copied
    assert second.num_blocks == LLMEngine.num_kv_blocks(loaded.config)
    assert _greedy(second) == want


def test_an_engine_on_its_share_of_the_cores(tmp_path: Path) -> None:
    """AsyncEngine.build(cores=...): the engine thread runs on those cores only (a server's
    hot slot), and the caller's thread keeps its own."""
    import asyncio
    import os

    import torch

    from kvserve.async_engine import AsyncEngine

    save_tiny(tmp_path, "llama", seed=5)
    loaded = LLMEngine.load(EngineArgs(model=str(tmp_path), kv_cache_memory="8MiB"))
    mine, threads = os.sched_getaffinity(0), torch.get_num_threads()
    share = [min(mine)]

    async def main() -> set[int]:
        engine = AsyncEngine.build(lambda: LLMEngine.from_loaded(loaded), cores=share)
        engine.start()
        try:
            out = [o async for o in engine.generate(
                {"prompt_token_ids": PROMPTS[0]},
                SamplingParams(temperature=0, max_tokens=3), "r")]
            assert out[-1].finished
            thread = engine.engine_thread.thread
            assert thread is not None
            return os.sched_getaffinity(thread.native_id)
        finally:
            await engine.shutdown(1.0)

    assert asyncio.run(main()) == set(share)
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == (mine, threads)
