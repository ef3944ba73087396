"""A decode node's event stream, readable ahead of its consumer.

While the proxy waits for P's first token, it may look at D's stream for the first event
that carries a token (``until_token``): when D's token comes first (P hung, or P's answer
is slow to arrive while D recomputed the prompt or got the KV), D's stream is the
client's whole answer. Events read ahead are kept and come first when the stream is then
iterated; a read still in flight when the look-ahead is abandoned is kept too (never
cancelled mid-line), so no event is lost or read twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.httpkit.sse_reader import SSEIdleTimeout, SSEReader
from proxy.answers import MalformedAnswer, check_answer
from proxy.node_client import NodeResponse, NodeTimeout
from proxy.waiting import never, wait_watched

_END = object()  # the stream ended (with or without [DONE]: see ``done``)


def carries_token(obj: Any) -> bool:
    """An event D would not send before its first token: one with tokens (or their text,
    should a node leave ``token_ids`` out: the look-ahead must not hold the answer), an
    error, or a finish. A chat stream's role chunk is none."""
    if not isinstance(obj, dict):
        return True
    if "error" in obj:
        return True
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("token_ids") or choice.get("finish_reason") or choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(
            delta.get(k) for k in ("content", "reasoning_content", "tool_calls")
        ):
            return True
    return False


class DecodeEvents:
    """``async for obj in DecodeEvents(resp)``: D's JSON events, look-ahead first."""

    def __init__(
        self,
        resp: NodeResponse,
        watch: Callable[[], Exception | None] | None = None,
        poll_s: float | None = None,
    ) -> None:
        """``watch``, called every ``poll_s`` seconds while a read waits, returns the error
        to raise instead of waiting on (D hung), or None."""
        self.resp = resp
        self.watch, self.poll_s = watch, poll_s
        # Comments (``: keep-alive``) reset each read's timeout: a stream of nothing else
        # is given up once it went as long without an event (a read timeout, as if silent).
        self._reader = SSEReader(resp.aiter_lines(), max_idle_s=resp.timeout)
        self._it = self._reader.__aiter__()
        self._ahead: deque[Any] = deque()
        self._pending: asyncio.Future[Any] | None = None  # a read in flight

    @property
    def done(self) -> bool:
        """The stream ended with ``data: [DONE]``."""
        return self._reader.done

    async def _read(self) -> Any:
        if self._pending is None:
            self._pending = asyncio.ensure_future(_next(self._it))
            self._pending.add_done_callback(_consume)  # retrieved even if nobody awaits it
        pending = self._pending
        # asyncio.wait never cancels what it waits on: a caller cancelled here (or given
        # up by ``watch``) leaves the read running for the next caller.
        await wait_watched(pending, self.watch or never, self.poll_s)
        self._pending = None
        try:
            obj = pending.result()
        except (ValueError, RecursionError) as e:  # the event's JSON (SSEReader)
            raise MalformedAnswer(f"an event is not JSON: {str(e)[:120]}") from None
        except SSEIdleTimeout as e:
            self.resp.close()  # its connection is in mid-answer: never reused
            raise NodeTimeout(str(e)) from e
        return obj if obj is _END else check_answer(obj)

    async def until_token(self) -> None:
        """Read ahead until an event carries a token (or the stream ended or broke: the
        error is raised when iterating)."""
        if any(obj is _END or carries_token(obj) for obj in self._ahead):
            return
        while True:
            try:
                obj = await self._read()
            except Exception as e:  # noqa: BLE001 - kept for the consumer
                self._ahead.append(_Broken(e))
                return
            self._ahead.append(obj)
            if obj is _END or carries_token(obj):
                return

    def ahead_has_token(self) -> bool:
        """An event read ahead carries a token or a finish (not only an error, an end or
        a broken read): the stream is an answer, not a failure before its first token."""
        return any(
            obj is not _END
            and not isinstance(obj, _Broken)
            and carries_token(obj)
            and "error" not in obj
            for obj in self._ahead
        )

    def ahead_error_event(self) -> dict[str, Any] | None:
        """D's error event, when it ended the look-ahead before any token; else None."""
        if self.ahead_has_token():
            return None
        for obj in self._ahead:
            if isinstance(obj, dict) and "error" in obj:
                return obj
        return None

    def ahead_error(self) -> str:
        """What ended the look-ahead without a token: a broken read's error, D's error
        event, or the stream's end."""
        for obj in self._ahead:
            if isinstance(obj, _Broken):
                return str(obj.error)
            if isinstance(obj, dict) and "error" in obj:
                return f"error event {str(obj['error'])[:200]}"
        return "the stream ended"

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            obj = self._ahead.popleft() if self._ahead else await self._read()
            if obj is _END:
                return
            if isinstance(obj, _Broken):
                raise obj.error
            yield obj

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        self.resp.close()


class _Broken:
    def __init__(self, error: Exception) -> None:
        self.error = error


async def _next(it: AsyncIterator[Any]) -> Any:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return _END


def _consume(fut: asyncio.Future[Any]) -> None:
    with contextlib.suppress(asyncio.CancelledError, Exception):
        fut.result()
