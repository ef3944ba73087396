"""Overload pieces without processes: the admission bound (429 + Retry-After before the
body is read), a request's output stream that a slow reader cannot grow, the flag, and the
proxy's reading of a node's load answer (see ``test_overload.py`` for real nodes)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from engine.async_engine import _Stream
from engine.httpkit.admission import Admission, AdmissionMiddleware
from engine.outputs import RequestOutput
from engine.server.node_main import build_parser
from proxy.legs import UpstreamError
from proxy.nodes import Node

WORK = frozenset(["/v1/completions"])


async def _call(app: Any, path: str) -> dict[str, Any]:
    """One HTTP request through ``app``; its status, headers and body."""
    sent: list[dict[str, Any]] = []
    body_read = False

    async def receive() -> dict[str, Any]:
        nonlocal body_read
        body_read = True
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return {
        "status": start["status"],
        "headers": {k.decode(): v.decode() for k, v in start.get("headers", [])},
        "body": body,
        "body_read": body_read,
    }


def test_past_the_limit_a_request_gets_429_with_retry_after_before_its_body_is_read() -> None:
    release = asyncio.Event()
    running = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal running
        await receive()
        running += 1
        if scope["path"] in WORK:
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    admission = Admission(WORK, limit=2)
    mw = AdmissionMiddleware(app, admission)

    async def run() -> None:
        held = [asyncio.create_task(_call(mw, "/v1/completions")) for _ in range(2)]
        while running < 2:
            await asyncio.sleep(0)
        assert admission.in_flight == 2
        refused = await _call(mw, "/v1/completions")
        assert refused["status"] == 429 and refused["headers"]["retry-after"] == "1"
        assert not refused["body_read"]  # answered before the body was read
        err = json.loads(refused["body"])["error"]
        assert (err["type"], err["code"]) == ("rate_limit_error", "overloaded")
        assert "limit of 2" in err["message"]
        other = await _call(mw, "/health")  # only the work paths are bounded
        assert other["status"] == 200
        release.set()
        assert [r["status"] for r in await asyncio.gather(*held)] == [200, 200]
        assert admission.in_flight == 0
        assert (await _call(mw, "/v1/completions"))["status"] == 200
        assert admission.refused_total == 1

    asyncio.run(run())


def test_without_a_limit_every_request_is_admitted() -> None:
    admission = Admission(WORK, limit=None)
    assert all(admission.try_enter() for _ in range(1000))
    with pytest.raises(ValueError):
        Admission(WORK, limit=0)


def test_outputs_a_slow_reader_has_not_taken_are_merged_into_one() -> None:
    async def run() -> None:
        stream = _Stream(asyncio.get_running_loop())

        def engine_thread() -> None:
            for i in range(1000):
                stream.put(RequestOutput("r", [i], num_output_tokens=i + 1))
            stream.put(RequestOutput("r", [1000], True, "length", num_output_tokens=1001))

        def all_delivered() -> bool:  # the puts run on this loop, after the thread's calls
            tail = stream._items[-1] if stream.pending else None
            return isinstance(tail, RequestOutput) and tail.finished

        t = threading.Thread(target=engine_thread)
        t.start()
        t.join()
        while not all_delivered():
            await asyncio.sleep(0.001)
        assert stream.pending == 1  # not 1001 queued outputs
        out = await stream.get()
        assert isinstance(out, RequestOutput)
        assert out.new_token_ids == list(range(1001))
        assert (out.finished, out.finish_reason, out.num_output_tokens) == (True, "length", 1001)

    asyncio.run(run())


def test_a_reader_that_keeps_up_gets_every_output_as_it_came() -> None:
    async def run() -> None:
        stream = _Stream(asyncio.get_running_loop())
        got: list[list[int]] = []
        for i in range(3):
            stream.put(RequestOutput("r", [i], finished=i == 2))
            out = await stream.get()
            assert isinstance(out, RequestOutput)
            got.append(out.new_token_ids)
        assert got == [[0], [1], [2]]
        stream.put(ValueError("refused"))
        assert isinstance(await stream.get(), ValueError)

    asyncio.run(run())


def test_max_queued_requests_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.server.cli_args import parse_config

    _, config = parse_config(build_parser("decode"), [])
    assert config.scheduler.max_queued_requests == 256
    assert config.scheduler.max_admitted_requests == config.scheduler.max_num_seqs + 256
    argv = ["--max-num-seqs", "8", "--max-queued-requests", "0"]
    _, config = parse_config(build_parser("decode"), argv)
    assert config.scheduler.max_admitted_requests == 8
    with pytest.raises(SystemExit) as info:
        parse_config(build_parser("decode"), ["--max-queued-requests", "-1"])
    assert info.value.code == 2
    assert "--max-queued-requests: must be >= 0" in capsys.readouterr().err


def _upstream(status: int, code: str | None = None, retry_after: str | None = None):
    body = {"error": {"message": "m", "type": "t", "param": None, "code": code}}
    node = Node("http://10.0.0.2:8200", "decode")
    return UpstreamError(node, "x", status=status, body=body, retry_after=retry_after)


@pytest.mark.parametrize(
    "status, code, overloaded, node_fault",
    [
        (429, "overloaded", True, False),
        (429, None, True, False),
        (503, "overloaded", True, False),  # e.g. an engine that sheds load with a 503
        (503, "draining", False, True),
        (503, "engine_dead", False, True),
        (500, None, False, True),
        (400, None, False, False),
    ],
)
def test_the_proxy_tells_a_load_answer_from_a_node_failure(
    status: int, code: str | None, overloaded: bool, node_fault: bool
) -> None:
    err = _upstream(status, code, "3")
    assert (err.overloaded, err.node_fault) == (overloaded, node_fault)
    assert err.retry_after == "3"


def test_the_proxy_refuses_at_max_inflight_before_reading_the_body() -> None:
    from starlette.requests import Request

    from engine.httpkit.drain import Drainer
    from proxy.config import ProxyConfig
    from proxy.metrics import ProxyMetrics
    from proxy.nodes import NodePool
    from proxy.router import Router
    from proxy.serving import ProxyServing
    from proxy.validation import COMPLETIONS

    cfg = ProxyConfig(prefill=("http://10.0.0.1:8100",), decode=("http://10.0.0.2:8200",),
                      max_inflight=2)  # fmt: skip
    pool = NodePool(cfg.prefill, cfg.decode)
    serving = ProxyServing(cfg, pool, Router(pool), ProxyMetrics(pool), Drainer(frozenset()))
    serving.inflight, serving.reading = 1, 1  # one request in flight, one being read

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body of a refused request was read")

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "state": {"request_id": "r"}}  # fmt: skip
    resp = asyncio.run(serving.generate(Request(scope, receive), COMPLETIONS))
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert json.loads(resp.body)["error"]["code"] == "too_many_requests"


def test_a_stream_to_decode_nodes_that_just_refused_for_load_gets_the_429_even_when_p_is_faster() -> (
    None
):
    """Every decode node answered a request with 429; P answers a streamed request before
    D's refusal arrives. The client must get D's 429 (a status it can act on), not a 200
    stream with P's first token followed by an error event. Stand-in nodes on loopback."""
    from proxy.config import ProxyConfig
    from proxy.legs import Legs
    from proxy.metrics import ProxyMetrics
    from proxy.node_client import NodeClient
    from proxy.nodes import NodePool
    from proxy.retries import PassThrough
    from proxy.router import Router
    from proxy.session import Session
    from proxy.validation import COMPLETIONS, validate_request
    from tests.standin_http import SeenRequest, StandIn, answer

    refused = {
        "error": {"message": "at the limit", "type": "rate_limit_error", "code": "overloaded"}
    }

    async def prefill(req: SeenRequest) -> bytes:  # P: the first token at once
        if req.path == "/v1/abort":
            return answer(200, {})
        body = {"choices": [{"index": 0, "text": "6", "token_ids": [54]}], "model": "tiny"}
        return answer(200, body)

    async def decode(req: SeenRequest) -> bytes:
        if req.path == "/v1/abort":
            return answer(200, {})
        await asyncio.sleep(0.3)  # D: the refusal comes after P's answer
        return answer(429, refused, {"Retry-After": "2"})

    async def run(pool: NodePool, cfg: ProxyConfig, stream: bool) -> tuple[int, str | None]:
        body = {"prompt": "x", "max_tokens": 4, "stream": stream}
        req = validate_request(COMPLETIONS, json.dumps(body).encode(), ["tiny"], None)
        async with NodeClient(timeout=10) as client:
            legs = Legs(client)
            session = Session(req, "r", cfg, Router(pool), legs, ProxyMetrics(pool))
            try:
                if stream:
                    await session.start_stream()
                    chunks = [c async for c in session.events()]
                    return 200, "".join(chunks)
                await session.complete()
                return 200, None
            except PassThrough as e:
                return e.status, e.headers.get("Retry-After")
            finally:
                session.close()
                await legs.drain()  # the aborts of the refused legs

    async def main() -> list[tuple[int, str | None]]:
        async with StandIn(prefill) as p, StandIn(decode) as d1, StandIn(decode) as d2:
            cfg = ProxyConfig(prefill=(p.url,), decode=(d1.url, d2.url))
            pool = NodePool(cfg.prefill, cfg.decode)
            for node in pool.all():
                node.set_healthy(True)
                node.update_info(
                    {"side_channel": "tcp://10.0.0.1:5600"}, {"data": [{"id": "tiny"}]}
                )
            # The first (not streamed) request teaches the proxy that every D refuses.
            return [await run(pool, cfg, stream=False), await run(pool, cfg, stream=True)]

    assert asyncio.run(main()) == [(429, "2"), (429, "2")]
