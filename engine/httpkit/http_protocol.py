"""Which HTTP/1.1 parser uvicorn runs, with the request head capped, and deadlines on a
head that never completes and on a client that stops reading.

uvicorn parses with ``httptools`` (C, llhttp) when it is installed and with ``h11`` (pure
Python) otherwise. ``httptools`` costs the proxy ~0.2 ms less CPU per request, but
uvicorn's ``httptools`` protocol has no limit on the request head: a client that sends one
endless header line makes the server buffer it all (measured: 187 MiB of one header
buffered, then a 400). ``h11`` refuses a head past ``h11_max_incomplete_event_size``.

So the head is capped at ``MAX_HEAD_BYTES`` on both: ``h11`` by its own setting, and
``httptools`` by ``GuardedHttpToolsProtocol``, which counts the bytes fed to the parser while
a request's head is incomplete and answers 431 (and closes) past the cap. A chunk in which
another request's head ended is not counted (it may hold that request's body), so the
parser holds at most the cap plus two reads (asyncio reads at most 256 KiB at a time).

uvicorn has no deadline on a request head either: a connection that sends nothing, or
half a head, is held for good (slowloris: enough of them exhaust the server's file
descriptors). ``GuardedHttpToolsProtocol`` gives each head ``HEAD_TIMEOUT_S`` from the
connection's start or the head's first byte, then answers 408 and closes (nginx's
``client_header_timeout``; idle keep-alive connections between requests are uvicorn's own
``timeout_keep_alive``). A body that stops arriving is ``read_body``'s (``body.py``).

Nor has uvicorn a deadline on writing: an answer to a client that stops reading (its
window shut, the connection open) waits in ``send`` for good -- a stream's request holds
its admission slot (and in the proxy its decode leg) as long as the client likes. Once
the transport's buffer is over its high-water mark, ``WRITE_STALL_TIMEOUT_S`` without it
draining closes the connection (nginx's ``send_timeout``): the app sees the client gone
and ends the request (a stream is aborted on the engine, as on any disconnect).

With ``h11`` (httptools missing) heads are capped but neither deadline holds: a warning
says so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# Request line plus headers. Real clients send well under 8 KiB; nginx's default for
# a whole head is 32 KiB (large_client_header_buffers 4 x 8k).
MAX_HEAD_BYTES = 64 * 1024
# From the connection's start (first request) or the head's first byte (later ones).
HEAD_TIMEOUT_S = 30.0
# How long an answer may sit unread past the send buffer's high-water mark.
WRITE_STALL_TIMEOUT_S = 60.0

_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: 33\r\n"
    b"connection: close\r\n\r\n"
    b"Request header fields too large.\n"
)
_408 = (
    b"HTTP/1.1 408 Request Timeout\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: 41\r\n"
    b"connection: close\r\n\r\n"
    b"The request head did not arrive in time.\n"
)


class _Deadline:
    """One timer of a connection: ``arm`` starts it unless running, ``cancel`` stops it;
    ``on_expiry`` runs when it fires."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_expiry: Callable[[], None]) -> None:
        self._loop, self._on_expiry = loop, on_expiry
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, delay_s: float) -> None:
        if self._timer is None:
            self._timer = self._loop.call_later(delay_s, self._fire)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self._on_expiry()


def _guarded_httptools_protocol() -> type[asyncio.Protocol] | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools is not installed
        return None

    class GuardedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc]
        """uvicorn's httptools protocol with the request head capped at ``max_head_bytes``
        and given ``HEAD_TIMEOUT_S`` to arrive, and answers cut off after
        ``WRITE_STALL_TIMEOUT_S`` unread."""

        max_head_bytes = MAX_HEAD_BYTES

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True  # the next byte fed starts (or continues) a request head
            self._head_bytes = 0
            self._heads_done = 0  # request heads completed on this connection
            self._refused = False
            self._head_deadline = _Deadline(self.loop, self._head_too_slow)
            self._write_deadline = _Deadline(self.loop, self._write_stalled)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_deadline.arm(HEAD_TIMEOUT_S)

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_deadline.cancel()
            self._write_deadline.cancel()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            self._write_deadline.arm(WRITE_STALL_TIMEOUT_S)

        def resume_writing(self) -> None:
            self._write_deadline.cancel()
            super().resume_writing()

        def _write_stalled(self) -> None:
            if not self.transport.is_closing():
                logger.info(
                    "closed %s: it read nothing of its answer for %gs", self.client,
                    WRITE_STALL_TIMEOUT_S,
                )  # fmt: skip
                self.transport.abort()

        def _head_too_slow(self) -> None:
            if self._in_head and not self._refused and not self.transport.is_closing():
                self._refused = True
                logger.info("closed %s: no request head within %gs", self.client, HEAD_TIMEOUT_S)
                self.transport.write(_408)
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_deadline.arm(HEAD_TIMEOUT_S)  # a later request's head: its first byte

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            was_in_head, heads_done = self._in_head, self._heads_done
            super().data_received(data)
            if self._in_head and was_in_head and self._heads_done == heads_done:
                # the whole chunk was head bytes of one request
                self._head_bytes += len(data)
                if self._head_bytes > self.max_head_bytes:
                    self._refused = True
                    logger.warning(
                        "refused a request head over %d bytes from %s", self.max_head_bytes,
                        self.client,
                    )  # fmt: skip
                    self.transport.write(_431)
                    self.transport.close()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._head_bytes = 0
            self._heads_done += 1
            self._head_deadline.cancel()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_head = True
            super().on_message_complete()

    return GuardedHttpToolsProtocol


def uvicorn_http_options() -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments: the parser, with the head capped (and, with
    httptools, the head and write deadlines)."""
    proto = _guarded_httptools_protocol()
    if proto is not None:
        return {"http": proto}
    logger.warning(
        "httptools is not installed: HTTP parsed by h11, request heads capped at %d bytes "
        "but no deadline on a slow head or a client that stops reading (pip install "
        "httptools)", MAX_HEAD_BYTES,
    )  # fmt: skip
    return {"http": "h11", "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
