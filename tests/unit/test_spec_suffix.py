"""The suffix proposer (spec/suffix.py): longest match first, then the most frequent
continuation; incremental indexing equal to a brute-force oracle at every step; the cache's
token bound and its oldest-first eviction; finished requests cached, preempted ones not; and
tenants: one tenant's text is never proposed to another."""

from __future__ import annotations

import random

import pytest

from kvserve.config import SpeculativeConfig
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.spec.suffix import SuffixProposer


def _req(rid: str, tokens: list[int], tenant: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=1000, tenant=tenant)


def _propose(p: SuffixProposer, req: Request, k: int = 8) -> list[int]:
    return p.propose([req], [k], [[]])[0]


def _finish(p: SuffixProposer, req: Request, output: list[int]) -> None:
    """The request decodes `output` (the proposer sees it as the engine shows it), finishes."""
    _propose(p, req)
    for t in output:
        req.append_output_token(t)
        _propose(p, req)
    req.status = RequestStatus.FINISHED_LENGTH
    p.remove([req.request_id])


def _oracle(docs: list[list[int]], own: list[int], k: int, depth: int, factor: float,
            min_prob: float) -> list[int]:
    """SuffixDecoding's rule by brute force: occurrences (in docs, oldest first, then the
    request's own tokens before its last) of the longest suffix of own (2 .. depth tokens)
    that a token follows; then the greedy walk by frequency, ties to the latest occurrence."""
    sources = [*docs, own]
    q = own[-depth:]

    def length(src: list[int], p: int) -> int:
        n = 0
        while n < len(q) and p - n >= 0 and src[p - n] == q[-1 - n]:
            n += 1
        return n

    occ = [(s, p, length(src, p)) for s, src in enumerate(sources)
           for p in range(len(src) - 1)]
    best = max((n for _, _, n in occ), default=0)
    if best < 2:
        return []
    alive = [(s, p) for s, p, n in occ if n == best]
    drafts: list[int] = []
    prob = 1.0
    while alive and len(drafts) < min(k, int(best * factor)):
        nxt = [sources[s][p + 1] if p + 1 < len(sources[s]) else None for s, p in alive]
        counts: dict[int, int] = {}
        for t in nxt:
            if t is not None:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        top = max(counts.values())
        if prob * top / len(nxt) < min_prob:
            break
        prob *= top / len(nxt)
        tok = next(t for t in reversed(nxt) if t is not None and counts[t] == top)
        drafts.append(tok)
        alive = [(s, p + 1) for (s, p), t in zip(alive, nxt, strict=True) if t == tok]
    return drafts


def test_the_longest_match_wins_over_a_more_frequent_shorter_one() -> None:
    p = SuffixProposer(max_depth=8, min_token_prob=0.0)
    # "5 6" is followed by 1 three times, but "9 5 6" (the request's end) by 2 once.
    req = _req("a", [5, 6, 1, 5, 6, 1, 5, 6, 1, 9, 5, 6, 2, 3, 9, 5, 6])
    assert _propose(p, req, 1) == [2]
    assert _propose(p, req, 3) == [2, 3, 9]  # 3 tokens matched: at most 3 drafts


def test_among_the_longest_matches_the_most_frequent_continuation() -> None:
    p = SuffixProposer(max_depth=8, min_token_prob=0.0)
    # "7 8" is followed by 2 twice, by 1 once (the latest): frequency wins.
    req = _req("a", [7, 8, 2, 0, 7, 8, 2, 0, 7, 8, 1, 0, 3, 7, 8])
    assert _propose(p, req, 1) == [2]
    tie = _req("c", [7, 8, 1, 0, 7, 8, 2, 0, 7, 8])
    assert _propose(p, tie, 1) == [2]  # a tie goes to the latest occurrence


def test_min_token_prob_and_max_spec_factor_stop_the_drafts() -> None:
    tokens = [4, 5, 1, 2, 3, 4, 5, 1, 9, 9, 4, 5]
    # "4 5" is followed by 1 both times, then 2 or 9: the path's probability halves.
    assert _propose(SuffixProposer(min_token_prob=0.6), _req("a", tokens)) == [1]
    assert _propose(SuffixProposer(min_token_prob=0.5), _req("a", tokens)) == [1, 9]
    # Two tokens matched: factor 1 allows 2 drafts, 0.5 one, 3 six.
    long = [4, 5, 1, 2, 3, 6, 7, 8, 4, 5]
    assert _propose(SuffixProposer(max_spec_factor=1.0), _req("b", long)) == [1, 2]
    assert _propose(SuffixProposer(max_spec_factor=0.5), _req("b", long)) == [1]
    assert _propose(SuffixProposer(max_spec_factor=3.0), _req("b", long)) == [1, 2, 3, 6, 7, 8]


def test_no_match_no_drafts() -> None:
    p = SuffixProposer()
    assert _propose(p, _req("a", [1])) == []
    assert _propose(p, _req("b", [1, 2, 3, 4])) == []
    assert _propose(p, _req("c", [1, 2, 3, 1, 2])) == [3, 1]  # its own end is no match
    assert p.propose([_req("d", [1, 2, 1, 2])], [0], [[]]) == [[]]


@pytest.mark.parametrize("seed", range(6))
def test_incremental_index_equals_a_brute_force_oracle_at_every_step(seed: int) -> None:
    """Random text over a small vocabulary (many matches of every length), past outputs of
    the tenant in the cache, tokens appended one or several per step."""
    rnd = random.Random(seed)
    depth, factor, min_prob = 6, rnd.choice([1.0, 2.0]), rnd.choice([0.0, 0.1, 0.3])
    p = SuffixProposer(max_depth=depth, max_spec_factor=factor, min_token_prob=min_prob)
    docs = []
    for i in range(3):
        prompt = [rnd.randrange(4) for _ in range(rnd.randrange(2, 12))]
        out = [rnd.randrange(4) for _ in range(rnd.randrange(1, 30))]
        _finish(p, _req(f"old{i}", prompt, "t"), out)
        docs.append((prompt + out)[-(depth + len(out)):])
    req = _req("r", [rnd.randrange(4) for _ in range(5)], "t")
    for _ in range(60):
        k = rnd.randrange(1, 8)
        got = _propose(p, req, k)
        assert got == _oracle(docs, req.all_token_ids, k, depth, factor, min_prob)
        for _ in range(rnd.choice([1, 1, 3])):
            req.append_output_token(rnd.randrange(4))


def test_a_truncated_request_is_reindexed() -> None:
    p = SuffixProposer(min_token_prob=0.0)
    req = _req("a", [1, 2, 3, 1, 2])
    assert _propose(p, req) == [3, 1]
    req.append_output_token(9)
    req.append_output_token(9)
    _propose(p, req)
    req.drop_output_tokens(2)  # a stop string inside accepted drafts
    req.append_output_token(3)
    req.append_output_token(1)  # as many tokens as were indexed, other ones
    assert _propose(p, req) == [2, 3, 1]
    assert _propose(p, req) == _oracle([], req.all_token_ids, 8, 24, 1.0, 0.0)


def test_a_finished_output_serves_its_tenant_and_only_its_tenant() -> None:
    p = SuffixProposer(min_token_prob=0.0)
    prompt = [1, 2, 3, 4]
    secret = list(range(100, 130))  # tokens only tenant A's output holds
    _finish(p, _req("a1", prompt, "A"), secret)
    # The same prompt again for A: the cache has the whole continuation.
    again = _req("a2", prompt, "A")
    assert _propose(p, again, 8) == secret[:4]  # 4 tokens matched: 4 drafts
    again.append_output_token(100)
    again.append_output_token(101)
    assert _propose(p, again, 8) == secret[2:8]
    # B sends the same prompt and A's first tokens, twice: its proposals are those of a
    # proposer that never saw A (what B's own tokens repeat), never A's continuation.
    b = _req("b1", prompt + secret[:10] + prompt, "B")
    alone = _req("b1", list(b.all_token_ids), "B")
    fresh = SuffixProposer(min_token_prob=0.0)
    seen = []
    for t in secret[:20]:
        got = _propose(p, b, 8)
        assert got == _propose(fresh, alone, 8)
        seen += got
        b.append_output_token(t)
        alone.append_output_token(t)
    assert seen and not set(seen) & set(secret[10:]), seen
    assert _propose(p, _req("n1", prompt + [100, 101])) == []  # offline (None) neither
    # B's own past outputs do serve B.
    _finish(p, _req("b2", [50, 51, 52], "B"), [60, 61, 62])
    assert _propose(p, _req("b3", [50, 51, 52], "B")) == [60, 61, 62]
    assert _propose(p, _req("a3", [50, 51, 52], "A")) == []


def test_a_preempted_request_is_not_cached_and_keeps_its_index() -> None:
    p = SuffixProposer()
    req = _req("a", [1, 2, 3], "A")
    _propose(p, req)
    req.append_output_token(4)
    req.status = RequestStatus.PREEMPTED
    p.remove(["a"])  # preempted: not finished
    assert p.cache.num_tokens == 0
    assert _propose(p, _req("x", [1, 2, 3], "A")) == []
    req.status = RequestStatus.RUNNING
    req.append_output_token(5)
    _propose(p, req)
    req.status = RequestStatus.FINISHED_ABORTED  # an aborted output is the target's too
    p.remove(["a", "unknown"])
    assert "a" not in p._requests
    assert _propose(p, _req("y", [1, 2, 3], "A")) == [4, 5]


def test_the_cache_keeps_its_token_bound_and_drops_the_oldest_first() -> None:
    p = SuffixProposer(max_depth=4, max_cached_tokens=400, min_token_prob=0.0)
    for i in range(200):
        # Every document: a prompt [i, i+1000] then 8 tokens unique to it.
        _finish(p, _req(f"r{i}", [1000 + i, 2000 + i], "A" if i % 2 else "B"),
                [10_000 + 10 * i + j for j in range(8)])
        assert p.cache.num_tokens <= 400
    assert p.cache.num_tokens > 300
    assert not p._requests  # nothing kept for finished requests
    tenant = {i: "A" if i % 2 else "B" for i in range(200)}
    # The latest documents are there; the first ones are gone.
    assert _propose(p, _req("new", [1000 + 199, 2000 + 199], tenant[199])) == [11_990, 11_991]
    assert _propose(p, _req("old", [1000 + 1, 2000 + 1], tenant[1])) == []
    total = sum(s.size for segs in p.cache.segments.values() for s in segs)
    assert total == p.cache.num_tokens


def test_a_document_longer_than_a_segment_keeps_its_tail() -> None:
    p = SuffixProposer(max_depth=4, max_cached_tokens=40, min_token_prob=0.0)
    _finish(p, _req("a", [1, 2]), list(range(100, 200)))
    assert p.cache.num_tokens == 10
    assert _propose(p, _req("b", [195, 196])) == [197, 198]
    assert _propose(p, _req("c", [1, 2])) == []
    off = SuffixProposer(max_cached_tokens=0)
    _finish(off, _req("a", [1, 2]), [3, 4])
    assert off.cache.num_tokens == 0 and _propose(off, _req("b", [1, 2])) == []


def test_config_knobs_and_their_errors() -> None:
    spec = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8,
                                        "suffix_decoding_max_tree_depth": 32})
    assert spec.suffix_decoding_max_tree_depth == 32
    assert spec.suffix_decoding_max_cached_tokens == 1 << 20
    for key, bad, msg in [
            ("suffix_decoding_max_tree_depth", 1, r"max_tree_depth must be an integer in "
                                                  r"\[2, 256\], got 1"),
            ("suffix_decoding_max_cached_tokens", -1, "max_cached_tokens must be an integer "
                                                      ">= 0, got -1"),
            ("suffix_decoding_max_spec_factor", 0, "max_spec_factor must be > 0, got 0"),
            ("suffix_decoding_min_token_prob", 1.5, r"min_token_prob must be in \[0, 1\], "
                                                    r"got 1.5")]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 4,
                                         key: bad})
