"""A stand-in node: a real HTTP/1.1 server on a loopback port whose answers a test scripts.

For unit tests of the proxy's node client and sessions that need a node to answer in a
particular way (a malformed answer, a refusal after a delay, a closed keep-alive
connection) without starting an engine. The handler gets the request and returns the raw
bytes to send back (see ``Reply``); the server keeps the connection open for the next
request unless told to close.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SeenRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


# The raw answer; ``(raw, True)`` to close the connection after it; ``None`` to close
# without answering; an async iterator of bytes: pieces written as they come.
Reply = bytes | tuple[bytes, bool] | AsyncIterator[bytes] | None
Handler = Callable[[SeenRequest], Awaitable[Reply]]


def answer(
    status: int,
    body: Any = None,
    headers: dict[str, str] | None = None,
    *,
    raw: bytes | None = None,
) -> bytes:
    """An HTTP/1.1 answer with a Content-Length: JSON ``body`` or ``raw`` bytes."""
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    lines = [f"HTTP/1.1 {status} X", f"Content-Length: {len(data)}"]
    if body is not None:
        lines.append("Content-Type: application/json")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def chunked(status: int, pieces: list[bytes], headers: dict[str, str] | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} X", "Transfer-Encoding: chunked"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    out = ("\r\n".join(lines) + "\r\n\r\n").encode()
    for piece in pieces:
        out += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    return out + b"0\r\n\r\n"


def node_facts(req: SeenRequest, kv_role: str) -> bytes | None:
    """What a healthy pdserve node of ``kv_role`` ("producer", "consumer") answers outside
    its completions -- ``/health``, ``/v1/models`` (model ``tiny``), ``/v1/kv_transfer_info``,
    ``/v1/abort`` --; ``None`` for any other path (the test's own answer)."""
    if req.path == "/health":
        return answer(200, {"status": "ok"})
    if req.path == "/v1/models":
        return answer(200, {"data": [{"id": "tiny", "max_model_len": 4096}]})
    if req.path == "/v1/kv_transfer_info":
        return answer(200, {"role": kv_role, "side_channel": "tcp://127.0.0.1:1"})
    if req.path == "/v1/abort":
        return answer(200, {})
    return None


@dataclass
class StandIn:
    handler: Handler
    seen: list[SeenRequest] = field(default_factory=list)
    connections: int = 0
    server: asyncio.Server | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> StandIn:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head[:-4].decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                req = SeenRequest(method, path, headers, body)
                self.seen.append(req)
                out = await self.handler(req)
                if out is None:
                    return
                if hasattr(out, "__aiter__"):  # pieces written as they come (a paced stream)
                    async for piece in out:
                        writer.write(piece)
                        await writer.drain()
                    continue
                close = False
                if isinstance(out, tuple):
                    out, close = out
                writer.write(out)
                await writer.drain()
                if close or b"\r\nconnection: close" in out.split(b"\r\n\r\n", 1)[0].lower():
                    return
        finally:
            writer.close()
