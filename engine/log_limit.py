"""Log lines that others can make us repeat, at most one per period (``LogLimit``).

A warning written once per refused call lets whoever sends the calls (unauthenticated
posts to the proxy, decode legs naming addresses that never answer) fill the log. Such a
line goes through a ``LogLimit``: the first is written at once, the ones that follow it
within ``period`` seconds are held back and counted, and the next line written says how
many were (so none goes unaccounted for in the log, only unwritten).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class LogLimit:
    """At most one line per ``period`` seconds. Call ``take`` before each line: None --
    hold this one back (it is counted); else how many were held back since the last line
    written, for this one to say. Thread-safe."""

    def __init__(self, period: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.period = period
        self._clock = clock
        self._last: float | None = None
        self._quiet = 0
        self._lock = threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last < self.period:
                self._quiet += 1
                return None
            quiet, self._last, self._quiet = self._quiet, now, 0
            return quiet
