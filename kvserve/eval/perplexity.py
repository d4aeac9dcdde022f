"""Perplexity as llama.cpp's `llama-perplexity` computes it (tools/perplexity/perplexity.cpp,
`perplexity()`), so a kvserve number and a llama.cpp number on the same file compare directly.

    ids = tokenize(text)                  BOS first when the model's tokenizer adds one
    chunk c = ids[c*ctx : (c+1)*ctx]      c < len(ids) // ctx; the tail is dropped
                                          position 0 set to BOS when the model adds one

    chunk positions  0 ........... first-1 | first   first+1 ............ ctx-1
                     context only            logits at first..ctx-2 score the tokens at
                                             first+1..ctx-1: ctx-1-first per chunk

with first = ctx/2 (255 tokens scored per chunk at ctx 512). Each scored token adds its
negative log-likelihood v to nll and v^2 to nll2 (float64); after chunk i the running
PPL = exp(nll / count) is what llama.cpp prints as `[i]`, and at the end

    stderr = PPL * sqrt((nll2/count - (nll/count)^2) / (count - 1))

The numbers come from the engine's prompt_logprobs: prompt_logprobs[i] is the logprob of the
token at position i given positions 0..i-1, so the scored positions are first+1..ctx-1. Each
chunk is its own request (no shared prefix, and prompt logprobs bypass the prefix cache), so
the engine's token budget (max_num_batched_tokens) decides how many chunks one step runs, as
llama.cpp's n_batch does.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.llm_engine import LLMEngine


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    # llama.cpp's standard error of the PPL estimate; nan when fewer than 2 tokens were scored
    # (or their NLLs have no variance), where llama.cpp prints an error instead.
    stderr: float
    nll: float  # mean negative log-likelihood (nats) per scored token
    count: int  # tokens scored: num_chunks * (ctx - 1 - ctx/2)
    num_chunks: int
    ctx: int
    num_tokens: int  # tokens of the whole text, BOS included
    chunk_ppls: tuple[float, ...]  # running PPL after each chunk: llama.cpp's [1], [2], ...


def check_ctx(ctx: int) -> None:
    # ctx/2 must be exact (odd ctx would make llama.cpp's first = ctx/2 a floor nobody reads
    # into the number), and ctx 2 scores nothing (ctx - 1 - ctx/2 = 0 tokens per chunk).
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 4 or ctx % 2:
        raise ValueError(f"ctx must be an even integer >= 4 (each chunk scores its second "
                         f"half after the first ctx/2 tokens), got {ctx!r}")


def check_chunks(chunks: int | None) -> None:
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)
                               or chunks < 1):
        raise ValueError(f"chunks must be an integer >= 1 (or None: every whole chunk), "
                         f"got {chunks!r}")


def split_chunks(ids: Sequence[int], ctx: int, chunks: int | None = None,
                 bos_token_id: int | None = None) -> list[list[int]]:
    """llama.cpp's chunks of a tokenized text: min(chunks, len(ids) // ctx) non-overlapping
    runs of ctx tokens from the start, position 0 of each set to bos_token_id when given (the
    model adds BOS). llama.cpp refuses a text of fewer than 2 * ctx tokens; so does this."""
    check_ctx(ctx)
    check_chunks(chunks)
    if len(ids) < 2 * ctx:
        raise ValueError(f"the text has {len(ids)} tokens; perplexity at ctx {ctx} needs at "
                         f"least 2 x ctx = {2 * ctx} (as llama-perplexity): use a longer text "
                         f"or a smaller ctx")
    n = len(ids) // ctx if chunks is None else min(chunks, len(ids) // ctx)
    out = [list(ids[c * ctx:(c + 1) * ctx]) for c in range(n)]
    if bos_token_id is not None:
        for chunk in out:
            chunk[0] = bos_token_id
    return out


class NLLSum:
    """nll, nll2 and count as llama.cpp accumulates them (float64), with its PPL and stderr."""

    def __init__(self) -> None:
        self.nll = 0.0
        self.nll2 = 0.0
        self.count = 0

    def add(self, v: float) -> None:
        self.nll += v
        self.nll2 += v * v
        self.count += 1

    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    def stderr(self) -> float:
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        if self.count < 2 or var <= 0:
            return math.nan
        return self.ppl() * math.sqrt(var / (self.count - 1))


def perplexity(llm_or_engine: Any, text: str, ctx: int = 512, chunks: int | None = None,
               on_chunk: Callable[[int, float], None] | None = None) -> PerplexityResult:
    """The perplexity of `text` on an LLM or LLMEngine, chunked and scored as llama-perplexity
    does (module docstring). The text is tokenized whole, with BOS when the model adds one, as
    llama.cpp's common_tokenize(add_special=true). on_chunk(i, running_ppl) runs after chunk i
    (1-based), in chunk order. Other requests in the engine run alongside, sharing its token
    budget. The engine's max_model_len must exceed ctx: one position for the token it samples
    after each chunk."""
    engine = _engine_of(llm_or_engine)
    return perplexity_of_tokens(engine, engine.tokenizer.encode(text), ctx, chunks, on_chunk)


def perplexity_of_tokens(llm_or_engine: Any, ids: Sequence[int], ctx: int = 512,
                         chunks: int | None = None,
                         on_chunk: Callable[[int, float], None] | None = None
                         ) -> PerplexityResult:
    """perplexity() on a text already tokenized (BOS included when the model adds one)."""
    engine = _engine_of(llm_or_engine)
    tok = engine.tokenizer
    bos = tok.bos_token_id if tok.add_bos_token else None
    parts = split_chunks(ids, ctx, chunks, bos)
    max_len = engine.config.scheduler.max_model_len
    if max_len <= ctx:
        raise ValueError(f"ctx ({ctx}) must be < the engine's max_model_len ({max_len}): each "
                         f"chunk is a prompt of ctx tokens plus the one token the engine "
                         f"samples after it")
    first = ctx // 2
    # Greedy and one token: the sampled token is thrown away; the prompt logprobs are the work.
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    tag = uuid.uuid4().hex[:8]  # request ids that cannot collide with the caller's
    rids = [f"ppl-{tag}-{c}" for c in range(len(parts))]
    acc = NLLSum()
    running: list[float] = []
    finished: dict[int, list[Any]] = {}
    try:
        for rid, chunk in zip(rids, parts):
            engine.add_request(rid, {"prompt_token_ids": chunk}, params)
        while engine.has_unfinished_requests() and len(running) < len(parts):
            for out in engine.step():
                if out.finished and out.request_id.startswith(f"ppl-{tag}-"):
                    finished[int(out.request_id.rsplit("-", 1)[1])] = out.prompt_logprobs
            # Chunks finish in arrival order under FCFS, but add them strictly in order
            # anyway: the running PPL after chunk i must cover exactly chunks 1..i.
            while len(running) in finished:
                c = len(running)
                lps, chunk = finished.pop(c), parts[c]
                for i in range(first + 1, ctx):
                    if lps[i] is None:
                        raise RuntimeError(f"the engine returned no prompt logprob at "
                                           f"position {i} of chunk {c}")
                    acc.add(-lps[i][chunk[i]].logprob)
                running.append(acc.ppl())
                if on_chunk is not None:
                    on_chunk(c + 1, running[-1])
    except BaseException:
        engine.abort_request(rids)
        raise
    if len(running) != len(parts):
        raise RuntimeError(f"the engine finished {len(running)} of {len(parts)} chunks")
    return PerplexityResult(ppl=acc.ppl(), stderr=acc.stderr(), nll=acc.nll / acc.count,
                            count=acc.count, num_chunks=len(parts), ctx=ctx,
                            num_tokens=len(ids), chunk_ppls=tuple(running))


def _engine_of(llm_or_engine: Any) -> LLMEngine:
    # An LLM holds its engine as llm_engine (vLLM's name); anything else is taken as one.
    return getattr(llm_or_engine, "llm_engine", llm_or_engine)
