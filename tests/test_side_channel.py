"""Tests for kvconnector.nixl.side_channel (real sockets on localhost)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvconnector.nixl.messages import MAX_CHECKSUMS, MAX_RANKS, MAX_RESERVE_IDS
from kvconnector.nixl.side_channel import (
    MAX_WIRE_ITEMS,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
    SideChannelTimeout,
)


def _handler(msg: dict[str, Any]) -> dict[str, Any]:
    if msg.get("op") == "boom":
        raise RuntimeError("kaboom")
    if msg.get("op") == "bad":
        return "not a dict"  # type: ignore[return-value]
    return {"ok": True, "echo": msg, "blob": b"\x00\x01"}


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    srv = SideChannelServer("127.0.0.1", 0, _handler)
    try:
        yield srv
    finally:
        srv.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_request_reply(server: SideChannelServer) -> None:
    assert server.port > 0
    assert server.address == f"tcp://127.0.0.1:{server.port}"
    client = SideChannelClient()
    reply = client.request(server.address, {"op": "hi", "n": 3, "b": b"xy"}, timeout=5.0)
    assert reply == {"ok": True, "echo": {"op": "hi", "n": 3, "b": b"xy"}, "blob": b"\x00\x01"}


def test_handler_exception_and_bad_reply(server: SideChannelServer) -> None:
    client = SideChannelClient()
    reply = client.request(server.address, {"op": "boom"}, timeout=5.0)
    assert reply["ok"] is False and "kaboom" in reply["error"]
    reply = client.request(server.address, {"op": "bad"}, timeout=5.0)
    assert reply["ok"] is False and "dict" in reply["error"]
    # the server keeps serving after errors
    assert client.request(server.address, {"op": "x"}, timeout=5.0)["ok"] is True


def test_an_array_or_map_past_the_wire_limit_is_refused_before_the_handler_sees_it() -> None:
    """Decoding is bounded: a peer's 8 M-element array is never built in memory (nor
    handed to the handler); the reply names the limit. At the limit, the handler sees it."""
    # Every array a valid message carries fits.
    assert max(MAX_RESERVE_IDS, MAX_CHECKSUMS, MAX_RANKS) <= MAX_WIRE_ITEMS
    seen: list[int] = []

    def handler(msg: dict[str, Any]) -> dict[str, Any]:
        seen.append(len(msg["v"]))
        return {"ok": True}

    srv = SideChannelServer("127.0.0.1", 0, handler)
    client = SideChannelClient()
    try:
        for v in ([0] * (MAX_WIRE_ITEMS + 1), {str(i): 0 for i in range(MAX_WIRE_ITEMS + 1)}):
            reply = client.request(srv.address, {"v": v}, timeout=30.0)
            assert reply["ok"] is False and f"at most {MAX_WIRE_ITEMS}" in reply["error"], reply
        assert seen == []
        assert client.request(srv.address, {"v": [0] * MAX_WIRE_ITEMS}, timeout=30.0)["ok"]
        assert seen == [MAX_WIRE_ITEMS]
    finally:
        srv.close()


def test_explicit_port_and_wildcard_host() -> None:
    port = _free_port()
    with SideChannelServer("0.0.0.0", port, _handler) as srv:
        assert srv.port == port
        assert srv.address == f"tcp://127.0.0.1:{port}"
        assert SideChannelClient().request(srv.address, {"a": 1}, timeout=5.0)["ok"]
    with SideChannelServer("127.0.0.1", 0, _handler) as taken, pytest.raises(SideChannelError):
        SideChannelServer("127.0.0.1", taken.port, _handler)


def test_concurrent_clients(server: SideChannelServer) -> None:
    client = SideChannelClient()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for j in range(20):
                reply = client.request(server.address, {"i": i, "j": j}, timeout=5.0)
                assert reply["echo"] == {"i": i, "j": j}
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors


def test_timeout_closed_port() -> None:
    client = SideChannelClient()
    t0 = time.monotonic()
    with pytest.raises(SideChannelTimeout):
        client.request(f"tcp://127.0.0.1:{_free_port()}", {"op": "x"}, timeout=0.5)
    assert time.monotonic() - t0 < 5  # ends by its timeout, not hanging (slack for load)


def test_timeout_unresponsive_handler_then_late_reply_ignored() -> None:
    release = threading.Event()

    def slow(msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("slow"):
            release.wait(10)
        return {"ok": True, "seq": msg["seq"]}

    srv = SideChannelServer("127.0.0.1", 0, slow)
    try:
        client = SideChannelClient()
        t0 = time.monotonic()
        with pytest.raises(SideChannelTimeout):
            client.request(srv.address, {"slow": True, "seq": 1}, timeout=0.5)
        assert time.monotonic() - t0 < 5  # by its timeout (slack for load)
        release.set()  # the late reply to seq 1 goes to a closed socket
        assert client.request(srv.address, {"seq": 2}, timeout=5.0) == {"ok": True, "seq": 2}
    finally:
        release.set()
        t0 = time.monotonic()
        srv.close()
        assert time.monotonic() - t0 < 2.0


def test_close_is_prompt_and_idempotent() -> None:
    srv = SideChannelServer("127.0.0.1", 0, _handler)
    t0 = time.monotonic()
    srv.close()
    srv.close()
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(SideChannelTimeout):
        SideChannelClient().request(srv.address, {"op": "x"}, timeout=0.3)
