"""Prometheus metrics of the proxy, on its own ``CollectorRegistry``.

Request counters and latency histograms are recorded as requests progress; per-node
gauges (outstanding requests, health) and counters are read from the ``NodePool`` at
scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.httpkit.metrics import MetricsRegistry
from proxy.nodes import NodePool

PREFIX = "pdproxy"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _NodeCollector(Collector):
    def __init__(self, pool: NodePool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "url"]
        outstanding = GaugeMetricFamily(
            f"{PREFIX}_node_outstanding_requests",
            "Requests in flight on each node through this proxy",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            f"{PREFIX}_node_healthy", "1 if the node is in rotation, else 0", labels=labels
        )
        served = CounterMetricFamily(
            f"{PREFIX}_node_requests", "Requests routed to each node", labels=labels
        )
        failures = CounterMetricFamily(
            f"{PREFIX}_node_failures",
            "Requests that failed on each node (connection error or 5xx)",
            labels=labels,
        )
        for n in self._pool.all():
            key = [n.role, n.url]
            outstanding.add_metric(key, float(n.outstanding))
            healthy.add_metric(key, 1.0 if n.ready else 0.0)
            served.add_metric(key, float(n.requests_total))
            failures.add_metric(key, float(n.failures_total))
        yield from (outstanding, healthy, served, failures)


class ProxyMetrics(MetricsRegistry):
    def __init__(self, pool: NodePool) -> None:
        super().__init__(PREFIX, _NodeCollector(pool))
        self.requests = self.counter(
            "requests", "Requests answered, by endpoint and HTTP status", ["endpoint", "status"]
        )
        self.errors = self.counter(
            "request_errors",
            "Failed requests by kind (bad_request, overloaded, unavailable, upstream, "
            "stream_error, client_disconnect)",
            ["kind"],
        )
        self.retries = self.counter(
            "request_retries",
            "Requests retried on another prefill/decode pair, by the role that failed",
            ["role"],
        )
        self.inflight = self.gauge("requests_inflight", "Requests in flight")
        self.ttft = self.histogram(
            "time_to_first_token_seconds",
            "Time from request arrival until the proxy had the first token",
            buckets=_TTFT_BUCKETS,
        )
        self.itl = self.histogram(
            "inter_token_latency_seconds",
            "Time between consecutive streamed tokens",
            buckets=_ITL_BUCKETS,
        )
        self.e2e = self.histogram(
            "request_latency_seconds",
            "Time from request arrival to the end of the answer",
            buckets=_E2E_BUCKETS,
        )
