"""Prompt lookup (n-gram) proposer: no model, the request's own tokens.

The longest suffix of the request's tokens, from prompt_lookup_max down to prompt_lookup_min
tokens, that occurred earlier in them; the tokens that followed its latest earlier occurrence
are the drafts; at each length the request's tokens first, then its prompt re-spaced
(respace.py: a rewrite of a hard-wrapped text writes each paragraph as one line). An edit or
a rewrite copies long runs of its input, and there this guesses whole runs right. The drafts
are deterministic: verification reads them as one-hot q.

Each request keeps an index (NgramIndex) of its n-grams' latest starts, extended by the
tokens appended since its last step: a proposal costs a few dict operations per new token and
one lookup per n, not a rescan of the request's history (a rescan of a 400-token request cost
~0.6 ms a step, 15% of an 8-stream step of the default model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.request import Request
from kvserve.spec.base import DraftStops, KVFreeProposer
from kvserve.spec.respace import respaced_prompt


class NgramIndex:
    """The latest start of every n-gram (n_min <= n <= n_max) of a growing token list that
    ends before its last token:

        tokens   t0 t1 ... t(S-n-1) ... t(S-2) t(S-1)      (S = len(tokens))
        indexed  every window tokens[s : s + n] with s + n <= S - 1
        query    the suffix tokens[S - n : S], which is therefore never its own match
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.latest: dict[tuple[int, ...], int] = {}
        self.ends = 0  # windows ending (exclusively) at 1 .. ends are indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the windows of tokens (which must extend the list of the previous call)
        that end before its last token."""
        latest = self.latest
        for e in range(self.ends + 1, len(tokens)):  # windows ending at e, e <= size - 1
            for n in range(self.n_min, min(self.n_max, e) + 1):
                latest[tuple(tokens[e - n:e])] = e - n
        self.ends = max(self.ends, len(tokens) - 1)

    def lookup(self, tokens: Sequence[int], k: int,
               also: tuple[Sequence[int], NgramIndex] | None = None) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        of tokens (n_max .. n_min long); [] when none occurred before. tokens must extend the
        list of the previous call. also: another text and its index (built by extend),
        searched at each length after tokens (the prompt re-spaced: respace.py)."""
        self.extend(tokens)
        size = len(tokens)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            key = tuple(tokens[size - n:])
            s = self.latest.get(key)
            if s is not None:
                return list(tokens[s + n:s + n + k])
            if also is not None and (s := also[1].latest.get(key)) is not None:
                return list(also[0][s + n:s + n + k])
        return []


@dataclass
class _Tracked:
    request: Request
    index: NgramIndex
    respaced: tuple[list[int], NgramIndex] | None  # the prompt re-spaced, indexed


class NgramProposer(KVFreeProposer):
    def __init__(self, n_min: int, n_max: int, tokenizer: Any = None) -> None:
        """tokenizer: the target's, to read each prompt re-spaced too (respace.py); None:
        the request's tokens alone."""
        self.n_min, self.n_max = n_min, n_max
        self.tokenizer = tokenizer
        self._indexes: dict[str, _Tracked] = {}

    def _tracked(self, req: Request) -> _Tracked:
        """The request's index, new for a request not seen (or a new one under an old id)."""
        t = self._indexes.get(req.request_id)
        if t is None or t.request is not req or t.index.ends >= len(req.all_token_ids):
            respaced = t.respaced if t is not None and t.request is req else None
            if respaced is None and (ids := respaced_prompt(self.tokenizer,
                                                            req.prompt_token_ids)) is not None:
                index = NgramIndex(self.n_min, self.n_max)
                index.extend(ids)
                respaced = (ids, index)
            t = self._indexes[req.request_id] = _Tracked(
                req, NgramIndex(self.n_min, self.n_max), respaced)
        return t

    def propose(self, requests: list[Request], num_drafts: list[int],
                block_tables: list[list[int]], stops: DraftStops | None = None
                ) -> list[list[int]]:
        out = []
        for r, k in zip(requests, num_drafts, strict=True):
            if k:
                t = self._tracked(r)
                out.append(t.index.lookup(r.all_token_ids, k, t.respaced))
            else:
                out.append([])
        return out

    def remove(self, request_ids: list[str]) -> None:
        """Finished, aborted or preempted: the index goes (a preempted request's is rebuilt
        from its tokens when it drafts again)."""
        for rid in request_ids:
            self._indexes.pop(rid, None)
