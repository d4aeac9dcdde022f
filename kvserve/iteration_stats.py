"""Per-request latency bookkeeping, turned into one IterationStats per engine step: what the
server's metrics and stats window are fed (AsyncEngine's engine thread, after every step).

    arrival ---- queue time ---- first scheduled ... first token ---- ITL ---- ... finished
       |                                               |  (TTFT = first token - arrival)   |
       +-------------------------- e2e latency ------------------------------------------+

Pure Python, one thread (the engine's); times are monotonic seconds that the caller passes in,
so the tests give exact ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvserve.outputs import RequestOutput
from kvserve.request import DEFAULT_TIER


@dataclass
class IterationStats:
    """What one engine step did, for latency histograms and token counters (seconds)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)  # one per finished choice
    # With service tiers configured: (tier, seconds) per first token, (tier, reason) per
    # finished choice.
    tier_time_to_first_tokens: list[tuple[str, float]] = field(default_factory=list)
    tier_finished_reasons: list[tuple[str, str]] = field(default_factory=list)


StatsListener = Callable[[IterationStats], None]


@dataclass
class RequestTiming:
    """One request's latency bookkeeping (monotonic seconds)."""

    arrival: float
    num_prompt_tokens: int
    tier: str = DEFAULT_TIER
    first_token: float | None = None
    last_token: float | None = None
    num_output_tokens: int = 0
    queue_time_recorded: bool = False


class RequestTimings:
    """The timings of the requests in the engine, from add to finish or abort. tiered: the
    stats carry each first token's and finish's service tier too."""

    def __init__(self, tiered: bool = False) -> None:
        self.tiered = tiered
        self._timing: dict[str, RequestTiming] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._timing

    def add(self, request_id: str, arrival: float, num_prompt_tokens: int,
            tier: str | None = None) -> None:
        self._timing[request_id] = RequestTiming(arrival, num_prompt_tokens,
                                                 tier or DEFAULT_TIER)

    def abort(self, request_id: str, choices: int) -> IterationStats:
        """The request is gone: one "abort" finish per choice, as a request that runs to the
        end counts one finish per choice."""
        timing = self._timing.pop(request_id, None)
        it = IterationStats(finished_reasons=["abort"] * choices)
        if self.tiered:
            tier = timing.tier if timing is not None else DEFAULT_TIER
            it.tier_finished_reasons = [(tier, "abort")] * choices
        return it

    def step(self, outputs: list[RequestOutput], t_step: float, now: float,
             first_scheduled: Mapping[str, float]) -> IterationStats:
        """A step that began at t_step and gave outputs at now. first_scheduled: when each
        running request was first scheduled (LLMEngine.first_scheduled_times). A finished
        request's timing is dropped."""
        it = IterationStats()
        self._queue_times(it, t_step, first_scheduled, {o.request_id for o in outputs})
        for out in outputs:
            timing = self._timing.get(out.request_id)
            if timing is None:
                continue
            n_out = sum(len(c.token_ids) for c in out.outputs)
            new = n_out - timing.num_output_tokens
            if new > 0:
                it.num_generation_tokens += new
                if timing.first_token is None:
                    timing.first_token = now
                    it.num_prompt_tokens += timing.num_prompt_tokens
                    it.time_to_first_tokens.append(now - timing.arrival)
                    if self.tiered:
                        it.tier_time_to_first_tokens.append((timing.tier, now - timing.arrival))
                else:
                    assert timing.last_token is not None
                    it.inter_token_latencies.append(now - timing.last_token)
                timing.last_token = now
                timing.num_output_tokens = n_out
            if out.finished:
                it.e2e_latencies.append(now - timing.arrival)
                it.finished_reasons.extend(c.finish_reason or "stop" for c in out.outputs)
                if self.tiered:
                    it.tier_finished_reasons.extend((timing.tier, c.finish_reason or "stop")
                                                    for c in out.outputs)
                del self._timing[out.request_id]
        return it

    def _queue_times(self, it: IterationStats, t_step: float,
                     first_scheduled: Mapping[str, float], stepped: set[str]) -> None:
        """Queue time = first scheduled - arrival. A request scheduled for the first time in
        this step is now running (or, if it already finished, was scheduled at t_step)."""
        for rid, timing in self._timing.items():
            if timing.queue_time_recorded:
                continue
            t = first_scheduled.get(rid, t_step if rid in stepped else None)
            if t is not None:
                timing.queue_time_recorded = True
                it.queue_times.append(max(0.0, t - timing.arrival))
