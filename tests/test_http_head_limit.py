"""The request head is capped whichever parser uvicorn runs (httptools or h11).

A real uvicorn server (``make_server``, as the nodes and the proxy start theirs) on a
loopback socket, in a thread, and raw-socket clients: a head past the cap is refused and
the connection closed, heads under the cap and large bodies (also pipelined) are not.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from engine.httpkit import http_protocol
from engine.httpkit.http_protocol import MAX_HEAD_BYTES
from engine.httpkit.serve import bind_socket, make_server


async def echo_length(scope, receive, send) -> None:  # noqa: ANN001 - a bare ASGI app
    if scope["type"] != "http":
        return
    n, more = 0, True
    while more:
        msg = await receive()
        n += len(msg.get("body", b""))
        more = msg.get("more_body", False)
    body = str(n).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


PARSERS = ["httptools", "h11"]


@pytest.fixture(params=PARSERS)
def server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    if request.param == "h11":
        monkeypatch.setattr(http_protocol, "_capped_httptools_protocol", lambda: None)
    elif http_protocol._capped_httptools_protocol() is None:
        pytest.skip("httptools is not installed")
    sock = bind_socket("127.0.0.1", 0)
    srv = make_server(echo_length, log_level="WARNING", banner="", lifespan="off", own_signals=True)
    assert srv.config.http == "h11" or request.param == "httptools"
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    port = sock.getsockname()[1]
    for _ in range(200):
        if srv.started:
            break
        threading.Event().wait(0.02)
    yield port
    srv.should_exit = True
    thread.join(10)
    sock.close()


def read_answer(s: socket.socket) -> bytes:
    """One answer: read to its content-length, or until the server closes."""
    s.settimeout(10)  # a server that waits for more head bytes times out here
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:  # closed with our unread bytes in its buffer
            return out
        if not chunk:
            return out
        out += chunk
        head, sep, body = out.partition(b"\r\n\r\n")
        lengths = [h for h in head.lower().split(b"\r\n") if h.startswith(b"content-length:")]
        if sep and lengths and len(body) >= int(lengths[0].split(b":")[1]):
            return out


def test_a_head_past_the_cap_is_refused_and_the_connection_closed(server: int) -> None:
    # One endless header line, never terminated: without a cap the server waits for more.
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 128 * 1024))
        answer = read_answer(s)
    status = answer.split(b"\r\n", 1)[0]
    assert status.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")), answer[:200]
    assert b"connection: close" in answer.lower()


def test_a_head_under_the_cap_is_served(server: int) -> None:
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(MAX_HEAD_BYTES // 1100))
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        answer = read_answer(s)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_large_bodies_sent_with_their_heads_and_pipelined_are_not_counted_as_head(
    server: int,
) -> None:
    big = 4 * MAX_HEAD_BYTES
    first = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % big + b"b" * big
    second = b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(first + second)  # one write: the parser sees body and next head together
        answers = b""
        s.settimeout(10)
        while answers.count(b"HTTP/1.1 200") < 2:
            chunk = s.recv(65536)
            assert chunk, answers
            answers += chunk
    assert answers.count(b"HTTP/1.1 200") == 2
    assert answers.endswith(b"\r\n\r\n3") and b"\r\n\r\n%d" % big in answers
