"""A small thread-safe histogram whose snapshot the node's /metrics exports."""

from __future__ import annotations

import threading
from collections.abc import Sequence


class Histogram:
    def __init__(self, doc: str, buckets: Sequence[float]) -> None:
        self.doc = doc
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._sum += value
            for i, le in enumerate(self.buckets):
                if value <= le:
                    self._counts[i] += 1
                    return
            self._counts[-1] += 1

    def snapshot(self) -> tuple[list[tuple[float, int]], float]:
        """Cumulative (le, count) pairs ending with +Inf, and the sum of observations."""
        with self._lock:
            out, acc = [], 0
            for le, n in zip((*self.buckets, float("inf")), self._counts, strict=True):
                acc += n
                out.append((le, acc))
            return out, self._sum

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)
