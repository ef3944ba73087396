"""Prometheus metrics of one node, on a per-app ``CollectorRegistry``.

Engine counters, gauges and histograms are read from ``engine.stats()`` (typed,
``engine.stats``) at scrape time by a custom collector, with their Prometheus types --
among them vLLM's request-level histograms (``vllm:time_to_first_token_seconds``, ...,
``engine.core.scheduler_stats``); HTTP metrics and pdserve's HTTP-level request metrics are
recorded by the app as requests complete.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.httpkit.metrics import MetricsRegistry
from engine.stats import StatEntry

logger = logging.getLogger(__name__)

PREFIX = "pdserve"


class EngineStatsCollector(Collector):
    """Turns the engine's typed stats (``engine.stats``) into metric families on every
    scrape: counters as counters, gauges as gauges, each also under its vLLM name where it
    has one (``vllm:<name>{model_name=...}``)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        healthy = bool(self._engine.healthy)
        g = GaugeMetricFamily(f"{PREFIX}_engine_healthy", "1 if the engine is serving, else 0")
        g.add_metric([], 1.0 if healthy else 0.0)
        yield g
        try:
            entries = list(self._engine.stats().entries())
        except Exception:  # a dead engine must not break the scrape
            logger.warning("engine.stats() failed during a metrics scrape", exc_info=True)
            entries = []
        model = [self._engine.model_name]
        values = {e.name: e.value for e in entries}
        for e in entries:
            if e.pdserve:
                yield _entry_family(f"{PREFIX}_{e.metric}", e)
            if e.vllm:
                yield _entry_family(f"vllm:{e.vllm}", e, model)
        used, free = values.get("kv_blocks_used"), values.get("kv_blocks_free")
        if used is not None and free is not None and used + free > 0:
            ratio = used / (used + free)
            yield _family(
                f"{PREFIX}_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use", ratio
            )
            yield _family(
                "vllm:kv_cache_usage_perc", "gauge", "KV cache usage (1 = full)", ratio, model
            )
            yield _family(  # vLLM <= 0.10's name, which vLLM's example dashboard reads
                "vllm:gpu_cache_usage_perc", "gauge", "KV cache usage (1 = full)", ratio, model
            )
        histograms = getattr(self._engine, "histograms", dict)()
        for name, hist in sorted(histograms.items()):
            value = hist.snapshot()
            h = HistogramMetricFamily(f"{PREFIX}_{name}", hist.doc)
            h.add_metric([], [(_le(le), n) for le, n in value.cumulative()], value.sum)
            yield h


def _entry_family(name: str, e: StatEntry, model: list[str] | None = None) -> Metric:
    """One typed stat as a metric family: a histogram with its buckets, a labelled counter
    with a sample per label value, else a plain counter or gauge."""
    labels = ["model_name"] if model else []
    if e.histogram is not None:
        h = HistogramMetricFamily(name, e.doc, labels=labels)
        buckets = [(_le(le), n) for le, n in e.histogram.cumulative()]
        h.add_metric(model or [], buckets, e.histogram.sum)
        return h
    if e.label is not None:
        c = CounterMetricFamily(name, e.doc, labels=[*labels, e.label])
        for value, n in e.by_label:
            c.add_metric([*(model or []), value], n)
        return c
    return _family(name, e.kind, e.doc, e.value, model)


def _le(le: float) -> str:
    return "+Inf" if le == float("inf") else repr(float(le))


def _family(name: str, kind: str, doc: str, value: float, model: list[str] | None = None) -> Metric:
    labels = ["model_name"] if model else None
    fam: Metric
    if kind == "counter":
        fam = CounterMetricFamily(name, doc, labels=labels)
    else:
        fam = GaugeMetricFamily(name, doc, labels=labels)
    fam.add_metric(model or [], value)
    return fam


class ServerMetrics(MetricsRegistry):
    """All metrics of one node app; ``render()`` produces the /metrics body."""

    def __init__(self, engine: Any) -> None:
        super().__init__(PREFIX, EngineStatsCollector(engine))
        self.http_requests = self.counter(
            "http_requests",
            "HTTP requests by method, route and status",
            ["method", "path", "status"],
        )
        self.http_latency = self.histogram(
            "http_request_duration_seconds", "HTTP request latency by method and route",
            ["method", "path"],
        )  # fmt: skip
        self.requests_finished = self.counter(
            "request_finished",
            "Generation requests finished, by endpoint and finish reason",
            ["endpoint", "finish_reason"],
        )
        self.ttft = self.histogram(
            "time_to_first_token_seconds", "Time from request arrival to the first generated token"
        )
        self.e2e = self.histogram(
            "request_latency_seconds", "Time from request arrival to its last generated token"
        )
        self.prompt_tokens = self.counter(
            "request_prompt_tokens", "Prompt tokens of requests served over HTTP"
        )
        self.completion_tokens = self.counter(
            "request_completion_tokens", "Completion tokens returned over HTTP"
        )

    def track_admission(self, admission: Any) -> None:
        """Gauges of an ``engine.httpkit.admission.Admission``, read at scrape time."""
        self.gauge(
            "num_requests_admitted",
            "Generation requests in flight over HTTP (tokenizing, waiting, running, streaming)",
        ).set_function(lambda: admission.in_flight)
        limit = admission.limit
        self.gauge(
            "max_admitted_requests",
            "In-flight generation requests before new ones get 429 (-1: no limit)",
        ).set_function(lambda: -1 if limit is None else limit)

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
