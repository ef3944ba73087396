"""The node's registration loop (``proxy/announcer.py``) against real HTTP servers: a
proxy that does not answer or answers oddly affects only its own registration."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from harness import wait_for

from proxy.announcer import Announcer


def _proxy(expires_in: float) -> tuple[ThreadingHTTPServer, list[str]]:
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append(self.path)
            body = json.dumps({"status": "registered", "expires_in": expires_in}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


@pytest.fixture
def proxies() -> Iterator[list]:
    made: list = []

    def make(expires_in: float = 30.0) -> tuple[str, list[str]]:
        server, seen = _proxy(expires_in)
        made.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", seen

    yield make
    for s in made:
        s.shutdown()
        s.server_close()


def test_a_proxy_that_never_answers_does_not_delay_registering_with_another(proxies):
    """The proxies were posted to one after another: one that accepted the connection and
    never answered held every other registration (and renewal) for its whole timeout."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts, never answers
    healthy, seen = proxies()
    node = Announcer(
        [f"http://127.0.0.1:{silent.getsockname()[1]}", healthy],
        "decode", "http://127.0.0.1:8200", "key", interval=1.0, timeout=20.0,
    )  # fmt: skip
    node.start()
    try:
        wait_for(lambda: "/v1/nodes/register" in seen, 10, "the healthy proxy's registration")
    finally:
        node.stop(timeout=0.1)
        silent.close()


def test_a_tiny_expires_in_does_not_make_the_node_post_in_a_loop(proxies):
    """``expires_in: 0.001`` made the node renew every 0.3 ms."""
    url, seen = proxies(expires_in=0.001)
    node = Announcer([url], "decode", "http://127.0.0.1:8200", "key", interval=10.0)
    start = time.monotonic()
    node.start()
    wait_for(lambda: "/v1/nodes/register" in seen, 10, "the first registration")
    time.sleep(1.0)
    node.stop()
    took = time.monotonic() - start
    registrations = seen.count("/v1/nodes/register")
    assert 1 <= registrations <= 2 + 2 * took, (registrations, took)  # one each 0.5 s at most
    assert seen[-1] == "/v1/nodes/deregister"
