"""How many drafts each request verifies in its next step: 0..K, decided per step.

The value of a draft token j of request i is what the token it may add would cost without
speculation:

    gain     alpha_i^j * c_tok     alpha_i: the request's measured per-draft acceptance (the
                                   chance draft j survives is alpha^j); c_tok = cost(B) / B,
                                   a token's share of a plain step of B rows

Its price has two parts, both read from tables of measured times (step_costs.py's StepCosts:
seconds by rows, interpolated between the row counts seen):

    rows     cost(T + n) - cost(T)   the target step with the n draft rows added
    drafting draft_cost(rows) per drafting forward (a draft model: one per depth, over the
             requests drafting that deep; Medusa: one per step, every head at once; a
             lookup: nothing)
    catch-up a draft model that has not read a request's tokens yet (a new prompt) reads
             them first: catch_up_tokens x its measured cost per token, spread over the
             steps the request has left (_tokens_left: what the requests that finished
             longer than it ran on for, at most max_tokens), since it is paid once; not before
             the request has decoded CATCH_UP_AFTER tokens (a burst may still be arriving)

A draft model's forward costs nearly as much for one row as for eight (it streams its weights
either way), so the choice is made per depth: for d = 0..K, every request drafts
min(d, its cap, its own best count), where its own best count is the largest j whose gain
still exceeds one target row; the d with the largest gain minus price wins. On a bandwidth-
bound step at batch 1 the rows are cheap and a predictable request drafts deep; under load a
token is cheap (c_tok falls as B grows) while the rows and the draft's forwards are not, and
speculation backs off to 0. A request at 0 drafts one token every PROBE_EVERY steps, so a
text that turns predictable is noticed; under load less often, so that its probes cost at
most PROBE_SHARE of its share of the steps: a probe pays for one more row (and its share of
a draft forward), which on a CPU at 8 rows can cost a fifth of the step (Qwen2.5-Coder 1.5B
here: 8 rows 207 ms, 9 rows 247 ms). Probing every 8 steps there made 8 streams that never
drafted otherwise run at 0.87-0.94x of no speculation. Each verify step in a row of which
nothing is accepted doubles a request's wait for its next probe, up to 2^PROBE_BACKOFF
times: a probe of the default model's first layers (self_draft) costs most of a step, and
on text they predict 5% of the time its probes every ~28 steps cost ~3%, most of the 5%
that the issue's floor (0.95x) leaves.

A draft model knows how sure it is of each draft, and its confidence is well calibrated
(base.py's DraftStops), so for it (stops_on_confidence) the depth is not chosen ahead:
num_drafts decides which requests start, and draft_stops prices where each stops as it
drafts.
"""

from __future__ import annotations

import math
from collections import deque

from kvserve.request import Request
from kvserve.spec.base import DRAFT_FORWARDS, DraftStops
from kvserve.spec.step_costs import StepCosts

PROBE_EVERY = 8
PROBE_SHARE = 0.03
PROBE_BACKOFF = 2
# Tokens a new request decodes before a draft model may catch up on it (read its prompt).
# A server takes a burst's requests over its next steps, one or two a step (each joins a
# step that prefills it beside the others' decodes), so the first ones decode beside few
# others at first: there any catch-up paid, and the burst then decoded at 8 rows, where
# drafting barely pays and the catch-ups (~250 prompt tokens each, the whole batch waiting)
# never paid back (Qwen2.5-Coder 1.5B + 0.5B, input-grounded, 8 streams: 0.82x in a round
# with 286 drafts). Waiting costs a request alone the speed-up of its first 8 tokens (under
# 1% of a 256-token reply at 1.2x), and its first steps measure a one-row step, which a
# drafting request never runs. Exempting a catch-up that looked cheaper than the wait put
# the drafts back: the first step after the warm-up prices a token from an empty table.
CATCH_UP_AFTER = 8
# A request's acceptance: its own counts (decayed per verify step, ~5 steps' worth at most)
# beside a prior of weight _PRIOR_WEIGHT whose mean is the proposer's acceptance over the
# server's recent drafts (every request's, decayed per request verified; _PRIOR_ALPHA at
# start). A prior of fixed mean 0.7 had to decay with the counts, or a proposer never
# accepted kept drafting above a floor it held up (Medusa heads accepted 5% of the time, at
# every step of the default model); light and decayed, two rejections at a request's start
# (0.7 -> 0.43 -> 0.29) stopped a draft model the server's other requests accepted 77% of,
# and it never drafted again (a probe would first read every token since). The server's
# mean is what the proposer does, so the prior can be heavy and stay.
_PRIOR_ALPHA, _PRIOR_WEIGHT = 0.7, 4.0
_DECAY = 0.8  # per verify step, of a request's acceptance counts
# Per step a request does not draft while a draft model is behind on it (it cannot probe:
# a probe would first read every token since). Two rejections at a request's start stopped
# one request in twelve for good (alpha 0.63 against a threshold near 0.72; 2 drafts in 256
# tokens). Qwen2.5-Coder 1.5B + 0.5B, 1 stream, 3 x 4 open prompts on one engine, paired:
# 375 drafts and 179 s without, 1149 drafts and 162 s with.
_IDLE_DECAY = 0.9
# A request's tokens left, which spread a catch-up's price (_tokens_left): the output lengths
# of the last _LENGTHS requests to finish; with fewer than _MIN_LONGER of them longer than a
# request's own output, it is expected to write as much again, and at least _TYPICAL_ANSWER
# (a guess: a chat answer's length).
_LENGTHS, _MIN_LONGER, _TYPICAL_ANSWER = 64, 4, 256
_SERVER_DECAY = 0.98
# Catch-ups whose least time per token prices the next one (SpecPolicy.observe_catch_up).
_CATCH_UPS = 4
# Until a draft forward is measured, it costs this share of a one-row target step.
_PRIOR_DRAFT_SHARE = 0.4
# A verify row never costs less than this share of the step it joins (SpecPolicy._added):
# where the tables say less, or less than nothing, a stall timed the smaller step.
_MIN_ROW_SHARE = 0.02


class SpecPolicy:
    def __init__(self, k_max: int, adaptive: bool = True, draft_forwards: str = "none"
                 ) -> None:
        """draft_forwards: how the proposer's own forwards are priced (spec/base.py's
        DRAFT_FORWARDS: none, per_depth, per_step)."""
        if draft_forwards not in DRAFT_FORWARDS:
            raise ValueError(f"draft_forwards must be one of {DRAFT_FORWARDS}, got "
                             f"{draft_forwards!r}")
        self.k_max = k_max
        self.adaptive = adaptive
        self.draft_forwards = draft_forwards
        self._accepted: dict[str, float] = {}  # decayed accepted drafts
        self._rejected: dict[str, float] = {}  # decayed first rejections
        self._idle: dict[str, int] = {}  # steps since the request last drafted
        self._misses: dict[str, int] = {}  # its verify steps in a row with none accepted
        self._out: dict[str, int] = {}  # its output tokens when last seen (num_drafts)
        self.forget()

    def forget(self, keep_times: bool = False) -> None:
        """Drops every measured time and the server's acceptance: after the engine's
        warm-up, whose steps are its first (cold) and whose drafts continue a one-token
        prompt. Kept, they priced the rest of a server's life: a warm-up step of 940 ms at
        one row against 60 made every token look dear, so the first requests paid a draft
        model's catch-up over their prompts at 8 streams too (Qwen2.5-Coder 1.5B,
        input-grounded, 0.81-0.94x). keep_times: the step tables stay (the warm-up's second,
        warm pass: LLMEngine.warm_up), the acceptance, the catch-ups and the answer lengths
        go."""
        # Every request's verify steps, decayed (the prior's mean): one draft's weight.
        self._server = [_PRIOR_ALPHA, 1 - _PRIOR_ALPHA]
        if not keep_times:
            self.cost = StepCosts()  # the target's decode / verify steps, by rows
            self.prefill_cost = StepCosts()  # the target's steps with prompt tokens, by rows
            self.draft_cost = StepCosts(shape=self.cost)  # the proposer's forwards, by rows
        # Seconds per token of the proposer's last catch-ups (observe_catch_up).
        self._catch_ups: deque[float] = deque(maxlen=_CATCH_UPS)
        self._lengths: deque[int] = deque(maxlen=_LENGTHS)  # finished requests' outputs

    # -- measurements -------------------------------------------------------------------

    def observe_step(self, num_rows: int, seconds: float, prefill: bool = False) -> None:
        """A target step of num_rows tokens; prefill: some were a prompt's (a prefill chunk
        beside decodes), whose rows cost less than a verify row's (no logits, no sampling
        over the vocabulary): those steps price catch-ups, not rows. In one table, the
        steps that join a new request to a batch priced verify rows at 8+ rows as the
        prefill's (Qwen2.5-Coder 1.5B, 8 streams arriving a step apart: drafting, 0.82x)."""
        (self.prefill_cost if prefill else self.cost).observe(num_rows, seconds)

    def observe_draft(self, steps: list[tuple[int, float]]) -> None:
        """The proposer's forwards of one propose(): (rows, seconds) each."""
        for rows, seconds in steps:
            self.draft_cost.observe(rows, seconds)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A catch-up over `tokens`. One is timed per request, and a time only adds stalls
        to the work: a draft model's first catch-up runs cold, 4.6-4.8 ms a token against
        1.5-2.3 for the next ones (Qwen2.5-Coder 0.5B, one process, two runs). In an EMA of
        weight 0.2 that took about ten requests to fade, pricing the longer prompts'
        catch-ups at twice their cost meanwhile. So catch_up_cost is the least time per
        token of the last _CATCH_UPS: a cost that really rose shows within as many."""
        self._catch_ups.append(seconds / max(tokens, 1))

    @property
    def catch_up_cost(self) -> float:
        """Seconds per token the proposer catches up on, as measured lately; 0 before."""
        return min(self._catch_ups, default=0.0)

    def observe_verify(self, request_ids: list[str], drafts: list[list[int]],
                       emitted: list[list[int]]) -> None:
        for rid, d, e in zip(request_ids, drafts, emitted, strict=True):
            if d:
                a, r = len(e) - 1, int(len(e) - 1 < len(d))
                self._misses[rid] = 0 if a else self._misses.get(rid, 0) + 1
                self._accepted[rid] = self._accepted.get(rid, 0.0) * _DECAY + a
                self._rejected[rid] = self._rejected.get(rid, 0.0) * _DECAY + r
                s = self._server
                s[0], s[1] = s[0] * _SERVER_DECAY + a, s[1] * _SERVER_DECAY + r

    def alpha(self, request_id: str) -> float:
        """Per-draft acceptance: accepted drafts / (accepted + first rejections), the
        request's decayed counts beside the server's prior."""
        sa, sr = self._server
        a = self._accepted.get(request_id, 0.0) + _PRIOR_WEIGHT * sa / (sa + sr)
        r = self._rejected.get(request_id, 0.0) + _PRIOR_WEIGHT * sr / (sa + sr)
        return a / (a + r)

    def _catch_up_per_token(self) -> float:
        """Seconds per token the proposer catches up on: measured, or until measured, about
        0.6x the target's cost per prefill token (Qwen2.5-Coder 0.5B against 1.5B here:
        0.57x), or cost(1) / 20."""
        if self.catch_up_cost:
            return self.catch_up_cost
        big = [n for n in self.prefill_cost.table if n >= 64]
        return 0.6 * self.prefill_cost(max(big)) / max(big) if big else self.cost(1) / 20

    # -- the decision -------------------------------------------------------------------

    def _base(self, rows: int) -> float:
        """A plain step of `rows`: cost(rows), unless a step of one row more costs less
        and was measured since; then the table's estimate from its other row counts (no
        dearer than that step). One stall timed at a row count that the policy then stops
        running is kept until it goes stale (step_costs.py's _STALE): a first one-row step
        of 11 ms against 6 at two rows (the default model) made every draft look cheaper
        than none, and self_draft, accepted 5% of the time, drafted at each of 32 steps in
        a row. Capped at the step of one row more alone, the base is a row too dear, and so
        is a token (c_tok): on a compute-bound CPU a fifth of a step at 8 rows
        (Qwen2.5-Coder 1.5B). Only where the dearer count is the older: a count measured at
        every step is not a stall (the default model, 8 streams: 8 rows at 18-20 ms each
        step, 9 at 16.5 once, and re-estimated at 15.8 the suffix proposer, 97% accepted,
        stopped drafting)."""
        cost, above = self.cost(rows), self.cost(rows + 1)
        if cost <= above or not self.cost.measured_after(rows + 1, rows):
            return cost
        return min(self.cost.estimate_without(rows), above)

    def _added(self, rows: int, extra: int, base: float) -> float:
        """Seconds `extra` verify rows add to a step of `rows` costing base (_base): the
        tables' difference, and at least _MIN_ROW_SHARE of base a row."""
        return max(self.cost(rows + extra) - base, extra * _MIN_ROW_SHARE * base)

    def _draft_prior(self) -> float:
        """What a proposer forward costs until one is measured (a lookup runs none)."""
        return _PRIOR_DRAFT_SHARE * self.cost(1)

    def _tokens_left(self, req: Request) -> float:
        """The tokens req is expected to write still, which a catch-up's price is spread
        over: the mean excess of the recently finished requests that ran longer than it
        has so far, at most max_tokens - its output. Not max_tokens alone: a client that
        sends none gets the context's room (thousands of tokens), where any catch-up looked
        free, and a chat answer ends well before its cap."""
        n, cap = req.num_output_tokens, req.max_tokens
        room = max(1, cap - n)
        longer = [min(length, cap) - n for length in self._lengths if length > n]
        if len(longer) < _MIN_LONGER:
            return min(room, max(n, _TYPICAL_ANSWER))
        return min(room, max(1.0, sum(longer) / len(longer)))

    def _catch_up_pays(self, alpha: float, cap: int, tokens: int, req: Request, load: int,
                       draft_prior: float) -> bool:
        """Whether req drafting at `load` rows saves more over the steps it has left than
        the proposer's catch-up over `tokens` costs. A step at depth k there gains
        sum_{j<=k} alpha^j tokens at c_tok and pays k rows and k draft forwards' share
        (1 / load of each); the request has left / (1 + gain) such steps."""
        base = self._base(load)
        c_tok = base / load
        per_depth = self._added(load, 1, base) + self.draft_cost(load, draft_prior) / load
        left = self._tokens_left(req)
        per_token = self._catch_up_per_token()
        gain = best = 0.0
        for k in range(1, cap + 1):
            gain += alpha ** k
            best = max(best, (gain * c_tok - k * per_depth) * left / (1 + gain))
        return best > tokens * per_token

    def num_drafts(self, requests: list[Request], max_drafts: list[int],
                   catch_up: list[int] | None = None, load: int = 0) -> list[int]:
        """Drafts per request for the next step (each <= its max_drafts and K); catch_up:
        the tokens the proposer would read first for each (None: none); load: the requests
        the engine holds (running and waiting, up to its max_num_seqs), which this step's
        rows are only while no request is being prefilled."""
        caps = [min(self.k_max, m) for m in max_drafts]
        if not self.adaptive:
            return caps
        for r in requests:
            self._out[r.request_id] = r.num_output_tokens
        rows = len(requests)
        base = self._base(rows)
        c_tok = base / max(rows, 1)
        row_price = self._added(rows, 1, base)
        alphas = [self.alpha(r.request_id) for r in requests]
        # Each request's own best depth: the drafts whose gain beats one more target row.
        own = []
        for a, cap in zip(alphas, caps, strict=True):
            j = 0
            while j < cap and a ** (j + 1) * c_tok > row_price:
                j += 1
            own.append(j)
        # A new request's catch-up waits until it has decoded CATCH_UP_AFTER tokens: a burst
        # may still be arriving, so the load it will decode under is unknown.
        if catch_up:
            own = [0 if n and r.num_output_tokens < CATCH_UP_AFTER else k
                   for r, k, n in zip(requests, own, catch_up, strict=True)]
        draft_prior = self._draft_prior()
        # A catch-up (a draft model reading a new prompt) is paid once, for all the steps
        # the request drafts after it, and those run at the engine's load, not at this
        # step's rows where requests are still waiting: a burst of requests decodes at
        # first beside few others while the rest are prefilled, where any draft pays, then
        # at 8 rows, where few do. (Where the rows are the load, the loop below prices the
        # catch-up itself; gated there too, a request alone on Qwen2.5-Coder 1.5B, priced
        # with the priors of its first step, never drafted.)
        if catch_up and load > rows:
            own = [k if not (k and n) or self._catch_up_pays(a, k, n, r, load, draft_prior)
                   else 0 for r, k, n, a in zip(requests, own, catch_up, alphas, strict=True)]
        best_d, best_value = 0, 0.0
        if catch_up and self.draft_forwards == "per_depth":  # the same at every depth
            per_token = self._catch_up_per_token()
            left = [self._tokens_left(r) if n else 0.0
                    for r, n in zip(requests, catch_up, strict=True)]
        for d in range(1, max(own, default=0) + 1):
            ks = [min(d, k) for k in own]
            gain = sum(sum(a ** j for j in range(1, k + 1)) for a, k in zip(alphas, ks,
                                                                           strict=True))
            price = self._added(rows, sum(ks), base)
            if self.draft_forwards == "per_step":
                price += self.draft_cost(sum(1 for k in ks if k), draft_prior)
            elif self.draft_forwards == "per_depth":
                price += sum(self.draft_cost(sum(1 for k in ks if k > j), draft_prior)
                             for j in range(d))
                if catch_up:
                    for k, n, a, tl in zip(ks, catch_up, alphas, left, strict=True):
                        if k and n:
                            steps = tl / sum(a ** j for j in range(k + 1))
                            price += n * per_token / max(1.0, steps)
            value = gain * c_tok - price
            if value > best_value:
                best_d, best_value = d, value
        ks = [min(best_d, k) for k in own]
        # Probes: a request at 0 for probe_every steps (longer after misses: PROBE_BACKOFF)
        # drafts one token. A proposer's probes that need its forward (a draft model,
        # Medusa) wait for a step that runs it anyway, or go all at once.
        probe_price = row_price
        if self.draft_forwards != "none":
            probe_price += self.draft_cost(rows, draft_prior) / max(rows, 1)
        probe_every = PROBE_EVERY if c_tok <= 0 else max(
            PROBE_EVERY, math.ceil(probe_price / (PROBE_SHARE * c_tok) - 1e-9))
        due = []
        for i, r in enumerate(requests):
            rid = r.request_id
            self._idle[rid] = 0 if ks[i] else self._idle.get(rid, 0) + 1
            # (Never a probe that makes a draft model read a whole prompt first.)
            wait = probe_every << min(self._misses.get(rid, 0), PROBE_BACKOFF)
            if not ks[i] and caps[i] and self._idle[rid] >= wait \
                    and not (catch_up and catch_up[i]):
                due.append(i)
            # A request a draft model is behind on never probes, so its counts would stay
            # where they stopped it: they fade toward the server's prior instead.
            if not ks[i] and catch_up and catch_up[i] and rid in self._accepted:
                self._accepted[rid] *= _IDLE_DECAY
                self._rejected[rid] *= _IDLE_DECAY
        if due and (self.draft_forwards == "none" or best_d or len(due) == sum(
                1 for c in caps if c)):
            for i in due:
                ks[i] = 1
                self._idle[requests[i].request_id] = 0
        return ks

    def draft_stops(self, requests: list[Request], ks: list[int], max_drafts: list[int]
                    ) -> tuple[list[int], DraftStops | None]:
        """For a proposer that knows its confidence (stops_on_confidence), after
        num_drafts: every request num_drafts starts may draft up to its cap, and stops
        where the prices returned say (base.py's DraftStops). num_drafts' depths price the
        j-th draft at alpha^j, the acceptance of an average draft; a draft model knows
        better for each of its own, so its depth is decided as it drafts. Qwen2.5-Coder
        1.5B, 0.5B drafting, open generation, greedy, 1 stream: replaying the confidences
        and outcomes of 603 proposals drafted at K = 4, stopping where these prices say
        costs 57 ms a token, the best fixed K (1) 60, no drafts 74; in a server
        (benchmarks/spec_cell.py, 3 rounds) 1.21x of no speculation, as alpha's depths
        were, but steadily (372-383 drafting steps a run, against 248-381).
        Not adaptive: ks as they are, no stops."""
        if not self.adaptive:
            return ks, None
        caps = [min(self.k_max, m) for m in max_drafts]
        ks = [cap if k else 0 for k, cap in zip(ks, caps, strict=True)]
        n = sum(1 for k in ks if k)
        if not n:
            return ks, None
        rows = len(requests)
        base = self._base(rows)
        c_tok = base / max(rows, 1)
        draft_prior = self._draft_prior()
        share = self.draft_cost(n, draft_prior) / n / c_tok
        # Draft j's verify row: the (j + 1)-th of each of the n drafting requests, priced
        # over the step without it; the first over the base, as num_drafts prices it (a
        # stalled step of `rows` made the first drafts look free).
        below = [base, *(self.cost(rows + n * j) for j in range(1, max(ks)))]
        keep = [max(self.cost(rows + n * (j + 1)) - b, n * _MIN_ROW_SHARE * base) / n / c_tok
                for j, b in enumerate(below)]
        more = [row + share for row in keep]
        return ks, DraftStops(keep, more, [self.alpha(r.request_id) for r in requests])

    def remove(self, request_ids: list[str], finished: bool = True) -> None:
        """The requests are done. Where they finished (not aborted: a client that left
        says nothing of an answer's length), each one's output joins the lengths
        _tokens_left reads."""
        for rid in request_ids:
            n = self._out.pop(rid, None)
            if n and finished:
                self._lengths.append(n)
            self._accepted.pop(rid, None)
            self._rejected.pop(rid, None)
            self._idle.pop(rid, None)
            self._misses.pop(rid, None)
