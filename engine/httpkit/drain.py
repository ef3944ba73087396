"""Draining on SIGTERM: stop taking work, let what runs finish, end what is left cleanly.

``Drainer.start()`` turns the server to draining: ``/health`` answers 503 ``draining``,
new requests on the work paths get 503 with ``Retry-After`` (a proxy routes elsewhere);
requests in flight run on. When they have all finished, or ``shutdown_timeout`` seconds
have passed, each one still open is cancelled: a started event stream ends with an error
event and ``data: [DONE]``, a response not yet started becomes a 503; then ``on_drained``
runs (the server stops). Pure ASGI middleware, shared by the node and the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.httpkit.listen import DEFAULT_SHUTDOWN_TIMEOUT_S
from engine.httpkit.sse import SSE_DONE, sse_event
from engine.server.request_fields import error_body

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"


@dataclass(eq=False)  # identity: one entry per request
class _Active:
    task: asyncio.Task
    started: bool = False
    sse: bool = False
    ended: bool = False
    cut: bool = False  # cancelled by the drain deadline
    replaced: bool = False  # its answer was replaced by the 503 draining


class Drainer:
    def __init__(
        self,
        work_paths: frozenset[str],
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    ) -> None:
        self.work_paths = work_paths
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self._active: set[_Active] = set()
        self._idle = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def start(self, on_drained: Callable[[], None]) -> None:
        """Begin draining (idempotent); call from the event loop's thread."""
        if self.draining:
            return
        self.draining = True
        logger.info(
            "draining: %d request(s) in flight, up to %.0fs", self.in_flight, self.shutdown_timeout
        )
        self._task = asyncio.get_running_loop().create_task(self._drain(on_drained))

    async def _drain(self, on_drained: Callable[[], None]) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self._active and time.monotonic() < deadline:
            self._idle.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), deadline - time.monotonic())
        if self._active:
            logger.warning("shutdown timeout: ending %d open request(s)", len(self._active))
            for entry in list(self._active):
                entry.cut = True
                entry.task.cancel()
            for _ in range(200):  # let the cancelled requests write their last bytes
                if not self._active:
                    break
                await asyncio.sleep(0.01)
        logger.info("drained")
        on_drained()

    # -- per request --------------------------------------------------------------------------
    def _enter(self) -> _Active:
        task = asyncio.current_task()
        assert task is not None
        entry = _Active(task)
        self._active.add(entry)
        return entry

    def _leave(self, entry: _Active) -> None:
        self._active.discard(entry)
        if not self._active:
            self._idle.set()


class DrainMiddleware:
    def __init__(self, app: ASGIApp, drainer: Drainer) -> None:
        self.app = app
        self.drainer = drainer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        d = self.drainer
        if scope["type"] != "http" or scope["path"] not in d.work_paths:
            await self.app(scope, receive, send)
            return
        if d.draining:
            await _send_json(send, 503, _draining_body(), retry=True)
            return
        entry = d._enter()

        async def tracked_send(message: Message) -> None:
            if entry.cut and (entry.replaced or not entry.started):
                # The deadline cut this request before its answer started. Whatever the
                # app answers now (a 499: it saw its task cancelled as a disconnect), the
                # client gets 503 draining, which a proxy retries on another node.
                if not entry.replaced and message["type"] == "http.response.start":
                    entry.replaced = entry.started = entry.ended = True
                    await _send_json(send, 503, _draining_body(), retry=True)
                return
            if message["type"] == "http.response.start":
                entry.started = True
                for name, value in message.get("headers", []):
                    if name.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                        entry.sse = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                entry.ended = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except asyncio.CancelledError:
            if not entry.cut:
                raise
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # Python 3.11+
                task.uncancel()
            with contextlib.suppress(Exception):
                await _close_cut(send, entry)
        finally:
            d._leave(entry)


def _draining_body() -> dict:
    return error_body(
        "the server is shutting down (draining); retry on another server",
        "server_error",
        code="draining",
    )


async def _send_json(send: Send, status: int, body: dict, retry: bool = False) -> None:
    headers = [(b"content-type", b"application/json")]
    if retry:
        headers.append((b"retry-after", RETRY_AFTER_S.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


async def _close_cut(send: Send, entry: _Active) -> None:
    """End a request the drain deadline cut: an error event and [DONE] on a started event
    stream, a 503 on a response not started; a started plain response is left as it is."""
    if entry.ended:
        return
    if not entry.started:
        await _send_json(send, 503, _draining_body(), retry=True)
    elif entry.sse:
        body = error_body(
            "the server shut down before this answer was complete", "server_error", code="draining"
        )
        final = (sse_event(body) + SSE_DONE).encode()
        await send({"type": "http.response.body", "body": final, "more_body": False})
