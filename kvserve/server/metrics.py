"""Prometheus metrics with vLLM's names, so existing vLLM dashboards work (docs/metrics.md).

One CollectorRegistry per app (no module globals): two servers in one process, as in tests,
never share counters. Gauges and the scheduler's cumulative counters are read from the
engine's latest stats snapshot at scrape time; per-request counters and histograms are fed
by the engine thread once per step (IterationStats).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.iteration_stats import IterationStats
from kvserve.outputs import EngineStats
from kvserve.spec.base import SpecStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class _EngineCollector(Collector):
    """Scrape-time view of the engine's stats snapshot."""

    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str) -> None:
        """stats: None while the model has no engine (model tiers: warm or cold)."""
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        if s is None:
            return
        labels = ["model_name"]
        for family, name, doc, value in (
                (GaugeMetricFamily, "vllm:num_requests_running",
                 "Requests in model execution batches.", s.num_running),
                (GaugeMetricFamily, "vllm:num_requests_waiting",
                 "Requests waiting to be processed.", s.num_waiting),
                (GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                 "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
                (CounterMetricFamily, "vllm:prefix_cache_queries",
                 "Prefix cache queries, in queried tokens.", s.prefix_cache_queries),
                (CounterMetricFamily, "vllm:prefix_cache_hits",
                 "Prefix cache hits, in cached tokens.", s.prefix_cache_hits),
                (CounterMetricFamily, "vllm:num_preemptions",
                 "Cumulative number of preemptions.", s.num_preemptions)):
            metric = family(name, doc, labels=labels)
            metric.add_metric([self._model], float(value))
            yield metric
        if s.spec is not None:
            yield from self._spec_metrics(s.spec, labels)
        if s.tiers is not None:
            for name, doc, i in (("kvserve:tier_num_requests_running",
                                  "Requests in model execution batches, by service tier.", 0),
                                 ("kvserve:tier_num_requests_waiting",
                                  "Requests waiting to be processed, by service tier.", 1)):
                metric = GaugeMetricFamily(name, doc, labels=labels + ["tier"])
                for tier, counts in sorted(s.tiers.items()):
                    metric.add_metric([self._model, tier], float(counts[i]))
                yield metric
            rejected = CounterMetricFamily(
                "kvserve:tier_requests_rejected",
                "Requests refused with 429: their tier's waiting queue was full.",
                labels=labels + ["tier"])
            for tier, n in sorted((s.tier_rejections or {}).items()):
                rejected.add_metric([self._model, tier], float(n))
            yield rejected

    def _spec_metrics(self, spec: SpecStats, labels: list[str]
                      ) -> Iterator[CounterMetricFamily]:
        """vLLM's speculative-decoding counters (a draft: one request's drafts in a step)."""
        for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Verify steps of a request with drafts.",
                 spec.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                 spec.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 spec.num_accepted_tokens)):
            metric = CounterMetricFamily(name, doc, labels=labels)
            metric.add_metric([self._model], float(value))
            yield metric
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=labels + ["position"])
        for pos, value in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([self._model, str(pos)], float(value))
        yield per_pos


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.registry.register(_EngineCollector(stats, model_name))
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens produced.",
                                         labels, registry=r).labels(model_name)
        success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                          labels + ["finished_reason"], registry=r)
        self.request_success = {reason: success.labels(model_name, reason)
                                for reason in FINISH_REASONS}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency.",
                             labels, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=_REQUEST_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Time spent waiting before first scheduled.", labels,
                                    buckets=_REQUEST_BUCKETS, registry=r).labels(model_name)
        # Service tiers (samples only where tiers are configured).
        self.tier_ttft = Histogram("kvserve:tier_time_to_first_token_seconds",
                                   "Time to first token, by service tier.", labels + ["tier"],
                                   buckets=_TTFT_BUCKETS, registry=r)
        self.tier_success = Counter("kvserve:tier_request_success",
                                    "Finished requests, by service tier and finish reason.",
                                    labels + ["tier", "finished_reason"], registry=r)

    def observe(self, it: IterationStats) -> None:
        """Called on the engine thread after each step (prometheus_client is thread-safe)."""
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        for v in it.time_to_first_tokens:
            self.ttft.observe(v)
        for v in it.inter_token_latencies:
            self.itl.observe(v)
        for v in it.e2e_latencies:
            self.e2e.observe(v)
        for v in it.queue_times:
            self.queue_time.observe(v)
        for reason in it.finished_reasons:
            counter = self.request_success.get(reason)
            if counter is not None:
                counter.inc()
        for tier, v in it.tier_time_to_first_tokens:
            self.tier_ttft.labels(self.model_name, tier).observe(v)
        for tier, reason in it.tier_finished_reasons:
            self.tier_success.labels(self.model_name, tier, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Merged(Collector):
    """Several models' registries as one exposition: each metric family once, with every
    model's samples (Prometheus refuses a family that appears twice)."""

    def __init__(self, registries: Iterable[CollectorRegistry]) -> None:
        self._registries = list(registries)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self._registries:
            for metric in registry.collect():
                have = families.get(metric.name)
                if have is None:
                    have = families[metric.name] = Metric(metric.name, metric.documentation,
                                                          metric.type, metric.unit)
                have.samples.extend(metric.samples)
        yield from families.values()


def render_merged(metrics: Iterable[ServerMetrics]) -> bytes:
    """One /metrics body for a server's several models (model tiers), each series labelled
    with its model_name as a single-model server labels its own."""
    return generate_latest(_Merged(m.registry for m in metrics))  # type: ignore[arg-type]
