"""``POST /v1/responses`` on the proxy in process (no nodes): its admission is the chat
route's (``--max-inflight``: 429 before the body is read, a request being read counts)
and it is counted under its own endpoint."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from proxy.app import build_app
from proxy.config import ProxyConfig


def _requests_total(text: str, endpoint: str, status: str) -> float:
    want = f'pdproxy_requests_total{{endpoint="{endpoint}",status="{status}"}}'
    lines = [ln for ln in text.splitlines() if ln.startswith(want)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_a_responses_request_being_read_counts_against_max_inflight() -> None:
    cfg = ProxyConfig(prefill=("http://10.0.0.1:8100",), decode=("http://10.0.0.2:8200",),
                      max_inflight=1)  # fmt: skip
    app = build_app(cfg)  # no lifespan: no node is ever asked
    release = asyncio.Event()
    first_byte = asyncio.Event()

    async def slow_body() -> AsyncIterator[bytes]:
        yield b'{"model": "tiny", "input": '
        first_byte.set()
        await release.wait()
        yield b'"hi"}'

    async def main() -> tuple[httpx.Response, str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            slow = asyncio.create_task(client.post("/v1/responses", content=slow_body()))
            await asyncio.wait_for(first_byte.wait(), 10)
            await asyncio.sleep(0.05)  # the slow request is being read
            second = await client.post("/v1/responses", json={"model": "tiny", "input": "x"})
            metrics = (await client.get("/metrics")).text
            release.set()
            slow.cancel()
            return second, metrics

    second, metrics = asyncio.run(main())
    assert second.status_code == 429, second.text
    assert second.headers["retry-after"] == "1"
    assert json.loads(second.text)["error"]["code"] == "too_many_requests"
    assert _requests_total(metrics, "responses", "429") == 1
    assert _requests_total(metrics, "chat", "429") == 0


def test_truncation_auto_is_cut_to_the_context_the_proxy_knows() -> None:
    """Both legs of a P/D pair cut a conversation to the same context (the decode nodes'
    least), not each to its own: the proxy names it in the chat body they get."""
    from engine.responses_api.request import to_chat
    from proxy.validation import CHAT, validate_request

    chat, _ = to_chat({"model": "tiny", "input": "hi", "truncation": "auto"})
    assert chat["truncate_messages_to"] == -1
    req = validate_request(CHAT, json.dumps(chat).encode(), ["tiny"], 4096)
    assert req.body["truncate_messages_to"] == 4096
    chat, _ = to_chat({"model": "tiny", "input": "hi"})
    req = validate_request(CHAT, json.dumps(chat).encode(), ["tiny"], 4096)
    assert "truncate_messages_to" not in req.body
