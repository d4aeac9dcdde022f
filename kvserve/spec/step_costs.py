"""StepCosts: a step's measured seconds by its rows, what SpecPolicy (policy.py) prices a
draft's verify row and the proposer's forwards with.

A table of EMAs per row count, interpolated between the counts measured, extended past them
along a fitted slope (or as another table scales, or by a prior share per row), with the
guards that noisy measurements on shared 2-core machines asked for: a step slower
than that many one-row steps is a stall and is dropped; an entry not measured for a while
is stale and gives way to the counts measured since, and past them it is scaled by how far
the machine's speed has moved since it was timed. StepCosts' docstring says why each.
"""

from __future__ import annotations

_EMA = 0.2  # of the step-time tables
_STALE = 32  # observations since a row count's last, past which StepCosts caps it
# Until a row count is measured, one more row costs this share of a one-row step.
_PRIOR_ROW_SHARE = 0.05


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + _EMA * (new - old)


class StepCosts:
    """Seconds by rows (EMA per row count): interpolated between measured row counts,
    extended past the largest along the least-squares slope of the upper half of the
    measured counts (at least `row_share` of the measured base per row), below the
    smallest by `row_share` per row, or, with one count measured or none, as `shape`
    (another table: the draft model's forwards scale as the target's steps do) or by
    `row_share` per row.

    The extension is what prices rows not yet tried. At `row_share` alone (5% of a step
    per row, a bandwidth-bound GPU's) rows past the measured ones looked nearly free on
    the CPU, where each costs 10-20% of a one-row step (the kernels are compute-bound from
    a few rows: Qwen2.5-Coder 1.5B 74 ms at 1 row, 207 at 8, 324 at 15), and the draft
    model's forward at 8 rows looked like 26 ms against 80: at 8 streams every request
    started drafting, paid its catch-up over its prompt, and the server ran at 0.80-0.84x.

    A row count is only measured while the policy picks it, so an entry can go stale: the
    server's first decode steps (160 ms against 6 for the default model) made one row look
    dearer than four, drafting never stopped, and one row was never measured again
    (self_draft at 5% acceptance ran at 0.61x). So an entry not measured for _STALE
    observations is capped by the larger row counts measured since. Only a stale one: the
    cap over every larger count takes the least of many noisy times, which made rows look
    cheap under load (8 streams of Qwen2.5-Coder 1.5B drafting at 0.84x)."""

    def __init__(self, row_share: float = _PRIOR_ROW_SHARE, shape: StepCosts | None = None
                 ) -> None:
        self.table: dict[int, float] = {}
        self.row_share = row_share
        self.shape = shape
        self._observations = 0
        self._seen: dict[int, int] = {}  # row count -> the observation that last measured it
        # _rescaled()'s and _fresh()'s, until the next observe() (they read only the table
        # and the observation count; the policy prices dozens of row counts a step).
        self._view: dict[int, float] | None = None
        self._fresh_view: dict[int, float] | None = None

    def observe(self, rows: int, seconds: float) -> None:
        one = self.table.get(1)
        if rows > 1 and one is not None and seconds > rows * one:
            # A step over n rows does less work than n steps of one row (those stream the
            # weights n times), so a longer one was a stall: another process on the cores,
            # a cold first call. Kept, it prices its row count out for good, since the
            # policy never picks a count it thinks dear and so never measures it again: one
            # 3-row step of 46 ms against 8 at 1 and 2 rows (the default model, three
            # servers sharing 2 cores) left the suffix proposer drafting one token a step,
            # 1.26x of no speculation against 1.46x for the n-gram one beside it.
            return
        old = self.table.get(rows)
        if old is not None and self._stale(rows):
            # A stale average starts again: what it averaged is long past. From one step,
            # it is that step's time, and a stall there would be all of it; a step over
            # fewer rows does no more work than one over more, so it starts again at most
            # at the larger counts measured lately. (Not a count's first measurement: a
            # larger count timed once at a quiet moment would price the rows measured at
            # every step under load too low; test_a_fresh_row_count_keeps_its_own_time.) A
            # burst's last request, alone after 32+ steps of two or more rows, restarted
            # one row from its first step; 60 ms of stall there (added by hand: ~95 ms
            # against 27-36 at two rows) made a token look dear enough for its draft model to
            # catch up over 488 tokens (~1.2 s) with 58 left to write, the 6 drafts of a
            # server round at 0.81x (Qwen2.5-Coder 1.5B + 0.5B, 8 streams, grounded).
            old = None
            seconds = min([seconds] + [v for n, v in self._fresh().items() if n > rows])
        self.table[rows] = _ema(old, seconds)
        self._observations += 1
        self._seen[rows] = self._observations
        self._view = self._fresh_view = None

    def __call__(self, rows: int, default_base: float = 1.0) -> float:
        table = self.table
        if not table:
            # Nothing measured: default_base at one row, scaled as `shape` is, where it has
            # been measured. By the prior share alone, a draft model's first forward at 8
            # streams was priced at 35 ms against 75-94 measured once it ran, and 8 streams
            # of Qwen2.5-Coder 1.5B started drafting (0.90x in that round).
            if self.shape is not None and self.shape.table:
                return default_base * self.shape(rows) / self.shape(1)
            return default_base * (1 + self.row_share * (rows - 1))
        table = self._rescaled()
        cost = self._estimate(rows, table)
        seen = self._seen.get(rows)
        stale = seen is not None and self._stale(rows)
        if stale:
            cost = min([cost] + [v for n, v in table.items()
                                 if n > rows and self._seen[n] > seen])
        if stale or seen is None:
            # A stale entry no further than one row past the fresh ones also gives way to
            # what they say of it, as if it were unmeasured, so a policy that stopped
            # choosing a count it thought dear tries it once more and measures it again,
            # one count at a time (the rows past the fresh ones are priced along their
            # slope, which under-prices compute-bound rows several counts out). Kept, the
            # Qwen2.5-Coder 1.5B target's 3 rows (109.8 ms, measured once early, against
            # 66 timed directly and 49 at 2 rows) priced a second draft out for good: one
            # token a step, 227 drafts of 314 tokens on two open prompts. So does a count
            # never measured, which the entries on either side price otherwise: a server
            # warmed up while others started beside it kept 8 rows at 356 ms (176 on its
            # own), so its one-stream verify rows, between 74 ms at one row and that, cost
            # 40 ms each against 14, never drafted and so were never measured (Qwen2.5-
            # Coder 1.5B + 0.5B, open generation: no draft in a whole server round).
            fresh = self._fresh()
            if fresh and rows <= max(fresh) + 1:
                cost = min(cost, self._estimate(rows, fresh))
        if seen is None and self.shape is not None and self.shape.table:
            # A count never measured in a table that scales as `shape` is priced at most as
            # an empty table would price it (default_base at one row, scaled as `shape`).
            # Its estimate scales another count's time as `shape` does, and the two were
            # timed apart: a server warmed up while two more started beside it timed its
            # draft model's 8-row forward at ~3x its own time and the target's steps at ~1x,
            # so one stream priced a draft at 55 ms against ~18 and never drafted, and so
            # never ran the draft at one row to measure it (Qwen2.5-Coder 1.5B + 0.5B, open
            # generation, AVX2: no draft in a server cell's two rounds, 0.98x).
            cost = min(cost, default_base * self.shape(rows) / self.shape(1))
        return cost

    def _rescaled(self) -> dict[int, float]:
        """The table, its stale entries past the largest fresh count scaled by how far the
        machine's speed has moved since: the fresh time at that count over what the stale
        entries around it say of it. A step's time is its work over the machine's speed, and a
        shared 2-core machine's drifts by a third within a minute; the entries measured lately
        beside those measured long ago then price the rows between them at the difference
        of two speeds. A burst's plain 8-row steps had slowed from ~150 ms to 212 while 16
        rows stood at 294 (the warm-up's, a quiet minute earlier): 8 verify rows looked like
        82 ms against ~140, a token at 26 ms, and 8 streams of Qwen2.5-Coder 1.5B + 0.5B
        caught up and drafted, 0.85-0.93x of no speculation (AVX2); re-measured once
        drafting, 16 rows took 353, what the scale says (212 / 177, the 5- and 16-row
        entries' time for 8 rows). Only where stale counts lie on both sides of the fresh
        ones: below the smallest measured count the table's estimate is a guess."""
        if self._view is None:
            self._view = self.table
            fresh = self._fresh()
            stale = {n: v for n, v in self.table.items() if n not in fresh}
            if fresh and stale and min(stale) < max(fresh) < max(stale):
                top = max(fresh)
                scale = fresh[top] / self._estimate(top, stale)
                self._view = {n: v * scale if n > top and n in stale else v
                              for n, v in self.table.items()}
        return self._view

    def measured_after(self, a: int, b: int) -> bool:
        """Whether row count a was last measured after row count b (or b never was)."""
        return a in self._seen and self._seen[a] > self._seen.get(b, -1)

    def estimate_without(self, rows: int) -> float:
        """What the other measured row counts say a step of rows costs (its own entry set
        aside as a stall); its own entry when it is the only one."""
        others = {n: v for n, v in self.table.items() if n != rows}
        return self._estimate(rows, others) if others else self(rows)

    def _fresh(self) -> dict[int, float]:
        """The entries measured within the last _STALE observations."""
        if self._fresh_view is None:
            self._fresh_view = {n: v for n, v in self.table.items() if not self._stale(n)}
        return self._fresh_view

    def _stale(self, rows: int) -> bool:
        """Whether the measured row count rows was last measured over _STALE observations
        ago."""
        return self._observations - self._seen[rows] > _STALE

    def _estimate(self, rows: int, table: dict[int, float]) -> float:
        if rows in table:
            return table[rows]
        below = max((n for n in table if n < rows), default=None)
        above = min((n for n in table if n > rows), default=None)
        if below is not None and above is not None:
            w = (rows - below) / (above - below)
            return table[below] + w * (table[above] - table[below])
        known = below if below is not None else above
        assert known is not None
        base = table[known] / (1 + self.row_share * (known - 1))
        # Past the largest count: along the slope of the upper half. Below the smallest,
        # by the prior share alone: a step's cost is convex in its rows (flat while the
        # weights' streaming bounds it, steep once the compute does), so the slope of 3 and
        # 5 rows extended down priced a one-row step of Qwen2.5-Coder 1.5B at 31 ms against
        # ~60 (a drafting request never runs one), and a token looked half as dear as it is.
        if below is not None and len(table) > 1:
            slope = self._upper_slope(table)
            return table[known] + max(slope, base * self.row_share) * (rows - known)
        shape = self.shape
        if shape is not None and shape.table:
            return table[known] * shape(rows) / shape(known)
        return table[known] + base * self.row_share * (rows - known)

    @staticmethod
    def _upper_slope(table: dict[int, float]) -> float:
        """Seconds per row over the upper half of the measured counts (from the largest / 2
        up, at least the two largest): a least-squares line. The slope of the two largest
        alone rode on their noise: with each entry of a measured table (1-8 rows of
        Qwen2.5-Coder 1.5B) 10% off at random, as counts measured a few times while a burst
        fills or drains are, 16 rows were priced at 166-646 ms against ~250, and 8 streams
        drafted in one table of six; fitted over 4-8 rows, 217-361 ms at 15% off, and none."""
        ns = sorted(table)
        upper = [n for n in ns if 2 * n >= ns[-1]]
        ns = upper if len(upper) > 1 else ns[-2:]
        mean_n = sum(ns) / len(ns)
        mean_t = sum(table[n] for n in ns) / len(ns)
        return (sum((n - mean_n) * (table[n] - mean_t) for n in ns)
                / sum((n - mean_n) ** 2 for n in ns))
