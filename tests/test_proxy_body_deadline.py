"""A node that trickles a whole (non-streamed) answer: one byte at a time, each well
inside the node client's per-read timeout (``--request-timeout``). The body's size was
capped (``max_body_bytes``) but not its time: a 1 MB answer at a byte every 50 ms held
the client's request for ~14 hours. Now the whole body must come within the call's
timeout of its headers, or the call fails as a read timeout does: the request moves to
another node (502 ``upstream_error`` once none is left), the node's failure counted.
Real sockets: the nodes are stand-in HTTP servers on loopback (``tests/standin_http.py``),
the proxy runs in process (``tests/test_proxy_error_before_token.py``'s ``proxy_over``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from test_proxy_error_before_token import WHOLE, _node, answer_text, asked, good, post, proxy_over

from proxy.node_client import NodeClient, NodeTimeout
from tests.standin_http import SeenRequest, StandIn

pytestmark = pytest.mark.timeout(90)

REQUEST_TIMEOUT_S = 1.0  # the proxy's --request-timeout (the node client's) here
TRICKLE_EVERY_S = 0.05  # far inside each read's timeout
BODY_BYTES = 1_000_000


def _trickled(req: SeenRequest) -> Any:
    """A 200 answer with a ``BODY_BYTES`` Content-Length, its body a byte every
    ``TRICKLE_EVERY_S`` (never finished in a test's time)."""

    async def pieces() -> AsyncIterator[bytes]:
        yield f"HTTP/1.1 200 OK\r\nContent-Length: {BODY_BYTES}\r\n\r\n".encode()
        for _ in range(BODY_BYTES):
            yield b" "
            await asyncio.sleep(TRICKLE_EVERY_S)

    return pieces()


def _trickling_decode() -> Any:
    """A decode node, healthy, whose non-streamed completions trickle."""

    async def leg(req: SeenRequest) -> Any:
        return _trickled(req)

    return _node("consumer", leg)


def test_the_node_client_gives_a_trickled_body_the_calls_timeout_in_all() -> None:
    async def handler(req: SeenRequest) -> Any:
        return _trickled(req)

    async def main() -> str:
        async with StandIn(handler) as node, NodeClient(timeout=REQUEST_TIMEOUT_S) as c:
            with pytest.raises(NodeTimeout) as e:
                await asyncio.wait_for(c.post(node.url + "/v1/completions", json={}), 20)
            assert c.in_flight == 0  # its connection slot was given back
            return str(e.value)

    message = asyncio.run(main())
    assert "body" in message and f"{REQUEST_TIMEOUT_S:g} s" in message, message


def test_a_decode_node_trickling_its_answer_fails_over_to_another() -> None:
    """D1 trickles its non-streamed answer: the request moves to D2, whose answer the
    client gets; D1's failure is counted."""

    async def main() -> tuple[Any, list[int], list[int]]:
        decodes = [("handler", _trickling_decode()), good]
        async with proxy_over(decodes, request_timeout=REQUEST_TIMEOUT_S, **WHOLE) as (
            client,
            ds,
            pool,
        ):
            resp = await asyncio.wait_for(post(client, "chat", False), 20)
            return resp, [asked(d) for d in ds], [n.counters.failures for n in pool.decode]

    resp, seen, failures = asyncio.run(main())
    assert resp.status_code == 200, resp.text
    assert answer_text("chat", resp) == ("t7t8t9", []), resp.text
    assert seen == [1, 1]
    assert failures == [1, 0]


def test_a_request_whose_only_decode_node_trickles_ends_with_502() -> None:
    """The only D trickles: the client gets the proxy's 502 ``upstream_error`` naming
    the timeout, not a request held for hours."""

    async def main() -> Any:
        decodes = [("handler", _trickling_decode())]
        async with proxy_over(decodes, request_timeout=REQUEST_TIMEOUT_S, **WHOLE) as (
            client,
            _,
            _,
        ):
            return await asyncio.wait_for(post(client, "completions", False), 20)

    resp = asyncio.run(main())
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["code"] == "upstream_error", error
    assert f"body did not all come within {REQUEST_TIMEOUT_S:g} s" in error["message"], error
