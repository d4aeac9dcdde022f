"""The router's own Prometheus metrics (GET /metrics on the router; each replica keeps its
vllm:* metrics on its own /metrics). One CollectorRegistry per router, no module globals.

    kvserve_router_requests_total{backend}            responses relayed from each backend
    kvserve_router_retries_total{backend}             attempts given up on (connection failed
                                                      before a byte came back, or a 503) and
                                                      sent elsewhere
    kvserve_router_routing_decisions_total{decision}  prefix_hit | fallback | no_match (a
                                                      retried request decides again)
    kvserve_router_prompt_tokens_total                prompt tokens routed
    kvserve_router_matched_tokens_total               of them, in blocks the chosen backend was
                                                      sent before (the router's own estimate
                                                      of the replicas' prefix-cache hits)
    kvserve_router_backend_in_flight{backend}         gauge
    kvserve_router_backend_healthy{backend}           gauge, 1 or 0
    kvserve_router_prefix_map_blocks                  gauge, entries in the prefix map
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvserve.router.policy import DECISION_KINDS, Decision


class BackendState(Protocol):
    """What the gauges read of a backend (pool.Backend)."""

    in_flight: int
    healthy: bool

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _PoolCollector(Collector):
    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        backends, prefix_blocks = self._metrics.backends, self._metrics.prefix_blocks
        if prefix_blocks is None:
            return
        in_flight = GaugeMetricFamily("kvserve_router_backend_in_flight",
                                      "Requests sent to the backend and not finished.",
                                      labels=["backend"])
        healthy = GaugeMetricFamily("kvserve_router_backend_healthy",
                                    "1 while the backend is routable.", labels=["backend"])
        for url, b in backends.items():
            in_flight.add_metric([url], b.in_flight)
            healthy.add_metric([url], 1.0 if b.healthy else 0.0)
        yield in_flight
        yield healthy
        yield GaugeMetricFamily("kvserve_router_prefix_map_blocks",
                                "Block hashes in the router's prefix map.",
                                value=prefix_blocks())


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.backends: Mapping[str, BackendState] = {}
        self.prefix_blocks: Callable[[], int] | None = None  # entries in the prefix map
        r = self.registry
        self.requests = Counter("kvserve_router_requests", "Responses relayed, by backend.",
                                ["backend"], registry=r)
        self.retries = Counter("kvserve_router_retries",
                               "Attempts sent elsewhere (connection failed, or 503).",
                               ["backend"], registry=r)
        self.decisions = Counter("kvserve_router_routing_decisions",
                                 "Routing decisions: prefix_hit, fallback, no_match.",
                                 ["decision"], registry=r)
        for kind in DECISION_KINDS:
            self.decisions.labels(kind)  # present at 0 from the start
        self.prompt_tokens = Counter("kvserve_router_prompt_tokens", "Prompt tokens routed.",
                                     registry=r)
        self.matched_tokens = Counter("kvserve_router_matched_tokens",
                                      "Prompt tokens in blocks the chosen backend was sent "
                                      "before.", registry=r)
        r.register(_PoolCollector(self))

    def attach(self, backends: Mapping[str, BackendState], prefix_blocks: Callable[[], int]
               ) -> None:
        """The pool's backends and prefix map, read at scrape time."""
        self.backends, self.prefix_blocks = backends, prefix_blocks
        for url in backends:
            self.requests.labels(url)
            self.retries.labels(url)

    def decision(self, d: Decision, num_tokens: int, block_size: int) -> None:
        self.decisions.labels(d.kind).inc()
        self.prompt_tokens.inc(num_tokens)
        self.matched_tokens.inc(d.matched_blocks * block_size)

    def render(self) -> bytes:
        return generate_latest(self.registry)
