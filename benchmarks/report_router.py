"""BENCHMARKS.md's routing section, from benchmarks/results/router.json (written by
benchmarks/router_bench.py). report.py calls router_section."""

from __future__ import annotations

from typing import Any

NAMES = {"router": "kvserve router (cache-aware)", "nginx": "nginx `least_conn`"}


def router_section(data: dict[str, Any] | None) -> list[str]:
    lines = ["## Cache-aware routing (issue 15)", ""]
    if not data:
        return lines + ["Not measured (`python benchmarks/router_bench.py --rounds 3`).", ""]
    c = data["config"]
    s = data["summary"]
    lines += [
        (f"Run {data['date']} on {data['machine']}, with `{data['command']}`. Two `kvserve "
         f"serve` replicas of {c['model']}, each pinned to its own core with "
         f"{c['num_blocks']} KV blocks of 16 tokens (room for about half the system prompts "
         f"at once), behind either proxy. The workload: {c['num_prefixes']} system prompts of "
         f"{c['prefix_len']} tokens, each of {c['num_prompts']} requests one of them plus a "
         f"distinct {c['suffix_len']}-token question, {c['output_len']} tokens out, "
         f"{c['concurrency']} concurrent streaming clients. Each round measures both proxies "
         f"(the order alternating) on fresh prompts; the hit rate is both replicas' "
         f"`vllm:prefix_cache_hits` over `vllm:prefix_cache_queries` in that measurement; "
         f"medians of {c['rounds']} rounds."),
        "",
        "| proxy | prefix-cache hit rate | median TTFT | p90 TTFT | output tok/s |",
        "|---|---|---|---|---|"]
    for name in ("router", "nginx"):
        r = s[name]
        lines.append(f"| {NAMES[name]} | {r['hit_rate']:.1%} | {r['median_ttft_ms']:.0f} ms | "
                     f"{r['p90_ttft_ms']:.0f} ms | {r['output_throughput']:.1f} |")
    router, nginx = s["router"], s["nginx"]
    decisions: dict[str, float] = {}
    for run in data["runs"]:
        for k, v in (run.get("router_decisions") or {}).items():
            decisions[k] = decisions.get(k, 0.0) + v
    total = sum(decisions.values()) or 1.0
    lines += [
        "",
        (f"**The router wins and is kept**: {router['hit_rate']:.0%} of prompt tokens found in "
         f"cache against {nginx['hit_rate']:.0%}, the median TTFT "
         f"{nginx['median_ttft_ms'] / router['median_ttft_ms']:.1f}x lower and "
         f"{router['output_throughput'] / nginx['output_throughput']:.1f}x the output rate. "
         f"`least_conn` spreads each system prompt over both replicas, so each must compute "
         f"and hold every prefix, more than its cache has room for; the router sends a prefix "
         f"to one replica, and each replica holds its half. Its decisions over all rounds: "
         + ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(decisions.items()))
         + " (no_match: the first request of each prefix; fallback: the preferred replica over "
           "the load bound, `docs/router.md`)."),
        ""]
    return lines
