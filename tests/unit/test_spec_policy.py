"""SpecPolicy: drafts per request from acceptance against measured step costs."""

from __future__ import annotations

import pytest

from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.spec.policy import (
    CATCH_UP_AFTER,
    PROBE_BACKOFF,
    PROBE_EVERY,
    PROBE_SHARE,
    SpecPolicy,
)
from kvserve.spec.step_costs import StepCosts


def _reqs(n: int) -> list[Request]:
    return [Request(str(i), [1, 2, 3], SamplingParams(max_tokens=64), max_tokens=64)
            for i in range(n)]


def _accept(policy: SpecPolicy, reqs: list[Request], k: int, accepted: int, times: int = 10
            ) -> None:
    for _ in range(times):
        policy.observe_verify([r.request_id for r in reqs], [[7] * k] * len(reqs),
                              [[7] * accepted + [8]] * len(reqs))


def _cpu_like(policy: SpecPolicy, per_row: float) -> None:
    """A 50 ms step at one row and per_row seconds more per row."""
    for rows in range(1, 40):
        policy.observe_step(rows, 0.050 + per_row * (rows - 1))


def test_step_costs_interpolate_and_extend() -> None:
    c = StepCosts(row_share=0.1)
    assert c(3, default_base=2.0) == 2.0 * 1.2  # nothing measured: the prior
    c.observe(5, 3.0)
    assert c(7) == 3.0 + (3.0 / 1.4) * 0.1 * 2  # one count measured: the prior share per row
    assert c(4) == 3.0 - (3.0 / 1.4) * 0.1
    c.observe(1, 1.0)
    assert c(3) == 2.0  # between measured counts
    assert c(7) == 3.0 + 0.5 * 2  # past them: the slope of the two nearest
    c.observe(6, 3.1)
    assert c(8) == 3.1 + (3.1 / 1.5) * 0.1 * 2  # a slope under the prior share: the share
    # Below the smallest count, the prior share alone, not the slope: a step is flat in its
    # rows where the weights' streaming bounds it (Qwen2.5-Coder 1.5B: 3 rows 63 ms, 5 rows
    # 95, 1 row ~60, where the slope said 31).
    e = StepCosts(row_share=0.1)
    e.observe(3, 0.063)
    e.observe(5, 0.095)
    assert e(1) == pytest.approx(0.063 - (0.063 / 1.2) * 0.1 * 2)
    assert e(7) == pytest.approx(0.095 + 0.016 * 2)
    # A table with one count measured and a shape: it scales as the shape does.
    d = StepCosts(row_share=0.1, shape=c)
    d.observe(1, 0.5)
    assert d(5) == 0.5 * 3.0 / 1.0
    c.observe(1, 2.0)
    assert c(1) == 1.0 + 0.2 * (2.0 - 1.0)  # an EMA


# Qwen2.5-Coder 1.5B's decode / verify steps by rows (seconds; AVX2 EPYC, 2 cores). 16 rows
# measured 0.248 in the same run.
_QWEN_STEPS = {1: 0.045, 2: 0.062, 3: 0.063, 4: 0.083, 5: 0.093, 6: 0.109, 7: 0.130, 8: 0.151}


def test_step_costs_extend_along_the_upper_half_not_two_noisy_neighbours() -> None:
    """7 and 8 rows 8% off, in opposite directions (a few measurements each while a burst
    fills): their own slope is negative, which priced 16 rows at the prior share (0.180)."""
    noisy = {rows: t * {7: 1.08, 8: 0.92}.get(rows, 1.0) for rows, t in _QWEN_STEPS.items()}
    c = StepCosts()
    for rows, t in noisy.items():
        c.observe(rows, t)
    assert 0.22 < c(16) < 0.30
    policy = SpecPolicy(4, draft_forwards="per_depth")
    for rows, t in noisy.items():
        policy.observe_step(rows, t)
    policy.observe_draft([(1, 0.017)])
    reqs = _reqs(8)
    _accept(policy, reqs, 4, 3)
    assert 0.7 < policy.alpha("0") < 0.9
    # At 8 rows a draft token gains ~0.8 x 19 ms and costs a verify row (~12-16 ms) and its
    # share of the draft's forward: no drafts (forced, one each: 0.74x of plain decoding).
    assert policy.num_drafts(reqs, [4] * 8, [0] * 8, 8) == [0] * 8


def test_an_unmeasured_draft_forward_scales_as_the_targets_steps() -> None:
    """A server's first drafting decision at 8 streams (its log): no draft forward measured
    yet, priced at 8 rows as 0.4 of a one-row step plus 5% a row (35 ms), where it took
    75-94 once it ran; requests at the server's prior acceptance (0.7) then drafted, and
    the round ran at 0.90x of no speculation."""
    policy = SpecPolicy(4, draft_forwards="per_depth")
    for rows, t in {1: 0.064, 6: 0.158, 7: 0.161, 8: 0.173}.items():
        policy.observe_step(rows, t)
    prior = 0.4 * 0.064
    assert policy.draft_cost(8, prior) == pytest.approx(prior * 0.173 / 0.064)
    reqs = [Request(str(i), [1] * 60, SamplingParams(max_tokens=256), max_tokens=256)
            for i in range(8)]
    for r in reqs:
        for _ in range(13):
            r.append_output_token(5)
    assert policy.num_drafts(reqs, [4] * 8, [60] * 8, 8) == [0] * 8


def test_a_predictable_request_drafts_deep_when_rows_are_cheap() -> None:
    policy = SpecPolicy(5)
    _cpu_like(policy, 0.004)
    reqs = _reqs(1)
    _accept(policy, reqs, 5, 5)
    assert policy.alpha("0") > 0.9
    assert policy.num_drafts(reqs, [16]) == [5]
    assert policy.num_drafts(reqs, [2]) == [2]  # never past max_drafts


def test_an_unpredictable_request_backs_off_then_probes() -> None:
    policy = SpecPolicy(5)
    _cpu_like(policy, 0.012)
    reqs = _reqs(1)
    _accept(policy, reqs, 5, 0)
    _accept(policy, reqs, 5, 1, times=1)  # (no miss in a row: 0)
    _accept(policy, reqs, 5, 0, times=1)
    assert policy.alpha("0") < 0.2
    # One miss in a row: the first probe waits twice PROBE_EVERY.
    ks = [policy.num_drafts(reqs, [16])[0] for _ in range(2 * PROBE_EVERY)]
    assert ks == [0] * (2 * PROBE_EVERY - 1) + [1]


def test_probes_that_miss_wait_longer_up_to_a_bound() -> None:
    # Every probe rejected: the wait doubles per miss, up to 2**PROBE_BACKOFF times; one
    # accepted draft brings it back to PROBE_EVERY.
    policy = SpecPolicy(5)
    _cpu_like(policy, 0.012)
    reqs = _reqs(1)
    _accept(policy, reqs, 5, 0)
    _accept(policy, reqs, 5, 1, times=1)
    _accept(policy, reqs, 1, 0, times=1)

    def wait() -> int:
        for n in range(1, 100):
            if policy.num_drafts(reqs, [16])[0]:
                return n
        raise AssertionError("no probe")

    waits = []
    for _ in range(PROBE_BACKOFF + 2):
        waits.append(wait())
        _accept(policy, reqs, 1, 0, times=1)  # the probe rejected
    assert waits == [PROBE_EVERY << min(m, PROBE_BACKOFF) for m in range(1, PROBE_BACKOFF + 3)]
    _accept(policy, reqs, 1, 1, times=1)  # a probe accepted
    assert wait() == PROBE_EVERY


def test_probes_under_load_cost_at_most_their_share() -> None:
    # 8 streams on a CPU: a step of 8 rows costs 480 ms and one more row 40 ms (a 12th of
    # it). Probing each request every PROBE_EVERY steps would add a row to nearly every
    # step (~8% of the time, for drafts that are mostly rejected); the probes' rows must
    # cost at most PROBE_SHARE of the steps, and every request must still probe.
    policy = SpecPolicy(5)
    for rows in range(1, 40):
        policy.observe_step(rows, 0.200 + 0.040 * (rows - 1))
    reqs = _reqs(8)
    _accept(policy, reqs, 5, 0)
    steps = 30 * PROBE_EVERY
    probes = [0] * 8
    for _ in range(steps):
        for i, k in enumerate(policy.num_drafts(reqs, [16] * 8)):
            assert k in (0, 1)
            probes[i] += k
    assert all(p >= 2 for p in probes)
    assert sum(probes) * 0.040 <= PROBE_SHARE * steps * 0.480 * 1.1


def test_draft_forwards_priced_per_depth_back_off_under_load() -> None:
    # A draft forward costs 17 ms whatever its rows; rows cost 6 ms each.
    policy = SpecPolicy(4, draft_forwards="per_depth")
    _cpu_like(policy, 0.006)
    policy.observe_draft([(n, 0.017 + 0.001 * n) for n in range(1, 17)])
    one = _reqs(1)
    _accept(policy, one, 4, 3)  # alpha ~0.75
    assert policy.num_drafts(one, [16]) != [0]  # alone, drafting pays
    eight = _reqs(8)
    _accept(policy, eight, 4, 1)  # alpha ~0.5
    assert policy.num_drafts(eight, [16] * 8) == [0] * 8  # under load it does not


def test_not_adaptive_drafts_k() -> None:
    policy = SpecPolicy(3, adaptive=False)
    assert policy.num_drafts(_reqs(2), [16, 1]) == [3, 1]


def test_drafts_never_accepted_stop_even_where_rows_are_cheap() -> None:
    # A 4 ms row against a 50 ms token: a draft pays from 8% acceptance. Drafts that are
    # never accepted must not look like 20% (a prior that outweighs the evidence).
    policy = SpecPolicy(5)
    _cpu_like(policy, 0.004)
    reqs = _reqs(1)
    _accept(policy, reqs, 1, 0)
    assert policy.alpha("0") < 0.05
    assert policy.num_drafts(reqs, [16]) == [0]


def test_a_per_step_forward_is_priced_once_whatever_the_depth() -> None:
    # Medusa: one 15 ms pass over the heads and the lm_head per step, for every depth; rows
    # cost 2 ms against a 50 ms token.
    def policies() -> tuple[SpecPolicy, SpecPolicy]:
        per_step, free = SpecPolicy(4, draft_forwards="per_step"), SpecPolicy(4)
        for policy in (per_step, free):
            _cpu_like(policy, 0.002)
            policy.observe_draft([(1, 0.015)])
        return per_step, free

    reqs = _reqs(1)
    per_step, free = policies()
    for policy in (per_step, free):
        _accept(policy, reqs, 4, 3)  # alpha ~0.75: four drafts gain ~100 ms, cost 23
    assert per_step.num_drafts(reqs, [16]) == [4] == free.num_drafts(reqs, [16])
    per_step, free = policies()
    for policy in (per_step, free):
        for _ in range(10):  # one in four accepted: alpha ~0.25
            _accept(policy, reqs, 1, 1, times=1)
            _accept(policy, reqs, 1, 0, times=3)
    assert 0.15 < per_step.alpha("0") < 0.35
    # A draft gains ~12 ms: not the pass and a row (17 ms), but a row alone.
    assert per_step.num_drafts(reqs, [16]) == [0]
    assert free.num_drafts(reqs, [16]) != [0]


def test_draft_forwards_must_be_known() -> None:
    with pytest.raises(ValueError, match="draft_forwards must be one of"):
        SpecPolicy(4, draft_forwards=True)  # type: ignore[arg-type]


def test_a_stale_dear_row_count_does_not_lock_drafting_in() -> None:
    # The server's first decode steps are slow (160 ms here against 6); one row is then only
    # measured again if the policy ever picks it. No row count may look dearer than more
    # rows do, so a request whose drafts are rejected stops drafting.
    policy = SpecPolicy(4, draft_forwards="per_depth")
    policy.observe_step(1, 0.160)
    for _ in range(10):
        for rows in range(2, 6):
            policy.observe_step(rows, 0.006 + 0.001 * rows)
    policy.observe_draft([(1, 0.004)])
    assert policy.cost(1) <= policy.cost(2) <= policy.cost(3)
    reqs = _reqs(1)
    _accept(policy, reqs, 1, 0)
    assert policy.num_drafts(reqs, [16]) == [0]


def test_a_fresh_dear_row_count_does_not_make_drafts_look_free() -> None:
    # The default model as self_draft's engine measured it: its first one-row step stalled
    # (11 ms against 6 at two rows), then every step drafted, so one row was not measured
    # again. Before that entry went stale, a draft looked cheaper than none: the step with
    # its row cost less than the step without. Drafts accepted 5% of the time must stop,
    # with or without a draft forward to pay.
    for forwards in ("per_depth", "none"):
        policy = SpecPolicy(4, draft_forwards=forwards)
        policy.observe_step(1, 0.01107)
        for _ in range(5):
            policy.observe_step(2, 0.0062)
            if forwards == "per_depth":
                policy.observe_draft([(1, 0.0045)])
        reqs = _reqs(1)
        _accept(policy, reqs, 1, 0, times=20)
        assert policy.alpha("0") < 0.05
        assert policy.num_drafts(reqs, [16]) == [0], forwards
        # A predictable request still drafts there, and stops where the price says.
        good = _reqs(1)
        policy2 = SpecPolicy(4, draft_forwards=forwards)
        policy2.observe_step(1, 0.01107)
        for _ in range(5):
            policy2.observe_step(2, 0.0062)
        _accept(policy2, good, 4, 4, times=20)
        assert policy2.num_drafts(good, [16]) != [0], forwards


def test_a_fresh_dear_row_count_under_load_is_priced_from_its_neighbours() -> None:
    # The Qwen2.5-Coder 1.5B target on a CPU: 74 ms at one row, 19 ms a row more; one
    # stall at 8 rows left 8 dearer than 9. At 8 streams a draft (alpha ~0.9) adds a 19 ms
    # row and a 40 ms draft forward's eighth for 0.9 of a 26 ms token: it must not draft.
    # A base capped at 9 rows' step alone prices a token at 28 ms, and the drafts pay.
    policy = SpecPolicy(4, draft_forwards="per_depth")
    for _ in range(5):
        for rows in range(1, 30):
            policy.observe_step(rows, 0.074 + 0.019 * (rows - 1))
    policy.observe_step(8, 0.400)
    for rows in range(9, 17):  # drafting steps since: 8 rows is not measured again
        policy.observe_step(rows, 0.074 + 0.019 * (rows - 1))
    assert policy.cost(8) > policy.cost(9)
    policy.observe_draft([(8, 0.040)])
    eight = _reqs(8)
    _accept(policy, eight, 4, 4, times=3)
    _accept(policy, eight, 4, 3, times=1)
    assert 0.85 < policy.alpha("0") < 0.95
    assert policy.num_drafts(eight, [16] * 8) == [0] * 8


def test_a_row_count_measured_every_step_keeps_its_time() -> None:
    # 8 streams of a model whose rows cost 1.9 ms each on a 4 ms base (a token 2.4 ms at
    # 8 rows), drafts accepted 95% of the time: ~4 drafts a request pay. 8 rows is measured
    # at every step that does not draft; 9 rows was measured once, long ago, low (16 ms
    # against 21). 8 rows is no stall: re-estimated from its neighbours, a token looked
    # 2.0 ms and no draft paid (the default model's suffix proposer at 8 streams, 97%
    # accepted, stopped drafting).
    policy = SpecPolicy(8)
    for rows in range(1, 73):
        policy.observe_step(rows, 0.016 if rows == 9 else 0.004 + 0.0019 * rows)
    for _ in range(10):
        policy.observe_step(8, 0.004 + 0.0019 * 8)
    assert policy.cost(8) > policy.cost(9)
    eight = _reqs(8)
    _accept(policy, eight, 20, 19, times=20)
    assert 0.93 < policy.alpha("0") < 0.97
    assert sum(policy.num_drafts(eight, [16] * 8)) >= 24


def test_a_stall_does_not_price_a_row_count_out() -> None:
    # One 3-row step stalled (46 ms against 8 at 1 and 2 rows). Kept, a second draft would
    # cost 38 ms, the policy would draft one token a step and never measure 3 rows again.
    policy = SpecPolicy(8)
    for _ in range(5):
        policy.observe_step(1, 0.0080)
        policy.observe_step(2, 0.0083)
    policy.observe_step(3, 0.0465)
    assert policy.cost(3) < 3 * policy.cost(1)
    reqs = _reqs(1)
    _accept(policy, reqs, 4, 3)
    assert policy.num_drafts(reqs, [200])[0] > 1
    # A step no longer than n one-row steps is a measurement like any other.
    policy.observe_step(3, 0.0200)
    assert policy.cost(3) == 0.0200


def test_a_stale_dear_row_count_is_tried_again() -> None:
    # The Qwen2.5-Coder 1.5B target with its 0.5B draft, as one engine measured it: 3-5 rows
    # once early at 110 / 103 / 123 ms (66 / 82 / 100 timed directly), then one draft a step
    # at 1 and 2 rows (44 and 49 ms). The stale 3 rows, one past the fresh counts, gives way
    # to their estimate: a second draft is tried, and 3 rows measured again.
    policy = SpecPolicy(4, draft_forwards="per_depth")
    for rows, t in ((3, 0.1098), (4, 0.1027), (5, 0.1232)):
        policy.observe_step(rows, t)
    policy.observe_draft([(1, 0.0138)])
    reqs = _reqs(1)
    _accept(policy, reqs, 2, 2, times=3)
    _accept(policy, reqs, 1, 1, times=7)  # alpha ~0.85
    for _ in range(20):
        policy.observe_step(1, 0.0443)
        policy.observe_step(2, 0.0490)
    assert policy.cost(3) < 0.070
    assert policy.cost(5) == pytest.approx(0.1232)  # two past the fresh counts: as it was
    assert policy.num_drafts(reqs, [200]) == [2]
    # Measured again, 3 rows is fresh, its average started anew; then 4 rows is one past,
    # priced from 1-3 rows (84 ms; 82 timed) instead of its stale 103, and tried next.
    policy.observe_step(3, 0.0663)
    assert policy.cost(3) == 0.0663
    assert 0.080 < policy.cost(4) < 0.090
    assert policy.num_drafts(reqs, [200]) == [3]


def test_a_fresh_row_count_keeps_its_own_time() -> None:
    # Under load the step of 8 rows is measured all the time; a larger count measured once
    # at a quiet moment must not make it (and so the rows past it) look cheaper.
    c = StepCosts()
    c.observe(12, 0.150)
    for _ in range(50):
        c.observe(8, 0.200)
    assert c(8) == 0.200


def test_a_stale_row_count_restarts_no_dearer_than_the_larger_fresh_ones() -> None:
    # A burst's last request (Qwen2.5-Coder 1.5B + its 0.5B draft, 8 streams, grounded),
    # alone at 198 of its 256 tokens after 35 steps of 2-8 rows: one row restarts from one
    # step. A stall there (60 ms) priced a token at ~86 ms against ~26, and its draft model
    # caught up over 488 tokens (~1.2 s) to draft the 58 left.
    p = SpecPolicy(4, draft_forwards="per_depth")
    p.observe_step(1, 0.026)
    for _ in range(5):
        for rows in range(8, 1, -1):
            p.observe_step(rows, 0.026 + 0.012 * (rows - 1))
    p.observe_draft([(1, 0.0108)])
    p.observe_catch_up(488, 488 * 0.00242)
    tail = Request("tail", list(range(290)), SamplingParams(max_tokens=256), max_tokens=256)
    for t in range(198):
        tail.append_output_token(t)
    _accept(p, [tail], 4, 4)
    assert p.alpha("tail") > 0.9
    p.observe_step(1, 0.026 + 0.060)
    assert p.cost(1) == pytest.approx(0.038)  # the two rows' time, not the stall's
    assert p.num_drafts([tail], [4], [488], load=1) == [0]
    # Measured again, it is an average like any other.
    p.observe_step(1, 0.026)
    assert p.cost(1) == pytest.approx(0.038 + 0.2 * (0.026 - 0.038))


def _catching_up() -> SpecPolicy:
    """A draft model's policy on a CPU-like target (50 ms a step, 5 ms a row more), 20 ms
    draft forwards and 3 ms a token of catch-up."""
    p = SpecPolicy(4, draft_forwards="per_depth")
    _cpu_like(p, 0.005)
    p.observe_draft([(n, 0.020 + 0.001 * n) for n in range(1, 17)])
    p.observe_catch_up(250, 0.750)
    return p


def test_a_catch_up_is_priced_at_the_load_the_request_will_decode_under() -> None:
    # A draft model must read a new request's 250-token prompt first (3 ms a token). Alone,
    # its drafts repay that within the steps it has left; with 7 more requests on their way
    # (prefilled in the next steps: this step has one row) they never do, and a burst of 8
    # requests that each caught up while few rows ran lost 6-19% (Qwen2.5-Coder 1.5B).
    new = [Request("0", list(range(250)), SamplingParams(max_tokens=256), max_tokens=256)]
    for t in range(CATCH_UP_AFTER):  # past the tokens a catch-up waits for (the next test)
        new[0].append_output_token(t)
    assert _catching_up().num_drafts(new, [16], [258], load=1) != [0]
    assert _catching_up().num_drafts(new, [16], [258], load=8) == [0]
    # Once caught up, only this step's rows price its drafts.
    assert _catching_up().num_drafts(new, [16], [0], load=8) != [0]


def test_a_catch_up_is_spread_over_the_tokens_requests_like_it_write() -> None:
    # A client that sends no max_tokens gets the context's room (4096 here): priced over
    # that, a draft model's catch-up over a long prompt always looked repaid. The price is
    # spread over what the server's finished requests wrote past this one's output instead.
    def new(rid: str, out: int, prompt: int = 250) -> Request:
        r = Request(rid, list(range(prompt)), SamplingParams(max_tokens=None), max_tokens=4096)
        for t in range(out):
            r.append_output_token(t)
        return r

    def finish(p: SpecPolicy, lengths: list[int], finished: bool = True) -> None:
        for i, n in enumerate(lengths):
            done = new(f"done{i}", n, prompt=10)
            assert p.num_drafts([done], [16], [0], load=1) is not None
            p.remove([done.request_id], finished)

    # No request finished yet: about a chat answer (256 tokens) left, enough for 258
    # tokens of catch-up, not for 2000.
    assert _catching_up().num_drafts([new("a", CATCH_UP_AFTER)], [16], [258], load=1) != [0]
    assert _catching_up().num_drafts([new("a", CATCH_UP_AFTER, 2000)], [16], [2008], load=1) == [0]
    # Answers of 3000 tokens: the same 2000-token catch-up now pays.
    long_ = _catching_up()
    finish(long_, [3000] * 8)
    assert long_.num_drafts([new("a", CATCH_UP_AFTER, 2000)], [16], [2008], load=1) != [0]
    # Answers of 24 tokens: 16 tokens left, too few to repay even 258. (Requests aborted at
    # 24 tokens say nothing of an answer's length.)
    aborted = _catching_up()
    finish(aborted, [24] * 8, finished=False)
    assert aborted.num_drafts([new("a", CATCH_UP_AFTER)], [16], [258], load=1) != [0]
    short = _catching_up()
    finish(short, [24] * 8)
    assert short.num_drafts([new("a", CATCH_UP_AFTER)], [16], [258], load=1) == [0]
    # Once a request outlives most of them (3 of 8 longer), it is expected to write as
    # much again as it has (here 300 tokens, behind by 310): the catch-up pays again, as
    # it does where none finished.
    finish(short, [600] * 3)
    assert short.num_drafts([new("b", 300, 10)], [16], [310], load=1) != [0]
    assert _catching_up().num_drafts([new("b", 300, 10)], [16], [310], load=1) != [0]


def test_a_cold_first_catch_up_does_not_price_the_next_ones() -> None:
    # A draft model's first catch-up runs cold: 4.8 ms a token, the next ones 1.5-2.3
    # (Qwen2.5-Coder 0.5B, in one process). An EMA took ten requests to fade it, pricing a
    # 600-token prompt's catch-up at 2.5 s instead of 1 s meanwhile: no drafts for it.
    def policy(per_token: list[float]) -> SpecPolicy:
        p = SpecPolicy(4, draft_forwards="per_depth")
        _cpu_like(p, 0.005)
        p.observe_draft([(n, 0.020 + 0.001 * n) for n in range(1, 17)])
        for t in per_token:
            p.observe_catch_up(250, 250 * t)
        return p

    req = Request("a", list(range(600)), SamplingParams(max_tokens=256), max_tokens=256)
    for t in range(CATCH_UP_AFTER):
        req.append_output_token(t)
    n = 600 + CATCH_UP_AFTER
    assert policy([0.0048]).num_drafts([req], [16], [n], load=1) == [0]  # the cold time alone
    p = policy([0.0048, 0.0016])
    assert p.catch_up_cost == pytest.approx(0.0016)
    assert p.num_drafts([req], [16], [n], load=1) != [0]
    # A cost that really rose is followed within the window's catch-ups.
    for _ in range(4):
        p.observe_catch_up(250, 250 * 0.0048)
    assert p.catch_up_cost == pytest.approx(0.0048)
    assert p.num_drafts([req], [16], [n], load=1) == [0]


def test_a_new_requests_catch_up_waits_for_its_first_tokens() -> None:
    # A burst reaches the engine over its next steps, so a request's first steps may see
    # one row and a load of one; the catch-up waits until CATCH_UP_AFTER tokens are decoded.
    p = _catching_up()
    req = Request("0", list(range(250)), SamplingParams(max_tokens=256), max_tokens=256)
    for t in range(CATCH_UP_AFTER):
        assert p.num_drafts([req], [16], [250 + t], load=1) == [0], t
        req.append_output_token(t)
    assert p.num_drafts([req], [16], [250 + CATCH_UP_AFTER], load=1) != [0]
    # Nothing to read first (a lookup; a draft model already caught up): from the first.
    fresh = Request("1", list(range(250)), SamplingParams(max_tokens=256), max_tokens=256)
    assert p.num_drafts([fresh], [16], [0], load=1) != [0]


def test_a_request_stopped_by_early_rejections_restarts() -> None:
    """Two rejections at its start stop a request; its draft model then falls behind, so it
    cannot probe, and its counts fade toward the server's prior (0.9 here) until it drafts
    again, its catch-up priced."""
    p = SpecPolicy(4, draft_forwards="per_depth")
    _cpu_like(p, 0.015)
    p.observe_draft([(1, 0.017)])
    p.observe_catch_up(50, 0.200)
    others = _reqs(4)
    _accept(p, others, 4, 4, times=3)
    _accept(p, others, 4, 3, times=2)
    req = Request("new", list(range(60)), SamplingParams(max_tokens=256), max_tokens=256)
    for t in range(CATCH_UP_AFTER):
        req.append_output_token(t)
    p.observe_verify(["new"] * 2, [[7, 7]] * 2, [[8]] * 2)
    alpha0 = p.alpha("new")
    assert alpha0 < 0.75
    assert p.num_drafts([req], [4], [0], load=1) == [0]
    behind = 1
    for _ in range(40):
        if p.num_drafts([req], [4], [behind], load=1) != [0]:
            break
        req.append_output_token(5)
        behind += 1
    else:
        raise AssertionError(f"never drafted again (alpha {p.alpha('new'):.2f})")
    assert p.alpha("new") > alpha0 and behind > 1


def test_draft_stops_price_each_depth_in_tokens() -> None:
    # A 50 ms step at one row, 10 ms per row more, a 20 ms draft forward at one row: a
    # draft's row costs 0.2 of a token, another forward 0.4 more.
    policy = SpecPolicy(4, draft_forwards="per_depth")
    _cpu_like(policy, 0.010)
    policy.observe_draft([(1, 0.020)])
    reqs = _reqs(1)
    ks, stops = policy.draft_stops(reqs, [1], [3])
    assert ks == [3]  # started: up to its cap, where the confidences allow
    assert stops is not None
    assert stops.keep == pytest.approx([0.2] * 3)
    assert stops.more == pytest.approx([0.6] * 3)
    assert stops.alphas == [policy.alpha("0")]
    # Two requests drafting: the j-th draft of each is row 2 + 2j + 1, 2 + 2j + 2 (a token
    # costs 60 ms / 2 rows), and each pays half a forward of two rows.
    policy.observe_draft([(2, 0.030)])
    ks, stops = policy.draft_stops(_reqs(2), [2, 2], [4, 4])
    assert ks == [4, 4] and stops is not None
    assert stops.keep == pytest.approx([0.010 / 0.030] * 4)
    assert stops.more == pytest.approx([(0.010 + 0.015) / 0.030] * 4)
    # One request not started stays at 0; not adaptive: no stops.
    assert policy.draft_stops(_reqs(2), [0, 2], [4, 4])[0] == [0, 4]
    assert policy.draft_stops(_reqs(1), [0], [4]) == ([0], None)
    policy.adaptive = False
    assert policy.draft_stops(reqs, [2], [4]) == ([2], None)


def test_draft_stops_price_the_first_draft_over_the_base() -> None:
    # The stalled first one-row step of test_a_fresh_dear_row_count_...: 11 ms against 6.2
    # at two rows, measured since. num_drafts prices a step of one row from two rows' time
    # at the prior row share (6.2 / 1.05 ms); the first draft's row, 6.2 ms less that, is
    # 5% of a token. Priced over the stalled 11 ms instead, it was the 2% floor: nearly
    # free, and a draft model with middling confidence kept drafting.
    policy = SpecPolicy(4, draft_forwards="per_depth")
    policy.observe_step(1, 0.01107)
    for _ in range(5):
        policy.observe_step(2, 0.0062)
        policy.observe_draft([(1, 0.0045)])
    ks, stops = policy.draft_stops(_reqs(1), [1], [4])
    assert ks == [4] and stops is not None
    base = 0.0062 / 1.05
    assert stops.keep[0] == pytest.approx((0.0062 - base) / base)


def test_a_request_starts_from_the_servers_acceptance() -> None:
    # A request's prior is what the proposer does on the server's other requests: two
    # rejections at its start do not stop a proposer accepted 80% of the time elsewhere,
    # and a proposer never accepted anywhere starts new requests near 0.
    policy = SpecPolicy(4)
    _accept(policy, _reqs(3), 5, 4, times=20)  # requests 0..2: 4 of 5 per step
    new = [Request("new", [1, 2, 3], SamplingParams(max_tokens=64), max_tokens=64)]
    assert policy.alpha("new") == pytest.approx(0.8, abs=0.02)
    _accept(policy, new, 1, 0, times=2)
    assert policy.alpha("new") > 0.5
    bad = SpecPolicy(4)
    _accept(bad, _reqs(3), 5, 0, times=20)
    assert bad.alpha("new") < 0.05


def test_steps_with_prompt_tokens_price_catch_ups_not_rows() -> None:
    # A step that prefills a new request beside the decodes has cheap rows (no logits):
    # kept apart, it neither lowers a verify row's price nor goes unused for catch-ups.
    policy = SpecPolicy(4)
    policy.observe_step(1, 0.070)
    policy.observe_step(8, 0.200)
    policy.observe_step(64, 0.640, prefill=True)
    assert policy.cost.table == {1: 0.070, 8: 0.200}
    assert policy.cost(16) == pytest.approx(0.200 + 8 * 0.130 / 7)  # the decodes' slope
    assert policy._catch_up_per_token() == pytest.approx(0.6 * 0.640 / 64)


def test_stale_rows_past_the_fresh_ones_follow_the_machines_drift() -> None:
    # Timed on a quiet machine: 4 and 16 rows. Then only 8 rows, 1.33x slower than those
    # two say of it: the stale count past the fresh one is scaled as much.
    c = StepCosts()
    c.observe(4, 0.100)
    c.observe(16, 0.340)
    for _ in range(40):
        c.observe(8, 0.240)
    scale = 0.240 / (0.100 + (0.340 - 0.100) * 4 / 12)
    assert scale == pytest.approx(4 / 3)
    assert c(16) == pytest.approx(0.340 * scale)
    assert c(12) == pytest.approx(0.240 + (0.340 * scale - 0.240) / 2)
    assert c(4) == pytest.approx(0.100)  # below the fresh count: as measured
    # With no stale count below the fresh one, nothing says how the speed moved.
    d = StepCosts()
    d.observe(16, 0.340)
    for _ in range(40):
        d.observe(8, 0.240)
    assert d(16) == pytest.approx(0.340)


def _slowed_burst(alpha_steps: int = 40) -> tuple[SpecPolicy, list[Request]]:
    """A draft model's policy as 8 streams of Qwen2.5-Coder 1.5B + 0.5B found it (AVX2,
    one process, the engines stepped in turn): the warm-up's 8-40 rows timed on a quiet
    machine, one stream's 1-5 rows, then a burst whose plain 8-row steps slowed to 212 ms;
    8 new requests 28 tokens in, each 77 tokens behind, the server's drafts ~95% accepted."""
    p = SpecPolicy(4, draft_forwards="per_depth")
    for rows, ms in ((8, 150.0), (16, 293.9), (24, 444.4), (40, 664.5)):
        p.observe_step(rows, ms / 1000)
    p.observe_draft([(8, 0.0763)])
    for _ in range(15):
        for rows, ms in ((1, 75.8), (2, 89.2), (3, 88.2), (4, 141.0), (5, 133.6)):
            p.observe_step(rows, ms / 1000)
    p.observe_draft([(1, 0.0203)])
    for _ in range(30):
        p.observe_step(7, 0.1522)
        p.observe_step(8, 0.2119)
    p.observe_catch_up(600, 600 * 0.00639)
    _accept(p, _reqs(8), 4, 4, times=alpha_steps)
    p.remove([str(i) for i in range(8)])
    reqs = [Request(f"new{i}", list(range(50)), SamplingParams(max_tokens=256),
                    max_tokens=256) for i in range(8)]
    for r in reqs:
        for t in range(28):
            r.append_output_token(t)
    return p, reqs


def test_a_slowed_machine_does_not_make_verify_rows_look_cheap() -> None:
    # Priced at the warm-up's 294 ms, 16 rows cost 82 ms more than the slowed 8 (against
    # ~140 once measured), and the 8 requests caught up and drafted: 0.85-0.93x.
    p, reqs = _slowed_burst()
    assert p.cost(16) == pytest.approx(0.2939 * 0.2119 / (0.1336 + (0.2939 - 0.1336) * 3 / 11))
    assert p.num_drafts(reqs, [4] * 8, [77] * 8, load=8) == [0] * 8
    # Were 16 rows as cheap now as then (measured so), the same requests would draft.
    p, reqs = _slowed_burst()
    for _ in range(3):
        p.observe_step(16, 0.2939)
    assert p.num_drafts(reqs, [4] * 8, [77] * 8, load=8) != [0] * 8


def test_a_warm_up_timed_on_a_busy_machine_does_not_price_one_stream_out() -> None:
    # A server warmed up while two more started beside it (Qwen2.5-Coder 1.5B + 0.5B, AVX2):
    # its 8-40 rows at 2-3x their own speed. One stream then measures one row at 74 ms, and
    # 2-5 rows, never measured, were priced between that and 8 rows at 356 ms: 40 ms a verify
    # row against ~14, so no request drafted, and no row count past one was ever measured.
    p = SpecPolicy(4, draft_forwards="per_depth")
    for rows, ms in ((8, 355.6), (16, 577.1), (24, 800.5), (40, 1430.6)):
        p.observe_step(rows, ms / 1000)
    p.observe_draft([(8, 0.1299)])
    reqs = _reqs(1)
    for _ in range(40):
        p.observe_step(1, 0.0741)
    # Two rows cost what the fresh one-row steps say (one row more at the prior share), so
    # the policy drafts and measures them; the 8-row entry no longer prices them.
    assert p.cost(2) == pytest.approx(0.0741 * 1.05)
    assert p.cost(3) > 0.0741 + 2 * 0.030  # two past the fresh ones: still from 8 rows
    assert p.num_drafts(reqs, [4]) != [0]
    # Measured, two rows are an entry like any other, and three rows now give way.
    for _ in range(3):
        p.observe_step(2, 0.0830)
    assert p.cost(2) == pytest.approx(0.0830)
    assert p.cost(3) < 0.0830 + 0.030


def test_a_draft_forward_timed_on_a_busy_machine_does_not_price_one_stream_out() -> None:
    # A server's warm-up timed the target's steps at their own speed (8-40 rows) and, a few
    # seconds later while two more servers started beside it, its draft model's 8-row
    # forward at ~3x (Qwen2.5-Coder 1.5B + 0.5B, AVX2). One row of the draft, never run, was
    # priced from that entry as the target's table scales (150 x 64 / 176 = 55 ms against
    # ~18), no draft paid, and the draft never ran at one row to be measured.
    p = SpecPolicy(4, draft_forwards="per_depth")
    for rows, ms in ((8, 176), (16, 280), (24, 380), (40, 560)):
        p.observe_step(rows, ms / 1000)
    p.observe_draft([(8, 0.150)])
    p.observe_step(60, 0.600, prefill=True)  # the request's prompt
    req = Request("a", list(range(60)), SamplingParams(max_tokens=256), max_tokens=256)
    for _ in range(CATCH_UP_AFTER):
        req.append_output_token(5)
        p.observe_step(1, 0.064)
    assert p.draft_cost(1) == pytest.approx(0.150 * 0.064 / 0.176)
    # Not run at one row, the draft is priced at most at the prior share of a target step:
    # the request catches up and drafts, and the draft's one-row forward is measured.
    assert p.draft_cost(1, p._draft_prior()) == pytest.approx(0.4 * 0.064)
    assert p.num_drafts([req], [4], [60], 1) != [0]
    p.observe_draft([(1, 0.018)])
    assert p.draft_cost(1, p._draft_prior()) == pytest.approx(0.018)
