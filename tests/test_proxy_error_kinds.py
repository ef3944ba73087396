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


def test_a_stream_of_several_choices_ended_by_an_error_counts_one_stream_error() -> None:
    """``n`` = 2 streamed, D failing both choices after their first token: the client's
    stream ends with one error event, and the request counts one ``stream_error`` (each
    choice's failure counted its own: 2 for one request's one error; found by the proxy
    fault property test)."""
    from test_proxy_error_before_token import _choice, _events, _prefill, proxy_over

    async def fails_after_one(req: SeenRequest) -> bytes:
        tok = {"choices": [_choice(False, [7], "t7", None, "delta")], "model": "tiny"}
        err = {"error": {"message": "D broke", "type": "server_error", "param": None,
                         "code": None}}  # fmt: skip
        return _events(tok, err)

    async def run() -> tuple[list[Any], float]:
        async with proxy_over([fails_after_one], _prefill()) as (client, _, pool):
            resp = await client.post("/v1/completions", json={
                "model": "tiny", "prompt": "hi", "max_tokens": 3, "n": 2, "seed": 1,
                "stream": True})  # fmt: skip
            events = [json.loads(line[6:]) for line in resp.text.split("\n\n")
                      if line.startswith("data: {")]  # fmt: skip
            metrics = client._transport.app.state.metrics  # type: ignore[attr-defined]
            got = metrics.registry.get_sample_value(
                "pdproxy_request_errors_total", {"kind": "stream_error"}
            )
            return [e for e in events if "error" in e], got or 0.0

    errors, counted = asyncio.run(run())
    assert len(errors) == 1, errors
    assert counted == 1, counted
