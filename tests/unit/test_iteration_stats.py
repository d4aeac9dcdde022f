"""RequestTimings: a step's outputs -> IterationStats, with exact times (the caller's clock)."""

from __future__ import annotations

from kvserve.iteration_stats import RequestTimings
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.request import DEFAULT_TIER


def out(rid: str, *tokens: list[int], reasons: tuple[str | None, ...] = ()) -> RequestOutput:
    """A cumulative output: one choice per token list, finished when every choice has a
    reason."""
    reasons = reasons or (None,) * len(tokens)
    choices = [CompletionOutput(i, "", list(t), None, None, r)
               for i, (t, r) in enumerate(zip(tokens, reasons, strict=True))]
    return RequestOutput(rid, None, [], None, choices, finished=all(reasons))


def test_a_step_counts_first_tokens_later_tokens_queue_times_and_finishes() -> None:
    t = RequestTimings(tiered=True)
    t.add("a", arrival=1.0, num_prompt_tokens=5, tier="paid")
    t.add("b", arrival=2.0, num_prompt_tokens=3)  # n = 2, the default tier

    # a is scheduled at 3.0 and gives its first token at 3.5; b still waits.
    it = t.step([out("a", [7])], t_step=3.0, now=3.5, first_scheduled={"a": 3.0})
    assert (it.num_prompt_tokens, it.num_generation_tokens) == (5, 1)
    assert it.queue_times == [2.0] and it.time_to_first_tokens == [2.5]
    assert it.tier_time_to_first_tokens == [("paid", 2.5)]
    assert it.inter_token_latencies == [] and it.finished_reasons == []

    # a emits two tokens in one step (an accepted draft): one inter-token gap, two tokens;
    # b's first step: its queue time once, its two choices' first tokens.
    it = t.step([out("a", [7, 8, 9]), out("b", [1], [2])], t_step=4.0, now=4.25,
                first_scheduled={"a": 3.0, "b": 4.0})
    assert (it.num_prompt_tokens, it.num_generation_tokens) == (3, 4)
    assert it.queue_times == [2.0]  # b's; a's was counted the step before
    assert it.inter_token_latencies == [0.75] and it.time_to_first_tokens == [2.25]
    assert it.tier_time_to_first_tokens == [(DEFAULT_TIER, 2.25)]

    it = t.step([out("a", [7, 8, 9, 10], reasons=("length",))], t_step=4.5, now=5.0,
                first_scheduled={"a": 3.0, "b": 4.0})
    assert it.e2e_latencies == [4.0] and it.finished_reasons == ["length"]
    assert it.tier_finished_reasons == [("paid", "length")]
    assert it.inter_token_latencies == [0.75] and it.queue_times == []
    assert "a" not in t and "b" in t

    # An abort finishes each choice once, in the request's tier.
    it = t.abort("b", choices=2)
    assert it.finished_reasons == ["abort", "abort"]
    assert it.tier_finished_reasons == [(DEFAULT_TIER, "abort")] * 2
    assert "b" not in t


def test_a_request_done_in_its_first_step_was_scheduled_when_the_step_began() -> None:
    # It finished within the step, so the engine no longer lists it as running.
    t = RequestTimings()
    t.add("c", arrival=6.0, num_prompt_tokens=2)
    it = t.step([out("c", [4], reasons=("stop",))], t_step=7.0, now=7.5, first_scheduled={})
    assert it.queue_times == [1.0] and it.time_to_first_tokens == [1.5]
    assert it.e2e_latencies == [1.5] and it.finished_reasons == ["stop"]
    assert it.tier_time_to_first_tokens == [] and it.tier_finished_reasons == []  # untiered
    # A request not yet scheduled, and not in the step, gets no queue time.
    t.add("d", arrival=8.0, num_prompt_tokens=2)
    assert t.step([], t_step=9.0, now=9.5, first_scheduled={}).queue_times == []
