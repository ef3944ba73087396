"""pd-bench's bound on a stalled stream: each wait for a stream's next ``data:`` event,
once its first came, lasts at most ``--idle-timeout`` seconds.

A server that stops sending mid-answer, or sends only SSE comments (``: keep-alive``),
held a request until its ``--timeout`` (each read's timeout was the same): a run with a
long ``--timeout`` (vLLM's bench allows 6 h) waited that long on every stalled stream.
The wait for the answer's first event is not bounded here: a loaded server may queue a
request a long time before its first token (``--timeout`` bounds it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

DEFAULT_IDLE_TIMEOUT_S = 120.0


class StreamIdle(Exception):
    """The stream sent no event within the idle bound (silence or only comments)."""


async def idle_bounded(lines: AsyncIterator[str], idle_s: float | None) -> AsyncIterator[str]:
    """``lines`` (a stream's text lines), failing with ``StreamIdle`` once ``idle_s``
    seconds pass without a ``data:`` line after the first one (``None`` or 0: no bound).
    The time the consumer holds a line is not counted."""
    it = aiter(lines)
    since: float | None = None  # when the wait for the next event began
    while True:
        try:
            if since is None or not idle_s:
                line = await anext(it)
            else:
                async with asyncio.timeout(max(0.0, idle_s - (time.monotonic() - since))):
                    line = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise StreamIdle(f"no event within {idle_s:g} s (--idle-timeout)") from None
        event = line.startswith("data:")
        yield line
        if event:
            since = time.monotonic()
        elif since is not None and idle_s and time.monotonic() - since > idle_s:
            raise StreamIdle(f"no event within {idle_s:g} s (--idle-timeout)")
