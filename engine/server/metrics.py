"""Prometheus metrics of one node, on a per-app ``CollectorRegistry``.

Engine gauges and counters are read from ``engine.stats()`` at scrape time by a custom
collector; HTTP and request-level metrics are recorded by the app as requests complete.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

PREFIX = "pdserve"

# engine.stats() key -> (metric name without prefix, kind, help). Always exported.
KNOWN_STATS: dict[str, tuple[str, str, str]] = {
    "num_running": ("num_requests_running", "gauge", "Requests currently running"),
    "num_waiting": ("num_requests_waiting", "gauge", "Requests waiting to be scheduled"),
    "kv_blocks_used": ("kv_blocks_used", "gauge", "KV cache blocks in use"),
    "kv_blocks_free": ("kv_blocks_free", "gauge", "KV cache blocks free"),
    "prompt_tokens_total": ("prompt_tokens", "counter", "Prompt tokens processed"),
    "generation_tokens_total": ("generation_tokens", "counter", "Tokens generated"),
}

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name).strip("_") or "unnamed"


class EngineStatsCollector(Collector):
    """Turns ``engine.stats()`` into metric families on every scrape."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        healthy = bool(getattr(self._engine, "healthy", True))
        g = GaugeMetricFamily(f"{PREFIX}_engine_healthy", "1 if the engine is serving, else 0")
        g.add_metric([], 1.0 if healthy else 0.0)
        yield g
        try:
            stats = dict(self._engine.stats())
        except Exception:  # a dead engine must not break the scrape
            logger.warning("engine.stats() failed during a metrics scrape", exc_info=True)
            stats = {}
        for key, (name, kind, doc) in KNOWN_STATS.items():
            yield _family(f"{PREFIX}_{name}", kind, doc, float(stats.get(key, 0.0)))
        used, free = stats.get("kv_blocks_used"), stats.get("kv_blocks_free")
        if used is not None and free is not None and used + free > 0:
            yield _family(
                f"{PREFIX}_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use",
                float(used) / float(used + free),
            )  # fmt: skip
        for key, value in sorted(stats.items()):
            if key in KNOWN_STATS or not isinstance(value, int | float):
                continue
            # Unknown keys (scheduler/connector extras) are exported as gauges as-is.
            yield _family(f"{PREFIX}_engine_{_sanitize(key)}", "gauge", key, float(value))
        histograms = getattr(self._engine, "histograms", dict)()
        for name, hist in sorted(histograms.items()):
            buckets, total = hist.snapshot()
            h = HistogramMetricFamily(f"{PREFIX}_{name}", hist.doc)
            h.add_metric(
                [], [("+Inf" if le == float("inf") else repr(le), n) for le, n in buckets], total
            )
            yield h


def _family(name: str, kind: str, doc: str, value: float) -> Metric:
    fam: Metric
    fam = CounterMetricFamily(name, doc) if kind == "counter" else GaugeMetricFamily(name, doc)
    fam.add_metric([], value)
    return fam


class ServerMetrics:
    """All metrics of one app; ``render()`` produces the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineStatsCollector(engine))
        self.http_requests = Counter(
            f"{PREFIX}_http_requests",
            "HTTP requests by method, route and status",
            ["method", "path", "status"],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            f"{PREFIX}_http_request_duration_seconds",
            "HTTP request latency by method and route",
            ["method", "path"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests_finished = Counter(
            f"{PREFIX}_request_finished",
            "Generation requests finished, by endpoint and finish reason",
            ["endpoint", "finish_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from request arrival to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            f"{PREFIX}_request_latency_seconds",
            "Time from request arrival to its last generated token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_request_prompt_tokens",
            "Prompt tokens of requests served over HTTP",
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            f"{PREFIX}_request_completion_tokens",
            "Completion tokens returned over HTTP",
            registry=self.registry,
        )

    def observe_http(self, method: str, path: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method, path, str(status)).inc()
        self.http_latency.labels(method, path).observe(seconds)

    def observe_finished(
        self,
        endpoint: str,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        ttft: float | None,
        e2e: float,
    ) -> None:
        self.requests_finished.labels(endpoint, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        self.e2e.observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)
