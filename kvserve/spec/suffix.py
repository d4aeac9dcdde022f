"""Suffix decoding (SuffixDecoding, arXiv:2411.04975; ArcticInference's suffix cache): no
model, the longest match of a request's latest tokens in two sources, and the continuation
seen most often after it.

    the request's own tokens    prompt + output so far, indexed as they are appended
    its tenant's past requests  each finished request's output, with the last max_depth
                                prompt tokens before it, of this server and the same tenant
                                (Request.tenant: the API key's hash; None offline); at most
                                max_cached_tokens in all, the oldest quarter dropped first
    its prompt re-spaced        its wrapped lines joined (respace.py: a rewrite of a
                                hard-wrapped text writes each paragraph as one line)

A request only ever reads its own tenant's past requests: text of one API key is never
proposed to another (the drafts would be verified away, but which ones are accepted shows in
timing, and the proposer must not be a side channel). Drafts are deterministic: verification
reads them as one-hot q, so output is exact whatever they are.

The index (_Corpus): a token buffer and, for each pair of adjacent tokens, the positions where
it ends. A match looks up the request's last two tokens, takes the latest _MAX_CANDIDATES
positions of that pair in each source, and extends them backwards a token at a time up to
max_depth; the positions that reach the longest length are the occurrences of the request's
longest matched suffix (a suffix tree's node at that depth). The drafts walk forward from them
as SuffixDecoding walks the tree: each step the most frequent next token among the surviving
occurrences (ties: the latest), keeping those it follows, until k tokens, max_spec_factor x
the match length, no continuation, or the path's probability (the product of count /
occurrences along it) below min_token_prob.

Per step and request: the tokens appended since the last step are indexed (a dict append
each), one dict lookup and at most max_depth vectorized filters over at most _MAX_CANDIDATES
positions per source, and the walk. Nothing rescans a history. The cache costs about 50
bytes a token (the buffer, a position, the pairs' dict), 50 MB at the default 1M tokens.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.request import Request
from kvserve.spec.base import DraftStops, KVFreeProposer
from kvserve.spec.respace import respaced_prompt

_SEP = -1  # between documents, before the first: never a token, never matched
_NO_TOKEN = -2  # the query's missing positions (a short request): never in a buffer
_MAX_CANDIDATES = 4096  # a pair's latest occurrences examined per source and step


class _Corpus:
    """Token ids after a _SEP, and where each adjacent pair of tokens ends (its second
    token's position). The buffer past size is _SEP, so a position's next token always
    reads."""

    def __init__(self, capacity: int = 256) -> None:
        self.tokens = np.full(capacity + 2, _SEP, dtype=np.int32)
        self.end = 1  # one past the last token; position 0 is the leading _SEP
        self.ends: dict[int, array] = {}

    @property
    def size(self) -> int:
        """Tokens and separators held (the leading _SEP not counted)."""
        return self.end - 1

    def _reserve(self, n: int) -> None:
        need = self.end + n + 1  # + the _SEP past the end
        if need > len(self.tokens):
            grown = np.full(max(need, 2 * len(self.tokens)), _SEP, dtype=np.int32)
            grown[:self.end] = self.tokens[:self.end]
            self.tokens = grown

    def extend(self, token_ids: Sequence[int]) -> None:
        n = len(token_ids)
        if not n:
            return
        self._reserve(n)
        start = self.end
        self.tokens[start:start + n] = token_ids
        ends = self.ends
        prev = int(self.tokens[start - 1])
        for pos, tok in enumerate(token_ids, start):
            if prev >= 0:
                key = (prev << 32) | tok
                where = ends.get(key)
                if where is None:
                    ends[key] = array("i", (pos,))
                else:
                    where.append(pos)
            prev = tok
        self.end = start + n

    def end_document(self) -> None:
        self._reserve(1)
        self.end += 1  # the buffer there is already _SEP

    def match(self, query: np.ndarray, key: int) -> tuple[int, np.ndarray | None]:
        """(length, positions): the longest suffix of the query (query[0] its last token,
        query[d] the one d before; at most len(query)) that occurs here followed by a token,
        and the positions where those occurrences end. (0, None) when none does."""
        where = self.ends.get(key)
        if where is None:
            return 0, None
        tok = self.tokens
        pos = np.frombuffer(where[-_MAX_CANDIDATES:], dtype=np.int32)
        pos = pos[tok[pos + 1] >= 0]  # followed by a token (not the request's own end)
        if not len(pos):
            return 0, None
        length = 2
        for d in range(2, len(query)):
            # Survivors matched d tokens, all real, so pos - d is at worst the leading _SEP.
            keep = tok[pos - d] == query[d]
            if not keep.any():
                break
            pos = pos[keep]
            length = d + 1
        return length, pos


class _Cache:
    """The finished requests' tokens, one list of _Corpus segments per tenant; at most
    max_tokens in all, a segment a quarter of that: past the bound the oldest segment (of
    any tenant) goes."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.segment_tokens = max(max_tokens // 4, 1)
        self.num_tokens = 0
        self.segments: dict[str | None, list[_Corpus]] = {}
        self._order: deque[tuple[str | None, _Corpus]] = deque()  # oldest first

    def add(self, tenant: str | None, token_ids: Sequence[int]) -> None:
        # A document longer than a segment keeps its tail (+ its separator).
        token_ids = token_ids[len(token_ids) - (self.segment_tokens - 1):] \
            if len(token_ids) >= self.segment_tokens else token_ids
        if not token_ids:
            return
        segs = self.segments.setdefault(tenant, [])
        if not segs or segs[-1].size + len(token_ids) + 1 > self.segment_tokens:
            segs.append(_Corpus(min(self.segment_tokens, 4 * len(token_ids) + 64)))
            self._order.append((tenant, segs[-1]))
        seg = segs[-1]
        before = seg.size
        seg.extend(token_ids)
        seg.end_document()
        self.num_tokens += seg.size - before
        while self.num_tokens > self.max_tokens:
            old_tenant, old = self._order.popleft()
            old_segs = self.segments[old_tenant]
            old_segs.remove(old)  # its first: a tenant's segments are in age order
            if not old_segs:
                del self.segments[old_tenant]
            self.num_tokens -= old.size


@dataclass
class _Tracked:
    request: Request
    corpus: _Corpus
    respaced: _Corpus | None = None  # its prompt re-spaced (respace.py), once it drafts
    respaced_read: bool = False  # whether respaced was made (None: re-spacing changed nothing)


class SuffixProposer(KVFreeProposer):
    def __init__(self, max_depth: int = 24, max_cached_tokens: int = 1 << 20,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 tokenizer: Any = None) -> None:
        """tokenizer: the target's, to read each prompt re-spaced too (respace.py); None:
        the request's tokens and its tenant's cache alone."""
        self.tokenizer = tokenizer
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.cache = _Cache(max_cached_tokens)
        self._requests: dict[str, _Tracked] = {}

    # -- the request's own index --------------------------------------------------------

    def _sync(self, req: Request) -> _Tracked:
        """The request's corpus holding all_token_ids: the new tokens appended (a finished
        request's last ones can be dropped: then, and for a new request, built anew)."""
        t = self._requests.get(req.request_id)
        ids = req.all_token_ids
        if t is not None and t.request is req:
            c = t.corpus
            n = c.size
            if n <= len(ids) and (n == 0 or int(c.tokens[n]) == ids[n - 1]):
                c.extend(ids[n:])
                return t
        c = _Corpus(len(ids) + 256)
        c.extend(ids)
        old = t if t is not None and t.request is req else None
        t = self._requests[req.request_id] = _Tracked(req, c)
        if old is not None:  # the same prompt: its re-spaced text stays
            t.respaced, t.respaced_read = old.respaced, old.respaced_read
        return t

    def _respaced(self, t: _Tracked) -> _Corpus | None:
        """The request's prompt re-spaced, made the first time it drafts: _sync sees every
        request every step, drafting or not, and a prompt's encoding costs ~1.7 ms per 1000
        tokens."""
        if not t.respaced_read:
            t.respaced_read = True
            prompt = respaced_prompt(self.tokenizer, t.request.prompt_token_ids)
            if prompt is not None:
                t.respaced = _Corpus(len(prompt))
                t.respaced.extend(prompt)
                t.respaced.end_document()
        return t.respaced

    # -- the protocol --------------------------------------------------------------------

    def propose(self, requests: list[Request], num_drafts: list[int],
                block_tables: list[list[int]], stops: DraftStops | None = None
                ) -> list[list[int]]:
        out = []
        for req, k in zip(requests, num_drafts, strict=True):
            t = self._sync(req)  # every request seen, so its tokens reach the cache
            out.append(self._speculate(t, req.tenant, k) if k else [])
        return out

    def _speculate(self, t: _Tracked, tenant: str | None, k: int) -> list[int]:
        """Up to k drafts following the request's tokens, from them, its prompt re-spaced
        and the tenant's cache."""
        own = t.corpus
        end = own.end
        query = own.tokens[max(end - self.max_depth, 0):end][::-1].copy()
        query[query < 0] = _NO_TOKEN
        if len(query) < 2 or query[1] < 0:
            return []
        key = (int(query[1]) << 32) | int(query[0])
        respaced = self._respaced(t)
        # Oldest first, the request's own last: ties go to the latest occurrence.
        sources = [*self.cache.segments.get(tenant, ()),
                   *((respaced,) if respaced is not None else ()), own]
        best, matched = 0, []
        for c in sources:
            length, pos = c.match(query, key)
            if length > best:
                best, matched = length, [(c, pos)]
            elif length == best and length:
                matched.append((c, pos))
        limit = min(k, int(best * self.max_spec_factor))
        drafts: list[int] = []
        prob = 1.0
        while matched and len(drafts) < limit:
            nexts = [c.tokens[pos + 1] for c, pos in matched]
            following = np.concatenate(nexts)
            real = following[following >= 0]
            if not len(real):
                break
            values, counts = np.unique(real, return_counts=True)
            top = int(counts.max())
            p = prob * top / len(following)
            if p < self.min_token_prob:
                break
            tops = values[counts == top]
            tok = int(tops[0]) if len(tops) == 1 else \
                int(following[np.flatnonzero(np.isin(following, tops))[-1]])
            drafts.append(tok)
            prob = p
            matched = [(c, pos[nx == tok] + 1) for (c, pos), nx in zip(matched, nexts)]
            matched = [(c, pos) for c, pos in matched if len(pos)]
        return drafts

    def remove(self, request_ids: list[str]) -> None:
        """A finished (or aborted) request's output goes to its tenant's cache. A preempted
        one keeps its index: its tokens stay, and the proposer holds no KV."""
        for rid in request_ids:
            t = self._requests.get(rid)
            if t is None or not t.request.is_finished():
                continue
            del self._requests[rid]
            req = t.request
            if req.num_output_tokens and self.cache.max_tokens:
                start = max(req.num_prompt_tokens - self.max_depth, 0)
                self.cache.add(req.tenant, req.all_token_ids[start:])
