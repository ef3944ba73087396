"""Waiting for a leg while watching for a reason to stop waiting.

The proxy's waits on a node (P's answer, D's answer, a read of D's stream) are this one
loop: the awaited future, the other legs whose end matters, and a check asked every
``poll_s`` seconds (a hung node never answers: its health checks tell). The wait for a
stream's first token (``Session._first_token``), which D's first token may also end,
keeps its own loop on the same pattern.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

Check = Callable[[], BaseException | None]


def never() -> None:
    return None


async def wait_watched(
    target: asyncio.Future[Any],
    check: Check,
    poll_s: float | None,
    others: Iterable[asyncio.Future[Any] | None] = (),
) -> None:
    """Return once ``target`` is done. Whenever ``poll_s`` seconds pass or one of
    ``others`` finishes while ``target`` is not done, ``check()`` is asked: an error it
    returns is raised instead of waiting on. ``others`` already done are not waited on
    (they would end every wait at once). ``target`` is never cancelled here (the caller
    owns it)."""
    others = tuple(f for f in others if f is not None)
    while not target.done():
        waits = {target}
        waits.update(f for f in others if not f.done())
        await asyncio.wait(waits, timeout=poll_s, return_when=asyncio.FIRST_COMPLETED)
        if not target.done() and (err := check()) is not None:
            raise err
