"""The engine's last minute, second by second, for the web page's live view (GET /engine/state).

Fed by the same IterationStats as ServerMetrics (the engine thread calls observe after every
step, chained after the metrics listener), read by the route on the event loop; one lock
between them. Memory is bounded whatever the load: one slot per second of the window, each
holding counters and two latency histograms (LOG_BINS per decade), not the samples.

    slot key = int(clock())      the current second is still filling; summaries read the
    |k-60|k-59| ... |k-1| k |    `seconds` complete seconds before it (k-60 .. k-1)
     ^ oldest             ^ now

Quantiles come from the histograms: a bin spans a factor 10 ** (1 / LOG_BINS), so a reported
p50 / p90 is within 3% of the exact sample quantile (its bin's geometric middle).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.iteration_stats import IterationStats
from kvserve.outputs import EngineStats

LOG_BINS = 40  # histogram bins per decade of seconds
MIN_LATENCY = 1e-4  # seconds: bin 0 holds everything below; the top bin everything above 1e3
NUM_BINS = 7 * LOG_BINS
RATE_SECONDS = 5  # tokens per second are averaged over this many complete seconds


def latency_bin(seconds: float) -> int:
    """The histogram bin of a latency, in [0, NUM_BINS - 1]."""
    if not seconds > MIN_LATENCY:
        return 0
    return min(NUM_BINS - 1, int(math.log10(seconds / MIN_LATENCY) * LOG_BINS))


def bin_value(b: int) -> float:
    """The geometric middle of bin b (what a quantile that falls in it reports)."""
    return MIN_LATENCY * 10 ** ((b + 0.5) / LOG_BINS)


def quantile(hist: dict[int, int], q: float) -> float | None:
    """The q-quantile (nearest rank) of a histogram bin -> count; None when it is empty."""
    n = sum(hist.values())
    if n == 0:
        return None
    rank = max(1, math.ceil(q * n))  # the rank-th smallest sample, 1-based
    seen = 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= rank:
            return bin_value(b)
    raise AssertionError("unreachable: the ranks add up to n")


@dataclass
class _Second:
    key: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    ttft_sum: float = 0.0
    itl_sum: float = 0.0
    ttft: dict[int, int] = field(default_factory=dict)  # bin -> count
    itl: dict[int, int] = field(default_factory=dict)


def _add(hist: dict[int, int], values: list[float]) -> None:
    for v in values:
        b = latency_bin(v)
        hist[b] = hist.get(b, 0) + 1


class StatsWindow:
    def __init__(self, stats: Callable[[], EngineStats], seconds: int = 60,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """stats: the engine's latest snapshot (read in observe, on the engine thread, right
        after the engine published it) for the prefix cache's cumulative counters."""
        if not 1 <= seconds <= 3600:
            raise ValueError(f"seconds must be in [1, 3600], got {seconds}")
        self.seconds = seconds
        self._stats = stats
        self._clock = clock
        self._lock = threading.Lock()
        self._slots: list[_Second | None] = [None] * (seconds + 1)
        s = stats()
        self._last_prefix = (s.prefix_cache_queries, s.prefix_cache_hits)

    def _slot(self, key: int) -> _Second:
        i = key % len(self._slots)
        slot = self._slots[i]
        if slot is None or slot.key != key:
            slot = self._slots[i] = _Second(key)
        return slot

    def observe(self, it: IterationStats) -> None:
        """Engine thread, after each step (and each abort). Never raises on its inputs."""
        s = self._stats()
        queries, hits = s.prefix_cache_queries, s.prefix_cache_hits
        with self._lock:
            slot = self._slot(int(self._clock()))
            slot.prompt_tokens += it.num_prompt_tokens
            slot.generation_tokens += it.num_generation_tokens
            slot.finished += len(it.finished_reasons)
            slot.prefix_queries += queries - self._last_prefix[0]
            slot.prefix_hits += hits - self._last_prefix[1]
            self._last_prefix = (queries, hits)
            slot.ttft_sum += sum(it.time_to_first_tokens)
            slot.itl_sum += sum(it.inter_token_latencies)
            _add(slot.ttft, it.time_to_first_tokens)
            _add(slot.itl, it.inter_token_latencies)

    def summary(self) -> dict[str, Any]:
        """The complete seconds of the window, JSON-ready (the engine-state route's "window").
        Series are oldest first, one entry per second; a mean is None in a second without
        samples, a quantile or rate None in a window without any."""
        now = int(self._clock())
        keys = range(now - self.seconds, now)
        with self._lock:
            slots = [self._slots[k % len(self._slots)] for k in keys]
            secs = [s if s is not None and s.key == k else _Second(k)
                    for s, k in zip(slots, keys)]
            ttft: dict[int, int] = {}
            itl: dict[int, int] = {}
            for s in secs:
                for b, c in s.ttft.items():
                    ttft[b] = ttft.get(b, 0) + c
                for b, c in s.itl.items():
                    itl[b] = itl.get(b, 0) + c
            series = {
                "prompt_tokens": [s.prompt_tokens for s in secs],
                "generation_tokens": [s.generation_tokens for s in secs],
                "finished": [s.finished for s in secs],
                "ttft_mean": [_mean(s.ttft_sum, s.ttft) for s in secs],
                "itl_mean": [_mean(s.itl_sum, s.itl) for s in secs],
            }
            queries = sum(s.prefix_queries for s in secs)
            hits = sum(s.prefix_hits for s in secs)
        recent = secs[-RATE_SECONDS:]
        return {
            "seconds": self.seconds,
            "rate_seconds": len(recent),
            "prompt_tokens_per_s": sum(s.prompt_tokens for s in recent) / len(recent),
            "generation_tokens_per_s": sum(s.generation_tokens for s in recent) / len(recent),
            "ttft": _quantiles(ttft),
            "itl": _quantiles(itl),
            "prefix_cache": {"queries": queries, "hits": hits,
                             "hit_rate": hits / queries if queries else None},
            "series": series,
        }


def _mean(total: float, hist: dict[int, int]) -> float | None:
    n = sum(hist.values())
    return total / n if n else None


def _quantiles(hist: dict[int, int]) -> dict[str, Any]:
    return {"count": sum(hist.values()), "p50": quantile(hist, 0.5),
            "p90": quantile(hist, 0.9), "p99": quantile(hist, 0.99)}
