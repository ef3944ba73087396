"""The connector's histograms: ``engine.stats.Histogram`` with its help text, safe to
observe from the connector's threads (lanes, the engine loop); the node's /metrics exports
each snapshot next to the engine's own."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from engine.stats import Histogram as _Histogram
from engine.stats import HistogramValue


class Histogram(_Histogram):
    def __init__(self, doc: str, buckets: Sequence[float]) -> None:
        super().__init__(tuple(buckets))
        self.doc = doc
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            super().observe(value)

    def snapshot(self) -> HistogramValue:
        with self._lock:
            return super().snapshot()

    @property
    def count(self) -> int:
        return self.snapshot().count
