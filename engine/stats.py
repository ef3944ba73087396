"""Typed statistics: every field declares whether it is a counter, a gauge or a histogram,
and its help.

A stats class is a dataclass whose fields are made with ``counter(...)``, ``gauge(...)``,
``histogram(...)`` or ``labeled_counter(...)``; an instance is a snapshot. ``entries()`` feeds the Prometheus exporter, which exports
counters as counters and gauges as gauges; ``stats["name"]`` reads one value by field name
(tests, scripts). Per-rank stats of the same class add up with ``+``. ``StatsGroup`` joins
the snapshots of several parts (scheduler, connector) behind the same interface.

Metric names: ``pdserve_engine_<field>`` unless the field names one (``metric=``); a counter's
``_total`` suffix is written by the exposition format. ``vllm=`` also exports the value under
vLLM's name (``vllm:<name>{model_name=...}``), for dashboards and autoscalers built for vLLM;
``pdserve=False`` exports it under vLLM's name only.

A histogram field's value is a ``HistogramValue`` (its buckets travel with it, so one field
can have buckets decided at run time, e.g. up to the model's context length); the
``Histogram`` accumulator makes them. A labelled counter's value is ``{label value: count}``.
Reading either by name (``stats["name"]``) gives its count (a histogram's observations, a
labelled counter's total).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class HistogramValue:
    """A histogram snapshot: ``counts[i]`` observations in ``(buckets[i-1], buckets[i]]``,
    the last one above every bucket (+Inf); not cumulative."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0

    @classmethod
    def empty(cls, buckets: tuple[float, ...]) -> HistogramValue:
        return cls(tuple(buckets), (0,) * (len(buckets) + 1))

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """Prometheus' (le, cumulative count) pairs, ending with +Inf."""
        out, acc = [], 0
        for le, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            acc += n
            out.append((le, acc))
        return out

    def __add__(self, other: HistogramValue) -> HistogramValue:
        if not isinstance(other, HistogramValue):
            return NotImplemented
        if not other.count:
            return self
        if not self.count:
            return other
        if other.buckets != self.buckets:
            raise ValueError("cannot add histograms with different buckets")
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return HistogramValue(self.buckets, counts, self.sum + other.sum)


class Histogram:
    """Accumulates observations for ``HistogramValue`` snapshots (one thread: the owner's)."""

    def __init__(self, buckets: tuple[float, ...] | list[float]) -> None:
        self.buckets = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._sum += value
        self._counts[bisect.bisect_left(self.buckets, value)] += 1

    def snapshot(self) -> HistogramValue:
        return HistogramValue(self.buckets, tuple(self._counts), self._sum)


@dataclass(frozen=True)
class StatEntry:
    name: str  # the field name, e.g. "prompt_tokens_total"
    kind: Kind
    doc: str
    value: float  # a histogram's count, a labelled counter's total
    metric: str  # the metric family name without prefix, e.g. "prompt_tokens"
    vllm: str | None = None  # vLLM's family name, e.g. "generation_tokens"
    pdserve: bool = True  # also exported as ``pdserve_<metric>``
    histogram: HistogramValue | None = None  # histograms only
    label: str | None = None  # labelled counters: the label's name ...
    by_label: tuple[tuple[str, float], ...] = ()  # ... and (label value, count) pairs


def _stat(
    kind: Kind,
    doc: str,
    metric: str | None,
    vllm: str | None,
    pdserve: bool = True,
    label: str | None = None,
    **default: Any,
) -> Any:
    md = {"kind": kind, "doc": doc, "metric": metric, "vllm": vllm, "pdserve": pdserve}
    if label is not None:
        md["label"] = label
    if not pdserve and not vllm:
        raise ValueError("a stat exported under no name")
    return dataclasses.field(**(default or {"default": 0}), metadata=md)


def counter(
    doc: str, metric: str | None = None, vllm: str | None = None, pdserve: bool = True
) -> Any:
    """A monotonically growing count (name the field ``..._total``)."""
    return _stat("counter", doc, metric, vllm, pdserve)


def gauge(doc: str, metric: str | None = None, vllm: str | None = None) -> Any:
    """A value that goes up and down (sizes, things in flight)."""
    return _stat("gauge", doc, metric, vllm)


def histogram(
    doc: str,
    buckets: tuple[float, ...],
    metric: str | None = None,
    vllm: str | None = None,
    pdserve: bool = True,
) -> Any:
    """A distribution (latencies, sizes); the value is a ``HistogramValue`` (these buckets
    unless the snapshot carries its own)."""
    empty = HistogramValue.empty(tuple(buckets))
    return _stat("histogram", doc, metric, vllm, pdserve, default_factory=lambda: empty)


def labeled_counter(
    doc: str,
    label: str,
    values: tuple[str, ...] = (),
    metric: str | None = None,
    vllm: str | None = None,
    pdserve: bool = True,
) -> Any:
    """Counts by one label's value (``{value: count}``); ``values`` are exported from the
    start, at 0 (name the field ``..._total``)."""
    return _stat(
        "counter", doc, metric, vllm, pdserve, label,
        default_factory=lambda: dict.fromkeys(values, 0),
    )  # fmt: skip


class _Readable:
    def entries(self) -> Iterator[StatEntry]:
        raise NotImplementedError

    def as_dict(self) -> dict[str, float]:
        return {e.name: e.value for e in self.entries()}

    def __getitem__(self, name: str) -> float:
        for e in self.entries():
            if e.name == name:
                return e.value
        raise KeyError(name)

    def get(self, name: str, default: float | None = None) -> float | None:
        try:
            return self[name]
        except KeyError:
            return default

    def __contains__(self, name: str) -> bool:
        return any(e.name == name for e in self.entries())


@dataclass
class Stats(_Readable):
    """Base class of the typed stats dataclasses."""

    def entries(self) -> Iterator[StatEntry]:
        for f in dataclasses.fields(self):
            md = f.metadata
            if "kind" not in md:
                continue
            metric = md["metric"] or "engine_" + f.name
            if md["kind"] == "counter":
                metric = metric.removesuffix("_total")
            value = getattr(self, f.name)
            common = dict(vllm=md["vllm"], pdserve=md.get("pdserve", True))
            if isinstance(value, HistogramValue):
                yield StatEntry(
                    f.name, md["kind"], md["doc"], float(value.count), metric,
                    histogram=value, **common,
                )  # fmt: skip
            elif isinstance(value, dict):
                pairs = tuple((str(k), float(v)) for k, v in value.items())
                yield StatEntry(
                    f.name, md["kind"], md["doc"], sum(v for _, v in pairs), metric,
                    label=md.get("label"), by_label=pairs, **common,
                )  # fmt: skip
            else:
                yield StatEntry(f.name, md["kind"], md["doc"], float(value), metric, **common)

    def __add__(self, other: Stats) -> Stats:
        """Field-wise sum (per-rank counters of one step, or of one class)."""
        if type(other) is not type(self):
            return NotImplemented
        values = {
            f.name: _add(getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
        }
        return type(self)(**values)


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, dict):
        return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}
    return a + b


class StatsGroup(_Readable):
    """Several snapshots read as one (a name is looked up in the parts in order)."""

    def __init__(self, *parts: _Readable | None) -> None:
        self.parts = [p for p in parts if p is not None]

    def entries(self) -> Iterator[StatEntry]:
        for part in self.parts:
            yield from part.entries()
