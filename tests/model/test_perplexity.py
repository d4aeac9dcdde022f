"""Perplexity of the default model on GPL-3 at ctx 512, the way llama-perplexity computes it:
non-overlapping 512-token chunks, each scoring its second half (tokens 257..511 given their
prefix). llama.cpp reports PPL 18.30 for these weights dequantized to float32
(../shared/reference/README.md). The engine's prompt_logprobs path produces the numbers."""

from __future__ import annotations

import math
from typing import Any

from kvserve.sampling_params import SamplingParams
from tests.conftest import run_all


def test_gpl3_perplexity_matches_llama_cpp(make_engine: Any, smollm2: Any,
                                           gpl_text: str) -> None:
    ids = smollm2[1].tokenizer.encode(gpl_text)
    n_ctx = 512
    engine = make_engine(max_num_batched_tokens=n_ctx)
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
    ppl = math.exp(nll / count)
    # llama.cpp prints two decimals; float32 summation-order differences move the 4th.
    assert abs(ppl - 18.30) < 0.01, ppl
