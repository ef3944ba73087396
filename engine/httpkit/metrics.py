"""A Prometheus registry per app with short declarations (node and proxy metrics)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class MetricsRegistry:
    """``prefix``-named metrics on their own registry; ``render()`` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, prefix: str, *collectors: Collector) -> None:
        self.prefix = prefix
        self.registry = CollectorRegistry(auto_describe=False)
        for c in collectors:
            self.registry.register(c)

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(f"{self.prefix}_{name}", doc, list(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(f"{self.prefix}_{name}", doc, list(labels), registry=self.registry)

    def histogram(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        return Histogram(
            f"{self.prefix}_{name}", doc, list(labels), buckets=buckets, registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
