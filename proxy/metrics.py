"""Prometheus metrics of the proxy, on its own ``CollectorRegistry``.

Request counters and latency histograms are recorded as requests progress; per-node
gauges (outstanding requests, health) and counters are read from the ``NodePool`` at
scrape time, node discovery's event counts from its ``Membership``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.httpkit.metrics import MetricsRegistry
from proxy.discovery import Membership
from proxy.nodes import NodePool
from proxy.router import Router

PREFIX = "pdproxy"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _NodeCollector(Collector):
    def __init__(
        self, pool: NodePool, router: Router | None = None, members: Membership | None = None
    ) -> None:
        self._pool = pool
        self._router = router
        self._members = members

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "url"]
        outstanding = GaugeMetricFamily(
            f"{PREFIX}_node_outstanding_requests",
            "Requests in flight on each node through this proxy (a node that left: until "
            "they end; one that joined again at its URL counts those from before)",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            f"{PREFIX}_node_healthy", "1 if the node is in rotation, else 0", labels=labels
        )
        served = CounterMetricFamily(
            f"{PREFIX}_node_requests",
            "Requests routed to each node (its URL's: counted on from before it left and "
            "joined again)",
            labels=labels,
        )
        failures = CounterMetricFamily(
            f"{PREFIX}_node_failures",
            "Requests that failed on each node (connection error or 5xx)",
            labels=labels,
        )
        # Nodes that left with requests still on them too, until their last one ends (then
        # their series go: no labels kept for nodes long gone).
        for n in [*self._pool.all(), *self._pool.leaving()]:
            key = [n.role, n.url]
            outstanding.add_metric(key, float(n.in_flight))
            healthy.add_metric(key, 1.0 if n.ready else 0.0)
            served.add_metric(key, float(n.counters.requests))  # per URL: never down
            failures.add_metric(key, float(n.counters.failures))
        yield from (outstanding, healthy, served, failures)
        if self._members is not None:
            events = CounterMetricFamily(
                f"{PREFIX}_discovery_events",
                "Node discovery: added, removed (no source lists it any more), expired "
                "(registration not renewed), refused (a registration answered 4xx), dns_error "
                "(a name's lookup gave no answer: its nodes kept), dns_timeout (of those, no "
                "answer within the lookup's deadline), dns_late (a lookup's answer taken after "
                "its deadline)",
                labels=["event"],
            )
            events_shown = ("added", "removed", "expired", "refused", "dns_error", "dns_timeout",
                            "dns_late")  # fmt: skip
            for event in events_shown:
                events.add_metric([event], float(self._members.events[event]))
            yield events
        if self._router is not None:
            yield from self._routing(self._router)

    def _routing(self, router: Router) -> Iterator[Metric]:
        decisions = CounterMetricFamily(
            f"{PREFIX}_route_decisions",
            "Nodes chosen, by role and why (least_load, round_robin; --routing prefix: "
            "cache_key, prefix, spread, load)",
            labels=["role", "reason"],
        )
        for (role, reason), n in sorted(router.decisions.items()):
            decisions.add_metric([role, reason], float(n))
        modes = CounterMetricFamily(
            f"{PREFIX}_route_mode",
            "Attempts routed, by mode: disaggregated (prefill + decode node), decode_only "
            "(--disagg-min-prompt-tokens), prefill_fallback (no prefill node ready, "
            "--prefill-fallback) or peer_refused (the decode node refuses every ready "
            "prefill node's side channel, --kv-allowed-peers: it prefills by itself)",
            labels=["mode"],
        )
        for mode in ("disaggregated", "decode_only", "prefill_fallback", "peer_refused"):
            modes.add_metric([mode], float(router.modes[mode]))
        yield from (decisions, modes)
        index = router.index
        if index is not None:
            blocks = GaugeMetricFamily(
                f"{PREFIX}_prefix_index_blocks",
                "Prompt blocks the proxy remembers per node for prefix routing",
                labels=["role", "url"],
            )
            for n in self._pool.all():
                blocks.add_metric([n.role, n.url], float(index.size(n.url)))
            evicted = CounterMetricFamily(
                f"{PREFIX}_prefix_index_evicted_blocks",
                "Blocks forgotten to stay within --prefix-max-chars",
            )
            evicted.add_metric([], float(index.evicted_total))
            yield from (blocks, evicted)
        if router.estimator is not None:
            ratio = GaugeMetricFamily(
                f"{PREFIX}_chars_per_token",
                "Characters per prompt token the proxy estimates with, by prompt kind",
                labels=["kind"],
            )
            for kind, r in sorted(router.estimator.ratio.items()):
                ratio.add_metric([kind], r)
            yield ratio


class ProxyMetrics(MetricsRegistry):
    def __init__(
        self, pool: NodePool, router: Router | None = None, members: Membership | None = None
    ) -> None:
        super().__init__(PREFIX, _NodeCollector(pool, router, members))
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
        self.migrations = self.counter(
            "stream_migrations",
            "Streams moved to another pair after their decode node failed mid-answer "
            "(--migration-limit), by how the stream ended (resumed, diverged, failed)",
            ["outcome"],
        )
        # Exported at 0 from the start, so that alerts on them see a series, not "no data".
        for role in ("prefill", "decode"):
            self.retries.labels(role)
        for outcome in ("resumed", "diverged", "failed"):
            self.migrations.labels(outcome)
        for kind in ("bad_request", "overloaded", "unavailable", "upstream", "stream_error",
                     "client_disconnect"):  # fmt: skip
            self.errors.labels(kind)
        self.inflight = self.gauge("requests_inflight", "Requests in flight")
        self.ttft = self.histogram(
            "time_to_first_token_seconds",
            "Time from request arrival until the proxy had the first token",
            buckets=_TTFT_BUCKETS,
        )
        self.itl = self.histogram(
            "inter_token_latency_seconds",
            "Time between consecutive streamed chunks, divided by the tokens the later one "
            "carries (one sample per chunk)",
            buckets=_ITL_BUCKETS,
        )
        self.e2e = self.histogram(
            "request_latency_seconds",
            "Time from request arrival to the end of the answer",
            buckets=_E2E_BUCKETS,
        )


class StreamError:
    """One request's ``stream_error``, counted once: its stream ends with one error event,
    however many of its choices (``n`` > 1, a batch of prompts) failed on their own, so its
    sessions share one of these."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._child = metrics.errors.labels("stream_error")
        self._counted = False

    def count(self) -> None:
        if not self._counted:
            self._counted = True
            self._child.inc()
