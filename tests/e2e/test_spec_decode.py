"""Speculative decoding end to end on the default model: greedy output with speculation is
token for token the output without it, for every proposer, alone and in mixed batches with
chunked prefill, preemption and prefix caching; stop strings, max_tokens, logprobs,
penalties, seeds, n > 1 and json_schema compose with it. The reference is the same engine
without speculation."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from kvserve.llm_engine import WARM_UP_ROWS
from kvserve.loader import resolve_model
from kvserve.request import Request
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.sampler import Sampler
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.spec.base import DraftStops
from kvserve.spec.policy import _PRIOR_ALPHA
from tests.conftest import run_all

# adaptive False: draft K whenever the proposer has drafts, so every test exercises them.
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False},
    "self_draft": {"method": "self_draft", "num_speculative_tokens": 3, "num_layers": 24,
                   "adaptive": False},
    "draft_model": {"method": "draft_model", "model": None, "num_speculative_tokens": 3,
                    "quantization": "gguf_exact", "adaptive": False},
    "medusa": {"method": "medusa", "model": None, "num_speculative_tokens": 3,
               "adaptive": False},
}


@pytest.fixture(scope="module")
def medusa_heads(make_engine: Any, gpl_text: str, tmp_path_factory: pytest.TempPathFactory
                 ) -> str:
    """Three Medusa heads for the default model, trained briefly on its own labels."""
    from kvserve.spec.medusa_train import TrainArgs, train_medusa

    out = str(tmp_path_factory.mktemp("medusa"))
    a = TrainArgs(num_heads=3, steps=40, max_tokens=2048, gen_prompts=8, gen_tokens=48)
    train_medusa(make_engine(), gpl_text, out, a, progress=False)
    return out


def _spec(name: str, request: pytest.FixtureRequest | None = None) -> dict[str, Any]:
    spec = dict(SPECS[name])
    if name == "medusa":
        assert request is not None
        spec["model"] = request.getfixturevalue("medusa_heads")
    elif "model" in spec:
        spec["model"] = resolve_model(None)  # the default model's blocks, run in float32
    return spec


def _chat(tok: Any, text: str) -> list[int]:
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def _prompts(tok: Any, gpl: str, n: int) -> list[list[int]]:
    """Copy tasks (n-gram friendly) and open ones, some sharing a prefix."""
    out = []
    for i in range(n):
        window = gpl[300 * i: 300 * i + 120 + 40 * (i % 5)]
        if i % 3 == 0:
            out.append(_chat(tok, f"Repeat this text exactly:\n{window}"))
        elif i % 3 == 1:
            out.append(_chat(tok, f"Summarize: {window}"))
        else:
            out.append(tok.encode(gpl[:200]) + tok.encode(window[:60]))  # shared prefix
    return out


def _outputs(engine: Any, prompts: list[list[int]], params: list[SamplingParams]
             ) -> dict[str, Any]:
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    return run_all(engine)


@pytest.mark.parametrize("method", list(SPECS))
def test_greedy_identity_in_mixed_batches_with_chunking_preemption_and_prefix_cache(
        make_engine: Any, smollm2: Any, gpl_text: str, method: str,
        request: pytest.FixtureRequest) -> None:
    tok = smollm2[1].tokenizer
    prompts = _prompts(tok, gpl_text, 18)
    params = [SamplingParams(temperature=0, max_tokens=20 + (i * 7) % 17, ignore_eos=True)
              for i in range(18)]
    # A 64-token budget chunks the prompts; 40 blocks of 16 cannot hold all 18 requests.
    kw = dict(max_num_batched_tokens=64, num_gpu_blocks_override=40, max_num_seqs=18)
    plain = _outputs(make_engine(**kw), prompts, params)
    engine = make_engine(speculative_config=_spec(method, request), **kw)
    spec = _outputs(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.prefix_cache_hits > 0
    for i in range(18):
        assert spec[str(i)].outputs[0].token_ids == plain[str(i)].outputs[0].token_ids, i
    st = engine.runner.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0, "no draft was accepted"
    assert st.num_accepted_tokens < st.num_draft_tokens, "no draft was rejected"
    engine.scheduler.block_pool.check_integrity()


def test_greedy_identity_alone(make_engine: Any, smollm2: Any, gpl_text: str) -> None:
    tok = smollm2[1].tokenizer
    prompt = _chat(tok, "Repeat this text exactly:\n" + gpl_text[1000:1500])
    sp = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)]
    plain = _outputs(make_engine(), [prompt], sp)["0"].outputs[0]
    engine = make_engine(speculative_config=_spec("ngram"))
    out = _outputs(engine, [prompt], sp)["0"].outputs[0]
    assert out.token_ids == plain.token_ids and out.text == plain.text
    # A copy task: a verify step adds well over one token on average.
    assert engine.runner.spec_stats.mean_accepted_length > 1.5


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_rewrite_that_joins_wrapped_lines_is_drafted_from_the_respaced_prompt(
        make_engine: Any, smollm2: Any, gpl_text: str, method: str) -> None:
    """The GPL's first paragraph, wrapped at 72 columns, to repeat: the model writes it on
    one line. The lookups that also read the prompt re-spaced (spec/respace.py) get more of
    their drafts accepted and waste fewer; the output stays plain decoding's."""
    para = gpl_text[gpl_text.index("  The licenses for most"):]
    para = para[:para.index("\n\n")]
    tok = smollm2[1].tokenizer
    prompt = _chat(tok, "Repeat this text exactly:\n\n" + para)
    sp = [SamplingParams(temperature=0, max_tokens=96)]
    plain = _outputs(make_engine(), [prompt], sp)["0"].outputs[0]
    assert "designed\nto take" in para and "designed to take" in plain.text  # joined
    counts = {}
    for on in (True, False):
        engine = make_engine(speculative_config={**_spec(method), "num_speculative_tokens": 8,
                                                 "respace_prompt": on})
        assert _outputs(engine, [prompt], sp)["0"].outputs[0].token_ids == plain.token_ids
        st = engine.runner.spec_stats
        counts[on] = (st.num_accepted_tokens, st.num_draft_tokens - st.num_accepted_tokens)
    (acc_on, lost_on), (acc_off, lost_off) = counts[True], counts[False]
    assert acc_on > acc_off and lost_on <= lost_off, counts


def test_a_draft_model_stops_where_the_policy_prices_say(make_engine: Any, smollm2: Any,
                                                         gpl_text: str) -> None:
    # DraftStops: a draft is kept while the product of the draft's confidences covers its
    # row's price (keep), and another forward runs while that times alpha covers more.
    tok = smollm2[1].tokenizer
    engine = make_engine(speculative_config=_spec("draft_model"))
    engine.add_request("0", {"prompt_token_ids": _chat(tok, "Summarize: " + gpl_text[:300])},
                       SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for _ in range(4):
        engine.step()
    req = engine.scheduler.running[0]
    proposer = engine.runner.proposer
    blocks = [engine.scheduler.kv_cache_manager.get_block_ids("0")]
    confs: list[float] = []
    sample = proposer._sample

    def recorded(logits: Any, meta: Any) -> Any:
        out = sample(logits, meta)
        confs.extend(out[2])
        return out

    proposer._sample = recorded

    def propose(keep: list[float], more: list[float]) -> list[int]:
        confs.clear()
        return proposer.propose([req], [3], blocks, DraftStops(keep, more, [1.0]))[0]

    full = propose([0.0] * 3, [0.0] * 3)
    assert len(full) == 3 and proposer.propose([req], [3], blocks)[0] == full
    # Each draft kept iff the product of the confidences so far reaches keep[j].
    sure = [math.prod(confs[:j + 1]) for j in range(3)]
    assert propose([0.0, sure[1] + 1e-6, 0.0], [0.0] * 3) == full[:1]
    assert propose([0.0, sure[1] - 1e-6, sure[2] + 1e-6], [0.0] * 3) == full[:2]
    assert propose([1.01] * 3, [0.0] * 3) == []  # none is sure enough: no forward wasted on
    assert len(confs) == 1  # ... a second
    # Another forward runs iff the product so far reaches more[j] (alpha 1 here).
    assert propose([0.0] * 3, [0.0, sure[0] + 1e-6, 0.0]) == full[:1] and len(confs) == 1
    assert propose([0.0] * 3, [0.0, sure[0] - 1e-6, sure[1] + 1e-6]) == full[:2]
    run_all(engine)


def test_a_draft_lm_head_over_part_of_the_vocabulary_drafts_as_the_whole_row_would(
        make_engine: Any, smollm2: Any, gpl_text: str) -> None:
    # draft_vocab_size: the draft's lm_head computes the first n token ids only. Greedy rows
    # without processors take the argmax of those (no scatter into V); any other row, and
    # the reference here, scatters them into a row of V with -inf elsewhere.
    tok = smollm2[1].tokenizer
    spec = dict(_spec("draft_model"), draft_vocab_size=20000)
    engine = make_engine(speculative_config=spec)
    proposer = engine.runner.proposer
    assert proposer.vocab_ids is not None and len(proposer.vocab_ids) >= 20000
    V = proposer.vocab_size
    logits = torch.randn(3, len(proposer.vocab_ids), generator=torch.Generator().manual_seed(0))
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the lower token id wins
    full = torch.full((3, V), float("-inf"))
    full[:, proposer.vocab_ids] = logits
    reqs = [Request(str(i), [1, 2], SamplingParams(temperature=0, max_tokens=4), max_tokens=4)
            for i in range(3)]
    meta = SamplingMetadata.from_requests(reqs, V, last_row_only=True)
    tokens, q, conf = proposer._sample(logits.clone(), meta)
    assert tokens == full.argmax(dim=1).tolist() and q is None and tokens[2] == 7
    assert conf == pytest.approx(full.softmax(dim=1).max(dim=1).values.tolist(), rel=1e-5)
    # A penalty changes the row: the scatter path, whose argmax may differ.
    pen = [Request(str(i), [1, 2, tokens[i]], SamplingParams(
        temperature=0, max_tokens=4, repetition_penalty=2.0), max_tokens=4) for i in range(3)]
    meta = SamplingMetadata.from_requests(pen, V, last_row_only=True)
    assert not meta.no_penalties
    penalized = Sampler.process_logits(full.clone(), meta)
    assert proposer._sample(logits.clone(), meta)[0] == penalized.argmax(dim=1).tolist()
    # And through the engine: the target's own output, drafts accepted.
    prompt = _chat(tok, "Repeat this text exactly:\n" + gpl_text[3000:3300])
    sp = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    plain = _outputs(make_engine(), [prompt], sp)["0"].outputs[0].token_ids
    assert _outputs(engine, [prompt], sp)["0"].outputs[0].token_ids == plain
    assert engine.runner.spec_stats.num_accepted_tokens > 0


def test_a_draft_whose_lm_head_is_quantized_keeps_its_whole_vocabulary(
        make_engine: Any, smollm2: Any, gpl_text: str, tmp_path: Any) -> None:
    # A `kvserve quantize --lm-head` export holds no float lm_head rows to cut: the draft keeps
    # its 4-bit lm_head over the whole vocabulary (draft_vocab_size asked for less) and still
    # drafts toward the target's own output.
    from kvserve.quant.quantize_args import QuantizeArgs
    from kvserve.quantize import quantize_checkpoint

    out = str(tmp_path / "draft")
    with torch.inference_mode():
        quantize_checkpoint(resolve_model(None), out,
                            QuantizeArgs(method="int4", group_size=32, lm_head=True))
    spec = {**_spec("draft_model"), "model": out, "draft_vocab_size": 20000}
    del spec["quantization"]  # found from the export's config: gptq
    engine = make_engine(speculative_config=spec)
    proposer = engine.runner.proposer
    assert proposer.vocab_ids is None
    assert proposer.model.lm_head.weight.dtype == torch.uint8  # its packed 4-bit blocks
    prompt = _chat(smollm2[1].tokenizer, "Repeat this text exactly:\n" + gpl_text[3000:3300])
    sp = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    plain = _outputs(make_engine(), [prompt], sp)["0"].outputs[0].token_ids
    assert _outputs(engine, [prompt], sp)["0"].outputs[0].token_ids == plain
    assert engine.runner.spec_stats.num_accepted_tokens > 0


def test_a_draft_model_reads_every_position_once_but_rejected_drafts(
        make_engine: Any, smollm2: Any, gpl_text: str) -> None:
    # The drafts a proposal fed have their KV in the draft's cache: as far as the target
    # accepts them, the next proposal starts after them. Every position is read at least
    # once, and again only where a fed draft was rejected.
    tok = smollm2[1].tokenizer
    prompt = _chat(tok, "Repeat this text exactly:\n" + gpl_text[2000:2400])
    engine = make_engine(speculative_config=_spec("draft_model"))
    proposer = engine.runner.proposer
    read: list[int] = []  # every position the draft is fed, in order
    forward = proposer._forward

    def counted(scheduled: Any) -> Any:
        for s in scheduled:
            read.extend(range(s.start_pos, s.start_pos + s.num_tokens))
        return forward(scheduled)

    proposer._forward = counted
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    _outputs(engine, [prompt], [sp])
    st = engine.runner.spec_stats
    assert st.num_accepted_tokens >= 24, st  # the target's own blocks draft: most accepted
    assert set(read) == set(range(max(read) + 1))  # none skipped
    assert len(read) <= max(read) + 1 + st.num_draft_tokens - st.num_accepted_tokens


def test_a_self_draft_runs_in_the_targets_cache_and_reads_one_token_per_proposal(
        make_engine: Any, smollm2: Any, gpl_text: str) -> None:
    # The target's first layers over the target's own KV: no cache of its own, no prompt
    # to read first (each proposal feeds the last sampled token, then its drafts), and its
    # drafts are those of the same layers drafting in a cache of their own (as it ran
    # before), which read every prompt first: the shared KV is the same KV.
    tok = smollm2[1].tokenizer
    prompts = [_chat(tok, "Repeat this text exactly:\n" + gpl_text[2000:2300]),
               _chat(tok, "Write a poem about the sea.")]
    spec = {**_spec("self_draft"), "num_layers": 28}
    engine = make_engine(speculative_config=spec)
    proposer = engine.runner.proposer
    assert proposer.shares_target_kv and proposer.kv_bytes_per_block == 0
    assert proposer.runner.kv_cache.data_ptr() == engine.runner.kv_cache.data_ptr()
    fed: list[tuple[int, int]] = []  # (request's tokens then, positions fed) per request
    forward = proposer._forward

    def counted(scheduled: Any) -> Any:
        fed.extend((s.request.num_tokens, s.start_pos) for s in scheduled
                   if s.start_pos < s.request.num_tokens)  # step 0 of a proposal
        assert all(s.num_tokens == 1 for s in scheduled)
        return forward(scheduled)

    proposer._forward = counted
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    shared = _outputs(engine, prompts, [sp] * 2)
    assert fed and all(start == n - 1 for n, start in fed)
    st = engine.runner.spec_stats
    assert st.num_accepted_tokens > 0 and st.num_accepted_tokens < st.num_draft_tokens, st
    plain = _outputs(make_engine(), prompts, [sp] * 2)
    assert [o.outputs[0].token_ids for o in shared.values()] == \
        [o.outputs[0].token_ids for o in plain.values()]
    # The same layers with a cache of their own (reading each prompt first): same drafts.
    own = make_engine(speculative_config=spec)
    own.runner.proposer.shares_target_kv = False
    own.runner.proposer.allocate_kv(own.num_blocks, None)
    _outputs(own, prompts, [sp] * 2)
    assert vars(own.runner.spec_stats) == vars(st)


def test_suffix_serves_a_repeated_request_from_its_tenants_past_outputs_only(
        make_engine: Any, smollm2: Any) -> None:
    """The same open prompt three times, each after the last finished: again for its tenant,
    its drafts come from the first answer and nearly all are accepted; for another tenant,
    the drafts are exactly those of the first run (its own tokens only)."""
    tok = smollm2[1].tokenizer
    prompt = _chat(tok, "Write a short story about a lighthouse keeper and a storm.")
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    engine = make_engine(speculative_config={"method": "suffix", "num_speculative_tokens": 8,
                                             "adaptive": False})
    st = engine.runner.spec_stats

    def run(rid: str, tenant: str) -> tuple[list[int], int, int, int]:
        before = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp, tenant=tenant)
        out = run_all(engine)[rid].outputs[0].token_ids
        return out, st.num_drafts - before[0], st.num_draft_tokens - before[1], \
            st.num_accepted_tokens - before[2]

    first, *first_counts = run("a1", "key-a")
    again, _, drafted, accepted = run("a2", "key-a")
    other, *other_counts = run("b1", "key-b")
    assert first == again == other
    assert drafted >= len(first) - 8 and accepted >= 0.9 * drafted, (drafted, accepted)
    assert first_counts[2] < 0.5 * accepted  # the first answer had no such help
    assert other_counts == first_counts  # key-b drew nothing from key-a's answers


def test_stop_strings_max_tokens_and_logprobs_inside_accepted_runs(
        make_engine: Any, smollm2: Any, gpl_text: str) -> None:
    tok = smollm2[1].tokenizer
    text = gpl_text[2000:2400]
    prompt = _chat(tok, "Repeat this text exactly:\n" + text)
    base = _outputs(make_engine(), [prompt], [SamplingParams(temperature=0, max_tokens=80,
                                                              ignore_eos=True)])
    full = base["0"].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 6]  # a string the copy reaches mid-way
    cases = [SamplingParams(temperature=0, max_tokens=80, stop=[stop], logprobs=2),
             SamplingParams(temperature=0, max_tokens=80, stop=[stop],
                            include_stop_str_in_output=True),
             SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, logprobs=1),
             SamplingParams(temperature=0, max_tokens=50, repetition_penalty=1.3,
                            frequency_penalty=0.4, ignore_eos=True)]
    plain = _outputs(make_engine(), [prompt] * 4, cases)
    engine = make_engine(speculative_config=_spec("ngram"))
    spec = _outputs(engine, [prompt] * 4, cases)
    assert engine.runner.spec_stats.num_accepted_tokens > 0
    for i in range(4):
        a, b = spec[str(i)].outputs[0], plain[str(i)].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
            (b.token_ids, b.text, b.finish_reason, b.stop_reason), i
        if b.logprobs is not None:
            assert a.logprobs is not None and len(a.logprobs) == len(a.token_ids)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert {t: v.logprob for t, v in x.items()} == pytest.approx(
                    {t: v.logprob for t, v in y.items()}, abs=1e-5)
    assert plain["0"].outputs[0].finish_reason == "stop"
    assert len(spec["2"].outputs[0].token_ids) == 37


def test_seeded_sampling_n_and_json_schema(make_engine: Any, smollm2: Any) -> None:
    tok = smollm2[1].tokenizer
    prompt = _chat(tok, "Give me a JSON object describing a cat, with its name and age.")
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    cases = [SamplingParams(temperature=0.8, seed=11, max_tokens=40, n=2, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=schema))]
    spec = _spec("self_draft")
    first = _outputs(make_engine(speculative_config=spec), [prompt] * 2, cases)
    again = _outputs(make_engine(speculative_config=spec), [prompt] * 2, cases)
    plain = _outputs(make_engine(), [prompt] * 2, cases)
    seeded = [o.token_ids for o in first["0"].outputs]
    assert seeded == [o.token_ids for o in again["0"].outputs]  # reproducible
    assert seeded[0] != seeded[1]  # the n samples differ
    grammar = first["1"].outputs[0]
    assert grammar.token_ids == plain["1"].outputs[0].token_ids  # greedy under a grammar
    obj = json.loads(grammar.text)
    assert isinstance(obj["name"], str) and isinstance(obj["age"], int)


def test_the_warm_up_keeps_only_its_warm_passes_times(make_engine: Any) -> None:
    # The warm-up's first steps, the draft model's first forwards among them, are the
    # engine's cold ones; kept, they priced every later draft (a 940 ms step at one row
    # against 60). Its last pass runs warm, and its times stay: a burst's row counts
    # (WARM_UP_ROWS plain, WARM_UP_ROWS x (1 + K) to verify, the draft's forwards over
    # WARM_UP_ROWS) are measured before the first burst, which one-stream traffic before
    # it would not measure (its first round then drafted at 0.85-0.89x, Qwen2.5-Coder 1.5B
    # + 0.5B, 8 streams, AVX2).
    spec = dict(_spec("draft_model"), adaptive=True)
    engine = make_engine(speculative_config=spec)
    policy = engine.runner.spec_policy
    steps: list[tuple[int, bool]] = []
    drafts: list[Any] = []
    observe_step, observe_draft = policy.observe_step, policy.observe_draft

    def step(rows: int, seconds: float, prefill: bool = False) -> None:
        steps.append((rows, prefill))
        observe_step(rows, seconds, prefill)

    def draft(timing: Any) -> None:
        drafts.append(timing)
        observe_draft(timing)

    passes: list[tuple[int, list[int], list[int]]] = []  # (requests, step rows, draft rows)
    warm_up_pass = engine._warm_up_pass

    def run_pass(n: int) -> None:
        first_step, first_draft = len(steps), len(drafts)
        warm_up_pass(n)
        passes.append((n, [r for r, _ in steps[first_step:]],
                       [r for d in drafts[first_draft:] for r, _ in d]))

    policy.observe_step, policy.observe_draft = step, draft
    engine._warm_up_pass = run_pass
    engine.warm_up()
    k = spec["num_speculative_tokens"]
    n = min(WARM_UP_ROWS, engine.config.scheduler.max_num_seqs)
    assert n == WARM_UP_ROWS > 1 and k > 1
    # Three passes of 1, n, n one-token requests: their prompt step, a plain decode step,
    # the draft's forwards over the n, a verify step of up to 1 + k rows each (forced: the
    # draft model stops only where it is unsure), and what a rejection leaves.
    assert [p[0] for p in passes] == [1, n, n]
    for rows, step_rows, draft_rows in passes:
        assert step_rows[:2] == [rows, rows]
        assert rows < step_rows[2] <= rows * (1 + k)
        assert draft_rows[0] == rows
    # Only the last pass's times are kept: no one-row entry (the first pass ran those).
    assert set(policy.cost.table) == set(passes[-1][1])
    assert set(policy.draft_cost.table) == set(passes[-1][2])
    assert 1 not in policy.cost.table and 1 not in policy.draft_cost.table
    assert policy.catch_up_cost == 0.0 and policy.adaptive and policy.k_max == k
    # Its drafts (one-token prompts') set no request's prior, its answers no length.
    assert policy.alpha("a request") == pytest.approx(_PRIOR_ALPHA)
    assert not policy._lengths
    assert engine.runner.spec_stats.num_drafts == 0
    assert not engine.has_unfinished_requests()
    _outputs(engine, [[1, 2, 3]], [SamplingParams(temperature=0, max_tokens=4)])
    assert 1 in policy.cost.table  # a request's steps are kept beside them


def test_bad_speculative_configs_are_clear_errors(make_engine: Any) -> None:
    with pytest.raises(ValueError, match="method must be one of ngram, draft_model"):
        make_engine(speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, "):
        make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown key.*num_spec_tokens"):
        make_engine(speculative_config={"method": "ngram", "num_spec_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config.model is required"):
        make_engine(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not valid JSON"):
        make_engine(speculative_config="{method: ngram}")
    with pytest.raises(ValueError, match="respace_prompt must be true or false, got 'no'"):
        make_engine(speculative_config={"method": "suffix", "num_speculative_tokens": 2,
                                        "respace_prompt": "no"})
    with pytest.raises(ValueError, match="num_layers must be below the target's 30 layers"):
        make_engine(speculative_config={"method": "self_draft", "num_speculative_tokens": 2,
                                        "num_layers": 30})


def test_a_draft_with_another_vocabulary_is_refused(make_engine: Any, tmp_path: Any) -> None:
    from tests.e2e.test_quantize_cli import _byte_symbols, _byte_tokenizer
    from tests.helpers import tiny_hf_model

    hf = tiny_hf_model("llama", seed=1)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    _byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": _byte_symbols()[0]}))
    with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens, the target .* one of "
                                         r"49152"):
        make_engine(speculative_config={"method": "draft_model", "model": str(tmp_path),
                                        "num_speculative_tokens": 2})


def test_medusa_heads_for_another_model_are_refused(make_engine: Any, tmp_path: Any,
                                                    medusa_heads: str) -> None:
    from kvserve.spec.medusa import MedusaHeads

    for name, hidden, vocab in (("hidden", 64, 49152), ("vocab", 576, 1000)):
        MedusaHeads(2, 1, hidden, vocab).save(str(tmp_path / name), torch.zeros(vocab, hidden))
        with pytest.raises(ValueError, match=rf"Medusa heads of hidden size {hidden} and "
                                             rf"vocabulary {vocab}, the target .* has hidden "
                                             rf"size 576 and vocabulary 49152"):
            make_engine(speculative_config={"method": "medusa", "model": str(tmp_path / name),
                                            "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens is 4, but .* has only 3 "
                                         "Medusa heads"):
        make_engine(speculative_config={"method": "medusa", "model": medusa_heads,
                                        "num_speculative_tokens": 4})
    with pytest.raises(ValueError, match="speculative_config.model is required with method "
                                         "'medusa'"):
        make_engine(speculative_config={"method": "medusa", "num_speculative_tokens": 2})
