"""The scheduler's waiting queue: one heap per service tier, served by weighted fair share.

    tiers     paid (weight 8): [(key, request), ...]    free (weight 1): [(key, request), ...]
    head()    the first request of the eligible tier with the smallest pass

Across tiers, stride scheduling: admitting a request from tier t adds 1 / weight_t to t's
pass, so while several tiers wait, tier t gets weight_t / sum(weights) of the admissions, and
no tier with requests waits forever. A tier whose queue was empty restarts at the virtual time
(the pass of the last admission), so an idle tier banks no credit to flood in with later. The
scheduler says which tiers are eligible (under their max_running).

Within a tier, by key (smaller first):
  - no tiers configured (the implicit default tier): (priority, arrival), strictly, as vLLM's
    priority policy;
  - a configured tier: arrival + priority * priority_aging_s, a static key that ages: waiting
    priority_aging_s seconds is worth one priority level, so a low-priority request is
    overtaken only by requests that arrived less than that much later per level. A tier that
    does not allow priorities refuses a nonzero one (check).

The queue also counts waiting requests as the waiting bounds do: the n children of one
request (one group_id) count once, overall and in their tier.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from kvserve.config import TierConfig
from kvserve.request import DEFAULT_TIER, Request
from kvserve.sampling_params import ParamError

# (priority, arrival time or aged arrival, insertion counter): smaller = more important. The
# counter breaks ties and keeps heap entries from ever comparing Requests.
OrderKey = tuple[float, float, int]

# The tier of requests that name none: strict priorities, no bounds of its own.
IMPLICIT_DEFAULT = TierConfig(DEFAULT_TIER, allow_priority=True, priority_aging_s=None)


class FairQueue:
    def __init__(self, tiers: tuple[TierConfig, ...] = ()) -> None:
        self.tiers: dict[str, TierConfig] = {t.name: t for t in tiers}
        self.tiers.setdefault(DEFAULT_TIER, IMPLICIT_DEFAULT)
        # Preemption order across tiers: heavier tiers are more important (rank 0 first).
        by_weight = sorted(self.tiers.values(), key=lambda t: -t.weight)
        self.rank = {t.name: i for i, t in enumerate(by_weight)}
        self._heaps: dict[str, list[tuple[OrderKey, Request]]] = {n: [] for n in self.tiers}
        self._pass = dict.fromkeys(self.tiers, 0.0)
        self._vtime = 0.0
        self._counter = 0
        # group_id -> its waiting requests, overall and per tier.
        self._groups: dict[str, int] = {}
        self._tier_groups: dict[str, dict[str, int]] = {n: {} for n in self.tiers}

    # -- intake -----------------------------------------------------------------------------

    def check(self, req: Request) -> None:
        """ValueError if req can never be queued: an unknown tier, or a priority its tier
        does not allow."""
        tier = self.tiers.get(req.tier)
        if tier is None:
            raise ValueError(f"unknown tier {req.tier!r}; the tiers are "
                             f"{', '.join(sorted(self.tiers))}")
        if req.priority and not tier.allow_priority:
            raise ParamError("priority", f"priority: tier {tier.name!r} does not allow "
                             f"request priorities; omit priority or send 0, got {req.priority}")

    def has_room(self, req: Request, limit: int | None) -> tuple[bool, str | None]:
        """(room overall under limit, the tier whose own max_waiting is reached or None)."""
        if req.group_id in self._groups:
            return True, None  # another child of a group already counted
        if limit is not None and len(self._groups) >= limit:
            return False, None
        cap = self.tiers[req.tier].max_waiting
        if cap is not None and len(self._tier_groups[req.tier]) >= cap:
            return False, req.tier
        return True, None

    def new_key(self, req: Request) -> OrderKey:
        tier = self.tiers[req.tier]
        self._counter += 1
        if tier.priority_aging_s is None:
            return (req.priority, req.arrival_time, self._counter)
        return (0, req.arrival_time + req.priority * tier.priority_aging_s, self._counter)

    def push(self, key: OrderKey, req: Request) -> None:
        heap = self._heaps[req.tier]
        if not heap:
            self._pass[req.tier] = max(self._pass[req.tier], self._vtime)
        heapq.heappush(heap, (key, req))
        for groups in (self._groups, self._tier_groups[req.tier]):
            groups[req.group_id] = groups.get(req.group_id, 0) + 1

    # -- admission --------------------------------------------------------------------------

    def head(self, eligible: Callable[[str], bool] = lambda _tier: True) -> Request | None:
        """The next request to admit: the head of the eligible tier with the smallest pass
        (ties: the heavier tier)."""
        best = None
        for name, heap in self._heaps.items():
            if heap and eligible(name):
                order = (self._pass[name], self.rank[name])
                if best is None or order < best[0]:
                    best = (order, heap[0][1])
        return None if best is None else best[1]

    def pop(self, req: Request) -> None:
        """Takes req, the head of its tier, out as admitted: its tier's pass advances."""
        heap = self._heaps[req.tier]
        assert heap and heap[0][1] is req, "pop() takes the head that head() returned"
        heapq.heappop(heap)
        self._vtime = max(self._vtime, self._pass[req.tier])
        self._pass[req.tier] += 1.0 / self.tiers[req.tier].weight
        self._left(req)

    def remove(self, key: OrderKey, req: Request) -> None:
        """Takes req out unadmitted (finished or aborted while waiting); O(tier's queue)."""
        heap = self._heaps[req.tier]
        heap.remove((key, req))
        heapq.heapify(heap)
        self._left(req)

    def _left(self, req: Request) -> None:
        for groups in (self._groups, self._tier_groups[req.tier]):
            left = groups[req.group_id] - 1
            if left:
                groups[req.group_id] = left
            else:
                del groups[req.group_id]

    # -- queries ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(len(h) for h in self._heaps.values())

    def __bool__(self) -> bool:
        return any(self._heaps.values())

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, each tier in key order, heavier tiers first (a picture of
        the queue, not the admission order, which interleaves the tiers)."""
        for name in sorted(self._heaps, key=self.rank.__getitem__):
            yield from (r for _, r in sorted(self._heaps[name]))

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def num_waiting(self, tier: str) -> int:
        return len(self._heaps[tier])

    def num_waiting_groups(self, tier: str) -> int:
        return len(self._tier_groups[tier])
