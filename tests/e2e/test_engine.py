"""The engine end to end on the default model: batching, chunking, preemption, prefix cache,
sampling and bad input. References: the same request run alone, and exact text arithmetic."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.sampling_params import SamplingParams
from tests.conftest import run_all


def _prompts(tok: Any, text: str, lengths: list[int]) -> list[list[int]]:
    ids = tok.encode(text)
    out, start = [], 0
    for n in lengths:
        out.append(ids[start:start + n])
        start += 37  # overlapping windows: some prompts share prefixes, most do not
    return out


def test_batch_invariance_with_chunking_and_preemption(make_engine: Any, smollm2: Any,
                                                       gpl_text: str) -> None:
    tok = smollm2[1].tokenizer
    lengths = [5 + (i * 29) % 140 for i in range(24)]
    prompts = _prompts(tok, gpl_text, lengths)
    params = [SamplingParams(temperature=0, max_tokens=8 + (i * 7) % 25, ignore_eos=True)
              for i in range(24)]
    # 64-token budget forces chunked prefill; 48 blocks of 16 (768 tokens) cannot hold all
    # 24 requests (about 2,700 tokens), so the scheduler must preempt.
    engine = make_engine(max_num_batched_tokens=64, num_gpu_blocks_override=49,
                         max_num_seqs=24)
    chunks = []
    execute = engine.runner.execute

    def recording_execute(so: Any) -> Any:
        chunks.extend((sr.start_pos, sr.num_tokens, sr.request.num_prompt_tokens)
                      for sr in so.scheduled)
        return execute(so)

    engine.runner.execute = recording_execute  # type: ignore[method-assign]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    batched = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    assert any(start > 0 and start + n < plen for start, n, plen in chunks), "no chunked prefill"
    engine.scheduler.block_pool.check_integrity()

    alone_engine = make_engine()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        alone_engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        alone = run_all(alone_engine)[str(i)]
        assert batched[str(i)].outputs[0].token_ids == alone.outputs[0].token_ids, f"request {i}"


def test_prefix_cache_reuses_blocks_and_keeps_output(make_engine: Any, smollm2: Any,
                                                     gpl_text: str) -> None:
    tok = smollm2[1].tokenizer
    prefix = tok.encode(gpl_text)[:200]
    q1, q2 = tok.encode(" Question one?"), tok.encode(" What is the second question?")
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = make_engine()
    engine.add_request("a", {"prompt_token_ids": prefix + q1}, sp)
    run_all(engine)
    engine.add_request("b", {"prompt_token_ids": prefix + q2}, sp)
    out_b = run_all(engine)["b"]
    assert out_b.num_cached_tokens == 192  # the 12 full blocks of the shared 200 tokens
    cold = make_engine(enable_prefix_caching=False)
    cold.add_request("b", {"prompt_token_ids": prefix + q2}, sp)
    out_cold = run_all(cold)["b"]
    assert out_cold.num_cached_tokens == 0
    assert out_b.outputs[0].token_ids == out_cold.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine: Any) -> None:
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    engine = make_engine()
    engine.add_request("alone", "Once upon a time", sp)
    alone = run_all(engine)["alone"].outputs[0].token_ids
    for i in range(5):
        engine.add_request(f"noise{i}", f"Noise prompt number {i} says",
                           SamplingParams(temperature=1.0, max_tokens=30))
    engine.add_request("batched", "Once upon a time", sp)
    batched = run_all(engine)["batched"].outputs[0].token_ids
    assert batched == alone
    engine.add_request("other_seed", "Once upon a time", SamplingParams(
        temperature=0.9, top_p=0.95, seed=4321, max_tokens=24, ignore_eos=True))
    assert run_all(engine)["other_seed"].outputs[0].token_ids != alone


def test_stop_string_cuts_text_exactly(make_engine: Any) -> None:
    engine = make_engine()
    prompt = "The three primary colors are"
    engine.add_request("full", prompt, SamplingParams(temperature=0, max_tokens=40,
                                                      ignore_eos=True))
    full = run_all(engine)["full"].outputs[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]  # likely spans a token boundary
    assert stop.strip(), text
    engine.add_request("cut", prompt, SamplingParams(temperature=0, max_tokens=40,
                                                     ignore_eos=True, stop=[stop]))
    cut = run_all(engine)["cut"].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop


def test_n_samples_and_logprobs(make_engine: Any) -> None:
    import math

    engine = make_engine()
    engine.add_request("n", "Tell me a story", SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=12, logprobs=3, ignore_eos=True))
    out = run_all(engine)["n"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # distinct seeded streams
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids) == 12
        total = 0.0
        for tok, lp in zip(o.token_ids, o.logprobs):
            assert tok in lp and 3 <= len(lp) <= 4
            ranks = sorted(v.rank for v in lp.values())
            # The top 3 plus the sampled token, which has rank > 3 when it is a 4th entry.
            assert ranks[:3] == [1, 2, 3] and (len(lp) == 3 or lp[tok].rank > 3)
            by_rank = sorted(lp.values(), key=lambda v: v.rank)
            assert all(a.logprob >= b.logprob for a, b in zip(by_rank, by_rank[1:]))
            assert sum(math.exp(v.logprob) for v in lp.values()) <= 1.0 + 1e-5
            total += lp[tok].logprob
        assert o.cumulative_logprob == pytest.approx(total)


def test_first_scheduled_times_name_requests_as_they_were_added(make_engine: Any) -> None:
    """What a serving layer reads between steps (its queue-time metric): an n > 1 request's
    children are known by the id it was added with, the earliest child's time; a request
    not yet scheduled has none, and a finished one is gone."""
    import time

    engine = make_engine(max_num_seqs=3)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("pair", "Tell me a story", SamplingParams(
        n=2, temperature=0, max_tokens=4, ignore_eos=True))
    engine.add_request("one", "Hello there", params)
    engine.add_request("late", "A third request", params)  # max_num_seqs: 3 rows
    assert engine.first_scheduled_times() == {}
    t0 = time.monotonic()
    engine.step()
    got = engine.first_scheduled_times()
    assert set(got) == {"pair", "one"} and all(t0 <= t <= time.monotonic()
                                               for t in got.values())
    run_all(engine)
    assert engine.first_scheduled_times() == {}
    s = engine.stats()
    assert s.spec is None and s.num_running == s.num_waiting == 0


def test_bad_input_is_rejected_without_disturbing_others(make_engine: Any) -> None:
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref_engine = make_engine(max_model_len=256)
    ref_engine.add_request("good", "A quiet river", sp)
    expected = run_all(ref_engine)["good"].outputs[0].token_ids

    engine = make_engine(max_model_len=256, num_gpu_blocks_override=12)
    engine.add_request("good", "A quiet river", sp)
    engine.step()  # the good request is running
    bad_calls = [
        ({"prompt_token_ids": [1] * 256}, None, "max_model_len"),
        ({"prompt_token_ids": [1] * 200}, SamplingParams(max_tokens=100), "max_model_len"),
        ({"prompt_token_ids": []}, None, "at least one token"),
        ({"prompt_token_ids": [5, 10**6]}, None, "[0, 49151]"),
        ({"prompt_token_ids": [5, -1]}, None, "[0, 49151]"),
        ("hello", SamplingParams(logit_bias={10**7: 1.0}), "logit_bias"),
        # Fits the context but never the 11 usable blocks (176 tokens): rejected up front.
        ({"prompt_token_ids": [5] * 250}, SamplingParams(max_tokens=5), "only 11 usable blocks"),
    ]
    for i, (prompt, params, needle) in enumerate(bad_calls):
        with pytest.raises(ValueError, match=None) as exc:
            engine.add_request(f"bad{i}", prompt, params)
        assert needle in str(exc.value), str(exc.value)
        engine.step()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", "again", sp)
    out = run_all(engine)
    assert list(out) == ["good"]
    assert out["good"].outputs[0].token_ids == expected
    engine.scheduler.block_pool.check_integrity()
