"""Prompt lookup (n-gram) proposer: no model, the request's own tokens.

The longest suffix of the request's tokens, from prompt_lookup_max down to prompt_lookup_min
tokens, that occurred earlier in them; the tokens that followed its latest earlier occurrence
are the drafts. An edit or a rewrite copies long runs of its input, and there this guesses
whole runs right. The drafts are deterministic: verification reads them as one-hot q.
"""

from __future__ import annotations

import numpy as np

from kvserve.request import Request
from kvserve.spec.base import KVFreeProposer


def ngram_lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    tokens (n_max .. n_min long); [] when none occurred before."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n:]
        # Window starts 0 .. size - n - 1: every occurrence that ends before the suffix does.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer(KVFreeProposer):
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, requests: list[Request], num_drafts: list[int],
                block_tables: list[list[int]]) -> list[list[int]]:
        return [ngram_lookup(np.asarray(r.all_token_ids, dtype=np.int64), self.n_min,
                             self.n_max, k) if k else []
                for r, k in zip(requests, num_drafts, strict=True)]
