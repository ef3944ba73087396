"""The request head is capped whichever parser uvicorn runs (httptools or h11); a head
or a body that stops arriving has a deadline (slowloris), and so has an answer its client
stopped reading.

A real uvicorn server (``make_server``, as the nodes and the proxy start theirs) on a
loopback socket, in a thread, and raw-socket clients: a head past the cap is refused and
the connection closed, heads under the cap and large bodies (also pipelined) are not; a
silent connection, a half head or a half body is answered 408 after its deadline, a slow
and a body trickling in is served; an endless answer to a client that reads nothing is cut
off and the app's send returns.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest
from starlette.requests import Request

from engine.httpkit import body as body_mod
from engine.httpkit import http_protocol
from engine.httpkit.http_protocol import MAX_HEAD_BYTES
from engine.httpkit.serve import bind_socket, make_server
from engine.server.request_fields import APIError


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
        monkeypatch.setattr(http_protocol, "_guarded_httptools_protocol", lambda: None)
    elif http_protocol._guarded_httptools_protocol() is None:
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
        while not answers.endswith(b"\r\n\r\n3"):  # the second answer, body included
            chunk = s.recv(65536)
            assert chunk, answers
            answers += chunk
    assert answers.count(b"HTTP/1.1 200") == 2
    assert answers.endswith(b"\r\n\r\n3") and b"\r\n\r\n%d" % big in answers


# -- deadlines: a head (and a body) that never completes does not hold a connection ----------


@pytest.fixture
def quick_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The httptools server with a 0.5 s head deadline and a 0.5 s body read deadline."""
    proto = http_protocol._guarded_httptools_protocol()
    if proto is None:
        pytest.skip("httptools is not installed")
    monkeypatch.setattr(http_protocol, "HEAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(body_mod, "BODY_READ_TIMEOUT_S", 0.5)
    sock = bind_socket("127.0.0.1", 0)
    srv = make_server(
        read_body_app, log_level="WARNING", banner="", lifespan="off", own_signals=True
    )
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        threading.Event().wait(0.02)
    yield sock.getsockname()[1]
    srv.should_exit = True
    thread.join(10)
    sock.close()


async def read_body_app(scope, receive, send) -> None:  # noqa: ANN001 - a bare ASGI app
    """Reads the body with the kit's ``read_body`` (its limit and its read deadline)."""
    if scope["type"] != "http":
        return
    try:
        raw = await body_mod.read_body(Request(scope, receive), 1 << 20)
        status, body = 200, str(len(raw)).encode()
    except APIError as e:
        status, body = e.status_code, e.message.encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize(
    "sent",
    [b"", b"GET / HTTP/1.1\r\nHost: x\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTT"],
    ids=["silent", "half-head", "half-head-after-a-request"],
)
def test_a_head_that_never_completes_is_answered_408_and_closed(
    quick_server: int, sent: bytes
) -> None:
    with socket.create_connection(("127.0.0.1", quick_server)) as s:
        s.sendall(sent)
        s.settimeout(10)  # without a deadline the server waits for good: recv times out
        answers = b""
        while chunk := s.recv(65536):
            answers += chunk
    if sent.count(b"\r\n\r\n"):  # the complete request was served first
        assert answers.startswith(b"HTTP/1.1 200")
    if sent:
        assert b"HTTP/1.1 408" in answers, answers
    else:
        assert answers == b"" or b"HTTP/1.1 408" in answers


def test_a_body_that_stops_arriving_is_answered_408(quick_server: int) -> None:
    with socket.create_connection(("127.0.0.1", quick_server)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        answer = read_answer(s)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"did not arrive" in answer


def _trickle(
    port: int, monkeypatch: pytest.MonkeyPatch, gap_s: float, min_rate: float = 4.0
) -> bytes:
    """An 8-byte body sent a byte every ``gap_s`` (a 1.5 s gap deadline, a minimum rate of
    ``min_rate`` bytes/s); the answer."""
    monkeypatch.setattr(body_mod, "BODY_READ_TIMEOUT_S", 1.5)
    monkeypatch.setattr(body_mod, "MIN_BODY_RATE_BYTES_PER_S", min_rate)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n")
        for piece in b"abcdefgh":
            threading.Event().wait(gap_s)
            try:
                s.sendall(bytes([piece]))
            except OSError:  # answered and closed already
                break
        return read_answer(s)


def test_a_body_that_trickles_in_is_served(
    quick_server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight pieces 0.3 s apart (2.4 s in all) pass a 1.5 s gap deadline, each gap a fifth
    of it, and the whole body's deadline (1.5 s + 1 s per byte at 1 byte/s: 9.5 s, so a
    loaded box's late pieces still fit)."""
    answer = _trickle(quick_server, monkeypatch, gap_s=0.3, min_rate=1.0)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\n8"), answer[:200]


def test_a_body_trickling_slower_than_the_minimum_rate_is_answered_408(
    quick_server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No gap reaches the 1.5 s gap deadline (a byte every 0.6 s), but the body runs out of
    its whole deadline (1.5 s + 1 s per 4 bytes) after ~2.5 s: a client holding a slot by
    sending a byte now and then is cut off, not served for as long as it likes."""
    answer = _trickle(quick_server, monkeypatch, gap_s=0.6)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"slower than 4 bytes/s" in answer


# -- a client that stops reading an answer ------------------------------------------------


def test_a_client_that_stops_reading_a_stream_is_cut_off_and_the_app_sees_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The answer streams for good; the client reads nothing (its receive buffer small).
    Once the server's send buffer is full past the write deadline, the connection is
    closed and the app's stream ends (without the deadline its send waits for good)."""
    if http_protocol._guarded_httptools_protocol() is None:
        pytest.skip("httptools is not installed")
    monkeypatch.setattr(http_protocol, "WRITE_STALL_TIMEOUT_S", 0.5)
    ended = threading.Event()

    async def endless(scope, receive, send) -> None:  # noqa: ANN001 - a bare ASGI app
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            for _ in range(100_000):  # ~6 GB unread: far past any socket buffer
                await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
        finally:
            ended.set()

    sock = bind_socket("127.0.0.1", 0)
    srv = make_server(endless, log_level="WARNING", banner="", lifespan="off", own_signals=True)
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if srv.started:
                break
            threading.Event().wait(0.02)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(sock.getsockname())
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert ended.wait(20), "the app's send still waits on a client that reads nothing"
    finally:
        srv.should_exit = True
        thread.join(10)
        sock.close()


@pytest.mark.slow  # an engine with its worker process
def test_a_node_aborts_a_stream_its_client_stopped_reading_and_frees_its_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node's app (real engine, ``tiny``) streaming 4,000 tokens to a client that reads
    nothing: the connection is cut at the write deadline, the engine request ends as
    aborted (not run to its length) and its admission slot is free again. Without the
    deadline the request runs to its end and its slot stays taken for good."""
    from harness import wait_for
    from inproc_node import served

    from engine.async_engine import AsyncLLMEngine
    from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from engine.server.app import build_app

    monkeypatch.setattr(http_protocol, "WRITE_STALL_TIMEOUT_S", 0.5)
    cfg = EngineConfig(
        model=ModelConfig(model="tiny"),
        cache=CacheConfig(num_blocks=512),
        parallel=ParallelConfig(device="cpu"),
    )
    engine = AsyncLLMEngine(cfg, "WARNING")
    app = build_app(engine, max_admitted=4)
    # Small kernel buffers on both ends (accepted sockets inherit the listener's), so a few
    # hundred unread events fill them.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.bind(("127.0.0.1", 0))
    try:
        with served(app, sock):
            body = (
                b'{"model": "tiny", "prompt": "go", "max_tokens": 4000, "stream": true, '
                b'"ignore_eos": true, "temperature": 0}'
            )
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.connect(sock.getsockname())
                s.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
                admission = app.state.admission
                wait_for(lambda: admission.in_flight == 1, 30, "the request to be admitted")
                wait_for(lambda: admission.in_flight == 0, 60, "the unread stream to be cut off")

            def finished_by(reason: str) -> float:
                entry = next(
                    e for e in engine.stats().entries() if e.name == "request_success_total"
                )
                return dict(entry.by_label).get(reason, 0.0)

            wait_for(lambda: finished_by("abort") == 1, 30, "the engine request to end as aborted")
            assert finished_by("length") == 0
    finally:
        engine.shutdown()
