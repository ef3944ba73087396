"""Reading an event stream of JSON ``data:`` events (the proxy's legs, pd-bench): no web
framework needed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any


def refuse_constant(name: str) -> Any:
    """``json.loads``' hook for ``NaN``/``Infinity``/``-Infinity``: not JSON (RFC 8259),
    never sent by a node, and a re-encoder with ``allow_nan=False`` fails on them later."""
    raise ValueError(f"{name} is not a JSON value")


class SSEReader:
    """``async for obj in SSEReader(resp.aiter_lines())`` yields each event's JSON; the loop
    ends at ``data: [DONE]`` (then ``done`` is True) or when the stream ends without it."""

    def __init__(self, lines: AsyncIterator[str]) -> None:
        self.lines = lines
        self.done = False

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for line in self.lines:
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                self.done = True
                return
            yield json.loads(data, parse_constant=refuse_constant)
