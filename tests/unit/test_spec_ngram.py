"""The n-gram proposer's incremental index against a brute-force scan of the whole history."""

from __future__ import annotations

import random

import pytest

from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.spec.ngram import NgramIndex, NgramProposer


def scan(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup by definition: for n = n_max .. n_min, the last start s < len - n with
    tokens[s : s + n] == the last n tokens and s + n <= len - 1; the k tokens after it."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n:]
        for s in range(size - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


@pytest.mark.parametrize(("n_min", "n_max", "vocab"), [(1, 1, 3), (2, 4, 4), (1, 5, 6),
                                                       (3, 3, 2), (2, 8, 5)])
def test_index_equals_a_scan_as_tokens_grow(n_min: int, n_max: int, vocab: int) -> None:
    rng = random.Random(n_min * 100 + n_max * 10 + vocab)
    for _ in range(20):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        index = NgramIndex(n_min, n_max)
        hits = 0
        while len(tokens) < 120:
            k = rng.randrange(1, 8)
            got = index.lookup(tokens, k)
            assert got == scan(tokens, n_min, n_max, k), (tokens, n_min, n_max, k)
            hits += bool(got)
            # A step appends 1 .. 6 tokens, sometimes a copy of an earlier run.
            if rng.random() < 0.5 and len(tokens) > 8:
                s = rng.randrange(len(tokens) - 6)
                tokens += tokens[s:s + rng.randrange(1, 7)]
            else:
                tokens += [rng.randrange(vocab) for _ in range(rng.randrange(1, 7))]
        assert hits  # the test reaches matches, not only misses


def test_the_latest_occurrence_of_the_longest_suffix_wins() -> None:
    index = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [7, 8, 9, 1, 7, 8, 2, 8, 7, 8]
    # Suffix (8, 7, 8) never occurred before; (7, 8) did at 0 and 4: the latest, 4, -> 2 8 7.
    assert index.lookup(tokens, 3) == [2, 8, 7]
    tokens += [5]  # (5,) is new, (8, 5) too: nothing
    assert index.lookup(tokens, 3) == []
    assert index.lookup(tokens + [7, 8, 9], 2) == [1, 7]  # (7, 8, 9) at 0 beats (8, 9) ...


def test_proposer_keeps_one_index_per_request_and_forgets_removed_ones() -> None:
    sp = SamplingParams(max_tokens=8)
    a = Request("a", [1, 2, 3, 4, 1, 2], sp, max_tokens=8)
    b = Request("b", [5, 6, 5], sp, max_tokens=8)
    prop = NgramProposer(1, 2)
    assert prop.propose([a, b], [3, 2], [[], []]) == [[3, 4, 1], [6, 5]]
    assert prop.propose([a, b], [0, 1], [[], []]) == [[], [6]]
    a.append_output_token(3)
    assert prop.propose([a], [2], [[]]) == [[4, 1]]
    prop.remove(["a"])
    # A new request under the same id starts a new index (not the old one's n-grams).
    a2 = Request("a", [9, 9], sp, max_tokens=8)
    assert prop.propose([a2], [2], [[]]) == [[9]]
