"""``pdproxy_request_errors_total{kind="bad_request"}`` counts every 400 a client gets from
the proxy: those of its own checks and a node's 400 passed through (a prompt too long for
the context, a chat template that fails: what only a node with a tokenizer can tell).
Found by a new-user walkthrough: 4 client 400s, the counter at 2. Stand-in nodes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request

from engine.httpkit.drain import Drainer
from proxy.config import ProxyConfig
from proxy.legs import Legs
from proxy.metrics import ProxyMetrics
from proxy.node_client import NodeClient
from proxy.nodes import NodePool
from proxy.router import Router
from proxy.serving import ProxyServing
from proxy.validation import CHAT, COMPLETIONS
from tests.standin_http import SeenRequest, StandIn, answer

TOO_LONG = {
    "error": {
        "message": "This model's maximum context length is 64 tokens.",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }
}


async def _refuse(req: SeenRequest) -> bytes:
    if req.path == "/v1/abort":
        return answer(200, {})
    return answer(400, TOO_LONG)


def _request(body: dict[str, Any], path: str) -> Request:
    raw = json.dumps(body).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:  # the client stays: nothing more until the answer
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "headers": [],
             "state": {"request_id": "r"}}  # fmt: skip
    return Request(scope, receive)


def test_every_400_the_client_gets_counts_as_bad_request() -> None:
    async def main() -> tuple[list[int], float]:
        async with StandIn(_refuse) as p, StandIn(_refuse) as d:
            cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,))
            pool = NodePool(cfg.prefill, cfg.decode)
            for node in pool.all():
                node.set_healthy(True)
                node.update_info(
                    {"side_channel": "tcp://127.0.0.1:5600"}, {"data": [{"id": "tiny"}]}
                )
            metrics = ProxyMetrics(pool)
            serving = ProxyServing(cfg, pool, Router(pool), metrics, Drainer(frozenset()))
            statuses = []
            async with NodeClient(timeout=10) as client:
                serving.legs, serving.client = Legs(client), client
                for endpoint, path, body in [
                    (COMPLETIONS, "/v1/completions", {"prompt": "x", "max_tokens": "a"}),  # proxy's
                    (COMPLETIONS, "/v1/completions", {"prompt": "x" * 100}),  # the nodes'
                    (COMPLETIONS, "/v1/completions", {"prompt": "x" * 100, "stream": True}),
                    (CHAT, "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
                ]:  # fmt: skip
                    resp = await serving.generate(_request(body, path), endpoint)
                    statuses.append(resp.status_code)
                await serving.legs.drain()
            count = metrics.errors.labels("bad_request")._value.get()
            return statuses, count

    statuses, count = asyncio.run(main())
    assert statuses == [400, 400, 400, 400]
    assert count == 4
