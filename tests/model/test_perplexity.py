"""Perplexity of the default model on GPL-3 at ctx 512, the way llama-perplexity computes it:
non-overlapping 512-token chunks, each scoring its second half (tokens 257..511 given their
prefix). The engine's prompt_logprobs path produces the numbers.

References, both from llama.cpp on the same token ids:
- 18.30: llama-perplexity on these weights dequantized to float32
  (../shared/reference/README.md); llama-cpp-python on the F32 GGUF gives 18.2998.
- 18.354: llama-cpp-python 0.3.36 on the shipped Q4_1 GGUF itself, where llama.cpp quantizes
  the activations to int8 per 32 values before each quantized matmul, as kvserve's default
  "gguf" path does (benchmarks/peers/llama_cpp_perplexity.py).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvserve.sampling_params import SamplingParams
from tests.conftest import run_all


def perplexity(engine: Any, ids: list[int], n_ctx: int = 512) -> float:
    for c in range(len(ids) // n_ctx):
        engine.add_request(str(c), {"prompt_token_ids": ids[c * n_ctx:(c + 1) * n_ctx]},
                           SamplingParams(max_tokens=1, prompt_logprobs=0))
    outs = run_all(engine)
    assert len(outs) == 14
    nll, count = 0.0, 0
    for out in outs.values():
        assert out.num_cached_tokens == 0  # prompt logprobs bypass the prefix cache
        for i in range(n_ctx // 2 + 1, n_ctx):
            nll -= out.prompt_logprobs[i][out.prompt_token_ids[i]].logprob
            count += 1
    return math.exp(nll / count)


# float32 summation-order differences move the 4th digit. The int8 path (with its default
# float16 KV cache, as llama.cpp's) measures 18.395: it rounds activations differently in
# detail from llama.cpp (float32 vs float16 block scales), ~0.2% of PPL here.
@pytest.mark.parametrize("quantization,llama_cpp,tol", [("gguf_exact", 18.30, 0.01),
                                                        ("gguf", 18.354, 0.05)])
def test_gpl3_perplexity_matches_llama_cpp(make_engine: Any, smollm2: Any, gpl_text: str,
                                           quantization: str, llama_cpp: float,
                                           tol: float) -> None:
    engine = make_engine(max_num_batched_tokens=512, quantization=quantization)
    ppl = perplexity(engine, smollm2[1].tokenizer.encode(gpl_text))
    assert abs(ppl - llama_cpp) < tol, ppl
