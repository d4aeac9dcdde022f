"""Perplexity of the default model on GPL-3 at ctx 512, the way llama-perplexity computes it:
non-overlapping 512-token chunks, each scoring its second half (tokens 257..511 given their
prefix). kvserve.eval.perplexity computes it from the engine's prompt_logprobs.

References, both from llama.cpp on the same token ids:
- 18.30: llama-perplexity on these weights dequantized to float32
  (../shared/reference/README.md); llama-cpp-python on the F32 GGUF gives 18.2998.
- 18.354: llama-cpp-python 0.3.36 on the shipped Q4_1 GGUF itself, where llama.cpp quantizes
  the activations to int8 per 32 values before each quantized matmul, as kvserve's default
  "gguf" path does (benchmarks/peers/llama_cpp_perplexity.py).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest

from kvserve.eval.perplexity import NLLSum, perplexity, split_chunks


# float32 summation-order differences move the 4th digit. The int8 path (with its default
# float16 KV cache, as llama.cpp's) measures 18.395: it rounds activations differently in
# detail from llama.cpp (float32 vs float16 block scales), ~0.2% of PPL here.
@pytest.mark.parametrize("quantization,llama_cpp,tol", [("gguf_exact", 18.30, 0.01),
                                                        ("gguf", 18.354, 0.05)])
def test_gpl3_perplexity_matches_llama_cpp(make_engine: Any, gpl_text: str,
                                           quantization: str, llama_cpp: float,
                                           tol: float) -> None:
    engine = make_engine(max_num_batched_tokens=512, quantization=quantization)
    seen: list[int] = []
    result = perplexity(engine, gpl_text, ctx=512, on_chunk=lambda i, _ppl: seen.append(i))
    # 7,639 tokens: 14 whole chunks of 512, 255 scored tokens each, reported in order.
    assert (result.num_tokens, result.num_chunks, result.count) == (7639, 14, 14 * 255)
    assert seen == list(range(1, 15)) and result.chunk_ppls[-1] == result.ppl
    assert abs(result.ppl - llama_cpp) < tol, result.ppl
    assert not engine.has_unfinished_requests()


def test_split_chunks_as_llama_cpp() -> None:
    ids = list(range(100, 125))  # 25 tokens at ctx 8: 3 whole chunks, the last token dropped
    assert split_chunks(ids, 8) == [ids[0:8], ids[8:16], ids[16:24]]
    assert split_chunks(ids, 8, chunks=2) == [ids[0:8], ids[8:16]]
    assert split_chunks(ids, 8, chunks=9) == split_chunks(ids, 8)
    # A model that adds BOS gets it at position 0 of every chunk, not only the text's first.
    assert [c[0] for c in split_chunks(ids, 8, bos_token_id=1)] == [1, 1, 1]
    assert split_chunks(ids, 8, bos_token_id=1)[1][1:] == ids[9:16]
    assert ids[8] == 108  # the caller's ids are left alone


@pytest.mark.parametrize("ctx,chunks,message", [
    (7, None, "ctx must be an even integer >= 4"), (2, None, "ctx must be an even integer >= 4"),
    (0, None, "ctx must be an even integer >= 4"), (8, 0, "chunks must be an integer >= 1"),
    (16, None, "the text has 25 tokens; perplexity at ctx 16 needs at least 2 x ctx = 32")])
def test_split_chunks_refuses(ctx: int, chunks: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_chunks(list(range(25)), ctx, chunks)


def test_nll_sum_is_llama_cpps_formula() -> None:
    nlls = [2.5, 0.25, 4.0, 1.0, 3.125, 0.5]
    acc = NLLSum()
    for v in nlls:
        acc.add(v)
    ppl = math.exp(statistics.fmean(nlls))
    assert acc.ppl() == pytest.approx(ppl, rel=1e-15)
    # llama.cpp: ppl * sqrt((mean(v^2) - mean(v)^2) / (n - 1)), the population deviation over
    # sqrt(n - 1), which is the sample deviation over sqrt(n).
    assert acc.stderr() == pytest.approx(ppl * statistics.stdev(nlls) / math.sqrt(len(nlls)),
                                         rel=1e-12)
    one = NLLSum()
    one.add(1.0)
    assert math.isnan(one.stderr())  # no spread to estimate from one token
