"""The engine seed (--seed, LLM(seed=...)) on the default model: it fixes the samples of
requests without their own seed, run after run and process after process; a request's own
seed still wins; and building an engine changes no process-wide state another engine (or the
caller) depends on. References: a second engine built the same way, and the same request
through `kvserve generate` in a fresh process."""

from __future__ import annotations

import gc
import subprocess
import sys
from typing import Any

import torch

from kvserve.engine_args import EngineArgs
from kvserve.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from tests.conftest import run_all

PROMPTS = ["Once upon a time", "The weather today", "My favourite food is", "In 1905,"]
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)


def _sample(engine: LLMEngine, tag: str) -> dict[str, str]:
    """Unseeded temperature-1 requests, plus one with its own seed, run as one batch."""
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", p, unseeded)
    engine.add_request(f"{tag}seeded", PROMPTS[0], SEEDED)
    return {rid: out.outputs[0].text for rid, out in run_all(engine).items()}


def test_engine_seed_fixes_unseeded_samples(make_engine: Any) -> None:
    torch.manual_seed(1)  # the caller's global generator must not matter
    a = _sample(make_engine(seed=7), "r")
    torch.manual_seed(2)
    b = _sample(make_engine(seed=7), "r")
    assert a == b
    c = _sample(make_engine(seed=8), "r")
    unseeded = [f"r{i}" for i in range(len(PROMPTS))]
    assert [c[r] for r in unseeded] != [a[r] for r in unseeded]
    # A request's own seed wins over the engine seed.
    assert c["rseeded"] == a["rseeded"]
    # The default seed (0, as vLLM V1) is a seed too: reproducible without --seed.
    assert _sample(make_engine(), "r") == _sample(make_engine(), "r")


def test_a_second_engine_leaves_the_first_and_the_process_alone(make_engine: Any,
                                                                smollm2: Any) -> None:
    first, ref = make_engine(seed=5), make_engine(seed=5)
    assert _sample(first, "a") == _sample(ref, "a")
    torch.manual_seed(99)
    rng = torch.get_rng_state()
    frozen = gc.get_freeze_count()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # not what configure_threads would pick
    try:
        second = LLMEngine.from_engine_args(EngineArgs(model=smollm2[0], seed=6,
                                                       kv_cache_memory="32MiB"))
        # Threads, gc.freeze and global seeds belong to kvserve.platform.setup_process.
        assert torch.equal(torch.get_rng_state(), rng)
        assert gc.get_freeze_count() == frozen
        assert torch.get_num_threads() == threads + 1
    finally:
        torch.set_num_threads(threads)
    _sample(second, "b")
    assert _sample(first, "c") == _sample(ref, "c")


def test_cli_generate_samples_the_same_in_a_fresh_process(make_engine: Any) -> None:
    engine = make_engine(seed=3)
    engine.add_request("x", PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=16))
    ref = run_all(engine)["x"].outputs[0].text
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "--prompt", PROMPTS[1],
         "--max-tokens", "16", "--temperature", "1.0", "--seed", "3",
         "--kv-cache-memory", "64MiB"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == ref + "\n"
