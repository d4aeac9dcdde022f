"""How many drafts each request verifies in its next step: 0..K, decided per step.

A draft token j of request i pays when the token it may add is worth more than it costs:

    gain   alpha_i^j * c_tok     alpha_i: the request's measured per-draft acceptance (the
                                 chance draft j survives is alpha^j); c_tok: what a token
                                 costs without speculation, cost(B) / B at batch B
    cost   cost(T + 1) - cost(T) + c_draft
                                 the step's cost for one more row at T rows (cost() is a
                                 table of measured step times, by rows), plus the proposer's
                                 own cost per draft token (a draft model's forward)

Drafts are handed out one at a time to the request with the largest gain until none pays.
On a bandwidth-bound CPU step an extra row costs little, so a predictable request drafts K;
under load the rows get dear and an unpredictable request's alpha falls, and both back off
to 0. A request at 0 drafts one token every PROBE_EVERY steps, so a text that turns
predictable is noticed.
"""

from __future__ import annotations

from kvserve.request import Request

PROBE_EVERY = 8
_PRIOR_ALPHA, _PRIOR_WEIGHT = 0.7, 2.0
_DECAY = 0.8  # per verify step, of a request's acceptance counts
_EMA = 0.2  # of the step-time table
# Until a row count is measured, one more row costs this share of a one-row step.
_PRIOR_ROW_SHARE = 0.05


class SpecPolicy:
    def __init__(self, k_max: int, adaptive: bool = True) -> None:
        self.k_max = k_max
        self.adaptive = adaptive
        self._accepted: dict[str, float] = {}  # decayed accepted drafts
        self._rejected: dict[str, float] = {}  # decayed first rejections
        self._idle: dict[str, int] = {}  # steps since the request last drafted
        self._step_cost: dict[int, float] = {}  # rows -> seconds (EMA)
        self.draft_cost = 0.0  # seconds per draft token per request (the proposer's)

    # -- measurements -------------------------------------------------------------------

    def observe_step(self, num_rows: int, seconds: float) -> None:
        old = self._step_cost.get(num_rows)
        self._step_cost[num_rows] = seconds if old is None else old + _EMA * (seconds - old)

    def observe_draft(self, num_tokens: int, seconds: float) -> None:
        """The proposer spent `seconds` drafting num_tokens tokens (over all requests)."""
        if num_tokens:
            per = seconds / num_tokens
            self.draft_cost = per if not self.draft_cost else \
                self.draft_cost + _EMA * (per - self.draft_cost)

    def observe_verify(self, request_ids: list[str], drafts: list[list[int]],
                       emitted: list[list[int]]) -> None:
        for rid, d, e in zip(request_ids, drafts, emitted, strict=True):
            if d:
                a = len(e) - 1
                self._accepted[rid] = self._accepted.get(rid, 0.0) * _DECAY + a
                self._rejected[rid] = self._rejected.get(rid, 0.0) * _DECAY + (a < len(d))

    def alpha(self, request_id: str) -> float:
        a = self._accepted.get(request_id, 0.0)
        r = self._rejected.get(request_id, 0.0)
        return (a + _PRIOR_ALPHA * _PRIOR_WEIGHT) / (a + r + _PRIOR_WEIGHT)

    def cost(self, rows: int) -> float:
        """Seconds for a step of `rows` rows: the table, interpolated between measured row
        counts, extended past them by the prior share per row."""
        table = self._step_cost
        if not table:
            return 1.0 + _PRIOR_ROW_SHARE * (rows - 1)
        if rows in table:
            return table[rows]
        below = max((n for n in table if n < rows), default=None)
        above = min((n for n in table if n > rows), default=None)
        if below is not None and above is not None:
            w = (rows - below) / (above - below)
            return table[below] + w * (table[above] - table[below])
        known = below if below is not None else above
        assert known is not None
        base = table[known] / (1 + _PRIOR_ROW_SHARE * (known - 1))
        return table[known] + base * _PRIOR_ROW_SHARE * (rows - known)

    # -- the decision -------------------------------------------------------------------

    def num_drafts(self, requests: list[Request], max_drafts: list[int]) -> list[int]:
        """Drafts per request for the next step (each <= its max_drafts and K)."""
        caps = [min(self.k_max, m) for m in max_drafts]
        if not self.adaptive:
            return caps
        ks = [0] * len(requests)
        alphas = [self.alpha(r.request_id) for r in requests]
        rows = len(requests)
        c_tok = self.cost(rows) / max(rows, 1)
        while True:
            best, best_gain = -1, 0.0
            for i, a in enumerate(alphas):
                if ks[i] < caps[i]:
                    gain = a ** (ks[i] + 1) * c_tok
                    if gain > best_gain:
                        best, best_gain = i, gain
            if best < 0 or best_gain <= self.cost(rows + 1) - self.cost(rows) + self.draft_cost:
                break
            ks[best] += 1
            rows += 1
        for i, r in enumerate(requests):
            rid = r.request_id
            if ks[i]:
                self._idle[rid] = 0
            else:
                self._idle[rid] = self._idle.get(rid, 0) + 1
                if self._idle[rid] >= PROBE_EVERY and caps[i]:
                    ks[i] = 1
                    self._idle[rid] = 0
        return ks

    def remove(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._accepted.pop(rid, None)
            self._rejected.pop(rid, None)
            self._idle.pop(rid, None)
