"""The proxy's HTTP/1.1 client to its nodes: pooled keep-alive connections on asyncio streams.

Why not httpx: a proxied request makes two or three node calls, and httpx spent ~0.8 ms
of the proxy's CPU on each (measured: 1,000 sequential POSTs to a uvicorn app on
loopback, httpx 0.74-0.82 ms CPU per call, this client 0.08-0.14 ms; py-spy put 42% of
the proxy's per-request CPU in httpx's send path). The proxy talks to nodes only: JSON
bodies out, JSON or SSE back, no redirects, cookies, proxies or compression, so the
client is small.

The contract, close to httpx's where the proxy used it:

- ``post(url, json=...)`` returns a ``NodeResponse`` with the whole body read;
  ``send_stream(...)`` returns it once the status line and headers arrived, and the body
  is read with ``aiter_lines()`` / ``aread()``; ``aclose()`` (or the sync ``close()``)
  ends it. A response read to its end hands its connection back for reuse; one closed
  early closes its connection (its unread bytes would corrupt the next answer).
- Every failure to talk to a node is a ``NodeHTTPError``: ``NodeConnectError`` (could not
  connect), ``NodeTimeout`` (connect, a write or one read took longer than its timeout),
  ``NodeProtocolError`` (the node closed mid-answer or sent a malformed or oversized one).
  A reused keep-alive connection that turns out to be closed before any byte of the
  answer came is retried once on a fresh connection (the node never saw the request).
- At most ``max_connections`` calls are in flight at once (a further call waits, up to
  its timeout, for a slot); at most ``max_connections`` idle connections are kept per node.
- Timeouts: ``connect_timeout`` to open a connection; ``timeout`` (per call, default the
  client's) for each write and each read, so a stream may last longer as long as the
  node keeps sending; a body read whole (``aread()``, ``post()``) must also come, all of
  it, within ``timeout`` of its headers (a node trickling it byte by byte is a timeout).
- Limits on what a node may send: a status line plus headers of at most 64 KiB, a body of
  at most ``max_body_bytes`` when read whole, and lines of at most ``max_body_bytes``
  when read by lines (streams are read piece by piece). A final status is 101 nowhere (the
  proxy asks no upgrade) and always within 200-599.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
READ_PIECE = 64 * 1024
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
_Key = tuple[str, str, int]  # scheme, host, port


class NodeHTTPError(Exception):
    """Talking to a node failed (the proxy's counterpart of ``httpx.HTTPError``)."""


class NodeConnectError(NodeHTTPError):
    pass


class NodeTimeout(NodeHTTPError):
    pass


class NodeProtocolError(NodeHTTPError):
    pass


class NodeStatusError(NodeHTTPError):
    """``raise_for_status()`` on an answer that is not 2xx."""


@lru_cache(maxsize=4096)
def _split(url: str) -> tuple[_Key, str]:
    """(scheme, host, port) and the path with its query, of an ``http(s)://`` URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r:.100}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.scheme, parts.hostname, port), target


def _check_header(name: str, value: str) -> None:
    if any(c in name or c in value for c in "\r\n\0") or not name or ":" in name:
        raise ValueError(f"header {name!r:.60} cannot be sent")


class _Conn:
    def __init__(self, key: _Key, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.key, self.reader, self.writer = key, reader, writer
        self.reused = False

    def usable(self) -> bool:
        """Idle and still open: the node has not closed it, nor sent anything unasked."""
        return not self.writer.is_closing() and not self.reader.at_eof() and not self.reader._buffer  # noqa: SLF001

    def close(self) -> None:
        self.writer.close()


class NodeResponse:
    """One node answer. ``status_code``; ``headers`` (lower-case names); the body through
    ``aread()``/``content``/``json()`` or ``aiter_lines()``/``aiter_bytes()``."""

    def __init__(
        self,
        client: NodeClient,
        conn: _Conn,
        status: int,
        headers: dict[str, str],
        timeout: float,
        keep_alive: bool,
    ) -> None:
        self.status_code = status
        self.headers = headers
        self._client, self._conn, self._timeout = client, conn, timeout
        self._keep_alive = keep_alive
        self._content: bytes | None = None
        self._done = False  # the body was read to its end
        self._released = False
        self._body: AsyncIterator[bytes] | None = None  # the one generator reading the wire
        te = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in te
        self._length: int | None = None
        if not self._chunked and "content-length" in headers:
            text = headers["content-length"].strip()
            # str.isdigit alone takes "²" and other non-ASCII digits, which int() refuses.
            if not (text.isascii() and text.isdigit() and len(text) <= 18):
                raise NodeProtocolError(f"bad Content-Length {text!r:.40}")
            self._length = int(text)
        elif not self._chunked:
            self._keep_alive = False  # the body runs to the end of the connection
        if status in (204, 304) or 100 <= status < 200:
            self._length = 0

    @property
    def timeout(self) -> float:
        """Each read's timeout, in seconds."""
        return self._timeout

    # -- reading -----------------------------------------------------------------------
    async def _read(self, coro: Any) -> Any:
        try:
            async with asyncio.timeout(self._timeout):
                out = await coro
        except TimeoutError as e:
            raise NodeTimeout(f"no data from the node within {self._timeout:g} s") from e
        except asyncio.IncompleteReadError as e:
            raise NodeProtocolError("the node closed the connection mid-answer") from e
        except asyncio.LimitOverrunError as e:
            raise NodeProtocolError("a chunk header line is too long") from e
        except (ConnectionError, OSError) as e:
            raise NodeProtocolError(f"reading the answer: {type(e).__name__}: {e}") from e
        self._client.heard[self._conn.key] = time.monotonic()
        return out

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body in pieces as they come (de-chunked)."""
        if self._done:
            if self._content:
                yield self._content
            return
        if self._body is None:
            self._body = self._read_body()
        async for piece in self._body:  # one reader of the wire, wherever a caller stopped
            yield piece

    async def drain(self, limit: int = READ_PIECE) -> None:
        """Read what is left of the body (an SSE stream's last chunk after ``[DONE]``), at
        most ``limit`` bytes, so that the connection can serve the next call; then end the
        answer. A longer rest, or a failure, closes the connection instead."""
        got = 0
        try:
            async for piece in self.aiter_bytes():
                got += len(piece)
                if got > limit:
                    break
        except NodeHTTPError:
            pass
        self.close()

    async def _read_body(self) -> AsyncIterator[bytes]:
        reader = self._conn.reader
        try:
            if self._chunked:
                while True:
                    size, whole = await self._read(self._next_chunk(reader))
                    if size == 0:
                        break
                    if whole is not None:  # the common case: one SSE event, one chunk
                        yield whole
                        continue
                    while size > 0:
                        piece = await self._read(reader.readexactly(min(size, READ_PIECE)))
                        size -= len(piece)
                        yield piece
                    if await self._read(reader.readexactly(2)) != b"\r\n":
                        raise NodeProtocolError("a chunk does not end with CRLF")
            elif self._length is not None:
                left = self._length
                while left > 0:
                    piece = await self._read(reader.read(min(left, READ_PIECE)))
                    if not piece:
                        raise NodeProtocolError("the node closed the connection mid-answer")
                    left -= len(piece)
                    yield piece
            else:
                while piece := await self._read(reader.read(READ_PIECE)):
                    yield piece
            self._done = True
        finally:
            self._release()

    @staticmethod
    async def _next_chunk(reader: asyncio.StreamReader) -> tuple[int, bytes | None]:
        """The next chunk's size, and the chunk itself with its closing CRLF when it is at
        most ``READ_PIECE`` bytes: read under one deadline (one timer per relayed event,
        not three). Size 0: the last chunk, its trailers read and ignored."""
        line = await reader.readuntil(b"\r\n")
        size_text = line[:-2].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise NodeProtocolError(f"bad chunk size {size_text[:20]!r}") from None
        if size < 0:
            raise NodeProtocolError("bad chunk size")
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailers: ignored
            return 0, None
        if size > READ_PIECE:
            return size, None
        whole = await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise NodeProtocolError("a chunk does not end with CRLF")
        return size, whole

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's lines (UTF-8, without their ``\\n`` or ``\\r\\n``). A line longer
        than the client's ``max_body_bytes`` is a ``NodeProtocolError`` (a node sending
        without newlines must not grow the proxy's memory without end)."""
        pending = bytearray()
        limit = self._client.max_body_bytes
        if self._body is None and not self._done:
            self._body = self._read_body()
        pieces = self._body if self._body is not None else self.aiter_bytes()
        async for piece in pieces:  # straight from the wire's reader: one generator less
            if b"\n" not in piece:
                pending += piece  # amortised: no copy of what is pending per piece
                if len(pending) > limit:
                    self.close()
                    raise NodeProtocolError(f"a line of the answer exceeds {limit} bytes")
                continue
            first, *lines, rest = piece.split(b"\n")
            pending += first
            yield bytes(pending).removesuffix(b"\r").decode("utf-8", "replace")
            for line in lines:
                yield line.removesuffix(b"\r").decode("utf-8", "replace")
            pending = bytearray(rest)
        if pending:
            yield bytes(pending).removesuffix(b"\r").decode("utf-8", "replace")

    async def aread(self) -> bytes:
        """The whole body: at most ``max_body_bytes``, all of it within the call's timeout
        (a node trickling a byte inside each read's timeout cannot hold the call longer)."""
        if self._content is None:
            limit, parts, size = self._client.max_body_bytes, [], 0
            if self._length is not None and self._length > limit:
                self.close()
                raise NodeProtocolError(f"the answer is larger than {limit} bytes")
            try:
                async with asyncio.timeout(self._timeout):
                    async for piece in self.aiter_bytes():
                        size += len(piece)
                        if size > limit:
                            self.close()
                            raise NodeProtocolError(f"the answer is larger than {limit} bytes")
                        parts.append(piece)
            except TimeoutError as e:
                self.close()
                raise NodeTimeout(
                    f"the answer's body did not all come within {self._timeout:g} s"
                ) from e
            self._content = b"".join(parts)
        return self._content

    @property
    def content(self) -> bytes:
        if self._content is None:
            raise RuntimeError("the body has not been read: await aread() first")
        return self._content

    def json(self) -> Any:
        return jsonlib.loads(self.content)

    def raise_for_status(self) -> None:
        if not 200 <= self.status_code < 300:
            raise NodeStatusError(f"the node answered HTTP {self.status_code}")

    # -- ending ------------------------------------------------------------------------
    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self._client._give_back(self._conn, reuse=self._done and self._keep_alive)  # noqa: SLF001

    def close(self) -> None:
        """End the answer now; a body not read to its end closes the connection."""
        self._release()

    async def aclose(self) -> None:
        self._release()


class NodeClient:
    """Pooled HTTP/1.1 connections to the nodes (see the module docstring)."""

    def __init__(
        self,
        *,
        timeout: float,
        connect_timeout: float | None = None,
        max_connections: int = 100,
        headers: Mapping[str, str] | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.timeout = timeout
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout
        self.max_connections = max_connections
        self.max_body_bytes = max_body_bytes
        self.headers = dict(headers or {})
        for name, value in self.headers.items():
            _check_header(name, value)
        self._slots = asyncio.Semaphore(max_connections)
        self.in_flight = 0  # calls holding a slot: sent, or answered but not yet ended
        self._idle: dict[_Key, list[_Conn]] = {}
        self._closed = False
        self._ssl: ssl.SSLContext | None = None
        # When bytes of an answer last came from each node (``heard_since``).
        self.heard: dict[_Key, float] = {}

    async def __aenter__(self) -> NodeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def forget(self, url: str) -> None:
        """Close the idle connections to ``url``'s host and port: the node left the pool
        (they were kept until the same address was called again, i.e. forever)."""
        try:
            key, _ = _split(url)
        except ValueError:
            return
        for conn in self._idle.pop(key, []):
            conn.close()
        self.heard.pop(key, None)

    def heard_since(self, url: str, since: float) -> bool:
        """Bytes of some answer came from ``url``'s node at ``since`` (monotonic) or later."""
        try:
            key, _ = _split(url)
        except ValueError:
            return False
        return self.heard.get(key, float("-inf")) >= since

    # -- the calls ---------------------------------------------------------------------
    async def get(self, url: str, *, timeout: float | None = None) -> NodeResponse:
        return await self.request("GET", url, timeout=timeout)

    async def post(self, url: str, **kw: Any) -> NodeResponse:
        """``send_stream("POST", url, **kw)`` with the whole answer read."""
        return await self.request("POST", url, **kw)

    async def request(self, method: str, url: str, **kw: Any) -> NodeResponse:
        resp = await self.send_stream(method, url, **kw)
        try:
            await resp.aread()
        finally:
            resp.close()
        return resp

    async def send_stream(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> NodeResponse:
        """Send one request; return once the answer's status line and headers came."""
        if self._closed:
            raise NodeConnectError("the client is closed")
        timeout = self.timeout if timeout is None else timeout
        key, target = _split(url)
        body = b""
        fields = dict(self.headers)
        if json is not None:
            body = jsonlib.dumps(json, separators=(",", ":")).encode()
            fields["Content-Type"] = "application/json"
        elif content is not None:
            body = content
        if headers:
            fields.update(headers)
        host = key[1] if ":" not in key[1] else f"[{key[1]}]"
        lines = [f"{method} {target} HTTP/1.1", f"Host: {host}:{key[2]}"]
        for name, value in fields.items():
            _check_header(name, value)
            lines.append(f"{name}: {value}")
        if method != "GET" or body:
            lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        try:
            async with asyncio.timeout(timeout):
                await self._slots.acquire()
        except TimeoutError as e:
            raise NodeTimeout(f"no free connection within {timeout:g} s") from e
        self.in_flight += 1
        try:
            for attempt in (0, 1):
                conn = await self._connect(key)
                try:
                    return await self._exchange(conn, head + body, timeout)
                except _StaleConnection:
                    conn.close()
                    for stale in self._idle.pop(key, []):  # the node likely restarted
                        stale.close()
                    if attempt:
                        raise NodeProtocolError("the node closed the connection") from None
                except BaseException:
                    conn.close()
                    raise
            raise AssertionError("unreachable")
        except BaseException:
            self._free_slot()
            raise

    # -- internals ---------------------------------------------------------------------
    async def _connect(self, key: _Key) -> _Conn:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.usable():
                conn.reused = True
                return conn
            conn.close()
        scheme, host, port = key
        if scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=self._ssl if scheme == "https" else None, limit=MAX_HEAD_BYTES
                )
        except TimeoutError as e:
            raise NodeTimeout(
                f"connecting to {host}:{port} took over {self.connect_timeout:g} s"
            ) from e
        except (OSError, ssl.SSLError) as e:
            raise NodeConnectError(f"cannot connect to {host}:{port}: {e}") from e
        return _Conn(key, reader, writer)

    async def _exchange(self, conn: _Conn, data: bytes, timeout: float) -> NodeResponse:
        reader, writer = conn.reader, conn.writer
        try:
            async with asyncio.timeout(timeout):
                writer.write(data)
                await writer.drain()
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    status, headers = _parse_head(head)
                    if status == 101:  # the proxy never asks to switch protocols
                        raise NodeProtocolError("the node answered 101 Switching Protocols")
                    if status >= 200:
                        break  # 1xx (100 Continue, 103 Early Hints): informational, skipped
        except TimeoutError as e:
            raise NodeTimeout(f"no answer from the node within {timeout:g} s") from e
        except asyncio.LimitOverrunError as e:
            raise NodeProtocolError(f"the answer's headers exceed {MAX_HEAD_BYTES} bytes") from e
        except asyncio.IncompleteReadError as e:
            if conn.reused and not e.partial:
                raise _StaleConnection from e
            raise NodeProtocolError("the node closed the connection before answering") from e
        except (ConnectionError, OSError) as e:
            if conn.reused:
                raise _StaleConnection from e
            raise NodeProtocolError(f"sending the request: {type(e).__name__}: {e}") from e
        self.heard[conn.key] = time.monotonic()
        keep_alive = "close" not in headers.get("connection", "").lower()
        return NodeResponse(self, conn, status, headers, timeout, keep_alive)

    def _free_slot(self) -> None:
        self.in_flight -= 1
        self._slots.release()

    def _give_back(self, conn: _Conn, reuse: bool) -> None:
        self._free_slot()
        if reuse and not self._closed and conn.usable():
            idle = self._idle.setdefault(conn.key, [])
            if len(idle) < self.max_connections:
                idle.append(conn)
                return
        conn.close()


class _StaleConnection(Exception):
    """A reused keep-alive connection was closed by the node before it answered."""


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """Status and headers (lower-case names; repeats joined with ", ") of an answer's head."""
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise NodeProtocolError(f"bad status line {lines[0][:80]!r}")
    status = int(parts[1])
    if not 100 <= status <= 599:
        raise NodeProtocolError(f"bad status {status}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise NodeProtocolError(f"bad header line {line[:80]!r}")
        key = name.decode("latin-1").lower()
        text = value.strip().decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return status, headers


__all__ = [
    "NodeClient",
    "NodeConnectError",
    "NodeHTTPError",
    "NodeProtocolError",
    "NodeResponse",
    "NodeStatusError",
    "NodeTimeout",
]
