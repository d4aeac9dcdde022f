"""Serving metrics from per-request timestamps: pure functions, no I/O.

One streamed request, on the client's clock (seconds):

    start         first chunk with text                               last chunk    end
      |---------------|---------|-------|-------- ... --------|-----------|----------|
      <---- TTFT ----><- itl_0 -><itl_1>                    <- itl_k-1 ->
      <------------------------------- E2E latency (end - start) ---------------------->

    TTFT = t_first - start
    ITL  = gaps between consecutive chunks with text (one token per chunk on the servers we
           measure; a chunk carrying several tokens counts as one gap, as in vLLM)
    TPOT = (E2E - TTFT) / (output_tokens - 1): decode time per token after the first; only
           requests with more than one output token have one
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    prompt_len: int  # prompt tokens (the server's usage count where it sent one)
    output_len: int = 0  # generated tokens (usage, else chunks with text)
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with text
    success: bool = False
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks, as
    numpy.percentile's default: position (n - 1) * q / 100 in the sorted values."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarize(values: Sequence[float], percentiles: Sequence[float] = (99,)) -> dict[str, float]:
    """mean, median, std and the given percentiles of a sample."""
    out = {"mean": mean(values), "median": percentile(values, 50)}
    m = out["mean"]
    out["std"] = (math.sqrt(sum((v - m) ** 2 for v in values) / len(values)) if values
                  else math.nan)
    for q in percentiles:
        out[f"p{q:g}"] = percentile(values, q)
    return out


def serving_metrics(records: Sequence[RequestRecord], duration: float,
                    percentiles: Sequence[float] = (99,)) -> dict[str, Any]:
    """Aggregate metrics of one benchmark run: throughputs over the whole wall-clock duration,
    latency distributions over the successful requests, in milliseconds."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    ok = [r for r in records if r.success and r.chunk_times]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    ms = 1000.0
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    dists = {
        "ttft": [r.ttft * ms for r in ok],
        "tpot": [t * ms for r in ok if (t := r.tpot) is not None],
        "itl": [g * ms for r in ok for g in r.itls],
        "e2el": [r.latency * ms for r in ok],
    }
    for name, values in dists.items():
        for stat, v in summarize(values, percentiles).items():
            out[f"{stat}_{name}_ms"] = v
    return out


def format_table(title: str, m: dict[str, Any], percentiles: Sequence[float] = (99,)) -> str:
    """The metrics as a fixed-width table (the layout of vLLM's bench serve)."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        text = fmt.format(value) if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    sections = (("ttft", "Time to First Token"),
                ("tpot", "Time per Output Token (excl. 1st token)"),
                ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"))
    for key, name in sections:
        lines.append(f"{name:-^{w}}")
        abbr = key.upper()
        row(f"Mean {abbr} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {abbr} (ms):", m[f"median_{key}_ms"])
        for q in percentiles:
            row(f"P{q:g} {abbr} (ms):", m[f"p{q:g}_{key}_ms"])
    lines.append("=" * w)
    return "\n".join(lines)


def spec_summary(engine: Any) -> dict[str, Any] | None:
    """Speculative decoding's counters of an in-process engine (None without it): drafts,
    draft and accepted tokens, acceptance rate (accepted / draft tokens) and mean accepted
    length (tokens per verify step: 1 + accepted / drafts), as vLLM reports them."""
    spec, st = engine.config.speculative, engine.stats().spec
    if spec is None or st is None:
        return None
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
            "num_accepted_tokens": st.num_accepted_tokens,
            "acceptance_rate": st.acceptance_rate,
            "mean_accepted_length": st.mean_accepted_length}


def format_spec_summary(s: dict[str, Any]) -> str:
    return (f"speculative decoding ({s['method']}, K={s['num_speculative_tokens']}): "
            f"acceptance rate {s['acceptance_rate']:.1%} ({s['num_accepted_tokens']} of "
            f"{s['num_draft_tokens']} draft tokens), mean accepted length "
            f"{s['mean_accepted_length']:.2f}")
