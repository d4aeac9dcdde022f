"""StatsWindow: per-second counters and latency quantiles over the last minute, held to the
exact sums and to nearest-rank quantiles of the raw samples (a bin's 3%)."""

from __future__ import annotations

import math
import random

import pytest

from kvserve.iteration_stats import IterationStats
from kvserve.outputs import EngineStats
from kvserve.server.stats_window import (
    LOG_BINS,
    NUM_BINS,
    StatsWindow,
    bin_value,
    latency_bin,
    quantile,
)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def nearest_rank(samples: list[float], q: float) -> float:
    return sorted(samples)[max(1, math.ceil(q * len(samples))) - 1]


def test_bins_cover_every_latency_within_three_percent() -> None:
    assert latency_bin(0.0) == 0 and latency_bin(-1.0) == 0 and latency_bin(float("nan")) == 0
    assert latency_bin(1e9) == NUM_BINS - 1
    for v in (1.5e-4, 0.001, 0.0123, 0.25, 1.0, 7.7, 999.0):
        b = latency_bin(v)
        half = 10 ** (1 / (2 * LOG_BINS))  # a bin's middle is within half a bin of v
        assert 1 / half - 1e-9 <= bin_value(b) / v <= half + 1e-9, v


def test_quantiles_match_nearest_rank_of_the_samples() -> None:
    rng = random.Random(0)
    samples = [rng.lognormvariate(-3, 1) for _ in range(1000)]
    hist: dict[int, int] = {}
    for v in samples:
        hist[latency_bin(v)] = hist.get(latency_bin(v), 0) + 1
    for q in (0.01, 0.5, 0.9, 0.99, 1.0):
        assert quantile(hist, q) == pytest.approx(nearest_rank(samples, q), rel=0.03)
    assert quantile({}, 0.5) is None


def test_window_counts_complete_seconds_and_forgets_the_old_ones() -> None:
    clock = Clock()
    stats = [EngineStats()]
    w = StatsWindow(lambda: stats[-1], seconds=60, clock=clock)
    empty = w.summary()
    assert empty["ttft"] == {"count": 0, "p50": None, "p90": None, "p99": None}
    assert empty["prompt_tokens_per_s"] == 0 and empty["prefix_cache"]["hit_rate"] is None
    assert empty["series"]["itl_mean"] == [None] * 60

    # Second 1000: a request's first token (prompt 30, TTFT 0.2 s), two more steps.
    stats.append(EngineStats(prefix_cache_queries=30, prefix_cache_hits=16))
    w.observe(IterationStats(num_prompt_tokens=30, num_generation_tokens=1,
                             time_to_first_tokens=[0.2]))
    w.observe(IterationStats(num_generation_tokens=1, inter_token_latencies=[0.01]))
    clock.t = 1001.5
    w.observe(IterationStats(num_generation_tokens=2, inter_token_latencies=[0.02, 0.03],
                             finished_reasons=["stop"]))
    s = w.summary()  # now in second 1001: only second 1000 is complete
    assert s["series"]["generation_tokens"][-1] == 2 and sum(s["series"]["finished"]) == 0
    assert s["series"]["ttft_mean"][-1] == pytest.approx(0.2)
    assert s["series"]["itl_mean"][-1] == pytest.approx(0.01)
    assert s["prompt_tokens_per_s"] == pytest.approx(30 / 5)
    assert s["prefix_cache"] == {"queries": 30, "hits": 16, "hit_rate": 16 / 30}

    clock.t = 1002.0
    s = w.summary()
    assert s["series"]["generation_tokens"][-2:] == [2, 2] and s["series"]["finished"][-1] == 1
    assert s["series"]["itl_mean"][-1] == pytest.approx(0.025)
    assert s["generation_tokens_per_s"] == pytest.approx(4 / 5)
    assert s["itl"]["count"] == 3
    assert s["itl"]["p50"] == pytest.approx(0.02, rel=0.03)
    assert s["itl"]["p90"] == pytest.approx(0.03, rel=0.03)
    assert s["ttft"]["p50"] == pytest.approx(0.2, rel=0.03)

    # 60 s later second 1000 has left the window; 1001 is the oldest one kept.
    clock.t = 1061.0
    s = w.summary()
    assert s["series"]["generation_tokens"][0] == 2 and s["ttft"]["count"] == 0
    assert s["itl"]["count"] == 2 and s["prefix_cache"]["queries"] == 0
    # A slot reused for a new second starts empty.
    w.observe(IterationStats(num_generation_tokens=5))
    clock.t = 1062.0
    s = w.summary()
    assert s["series"]["generation_tokens"][-1] == 5 and s["itl"]["count"] == 0
    assert s["generation_tokens_per_s"] == pytest.approx(1.0)


def test_seconds_is_checked() -> None:
    with pytest.raises(ValueError, match="seconds must be in"):
        StatsWindow(EngineStats, seconds=0)
