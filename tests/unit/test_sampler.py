"""Sampler tests on crafted logits, checked against hand-computed expectations."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.request import Request
from kvserve.sample.logprobs import compute_prompt_logprobs
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.processors import apply_min_p, apply_penalties, apply_top_k_top_p
from kvserve.sample.sampler import Sampler
from kvserve.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _req(rid: str, params: SamplingParams, prompt: list[int] | None = None,
         output: list[int] | None = None, eos: tuple[int, ...] = ()) -> Request:
    r = Request(rid, prompt or [0], params, max_tokens=1000, eos_token_ids=eos)
    for t in output or []:
        r.append_output_token(t)
    return r


def _kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row > NEG_INF).flatten().tolist() for row in logits]


# 4-token distribution, stored out of order so the sort/scatter-back path is exercised:
# token 2 -> 0.5, token 0 -> 0.3, token 3 -> 0.15, token 1 -> 0.05.
PROBS = torch.tensor([0.3, 0.05, 0.5, 0.15])
LOGITS = PROBS.log().unsqueeze(0)


# --- top-k / top-p / min-p -------------------------------------------------------------------


@pytest.mark.parametrize("top_p, kept", [
    # Rule: keep the smallest set of most likely tokens whose cumulative prob >= top_p.
    (0.8, [0, 2]),  # 0.5 + 0.3 = 0.8 reaches 0.8 exactly: the 0.15 token is not needed
    (0.79, [0, 2]),
    (0.81, [0, 2, 3]),
    (0.5, [2]),  # the top token alone reaches 0.5
    (0.49, [2]),
    (0.51, [0, 2]),
    (0.96, [0, 1, 2, 3]),
    (1e-9, [2]),  # the most likely token always survives
    (1.0, [0, 1, 2, 3]),
])
def test_top_p_boundary(top_p: float, kept: list[int]) -> None:
    out = apply_top_k_top_p(LOGITS, None, torch.tensor([top_p]))
    assert _kept(out) == [kept]
    # Survivors keep their logits unchanged (renormalization happens in the later softmax).
    assert torch.equal(out[0, kept], LOGITS[0, kept])


@pytest.mark.parametrize("k, kept", [(1, [2]), (2, [0, 2]), (3, [0, 2, 3]), (4, [0, 1, 2, 3]),
                                     (100, [0, 1, 2, 3])])
def test_top_k(k: int, kept: list[int]) -> None:
    assert _kept(apply_top_k_top_p(LOGITS, torch.tensor([k]), None)) == [kept]
    # The sort path (used when top-p is present) agrees with the topk path.
    assert _kept(apply_top_k_top_p(LOGITS, torch.tensor([k]), torch.tensor([1.0]))) == [kept]


def test_top_k_keeps_ties_at_boundary() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert _kept(apply_top_k_top_p(logits, torch.tensor([1]), None)) == [[1, 2]]
    assert _kept(apply_top_k_top_p(logits, torch.tensor([1]), torch.tensor([1.0]))) == [[1, 2]]


def test_top_p_renormalizes_after_top_k() -> None:
    # After top-k=3 the kept probs are 0.5/0.95, 0.3/0.95, 0.15/0.95; the top two sum to
    # 0.842, so top_p=0.84 keeps two and top_p=0.85 keeps three.
    k = torch.tensor([3])
    assert _kept(apply_top_k_top_p(LOGITS, k, torch.tensor([0.84]))) == [[0, 2]]
    assert _kept(apply_top_k_top_p(LOGITS, k, torch.tensor([0.85]))) == [[0, 2, 3]]


def test_per_row_params_match_single_rows() -> None:
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(6, vocab)
    ks = [1, vocab, 5, vocab, 10, 3]  # vocab = off
    ps = [1.0, 0.5, 1.0, 0.9, 0.3, 1.0]
    batched = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps))
    topk_only = apply_top_k_top_p(logits, torch.tensor(ks), None)
    for i in range(6):
        single = apply_top_k_top_p(logits[i:i + 1], torch.tensor([ks[i]]), torch.tensor([ps[i]]))
        assert torch.equal(batched[i:i + 1], single)
        # Independent check of the rule with a plain Python loop.
        probs = logits[i].softmax(0)
        order = probs.argsort(descending=True).tolist()[:ks[i]]
        renorm = probs[order] / probs[order].sum()
        n, cum = 0, 0.0
        while n < len(order) and (n == 0 or cum < ps[i] - 1e-6):
            cum += float(renorm[n])
            n += 1
        assert _kept(single) == [sorted(order[:n])]
        assert _kept(topk_only[i:i + 1]) == [sorted(order)]


@pytest.mark.parametrize("min_p, kept", [
    (0.0, [0, 1, 2, 3]),
    (0.2, [0, 2, 3]),  # threshold 0.1: drops the 0.05 token
    (0.5, [0, 2]),  # threshold 0.25
    (0.7, [2]),  # threshold 0.35
])
def test_min_p(min_p: float, kept: list[int]) -> None:
    assert _kept(apply_min_p(LOGITS, torch.tensor([min_p]))) == [kept]


# --- penalties, bias, min_tokens -------------------------------------------------------------


def test_penalties_match_formula() -> None:
    vocab = 8
    logits = torch.tensor([[1.5, -0.5, 2.0, 0.0, -1.0, 3.0, 0.7, -2.0],
                           [0.3, 0.2, -0.1, 1.0, 2.0, -3.0, 0.5, 0.9]])
    prompts = [[0, 1, 1], [4]]
    outputs = [[2, 2, 1, 5], [7, 7, 7, 3]]
    rep, freq, pres = [1.3, 0.8], [0.5, -0.25], [0.4, 1.0]
    reqs = [_req(str(i), SamplingParams(temperature=0.0, repetition_penalty=rep[i],
                                        frequency_penalty=freq[i], presence_penalty=pres[i]),
                 prompts[i], outputs[i]) for i in range(2)]
    meta = SamplingMetadata.from_requests(reqs, vocab)
    assert meta.output_counts is not None
    out = apply_penalties(logits, meta.output_counts, meta.prompt_mask, meta.repetition_penalty,
                          meta.frequency_penalty, meta.presence_penalty)
    for b in range(2):
        for t in range(vocab):
            x = float(logits[b, t])
            if t in prompts[b] or t in outputs[b]:
                x = x / rep[b] if x > 0 else x * rep[b]
            count = outputs[b].count(t)
            x -= count * freq[b] + (1.0 if count else 0.0) * pres[b]
            assert out[b, t].item() == pytest.approx(x, abs=1e-6), (b, t)


def test_only_some_rows_penalized() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    reqs = [_req("a", SamplingParams(temperature=0.0, frequency_penalty=2.0), output=[0]),
            _req("b", SamplingParams(temperature=0.0), output=[0])]
    meta = SamplingMetadata.from_requests(reqs, 3)
    assert meta.prompt_mask is None and meta.repetition_penalty is None
    out = Sampler(0)(logits, meta)
    assert out.token_ids == [1, 0]  # 2.0 - 2.0 = 0 < 1.0 for row a only


def test_no_penalty_tensors_in_common_case() -> None:
    meta = SamplingMetadata.from_requests([_req("a", SamplingParams(temperature=0.5))], 10)
    assert meta.no_penalties and meta.output_counts is None and meta.prompt_mask is None
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.logit_bias is None and meta.min_tokens_mask is None


def test_logit_bias() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    reqs = [_req("a", SamplingParams(temperature=0.0, logit_bias={0: 2.5, 2: -1.0})),
            _req("b", SamplingParams(temperature=0.0, logit_bias={1: 0.5}))]
    meta = SamplingMetadata.from_requests(reqs, 3)
    assert Sampler(0)(logits, meta).token_ids == [0, 2]  # [3.5, 2, 2] and [1, 2.5, 3]
    processed = Sampler.process_logits(logits, meta)
    assert processed.tolist() == [[3.5, 2.0, 2.0], [1.0, 2.5, 3.0]]
    assert logits.tolist() == [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]  # input untouched


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 4)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    reqs = [_req("a", params, output=[3], eos=(0,)),  # 1 < 2 output tokens: masked
            _req("b", params, output=[3, 3], eos=(0,)),  # reached min_tokens: free
            _req("c", SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),
                 eos=(0,)),  # ignore_eos: EOS is not a stop token, nothing to mask
            _req("d", SamplingParams(temperature=0.0), eos=(0,))]
    meta = SamplingMetadata.from_requests(reqs, 4)
    assert Sampler(0)(logits, meta).token_ids == [2, 0, 0, 0]
    processed = Sampler.process_logits(logits, meta)
    assert processed[0].tolist() == [NEG_INF, NEG_INF, 3.0, 0.0]


# --- greedy and random sampling --------------------------------------------------------------


def test_greedy_is_argmax_in_mixed_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, 30)
    reqs = [_req(str(i), SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, top_k=3))
            for i in range(5)]
    out = Sampler(0)(logits, SamplingMetadata.from_requests(reqs, 30))
    for i in (0, 2, 4):
        assert out.token_ids[i] == int(logits[i].argmax())
    for i in (1, 3):  # top_k=3 rows stay within their top 3
        assert out.token_ids[i] in logits[i].topk(3).indices.tolist()
    assert out.logprobs is None


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    vocab, steps = 64, 6
    gen = torch.Generator().manual_seed(7)
    step_logits = [torch.randn(vocab, generator=gen) for _ in range(steps)]
    target = SamplingParams(temperature=1.0, seed=1234, top_p=0.95)

    def run(batch: list[tuple[str, SamplingParams]], row: int) -> list[int]:
        sampler = Sampler(seed=99)
        tokens: list[int] = []
        for s in range(steps):
            reqs = [_req(rid, p) for rid, p in batch]
            logits = torch.randn(len(batch), vocab)  # other rows get unrelated logits
            logits[row] = step_logits[s]
            tokens.append(sampler(logits, SamplingMetadata.from_requests(reqs, vocab))
                          .token_ids[row])
        return tokens

    alone = run([("x", target)], 0)
    assert alone == run([("x", target)], 0)
    crowded = run([("u1", SamplingParams(temperature=0.8)),
                   ("s2", SamplingParams(temperature=1.0, seed=5)),
                   ("g", SamplingParams(temperature=0.0)),
                   ("x", target),
                   ("u2", SamplingParams(temperature=1.3, top_k=5))], 3)
    assert crowded == alone
    other_seed = run([("x", SamplingParams(temperature=1.0, seed=4321, top_p=0.95))], 0)
    assert other_seed != alone


def test_generators_live_across_steps_until_removed() -> None:
    vocab = 1000
    logits = torch.zeros(1, vocab)  # uniform: each draw is fresh randomness
    req = _req("x", SamplingParams(temperature=1.0, seed=3))
    sampler = Sampler()
    first = [sampler(logits, SamplingMetadata.from_requests([req], vocab)).token_ids[0]
             for _ in range(5)]
    assert len(set(first)) > 1  # the generator advanced rather than restarting each step
    assert len(sampler) == 1
    sampler.remove("x")
    assert len(sampler) == 0
    again = [sampler(logits, SamplingMetadata.from_requests([req], vocab)).token_ids[0]
             for _ in range(5)]
    assert again == first


def test_sampler_seed_fixes_unseeded_rows_and_is_checked() -> None:
    vocab = 1000
    logits = torch.zeros(3, vocab)  # uniform: every draw is the generator's
    reqs = [_req(str(i), SamplingParams(temperature=1.0)) for i in range(3)]

    def draws(seed: int) -> list[list[int]]:
        sampler = Sampler(seed=seed)
        return [sampler(logits, SamplingMetadata.from_requests(reqs, vocab)).token_ids
                for _ in range(4)]

    torch.manual_seed(1)  # the global generator is not the sampler's
    first = draws(11)
    torch.manual_seed(2)
    assert draws(11) == first
    assert draws(12) != first
    for bad in (2**64, -(2**63) - 1, 1.5, True, "3"):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[-9223372036854775808, "
                                             r"18446744073709551615\], got"):
            Sampler(seed=bad)  # type: ignore[arg-type]


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_distribution_after_temperature_and_top_k(seeded: bool) -> None:
    base = [0.1, 0.4, 0.2, 0.3]
    # temperature 0.5 squares the probs: [.01, .16, .04, .09]; top_k=3 drops token 0;
    # the rest renormalize over 0.29.
    expected = [0.0, 0.16 / 0.29, 0.04 / 0.29, 0.09 / 0.29]
    n = 20000 if not seeded else 4000
    reqs = [_req(str(i), SamplingParams(temperature=0.5, top_k=3,
                                        seed=i if seeded else None)) for i in range(n)]
    logits = torch.tensor(base).log().expand(n, 4).contiguous()
    tokens = Sampler(seed=2024)(logits, SamplingMetadata.from_requests(reqs, 4)).token_ids
    counts = [tokens.count(t) for t in range(4)]
    assert counts[0] == 0
    # df = 2; P(chi2 > 27.6) = 1e-6 for a correct sampler.
    assert _chi_square(counts, expected) < 27.6, counts


# --- logprobs --------------------------------------------------------------------------------


def _expected_rank(row: torch.Tensor, token: int) -> int:
    return 1 + sum(1 for x in row.tolist() if x > row[token].item())


def test_logprobs_are_raw_and_ranked() -> None:
    torch.manual_seed(3)
    vocab = 40
    logits = torch.randn(3, vocab)
    logits[2, 5] = logits[2, 6] = 9.0  # a tie at the top: both rank 1
    reqs = [_req("a", SamplingParams(temperature=1.0, logprobs=3, logit_bias={7: 50.0}),
                 output=[1, 1], prompt=[2]),
            _req("b", SamplingParams(temperature=0.0)),
            _req("c", SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5),
                 prompt=[5])]
    out = Sampler(0)(logits, SamplingMetadata.from_requests(reqs, vocab))
    raw = torch.log_softmax(logits, dim=1)
    assert out.token_ids[0] == 7  # the bias decides sampling...
    assert out.logprobs is not None and out.logprobs[1] is None
    for b, k in ((0, 3), (2, 2)):
        entry = out.logprobs[b]
        assert entry is not None
        top = raw[b].topk(k).indices.tolist()
        assert set(entry) == set(top) | {out.token_ids[b]}
        for tok, lp in entry.items():
            # ...but logprobs are those of the unprocessed logits.
            assert lp.logprob == pytest.approx(raw[b, tok].item(), abs=1e-6)
            assert lp.rank == _expected_rank(raw[b], tok)
    assert out.token_ids[2] == 6  # penalty on prompt token 5 breaks the tie
    assert out.logprobs[2][5].rank == 1 and out.logprobs[2][6].rank == 1
    assert out.logprobs[0][7].rank == _expected_rank(raw[0], 7) > 3


def test_logprobs_zero_returns_only_sampled_token() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = Sampler(0)(logits, SamplingMetadata.from_requests(
        [_req("a", SamplingParams(temperature=0.0, logprobs=0, logit_bias={0: 10.0}))], 3))
    assert out.logprobs is not None
    entry = out.logprobs[0]
    assert entry is not None and list(entry) == [0]
    assert entry[0].rank == 3
    assert entry[0].logprob == pytest.approx(-math.log(1 + math.e + math.e ** 2), abs=1e-6)


def test_prompt_logprobs() -> None:
    torch.manual_seed(4)
    logits = torch.randn(5, 20)
    targets = torch.tensor([3, 0, 19, 7, 7])
    out = compute_prompt_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits, dim=1)
    assert len(out) == 5
    for i, entry in enumerate(out):
        tgt = int(targets[i])
        assert set(entry) == set(raw[i].topk(2).indices.tolist()) | {tgt}
        assert entry[tgt].logprob == pytest.approx(raw[i, tgt].item(), abs=1e-6)
        assert entry[tgt].rank == _expected_rank(raw[i], tgt)


# --- several rows per request (draft tokens) -------------------------------------------------


def _with_outputs(r: Request, tokens: list[int]) -> Request:
    """A copy of r (same id, so the same seeded generator) with tokens appended as output."""
    return _req(r.request_id, r.sampling_params, r.prompt_token_ids,
                r.output_token_ids + tokens, r.eos_token_ids)


def test_row_j_of_a_request_equals_one_row_after_its_first_j_drafts() -> None:
    """Row j of a request with drafts d is the single-row step of that request after d[:j]
    were appended: the same processed logits (penalties and min_tokens count d[:j]), the same
    seeded draw (its generator draws once per row, row 0 first) and the same logprobs."""
    vocab = 64
    drafts = [3, 4]
    a = _req("a", SamplingParams(temperature=0.0, frequency_penalty=0.5), output=[1])
    b = _req("b", SamplingParams(temperature=0.9, seed=77, repetition_penalty=1.3,
                                 frequency_penalty=0.6, presence_penalty=0.4, min_tokens=3,
                                 stop_token_ids=[4], logit_bias={5: 1.0}, logprobs=2,
                                 top_k=40),
             prompt=[7, 8], output=[2], eos=(0,))
    c = _req("c", SamplingParams(temperature=1.0, seed=5))
    meta = SamplingMetadata.from_requests([a, b, c], vocab, spec_token_ids=[[], drafts, []])
    assert meta.row_offsets == [0, 1, 4, 5] and meta.num_rows == 5
    assert meta.row_requests == [0, 1, 1, 1, 2]
    assert meta.per_request(list("vwxyz")) == [["v"], ["w", "x", "y"], ["z"]]
    # Row 1 + j of b counts b's output [2] plus drafts[:j].
    assert meta.output_counts is not None
    assert torch.equal(meta.output_counts[2] - meta.output_counts[1],
                       torch.nn.functional.one_hot(torch.tensor(3), vocab).float())

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=gen) * 0.3  # flat: every u picks its own token
    processed = Sampler.process_logits(logits, meta)
    # min_tokens=3 with 1 output token: rows j = 0, 1 mask stop id 4 and EOS, row 2 does not.
    assert processed[1, 4] == processed[2, 0] == NEG_INF and processed[3, 4] > NEG_INF

    multi = Sampler(seed=1)(logits, meta)
    single_sampler = Sampler(seed=1)
    for j in range(len(drafts) + 1):
        bj = _with_outputs(b, drafts[:j])
        single = SamplingMetadata.from_requests([bj], vocab)
        row = logits[1 + j: 2 + j]
        assert torch.equal(processed[1 + j], Sampler.process_logits(row, single)[0]), j
        one = single_sampler(row, single)
        assert multi.token_ids[1 + j] == one.token_ids[0], j
        assert multi.logprobs is not None and one.logprobs is not None
        assert multi.logprobs[1 + j] == one.logprobs[0], j
    assert len(set(multi.token_ids[1:4])) == 3  # three draws, not one u reused
    # The requests without drafts are their one-row selves.
    plain = SamplingMetadata.from_requests([a, b, c], vocab)
    plain_rows = Sampler.process_logits(logits[[0, 1, 4]], plain)
    assert torch.equal(processed[[0, 1, 4]], plain_rows)
    assert [multi.token_ids[n] for n in (0, 1, 4)] == Sampler(seed=1)(logits[[0, 1, 4]],
                                                                      plain).token_ids


def test_spec_token_ids_need_one_list_per_request() -> None:
    reqs = [_req("a", SamplingParams()), _req("b", SamplingParams())]
    with pytest.raises(ValueError, match=r"spec_token_ids needs one list per request \(2\), "
                                         r"got 1"):
        SamplingMetadata.from_requests(reqs, 8, spec_token_ids=[[1]])
