"""A decode node whose stream sends no event, only SSE comment lines (``: keep-alive``)
forever -- a misbehaving node, or something else listening at its address. Each comment
is bytes, so the node client's per-read timeout (``--request-timeout``) never fired and
the client's request was held for good. Now a stream that goes ``--request-timeout``
without a ``data:`` event is given up as a read timeout would be: before any token the
request moves to another decode node, mid-answer the stream ends with an error event.
The proxy runs in process (its app, health checks included) over stand-in nodes on
loopback (``tests/test_proxy_error_before_token.py``'s ``proxy_over``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from harness import sse_chunk_events
from test_proxy_error_before_token import (
    ROLE,
    WHOLE,
    _node,
    answer_text,
    asked,
    good,
    post,
    proxy_over,
)

from engine.httpkit import sse_reader
from tests.standin_http import SeenRequest

pytestmark = pytest.mark.timeout(90)

REQUEST_TIMEOUT_S = 2.0  # the proxy's --request-timeout in these tests
COMMENT = b": keep-alive\n\n"


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _comments_forever(*events: Any) -> Any:
    """A consumer node whose chat stream sends ``events``, then a comment every 50 ms
    forever (its health and facts answered as a healthy node's)."""

    async def handler(req: SeenRequest) -> Any:
        if req.path != "/v1/chat/completions":
            return await _node("consumer", good)(req)

        async def pieces() -> AsyncIterator[bytes]:
            yield b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            for e in events:
                yield _chunk(f"data: {json.dumps(e)}\n\n".encode())
            while True:
                yield _chunk(COMMENT)
                await asyncio.sleep(0.05)

        return pieces()

    return handler


def _token(i: int) -> dict[str, Any]:
    return {
        "choices": [
            {"index": 0, "delta": {"content": f"t{i}"}, "token_ids": [i], "finish_reason": None}
        ],
        "model": "tiny",
    }


def test_a_decode_node_sending_only_comments_before_its_first_token_is_given_up() -> None:
    """D1 opens its chat stream (its role chunk), then sends comments forever: the
    request moves to D2, whose answer the client gets."""

    async def main() -> tuple[Any, list[int]]:
        decodes = [("handler", _comments_forever(ROLE)), good]
        async with proxy_over(decodes, request_timeout=REQUEST_TIMEOUT_S, **WHOLE) as (
            client,
            ds,
            _,
        ):
            resp = await asyncio.wait_for(post(client, "chat", True), 60)
            return resp, [asked(d) for d in ds]

    resp, seen = asyncio.run(main())
    assert resp.status_code == 200, resp.text
    assert answer_text("chat", resp) == ("t7t8t9", []), resp.text
    assert seen == [1, 1]


def test_a_decode_stream_that_turns_to_comments_mid_answer_ends_with_an_error_event() -> None:
    """D sends two tokens, then only comments: the client's stream ends with the two
    tokens, an error event naming the wait, and [DONE]."""

    async def main() -> Any:
        decodes = [("handler", _comments_forever(ROLE, _token(7), _token(8)))]
        async with proxy_over(decodes, request_timeout=REQUEST_TIMEOUT_S, **WHOLE) as (
            client,
            _,
            _,
        ):
            return await asyncio.wait_for(post(client, "chat", True), 60)

    resp = asyncio.run(main())
    assert resp.status_code == 200, resp.text
    events = sse_chunk_events([resp.text])
    ids = [t for e in events for ch in e.get("choices", []) for t in ch.get("token_ids") or []]
    assert ids == [7, 8], events
    assert "error" in events[-1], events
    assert "no event" in events[-1]["error"]["message"], events
    assert resp.text.endswith("data: [DONE]\n\n")


def test_the_reader_counts_time_without_an_event_not_time_between_lines() -> None:
    """``SSEReader(max_idle_s=...)``: comments, blank lines and other fields don't reset
    the clock, an event does; the time a consumer takes between events is not counted."""

    async def lines() -> AsyncIterator[str]:
        yield 'data: {"a": 1}'
        while True:
            yield ": keep-alive"
            yield ""
            yield "event: ping"
            await asyncio.sleep(0.02)

    async def main() -> list[Any]:
        got = []
        with pytest.raises(sse_reader.SSEIdleTimeout, match="no event"):
            async for obj in sse_reader.SSEReader(lines(), max_idle_s=0.3):
                got.append(obj)
                await asyncio.sleep(0.5)  # the consumer's time: not the node's
        return got

    assert asyncio.run(asyncio.wait_for(main(), 30)) == [{"a": 1}]
