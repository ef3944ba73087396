"""The proxy's HTTP/1.1 client to its nodes (``proxy/node_client.py``), against stand-in
nodes on loopback: keep-alive reuse, chunked streams, timeouts, malformed or truncated
answers, the connection bound, and that every ended answer gives its slot back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.node_client import (
    NodeClient,
    NodeConnectError,
    NodeProtocolError,
    NodeTimeout,
)
from tests.standin_http import SeenRequest, StandIn, answer, chunked

pytestmark = pytest.mark.timeout(60)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _ok(req: SeenRequest) -> bytes:
    return answer(200, {"path": req.path, "got": req.json() if req.body else None})


def test_json_calls_reuse_one_keep_alive_connection_and_send_headers() -> None:
    async def main() -> None:
        async with (
            StandIn(_ok) as node,
            NodeClient(timeout=5, headers={"Authorization": "Bearer k"}) as c,
        ):
            for i in range(3):
                resp = await c.post(
                    node.url + "/v1/x?a=1", json={"i": i}, headers={"X-Request-Id": f"r{i}"}
                )
                assert resp.status_code == 200
                assert resp.json() == {"path": "/v1/x?a=1", "got": {"i": i}}
            assert node.connections == 1
            assert [r.headers["x-request-id"] for r in node.seen] == ["r0", "r1", "r2"]
            assert all(r.headers["authorization"] == "Bearer k" for r in node.seen)
            assert node.seen[0].headers["content-type"] == "application/json"
            assert c.in_flight == 0

    run(main())


def test_a_chunked_stream_yields_its_lines_across_chunk_boundaries_then_the_connection_is_reused() -> (
    None
):
    pieces = [b'data: {"a"', b": 1}\n\nda", b"ta: [DONE]\r\n", b"\n"]

    async def handler(req: SeenRequest) -> bytes:
        if req.path == "/stream":
            return chunked(200, pieces, {"Content-Type": "text/event-stream"})
        return await _ok(req)

    async def main() -> None:
        async with StandIn(handler) as node, NodeClient(timeout=5) as c:
            resp = await c.send_stream("POST", node.url + "/stream", json={})
            assert resp.headers["content-type"] == "text/event-stream"
            assert c.in_flight == 1  # the open stream holds its slot
            lines = [line async for line in resp.aiter_lines()]
            assert lines == ['data: {"a": 1}', "", "data: [DONE]", ""]
            assert c.in_flight == 0
            assert (await c.post(node.url + "/x", json={})).status_code == 200
            assert node.connections == 1

    run(main())


def test_chunks_small_and_larger_than_a_read_piece_and_trailers_make_the_whole_body() -> None:
    sizes = [1, 65_535, 65_536, 65_537, 200_000, 3]
    pieces = [bytes([65 + i]) * n for i, n in enumerate(sizes)]
    wire = chunked(200, pieces).removesuffix(b"0\r\n\r\n") + b"0\r\nX-Trailer: t\r\n\r\n"

    async def handler(req: SeenRequest) -> bytes:
        return wire if req.path == "/chunks" else await _ok(req)

    async def main() -> None:
        async with StandIn(handler) as node, NodeClient(timeout=5) as c:
            resp = await c.send_stream("POST", node.url + "/chunks", json={})
            got = [piece async for piece in resp.aiter_bytes()]
            assert b"".join(got) == b"".join(pieces)
            assert max(len(p) for p in got) <= 65_536  # a larger chunk comes in read pieces
            assert c.in_flight == 0
            assert (await c.post(node.url + "/x", json={})).status_code == 200
            assert node.connections == 1  # read to its end: the connection was reused

    run(main())


def test_a_stream_closed_before_its_end_closes_its_connection_and_frees_its_slot() -> None:
    async def handler(req: SeenRequest) -> bytes:
        if req.path == "/stream":
            return chunked(200, [b"data: 1\n\n", b"data: 2\n\n"])
        return await _ok(req)

    async def main() -> None:
        async with StandIn(handler) as node, NodeClient(timeout=5, max_connections=1) as c:
            resp = await c.send_stream("POST", node.url + "/stream", json={})
            async for _line in resp.aiter_lines():
                break
            resp.close()
            assert c.in_flight == 0
            # The unread rest of the stream must not be taken for the next answer.
            assert (await c.post(node.url + "/x", json={"n": 1})).json()["got"] == {"n": 1}
            assert node.connections == 2

    run(main())


def test_a_node_closing_its_keep_alive_connection_between_calls_costs_no_call_and_no_repeat() -> (
    None
):
    async def handler(req: SeenRequest) -> bytes:
        return answer(200, {"n": len(node.seen)})  # no "Connection: close", yet it closes

    node = StandIn(handler)

    async def main() -> None:
        async with node, NodeClient(timeout=5) as c:
            orig = node._serve

            async def serve_once(reader: Any, writer: Any) -> None:  # one answer per connection
                node.connections += 1
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                node.seen.append(SeenRequest("POST", "/", {}, body))
                writer.write(await handler(node.seen[-1]))
                await writer.drain()
                writer.close()

            assert orig is not None
            node.server.close()  # type: ignore[union-attr]
            node.server = await asyncio.start_server(serve_once, "127.0.0.1", node.port)
            for i in range(4):
                resp = await c.post(node.url + "/x", json={"i": i})
                assert resp.status_code == 200
                await asyncio.sleep(0.01 if i % 2 else 0)  # FIN seen before reuse, or not
            assert len(node.seen) == 4  # each call reached the node exactly once

    run(main())


def test_a_stream_left_after_its_done_event_is_drained_and_its_connection_reused() -> None:
    """The proxy stops reading D's stream at ``data: [DONE]``; the chunked body's last chunk
    is still on the wire. ``drain()`` reads it, so the next call reuses the connection."""
    from engine.httpkit.sse_reader import SSEReader

    async def handler(req: SeenRequest) -> bytes:
        if req.path == "/stream":
            return chunked(200, [b'data: {"n": 1}\n\n', b"data: [DONE]\n\n"])
        return await _ok(req)

    async def main() -> None:
        async with StandIn(handler) as node, NodeClient(timeout=5) as c:
            for _ in range(3):
                resp = await c.send_stream("POST", node.url + "/stream", json={})
                events = SSEReader(resp.aiter_lines())
                assert [e async for e in events] == [{"n": 1}] and events.done
                await resp.drain()
                assert c.in_flight == 0
            assert (await c.post(node.url + "/x", json={})).status_code == 200
            assert node.connections == 1

    run(main())


def test_a_node_slower_than_the_timeout_gives_a_timeout_and_the_slot_back() -> None:
    async def handler(req: SeenRequest) -> bytes:
        if req.path == "/slow":
            await asyncio.sleep(2)
        return await _ok(req)

    async def main() -> None:
        async with StandIn(handler) as node, NodeClient(timeout=5, max_connections=1) as c:
            with pytest.raises(NodeTimeout):
                await c.post(node.url + "/slow", json={}, timeout=0.2)
            assert c.in_flight == 0
            assert (await c.post(node.url + "/x", json={})).status_code == 200

    run(main())


@pytest.mark.parametrize(
    "reply",
    [
        b"SPDY/3 200 OK\r\n\r\n",  # not HTTP/1.x
        b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",  # status not a number
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10,  # closed mid-body
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # bad chunk size
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY",  # chunk without CRLF
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n11170\r\n" + b"z" * 70_000 + b"XY",
        b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70_000 + b"\r\n\r\n",  # headers over 64 KiB
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200",  # closed inside the head
        None,  # closed without a byte
    ],
    ids=[
        "not-http",
        "status",
        "short-body",
        "neg-length",
        "chunk-size",
        "chunk-crlf",
        "big-chunk-crlf",
        "huge-head",
        "header-line",
        "cut-head",
        "no-answer",
    ],  # fmt: skip
)
def test_a_malformed_or_cut_answer_is_a_protocol_error_and_frees_the_slot(
    reply: bytes | None,
) -> None:
    async def handler(req: SeenRequest) -> tuple[bytes, bool] | bytes | None:
        if req.path == "/bad":
            return None if reply is None else (reply, True)  # then the node hangs up
        return await _ok(req)

    async def main() -> None:
        async with StandIn(handler) as node, NodeClient(timeout=5, max_connections=1) as c:
            with pytest.raises(NodeProtocolError):
                await c.post(node.url + "/bad", json={})
            assert c.in_flight == 0
            node.handler = _ok
            assert (await c.post(node.url + "/x", json={"k": 2})).json()["got"] == {"k": 2}

    run(main())


def test_an_answer_larger_than_the_body_limit_is_refused() -> None:
    async def handler(req: SeenRequest) -> bytes:
        if req.path == "/big-chunked":
            return chunked(200, [b"x" * 600, b"x" * 600])
        return answer(200, raw=b"x" * 2000)

    async def main() -> None:
        async with StandIn(handler) as node, NodeClient(timeout=5, max_body_bytes=1000) as c:
            for path in ("/big", "/big-chunked"):
                with pytest.raises(NodeProtocolError, match="larger than 1000"):
                    await c.post(node.url + path, json={})
            assert c.in_flight == 0

    run(main())


def test_no_node_listening_is_a_connect_error() -> None:
    async def main() -> None:
        async with StandIn(_ok) as node:
            url = node.url
        async with NodeClient(timeout=5, connect_timeout=2) as c:
            with pytest.raises(NodeConnectError):
                await c.post(url + "/x", json={})
            assert c.in_flight == 0

    run(main())


def test_header_values_with_line_breaks_are_never_sent() -> None:
    async def main() -> None:
        async with StandIn(_ok) as node, NodeClient(timeout=5) as c:
            with pytest.raises(ValueError, match="cannot be sent"):
                await c.post(node.url + "/x", json={}, headers={"X-Request-Id": "a\r\nX-Evil: 1"})
            assert node.seen == [] and c.in_flight == 0

    run(main())


def test_calls_beyond_max_connections_wait_for_a_free_slot() -> None:
    busy = 0
    most = 0

    async def handler(req: SeenRequest) -> bytes:
        nonlocal busy, most
        busy += 1
        most = max(most, busy)
        await asyncio.sleep(0.05)
        busy -= 1
        return await _ok(req)

    async def main() -> None:
        async with StandIn(handler) as node, NodeClient(timeout=5, max_connections=2) as c:
            answers = await asyncio.gather(
                *(c.post(node.url + "/x", json={"i": i}) for i in range(6))
            )
            assert [a.json()["got"]["i"] for a in answers] == list(range(6))
        assert most == 2

    run(main())


def test_a_decode_answer_that_arrives_for_a_dropped_attempt_is_closed_not_leaked() -> None:
    """D answers (its stream open) before P refuses; the attempt is dropped without anyone
    reading D's stream. The open answer must be closed, or it holds a connection slot
    for good."""
    from proxy.config import ProxyConfig
    from proxy.legs import Attempt, Legs, UpstreamError
    from proxy.nodes import NodePool
    from proxy.validation import COMPLETIONS, validate_request

    d_answered = asyncio.Event()

    async def prefill(req: SeenRequest) -> bytes:
        if req.path == "/v1/abort":
            return answer(200, {})
        await asyncio.wait_for(d_answered.wait(), 10)  # D's head is on its way
        await asyncio.sleep(0.2)
        return answer(400, {"error": {"message": "no", "type": "invalid_request_error"}})

    async def decode(req: SeenRequest) -> bytes:
        if req.path == "/v1/abort":
            return answer(200, {})
        d_answered.set()
        return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ndata:\r\n"  # and waits

    async def main() -> None:
        async with StandIn(prefill) as p, StandIn(decode) as d, NodeClient(timeout=10) as c:
            cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,))
            pool = NodePool(cfg.prefill, cfg.decode)
            p_node, d_node = pool.nodes("prefill")[0], pool.nodes("decode")[0]
            p_node.update_info({"side_channel": "tcp://127.0.0.1:1"}, None)
            req = validate_request(COMPLETIONS, b'{"prompt": "x", "max_tokens": 2}', ["m"], None)
            legs = Legs(c)
            attempt = Attempt(legs, req, p_node, d_node, "r", skip_first=False)
            with pytest.raises(UpstreamError, match="HTTP 400"):
                await attempt.wait_prefill()
            assert attempt.d_task.done() and attempt.d_stream is None  # D's answer unclaimed
            attempt.release()
            await asyncio.sleep(0)
            await legs.drain()
            assert c.in_flight == 0

    run(main())


def test_a_prefill_answer_without_a_token_is_an_upstream_error_not_a_first_token() -> None:
    """A prefill leg that ended without sampling (aborted on P) answers 200 with no token:
    streamed on as P's first chunk, the client would get an empty first token and D, told
    to skip the first token, would drop the real one."""
    from proxy.config import ProxyConfig
    from proxy.legs import Legs, UpstreamError
    from proxy.nodes import NodePool
    from proxy.validation import COMPLETIONS, validate_request

    aborted = {"choices": [{"index": 0, "text": "", "finish_reason": "abort", "token_ids": []}]}

    async def prefill(req: SeenRequest) -> bytes:
        return answer(200, aborted)

    async def main() -> None:
        async with StandIn(prefill) as p, NodeClient(timeout=10) as c:
            cfg = ProxyConfig(prefill=(p.url,), decode=("http://127.0.0.1:9",))
            node = NodePool(cfg.prefill, cfg.decode).nodes("prefill")[0]
            req = validate_request(COMPLETIONS, b'{"prompt": "x", "max_tokens": 2}', ["m"], None)
            with pytest.raises(UpstreamError, match="without a token"):
                await Legs(c).prefill(req, node, "r", "t")

    run(main())
