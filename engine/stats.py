"""Typed statistics: every field declares whether it is a counter or a gauge, and its help.

A stats class is a dataclass whose fields are made with ``counter(...)`` or ``gauge(...)``;
an instance is a snapshot. ``entries()`` feeds the Prometheus exporter, which exports
counters as counters and gauges as gauges; ``stats["name"]`` reads one value by field name
(tests, scripts). Per-rank stats of the same class add up with ``+``. ``StatsGroup`` joins
the snapshots of several parts (scheduler, connector) behind the same interface.

Metric names: ``pdserve_engine_<field>`` unless the field names one (``metric=``); a counter's
``_total`` suffix is written by the exposition format. ``vllm=`` also exports the value under
vLLM's name (``vllm:<name>{model_name=...}``), for dashboards and autoscalers built for vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["counter", "gauge"]


@dataclass(frozen=True)
class StatEntry:
    name: str  # the field name, e.g. "prompt_tokens_total"
    kind: Kind
    doc: str
    value: float
    metric: str  # the metric family name without prefix, e.g. "prompt_tokens"
    vllm: str | None = None  # vLLM's family name, e.g. "generation_tokens"


def _stat(kind: Kind, doc: str, metric: str | None, vllm: str | None) -> Any:
    return dataclasses.field(
        default=0, metadata={"kind": kind, "doc": doc, "metric": metric, "vllm": vllm}
    )


def counter(doc: str, metric: str | None = None, vllm: str | None = None) -> Any:
    """A monotonically growing count (name the field ``..._total``)."""
    return _stat("counter", doc, metric, vllm)


def gauge(doc: str, metric: str | None = None, vllm: str | None = None) -> Any:
    """A value that goes up and down (sizes, things in flight)."""
    return _stat("gauge", doc, metric, vllm)


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
            yield StatEntry(
                f.name, md["kind"], md["doc"], float(getattr(self, f.name)), metric, md["vllm"]
            )

    def __add__(self, other: Stats) -> Stats:
        """Field-wise sum (per-rank counters of one step, or of one class)."""
        if type(other) is not type(self):
            return NotImplemented
        values = {
            f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)
        }
        return type(self)(**values)


class StatsGroup(_Readable):
    """Several snapshots read as one (a name is looked up in the parts in order)."""

    def __init__(self, *parts: _Readable | None) -> None:
        self.parts = [p for p in parts if p is not None]

    def entries(self) -> Iterator[StatEntry]:
        for part in self.parts:
            yield from part.entries()
