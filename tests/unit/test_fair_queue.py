"""Service tiers: the FairQueue's admission order (stride shares, no banked credit, ageing) and
the scheduler's per-tier bounds and preemption order, with exact request ids."""

from __future__ import annotations

import pytest

from kvserve.config import CacheConfig, SchedulerConfig, TierConfig
from kvserve.fair_queue import FairQueue
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import QueueFullError, Scheduler
from tests.unit.test_scheduler import step

PAID = TierConfig("paid", weight=4, allow_priority=True)
FREE = TierConfig("free", weight=1)


def req(rid: str, tier: str | None, arrival: float = 0.0, priority: int = 0,
        prompt: int = 4, group: str | None = None) -> Request:
    base = 1000 * (1 + sum(map(ord, rid)))
    return Request(rid, list(range(base, base + prompt)), SamplingParams(max_tokens=4),
                   max_tokens=4, priority=priority, arrival_time=arrival, tier=tier,
                   group_id=group)


def fill(q: FairQueue, *reqs: Request) -> None:
    for r in reqs:
        q.check(r)
        q.push(q.new_key(r), r)


def drain(q: FairQueue, n: int, eligible=lambda _t: True) -> list[str]:
    out = []
    for _ in range(n):
        r = q.head(eligible)
        if r is None:
            break
        q.pop(r)
        out.append(r.request_id)
    return out


def test_tiers_share_admissions_by_weight() -> None:
    q = FairQueue((PAID, FREE))
    fill(q, *(req(f"p{i}", "paid", i) for i in range(12)),
         *(req(f"f{i}", "free", i) for i in range(4)))
    # Passes: paid +1/4 per admission, free +1; ties go to the heavier tier.
    assert drain(q, 12) == ["p0", "f0", "p1", "p2", "p3", "p4", "f1",
                            "p5", "p6", "p7", "p8", "f2"]
    assert len(q) == 4 and q.num_waiting("paid") == 3 and q.num_waiting("free") == 1


def test_an_idle_tier_banks_no_credit() -> None:
    q = FairQueue((PAID, FREE))
    fill(q, *(req(f"f{i}", "free", i) for i in range(10)))
    assert drain(q, 10) == [f"f{i}" for i in range(10)]  # free alone: pass 10
    fill(q, *(req(f"p{i}", "paid", 20 + i) for i in range(8)),
         *(req(f"g{i}", "free", 20 + i) for i in range(8)))
    # paid restarts at the virtual time (9, the last admission's pass), not at 0, and free
    # at its own 10: paid takes its 4:1 share from there, not ten admissions in a row.
    assert drain(q, 10) == ["p0", "p1", "p2", "p3", "p4", "g0", "p5", "p6", "p7", "g1"]


def test_an_ineligible_tier_is_passed_over_and_keeps_its_place() -> None:
    q = FairQueue((PAID, FREE))
    fill(q, req("p0", "paid"), req("p1", "paid", 1), req("f0", "free"), req("f1", "free", 1))
    assert drain(q, 2, eligible=lambda t: t != "paid") == ["f0", "f1"]
    assert drain(q, 2) == ["p0", "p1"]


def test_priority_orders_within_a_tier_and_ages() -> None:
    q = FairQueue((PAID, FREE))
    # aging 10 s per level: key = arrival + 10 * priority.
    fill(q, req("late-urgent", "paid", 30.0, priority=-2),  # key 10
         req("old-lazy", "paid", 0.0, priority=1),  # key 10, pushed later: after
         req("new", "paid", 5.0),  # key 5
         req("newer", "paid", 25.0))  # key 25
    assert drain(q, 4) == ["new", "late-urgent", "old-lazy", "newer"]


def test_without_tiers_priorities_are_strict() -> None:
    q = FairQueue()
    fill(q, req("a", None, 0.0, priority=1), req("b", None, 1000.0, priority=0))
    assert drain(q, 2) == ["b", "a"]


def test_a_tier_refuses_priority_it_does_not_allow_and_unknown_tiers() -> None:
    q = FairQueue((PAID, FREE))
    with pytest.raises(ValueError, match=r"priority: tier 'free' does not allow"):
        q.check(req("x", "free", priority=-5))
    q.check(req("y", "paid", priority=-5))
    with pytest.raises(ValueError, match=r"unknown tier 'gold'; the tiers are default, free, "
                                         r"paid"):
        q.check(req("z", "gold"))


def test_waiting_bounds_per_tier_count_a_group_once() -> None:
    q = FairQueue((TierConfig("free", max_waiting=2), PAID))
    fill(q, req("a#0", "free", group="a"), req("a#1", "free", group="a"))
    assert q.has_room(req("a#2", "free", group="a"), None) == (True, None)
    fill(q, req("b", "free"))
    assert q.has_room(req("c", "free"), None) == (False, "free")
    assert q.has_room(req("d", "paid"), None) == (True, None)
    assert q.has_room(req("d", "paid"), 3) == (True, None)  # 2 groups wait
    fill(q, req("d", "paid"))
    assert q.has_room(req("e", "paid"), 3) == (False, None)  # the overall bound
    assert q.num_groups == 3


def tiered_scheduler(*tiers: TierConfig, num_blocks: int = 10) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                     max_model_len=64, tiers=tiers),
                     CacheConfig(block_size=4), num_blocks)


def test_scheduler_keeps_a_tiers_max_running_and_raises_its_queue_full() -> None:
    sched = tiered_scheduler(TierConfig("free", max_running=1, max_waiting=2), PAID)
    for r in (req("f0", "free"), req("p0", "paid", 1), req("f1", "free", 2)):
        sched.add_request(r)
    with pytest.raises(QueueFullError, match="tier 'free' is full") as info:
        sched.add_request(req("f2", "free", 3))
    assert info.value.tier == "free"
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["p0", "f0"]  # f1: free runs 1 already
    assert sched.tier_counts() == {"free": (1, 1, 1), "paid": (1, 0, 0), "default": (0, 0, 0)}


def test_preemption_takes_the_lighter_tier_first() -> None:
    # 5 usable blocks of 4 tokens; two 8-token prompts (2 blocks each) then decodes.
    sched = tiered_scheduler(PAID, FREE, num_blocks=6)
    sched.add_request(req("free-old", "free", 0.0, prompt=8))
    sched.add_request(req("paid-new", "paid", 1.0, prompt=8))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["paid-new", "free-old"]
    # Each now needs a third block at its 9th token; one is free. paid first; free-old, the
    # lighter tier's request although it arrived first, is the one preempted.
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["paid-new"]
    assert out.preempted_ids == ["free-old"]


def test_a_priority_reorders_its_own_tier_only() -> None:
    """Even where the free tier allows priorities, the most urgent free request takes a free
    admission slot (overtaking free requests), never a paid one."""
    free_p = TierConfig("free", weight=1, allow_priority=True)

    def order(urgent: int) -> list[str]:
        q = FairQueue((PAID, free_p))
        fill(q, *(req(f"p{i}", "paid", i) for i in range(8)), req("f0", "free", 0.0),
             req("f1", "free", 1.0, priority=urgent))
        return drain(q, 10)

    assert order(0) == ["p0", "f0", "p1", "p2", "p3", "p4", "f1", "p5", "p6", "p7"]
    assert order(-1000) == ["p0", "f1", "p1", "p2", "p3", "p4", "f0", "p5", "p6", "p7"]
