"""Log lines that others can make us repeat, at most one per period (``LogLimit``).

A warning written once per refused call lets whoever sends the calls (unauthenticated
posts to the proxy, decode legs naming addresses that never answer) fill the log. Such a
line goes through a ``LogLimit``: the first is written at once, the ones that follow it
within ``period`` seconds are held back and counted, and the next line written says how
many were (so none goes unaccounted for in the log, only unwritten).
"""

from __future__ import annotations

import logging
import re
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


class LimitedLog:
    """A logger's warnings that others can provoke, each kind (a fixed name chosen by the
    code, never by a peer) at most once per ``period`` seconds; a line written after some
    were held back ends with how many."""

    def __init__(self, log: logging.Logger, period: float = 10.0) -> None:
        self._log = log
        self.period = period
        self._limits: dict[str, LogLimit] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object) -> None:
        with self._lock:
            limit = self._limits.get(kind)
            if limit is None:
                limit = self._limits[kind] = LogLimit(self.period)
        quiet = limit.take()
        if quiet is None:
            return
        if quiet:
            msg += " (%d more like it in the last %gs, not logged)"
            args = (*args, quiet, self.period)
        self._log.warning(msg, *args)


_HELD_BACK = re.compile(r"\((\d+) more like it in the last ")


def held_back(line: str) -> int:
    """How many lines a line written by ``LimitedLog`` says it held back (0: none)."""
    m = _HELD_BACK.search(line)
    return int(m.group(1)) if m else 0
