"""The default model with a quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3) against the
same engine with a float16 KV cache (the default for its GGUF weights).

Greedy output is compared token by token over 48 tokens of eight varied prompts. This
135M-parameter model meets near-ties often: even a float32 KV cache leaves the float16 one's
greedy path on four of these prompts within 25 tokens (measured: at tokens 6, 16, 17 and 23,
where float16's top two logprobs lie 0.01-0.13 nats apart). So the test holds every prompt to
the float16 output up to its first divergence and requires that divergence to be such a
near-tie: the quantized engine picks float16's runner-up, which float16 itself rated within
NEAR_TIE nats of its choice. Measured (2-core EPYC, both ISAs): int8 agrees on all 48 tokens
of 3 prompts and diverges on the others at tokens 2, 6, 14, 16, 23; fp8 agrees on 32+ tokens
of 3 prompts, diverging at 2, 5, 6, 16, 22, 34; every float16 margin there is <= 0.16 nats.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvserve.kv.layout import QuantizedKVCache
from kvserve.sampling_params import SamplingParams
from tests.conftest import run_all

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Here is a list of the planets in our solar system:\n1.",
    "Once upon a time, in a small village by the sea, there lived",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The GNU General Public License is a free, copyleft license for",
    "In 1969, Neil Armstrong",
    "Photosynthesis is the process by which",
]
N_TOKENS = 48
NEAR_TIE = 0.25  # nats between float16's top two logprobs at a divergence (measured <= 0.16)


def greedy(engine: Any) -> dict[str, Any]:
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    return {rid: out.outputs[0] for rid, out in run_all(engine).items()}


@pytest.fixture(scope="module")
def float16_outputs(make_engine: Any) -> dict[str, Any]:
    engine = make_engine(kv_cache_dtype="float16")
    assert not isinstance(engine.runner.kv_cache, QuantizedKVCache)
    return greedy(engine)


@pytest.mark.parametrize("kind,min_whole", [("int8", 3), ("fp8_e4m3", 3)])
def test_greedy_agrees_with_float16_kv_up_to_near_ties(make_engine: Any,
                                                       float16_outputs: dict[str, Any],
                                                       kind: str, min_whole: int) -> None:
    engine = make_engine(kv_cache_dtype=kind)
    assert isinstance(engine.runner.kv_cache, QuantizedKVCache)
    assert engine.runner.kv_cache.kv_dtype == kind
    mine = greedy(engine)
    agree_32 = 0
    for rid, ref in float16_outputs.items():
        got = mine[rid]
        assert len(got.token_ids) == len(ref.token_ids) == N_TOKENS
        j = next((j for j, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b),
                 N_TOKENS)
        agree_32 += j >= 32
        if j == N_TOKENS:
            continue
        # A divergence: float16's own top two at j hold both tokens, NEAR_TIE apart at most.
        lp = ref.logprobs[j]
        assert got.token_ids[j] in lp, (rid, j, "not float16's runner-up")
        margin = lp[ref.token_ids[j]].logprob - lp[got.token_ids[j]].logprob
        assert 0 <= margin <= NEAR_TIE, (rid, j, margin)
        assert j >= 2, (rid, j)  # the stated minimum prefix (prompt 3 measured 2)
    assert agree_32 >= min_whole, agree_32


def test_quantized_cache_holds_about_twice_the_tokens(make_engine: Any) -> None:
    """The same memory: int8 / fp8 blocks take 68 bytes per token, layer and kv head against
    float16's 128 (the scales counted), 1.88x the blocks."""
    f16 = make_engine(kv_cache_dtype="float16").num_blocks
    for kind in ("int8", "fp8_e4m3"):
        n = make_engine(kv_cache_dtype=kind).num_blocks
        assert n == (256 << 20) // (16 * 30 * 2 * 3 * 68)
        assert 1.85 < n / f16 < 1.9


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_prefix_cache_hit_reads_what_was_written(make_engine: Any, kind: str) -> None:
    """Scales are written once per token: a second request reusing the first one's full
    blocks gives the first one's greedy output exactly."""
    engine = make_engine(kv_cache_dtype=kind)
    prompt = PROMPTS[5] + " the GNU General Public License, which is" * 3
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = []
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, params)
        outs.append(run_all(engine)[rid])
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens >= 16
    assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_bad_kv_cache_dtype_is_refused(make_engine: Any) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, float32, "
                                         r"float16, bfloat16, int8, fp8_e4m3 \(fp8: "
                                         r"fp8_e4m3\), got 'fp8_e5m2'"):
        make_engine(kv_cache_dtype="fp8_e5m2")


def test_vllms_fp8_is_e4m3(make_engine: Any) -> None:
    """vLLM's `--kv-cache-dtype fp8` (e4m3 on NVIDIA GPUs) runs the fp8_e4m3 cache here."""
    engine = make_engine(kv_cache_dtype="fp8")
    assert engine.config.cache.kv_cache_dtype == "fp8_e4m3"
    assert isinstance(engine.runner.kv_cache, QuantizedKVCache)
    assert engine.runner.kv_cache.kv_dtype == "fp8_e4m3"


def test_start_up_reports_blocks_and_tokens(caplog: pytest.LogCaptureFixture) -> None:
    from kvserve.engine_args import EngineArgs
    from kvserve.llm_engine import LLMEngine

    with caplog.at_level(logging.INFO, logger="kvserve"):
        engine = LLMEngine.from_engine_args(EngineArgs(kv_cache_memory="64MiB",
                                                       kv_cache_dtype="int8"))
    n = engine.num_blocks - 1
    assert f"KV cache (int8): {n} blocks x 16 tokens = {16 * n} tokens" in caplog.text


@pytest.fixture(scope="module")
def float16_ppl(make_engine: Any, gpl_text: str) -> float:
    from kvserve.eval.perplexity import perplexity

    return perplexity(make_engine(kv_cache_dtype="float16", max_num_batched_tokens=512),
                      gpl_text, ctx=512).ppl


# Measured on the 2-core EPYC: float16 18.3947, int8 18.4084 (+0.07%), fp8_e4m3 18.5097
# (+0.63%). The targets: int8 within +1% of float16 KV, fp8 within +2%.
@pytest.mark.parametrize("kind,rel", [("int8", 0.01), ("fp8_e4m3", 0.02)])
def test_gpl3_perplexity_close_to_float16_kv(make_engine: Any, gpl_text: str,
                                             float16_ppl: float, kind: str, rel: float) -> None:
    from kvserve.eval.perplexity import perplexity

    result = perplexity(make_engine(kv_cache_dtype=kind, max_num_batched_tokens=512),
                        gpl_text, ctx=512)
    assert (result.num_chunks, result.count) == (14, 14 * 255)
    assert abs(float16_ppl - 18.395) < 0.05, float16_ppl  # test_perplexity.py's measurement
    assert float16_ppl * (1 - rel) < result.ppl < float16_ppl * (1 + rel), (result.ppl,
                                                                            float16_ppl)
