"""The NIXL connector's clocks, in one place a test's fake clock replaces (its ``time``).

``monotonic()``: deadlines within one host. ``wall()``: the clock hosts share (NTP),
only where a message's age crosses hosts (a reservation's ``sent_at``).
Both are looked up when called: a dataclass's ``default_factory=time.monotonic`` would
have bound the real clock at import.
"""

from __future__ import annotations

import time


def monotonic() -> float:
    return time.monotonic()


def wall() -> float:
    return time.time()
