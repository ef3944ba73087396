"""``AsyncLLMEngine``'s loop answers the callers that wait on it (``abort``, ``abort_matching``)
whatever happens to them or to it: a waiter that gave up does not end the loop, and a
loop that stopped answers what is left in its inbox. The loop's own code runs, over a
core that holds no request (no model: these are about the hand-offs)."""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

from engine.async_engine import AsyncLLMEngine


class _NoRequests:
    """A core with no requests; an abort finds nothing."""

    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(requests={})
        self.executor = SimpleNamespace(is_dead=False)
        self.aborted: list[str] = []

    def abort_request(self, request_id: str, *args: Any, **kw: Any) -> None:
        self.aborted.append(request_id)

    def has_work(self) -> bool:
        return False

    def stats(self) -> dict[str, float]:
        return {}


def _loop() -> AsyncLLMEngine:
    loop = AsyncLLMEngine.__new__(AsyncLLMEngine)
    loop.core = _NoRequests()  # type: ignore[assignment]
    loop.dead_reason = None
    loop._inbox = queue.Queue()
    loop._stop = threading.Event()
    loop._wake = threading.Event()
    loop._streams, loop._streams_lock = {}, threading.Lock()
    loop._unread_ends = {}
    return loop


def test_an_answer_its_waiter_gave_up_on_does_not_end_the_loop() -> None:
    """``abort_matching`` whose caller timed out (its future cancelled) before the loop
    got to it: the loop still aborts, and goes on (setting the cancelled future's result
    raised in the engine thread, which makes the engine dead)."""
    loop = _loop()
    gave_up: Future[list[str]] = Future()
    gave_up.cancel()
    loop._post(("abort_matching", ("r1", "request_id", gave_up)))
    later: Future[list[str]] = Future()
    loop._post(("abort_matching", ("r2", "request_id", later)))
    loop._drain_inbox(block=False)
    assert later.result(0) == []
    assert loop.dead_reason is None


def test_a_stopped_loop_answers_the_aborts_left_in_its_inbox() -> None:
    """An abort posted as the loop stops is answered (nothing found), not left to its
    waiter's timeout; one asked of a stopped loop is answered at once."""
    loop = _loop()
    waiting: Future[str | None] = Future()
    loop._post(("abort", ("r1", "abort", waiting)))
    loop._stop.set()
    loop._run()  # stopped: the loop ends at once
    assert waiting.done() and waiting.result(0) is None
    assert asyncio.run(asyncio.wait_for(loop.abort("r2"), 5)) is None
