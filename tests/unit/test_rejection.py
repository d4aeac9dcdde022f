"""Rejection sampling of draft tokens (sample/rejection.py, Sampler.verify).

The reference is the target distribution itself: a Markov chain p(next | previous) over a
small vocabulary, drafted by another chain q. Thousands of requests verify in one call; the
first two emitted tokens of each are counted against p(a | x) p(b | a) with a chi-square test,
which must pass for the exact rule and fail for a deliberately broken one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvserve.request import Request
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.sampler import Sampler
from kvserve.sampling_params import SamplingParams

V = 5


def chisquare(observed: torch.Tensor, expected: torch.Tensor) -> SimpleNamespace:
    """Pearson's chi-square test: the p-value is the chi-square(df) survival function at the
    statistic, the regularized upper incomplete gamma Q(df / 2, stat / 2)."""
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(float(observed.numel() - 1), dtype=torch.float64)
    return SimpleNamespace(statistic=float(stat),
                           pvalue=float(torch.special.gammaincc(df / 2, stat.double() / 2)))


def _request(rid: str, **params: object) -> Request:
    sp = SamplingParams(max_tokens=16, **params)  # type: ignore[arg-type]
    return Request(rid, [0], sp, max_tokens=16)


def _chains(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(V, V, generator=g) * 1.5, dim=1)  # target
    q = torch.softmax(torch.randn(V, V, generator=g) * 1.5, dim=1)  # draft, quite unlike p
    return p, q


def _simulate(k: int, claim: str, n: int = 6000, seed: int = 1) -> torch.Tensor:
    """The first two tokens each of n requests emits after token 0, drafting k tokens from q
    per step; claim: what verification is told q was ("q": the truth; "uniform": a broken
    rule, min(1, p / q') and max(0, p - q') with a q' the drafts were not drawn from)."""
    p, q = _chains()
    g = torch.Generator().manual_seed(seed)
    sampler = Sampler(seed=seed)
    reqs = [_request(str(i), temperature=1.0) for i in range(n)]
    emitted: list[list[int]] = [[] for _ in range(n)]
    last = [0] * n
    while any(len(e) < 2 for e in emitted):
        live = [i for i in range(n) if len(emitted[i]) < 2]
        drafts, qrows, rows = [], [], []
        for i in live:
            d, prev, qs = [], last[i], []
            for _ in range(k):
                qs.append(q[prev])
                prev = int(torch.multinomial(q[prev], 1, generator=g))
                d.append(prev)
            drafts.append(d)
            qrows.append(torch.stack(qs))
            ctx = [last[i]] + d
            rows.extend(ctx)  # row j: p(. | token before position j)
        logits = torch.log(p[torch.tensor(rows)])
        meta = SamplingMetadata.from_requests([reqs[i] for i in live], V,
                                              spec_token_ids=drafts)
        claimed = qrows if claim == "q" else [torch.full_like(r, 1 / V) for r in qrows]
        out = sampler.verify(logits, meta, claimed)
        for i, toks in zip(live, out.token_ids, strict=True):
            emitted[i].extend(toks)
            last[i] = toks[-1]
    pairs = torch.tensor([e[0] * V + e[1] for e in emitted])
    return torch.bincount(pairs, minlength=V * V).float()


def _expected(n: int) -> torch.Tensor:
    p, _ = _chains()
    return (p[0].unsqueeze(1) * p).flatten() * n


@pytest.mark.parametrize("k", [1, 3])
def test_draft_model_rejection_keeps_the_target_distribution(k: int) -> None:
    counts = _simulate(k, "q")
    assert chisquare(counts, _expected(6000)).pvalue > 1e-3


def test_a_broken_acceptance_rule_is_caught() -> None:
    # Drafts drawn from q but verified against another q': the emitted tokens are no longer
    # distributed as p, and the test above must see it. (Verifying them as one-hot would not
    # do: that rule is exact for any draft token, however it was chosen.)
    counts = _simulate(3, "uniform")
    assert chisquare(counts, _expected(6000)).pvalue < 1e-6


def test_deterministic_drafts_keep_the_target_distribution() -> None:
    # An n-gram proposer's drafts are fixed tokens: q is one-hot and acceptance is p(d).
    p, _ = _chains()
    n = 8000
    reqs = [_request(str(i), temperature=1.0) for i in range(n)]
    drafts = [[1, 2]] * n
    rows = torch.log(p[torch.tensor([0, 1, 2] * n)])
    meta = SamplingMetadata.from_requests(reqs, V, spec_token_ids=drafts)
    out = Sampler(seed=3).verify(rows, meta)
    first = torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=V).float()
    assert chisquare(first, p[0] * n).pvalue > 1e-3
    # Given the first draft was accepted, the second token is distributed as p(. | 1).
    second = [t[1] for t in out.token_ids if len(t) >= 2]
    counts = torch.bincount(torch.tensor(second), minlength=V).float()
    assert chisquare(counts, p[1] * len(second)).pvalue > 1e-3


def test_greedy_accepts_the_matching_prefix_then_the_targets_token() -> None:
    # Rows' argmax: 3, 1, 4, 0. Drafts [3, 1, 2]: 3 and 1 match, 2 != 4 -> emit 4.
    logits = torch.full((4, V), -1.0)
    for r, t in enumerate([3, 1, 4, 0]):
        logits[r, t] = 1.0
    meta = SamplingMetadata.from_requests([_request("a", temperature=0.0)], V,
                                          spec_token_ids=[[3, 1, 2]])
    assert Sampler().verify(logits, meta).token_ids == [[3, 1, 4]]
    meta = SamplingMetadata.from_requests([_request("a", temperature=0.0)], V,
                                          spec_token_ids=[[3, 1, 4]])
    assert Sampler().verify(logits, meta).token_ids == [[3, 1, 4, 0]]  # all + bonus


def test_processors_apply_to_every_draft_row() -> None:
    # logit_bias forbids token 3 in every row: a draft 3 is rejected at its own row.
    logits = torch.zeros(3, V)
    logits[:, 3] = 5.0
    logits[:, 1] = 1.0
    req = _request("a", temperature=0.0, logit_bias={3: -100.0})
    meta = SamplingMetadata.from_requests([req], V, spec_token_ids=[[1, 3]])
    assert Sampler().verify(logits, meta).token_ids == [[1, 1]]


def test_verify_without_drafts_is_the_plain_sampler() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    reqs = [_request(str(i), temperature=0.8 if i % 3 else 0.0, top_p=0.9,
                     seed=i if i % 2 else None) for i in range(6)]
    plain = Sampler(seed=5)(logits, SamplingMetadata.from_requests(reqs, 50)).token_ids
    meta = SamplingMetadata.from_requests(reqs, 50, spec_token_ids=[[] for _ in reqs])
    verified = Sampler(seed=5).verify(logits, meta).token_ids
    assert verified == [[t] for t in plain]


def test_seeded_verification_is_reproducible_and_logprobs_follow_the_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    req = _request("a", temperature=1.0, seed=42, logprobs=2)
    meta = SamplingMetadata.from_requests([req], 50, spec_token_ids=[[7, 8, 9]])
    a = Sampler().verify(logits, meta)
    b = Sampler(seed=99).verify(logits, meta)  # the request's seed wins over the engine's
    assert a.token_ids == b.token_ids
    toks = a.token_ids[0]
    assert a.logprobs[0] is not None and len(a.logprobs[0]) == len(toks)
    raw = torch.log_softmax(logits, dim=1)
    for j, (tok, entry) in enumerate(zip(toks, a.logprobs[0], strict=True)):
        assert entry[tok].logprob == pytest.approx(float(raw[j, tok]), abs=1e-5)
