"""Reading an event stream of JSON ``data:`` events (the proxy's legs, pd-bench): no web
framework needed."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any


def refuse_constant(name: str) -> Any:
    """``json.loads``' hook for ``NaN``/``Infinity``/``-Infinity``: not JSON (RFC 8259),
    never sent by a node, and a re-encoder with ``allow_nan=False`` fails on them later."""
    raise ValueError(f"{name} is not a JSON value")


class SSEIdleTimeout(TimeoutError):
    """The stream went ``max_idle_s`` without a ``data:`` event (only comments, blank
    lines or other fields came: each resets a per-read timeout, so they alone never
    end a wait)."""


class SSEReader:
    """``async for obj in SSEReader(resp.aiter_lines())`` yields each event's JSON; the loop
    ends at ``data: [DONE]`` (then ``done`` is True) or when the stream ends without it.

    With ``max_idle_s``, the time spent reading without a ``data:`` event is bounded:
    past it, at the next line that is no event, ``SSEIdleTimeout`` is raised. The clock
    starts when a read starts (the first, or the next after an event was yielded): the
    time the consumer holds an event is not the stream's. A stream that sends nothing at
    all is the line source's timeout to end (the proxy's node client: each read's)."""

    def __init__(self, lines: AsyncIterator[str], max_idle_s: float | None = None) -> None:
        self.lines = lines
        self.max_idle_s = max_idle_s
        self.done = False

    async def __aiter__(self) -> AsyncIterator[Any]:
        since = time.monotonic()
        async for line in self.lines:
            if not line.startswith("data:"):
                if self.max_idle_s is not None and time.monotonic() - since > self.max_idle_s:
                    raise SSEIdleTimeout(f"no event from the stream within {self.max_idle_s:g} s")
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                self.done = True
                return
            yield json.loads(data, parse_constant=refuse_constant)
            since = time.monotonic()
