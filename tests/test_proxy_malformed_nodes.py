"""Nodes that answer what no node sends, against stand-in nodes on loopback: the proxy
treats the node as failed (the request moves on, or its stream ends with an error event
and [DONE]), never answers the client 500 or passes a node's odd status through, never
blames the other node of the pair, and one node's odd answers change no other node's
health. Found by a fault round against the proxy (each case crashed it before)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from harness import sse_chunk_events
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import ProxyConfig
from proxy.health import HealthChecker
from proxy.node_client import NodeClient, NodeProtocolError
from proxy.nodes import NodePool
from tests.standin_http import SeenRequest, StandIn, answer, chunked
from tests.test_proxy_waits import (
    PREFILL_ANSWER,
    _complete_through_session,
    _node,
    _p_and_two_d,
    _ready_pool,
    _session,
    _sse,
    _stream_through_session,
    _token,
)

pytestmark = pytest.mark.timeout(60)

NAN_CHUNK = b'{"choices": [{"index": 0, "text": "b", "token_ids": [8], "logprobs": {"token_logprobs": [NaN]}}]}'
DEEP = b"[" * 200_000 + b"]" * 200_000  # json.loads: RecursionError, not ValueError
D_ANSWER = {
    "choices": [{"index": 0, "text": "xyz", "finish_reason": "length", "token_ids": [7, 8, 9]}],
    "model": "tiny",
}


def _raw_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


@contextlib.asynccontextmanager
async def _one_pair(prefill: Any, decode: Any) -> AsyncIterator[tuple[ProxyConfig, NodePool]]:
    """One P and one D answering with ``prefill`` and ``decode``: the config, a ready pool."""
    async with StandIn(_node(prefill)) as p, StandIn(_node(decode)) as d:
        cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,), health_interval=0.1)
        yield cfg, _ready_pool(cfg)


async def _prefill(req: SeenRequest) -> bytes:
    return answer(200, {**PREFILL_ANSWER, "model": "tiny"})


async def _good_decode(req: SeenRequest) -> bytes:
    if req.json().get("stream"):
        return chunked(200, _sse(_token(7), _token(8), _token(9, "length")))
    return answer(200, D_ANSWER)


@pytest.mark.parametrize(
    "garbage",
    [
        b"[1]",
        b"5",
        json.dumps({"choices": 5}).encode(),
        json.dumps({"choices": [5]}).encode(),
        json.dumps({"choices": [{"index": 0, "token_ids": 5}]}).encode(),
        json.dumps({"choices": [{"index": 0, "text": 5, "token_ids": [9]}]}).encode(),
        DEEP,
        NAN_CHUNK,  # not JSON: a node's encoder refuses it; it reached clients unparseable
    ],
    ids=["list", "int", "choices-int", "choice-int", "token-ids-int", "text-int", "deep", "nan"],
)
def test_a_malformed_event_mid_stream_ends_it_with_an_error_event(garbage: bytes) -> None:
    """D streams a token, then an event no node sends: the client has P's and D's
    tokens, then an error event and [DONE] (not a cut connection); D leaves the rotation."""

    async def decode(req: SeenRequest) -> bytes:
        pieces = _sse(_token(7), _token(8))[:-1] + [_raw_event(garbage)] + [b"data: [DONE]\n\n"]
        return chunked(200, pieces)

    async def main() -> None:
        async with _one_pair(_prefill, decode) as (cfg, pool):
            ids, events = await _stream_through_session(cfg, pool)
            assert ids == [7, 8], events
            assert "error" in events[-1], events
            d_node = pool.nodes("decode")[0]
            assert not d_node.healthy and pool.nodes("prefill")[0].healthy

    asyncio.run(main())


def _d2_answers_after_d1_sends(reply: bytes) -> None:
    """D1 answers a non-streamed request with ``reply``: the request is answered by D2,
    and D1 leaves the rotation."""

    async def bad(req: SeenRequest) -> bytes:
        return reply

    async def main() -> None:
        async with _p_and_two_d(_prefill, bad, _good_decode) as (cfg, pool, _d1):
            body = await _complete_through_session(cfg, pool)
            assert body["choices"][0]["token_ids"] == [7, 8, 9]
            assert [n.healthy for n in pool.nodes("decode")] == [False, True]

    asyncio.run(main())


@pytest.mark.parametrize(
    "raw",
    [b"[1, 2]", DEEP, json.dumps({"choices": [{"index": 0, "message": 5}]}).encode(), b"{}"],
    ids=["list", "deep", "message-int", "no-choices"],
)
def test_a_malformed_decode_answer_moves_the_request_to_another_decode_node(raw: bytes) -> None:
    """A non-streamed answer of D1 that is no completion: the request is answered by D2
    (it was a 500 from the proxy, D1 still in rotation)."""
    _d2_answers_after_d1_sends(answer(200, raw=raw))


def _status_answer(status: int) -> bytes:
    if status == 204:
        return b"HTTP/1.1 204 X\r\n\r\n"
    return answer(status, {"error": {"message": "odd"}}, {"Location": "http://elsewhere/"})


@pytest.mark.parametrize("status", [101, 204, 206, 302])
def test_a_decode_node_answering_an_odd_status_is_a_failed_node_not_the_clients_answer(
    status: int,
) -> None:
    """D1 answers 101/204/206/302: not passed to the client (it got 206 or 302 before,
    or a broken connection for 101); the request moves to D2 and D1 leaves the rotation."""
    _d2_answers_after_d1_sends(_status_answer(status))


PREFILL_FAULTS = {
    "text-int": lambda: answer(200, {**PREFILL_ANSWER, "choices": [{"index": 0, "text": 5}]}),
    "message-int": lambda: answer(200, {**PREFILL_ANSWER, "choices": [{"message": 5}]}),
    "first-token-str": lambda: answer(
        200, {**PREFILL_ANSWER, "kv_transfer_params": {"first_token": "7"}}
    ),
    "deep": lambda: answer(200, raw=DEEP),
    # "²" passes str.isdigit() and fails int(): a ValueError, not the client's fault
    "content-length-superscript": lambda: (
        "HTTP/1.1 200 X\r\nContent-Length: \u00b2\r\n\r\n{}".encode("latin-1")
    ),
    "status-302": lambda: _status_answer(302),
    "status-204": lambda: _status_answer(204),
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
@pytest.mark.parametrize("fault", sorted(PREFILL_FAULTS))
def test_a_malformed_prefill_answer_fails_the_prefill_node_and_decode_answers(
    fault: str, stream: bool
) -> None:
    """P's answer is malformed and no other P is ready: D's answer (it recomputes the
    prompt when no KV comes) is the client's; P leaves the rotation, D stays (a 500 or
    302 reached the client before, and one fault blamed the healthy D)."""

    p_answered = asyncio.Event()

    async def prefill(req: SeenRequest) -> bytes:
        p_answered.set()
        return PREFILL_FAULTS[fault]()

    async def decode(req: SeenRequest) -> bytes:
        await p_answered.wait()  # as with real nodes: D's answer comes after P's
        await asyncio.sleep(0.1)
        return await _good_decode(req)

    async def main() -> None:
        async with _one_pair(prefill, decode) as (cfg, pool):
            if stream:
                ids, events = await _stream_through_session(cfg, pool)
                assert ids == [7, 8, 9] and "error" not in events[-1], events
            else:
                body = await _complete_through_session(cfg, pool)
                assert body["choices"][0]["token_ids"] == [7, 8, 9]
            assert not pool.nodes("prefill")[0].healthy
            assert pool.nodes("decode")[0].healthy

    asyncio.run(main())


async def _endless_line(req: SeenRequest) -> AsyncIterator[bytes]:
    async def pieces() -> AsyncIterator[bytes]:
        yield b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        while True:
            piece = b"x" * 65536
            yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
            await asyncio.sleep(0)

    return pieces()


def test_a_stream_without_newlines_fails_at_the_line_limit() -> None:
    """A node sending bytes without a newline: the read fails once a line passes the
    client's limit (it grew the proxy's memory, quadratically in CPU, without end)."""

    async def main() -> None:
        async with (
            StandIn(_endless_line) as node,
            NodeClient(timeout=5, max_body_bytes=1 << 20) as client,
        ):
            resp = await client.send_stream("POST", node.url + "/v1/completions", json={})
            with pytest.raises(NodeProtocolError, match="line"):
                async with asyncio.timeout(20):
                    async for _line in resp.aiter_lines():
                        pass
            assert client.in_flight == 0  # the connection was given up

    asyncio.run(main())


KV_INFO = {"side_channel": "tcp://127.0.0.1:1", "incarnation": "i1"}


def _facts(models: Any, health_delay: float = 0.0) -> Any:
    async def handler(req: SeenRequest) -> bytes:
        if req.path == "/health":
            await asyncio.sleep(health_delay)
            return answer(200, {})
        if req.path == "/v1/kv_transfer_info":
            return answer(200, KV_INFO)
        return answer(200, raw=models) if isinstance(models, bytes) else answer(200, models)

    return handler


async def _bad_health(req: SeenRequest) -> bytes:
    return "HTTP/1.1 200 X\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1")


@pytest.mark.parametrize(
    "bad",
    [
        _facts({"data": {"x": 1}}),
        _facts({"data": 5}),
        _facts(DEEP),
        _bad_health,
    ],
    ids=["models-dict", "models-int", "models-deep", "health-content-length"],
)
def test_a_node_with_malformed_health_answers_is_unhealthy_and_others_are_checked(bad: Any) -> None:
    """One node's malformed /health or /v1/models: that node is out of the rotation, and
    the round still decides a slower healthy node (the first exception ended the round,
    the bad node stayed routable and the others' checks ran on unattended)."""

    good_models = {"data": [{"id": "tiny", "max_model_len": 64}]}

    async def main() -> None:
        async with (
            StandIn(bad) as b,
            StandIn(_facts(good_models, health_delay=0.3)) as g,
            NodeClient(timeout=5) as client,
        ):
            pool = NodePool((), (b.url, g.url))
            bad_node, good_node = pool.nodes("decode")
            bad_node.set_healthy(True)  # it was healthy; now it answers garbage
            await HealthChecker(pool, client, interval=1.0).check_all()
            assert not bad_node.healthy
            assert good_node.healthy and good_node.model == "tiny"

    asyncio.run(main())


def test_a_node_that_left_the_pool_with_requests_on_it_is_still_checked() -> None:
    """D leaves the pool (deregistered, or gone from DNS) while a request is on it: its
    health is still checked until that request ends, so a D that hangs after leaving is
    still found hung (``Attempt.d_gone`` reads its missed checks); the request waited
    for --request-timeout before."""

    async def hung(req: SeenRequest) -> bytes:
        await asyncio.sleep(30)
        return answer(200, {})

    async def main() -> None:
        async with StandIn(hung) as d, NodeClient(timeout=0.2) as client:
            pool = NodePool((), (d.url,))
            node = pool.nodes("decode")[0]
            node.outstanding = 1  # a request's leg holds it
            pool.remove(node, "deregistered")
            checker = HealthChecker(pool, client, interval=1.0)
            for _ in range(3):
                await checker.check_all()
            assert node.unreachable_checks == 3 and node.unreachable
            node.outstanding = 0  # its last request ended: no longer checked
            assert node not in pool.watched()
            await checker.stop()

    asyncio.run(main())


async def _chat_stream(cfg: Any, pool: NodePool) -> tuple[list[int], list[dict[str, Any]]]:
    """The token ids and events of one streamed chat request through a Session."""
    from proxy.legs import Legs
    from proxy.metrics import ProxyMetrics
    from proxy.router import Router
    from proxy.session import Session
    from proxy.validation import CHAT, validate_request

    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
    req = validate_request(CHAT, json.dumps(body).encode(), ["tiny"], None)
    async with NodeClient(timeout=20) as client:
        legs = Legs(client)
        session = Session(req, "r", cfg, Router(pool), legs, ProxyMetrics(pool))
        try:
            await asyncio.wait_for(session.start_stream(), 20)
            chunks = [c async for c in session.events()]
        finally:
            session.close()
            await legs.drain()
    events = sse_chunk_events(chunks)  # a chunk may hold several events
    ids = [t for e in events for ch in e.get("choices", []) for t in ch.get("token_ids") or []]
    return ids, events


def _chat_token(i: int, finish: str | None = None, **delta: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": f"t{i}", **delta}, "token_ids": [i]}
    return {"choices": [{**choice, "finish_reason": finish}], "model": "tiny"}


CHAT_PREFILL = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "t7"},
                 "finish_reason": "length", "token_ids": [7]}],
    "kv_transfer_params": {"first_token": 7}, "model": "tiny",
}  # fmt: skip


@pytest.mark.parametrize("fault", ["delta-null", "message-null"])
def test_a_null_delta_or_message_fails_its_node_not_the_proxy(fault: str) -> None:
    """Chat: D1's first event has ``"delta": null`` (or P's answer ``"message": null``):
    that node failed, the request moves on (D2) or D answers alone; before, the proxy's
    rewrite raised (an internal-error event, or a 500) and every node stayed healthy."""

    async def prefill(req: SeenRequest) -> bytes:
        if fault == "message-null":
            return answer(200, {**CHAT_PREFILL, "choices": [{"index": 0, "message": None}]})
        return answer(200, CHAT_PREFILL)

    async def bad_decode(req: SeenRequest) -> bytes:
        first = {"choices": [{"index": 0, "delta": None, "token_ids": [], "finish_reason": None}]}
        return chunked(200, _sse(first, _chat_token(8), _chat_token(9, "length")))

    async def good_decode(req: SeenRequest) -> bytes:
        events = [_chat_token(7, role="assistant"), _chat_token(8), _chat_token(9, "length")]
        return chunked(200, _sse(*events))

    d1 = bad_decode if fault == "delta-null" else good_decode

    async def main() -> None:
        async with _p_and_two_d(prefill, d1, good_decode) as (cfg, pool, _s1):
            ids, events = await _chat_stream(cfg, pool)
            assert ids == [7, 8, 9] and "error" not in events[-1], events
            p, (n1, n2) = pool.nodes("prefill")[0], pool.nodes("decode")
            if fault == "delta-null":
                assert p.healthy and not n1.healthy and n2.healthy
            else:
                assert not p.healthy and n1.healthy

    asyncio.run(main())


def test_nan_in_a_decode_answer_moves_the_request_to_another_decode_node() -> None:
    """A non-streamed answer holding ``Infinity``: D1 failed, D2 answers (the proxy's
    JSON encoder refused it: a 500)."""
    raw = json.dumps(D_ANSWER).replace("[7, 8, 9]", '[7, 8, 9], "x": Infinity')
    _d2_answers_after_d1_sends(answer(200, raw=raw.encode()))


def test_the_proxy_logs_each_requests_end(caplog: pytest.LogCaptureFixture) -> None:
    """The proxy logged where a request went, never how it ended: an operator could not see
    from its log when (or whether) a request finished."""

    async def main() -> None:
        async with _one_pair(_prefill, _good_decode) as (cfg, pool):
            body = await _complete_through_session(cfg, pool)
            assert body["choices"][0]["token_ids"] == [7, 8, 9]
            await _stream_through_session(cfg, pool)

    with caplog.at_level("INFO", logger="proxy.session"):
        asyncio.run(main())
    ends = [r.getMessage() for r in caplog.records if " finished: " in r.getMessage()]
    assert len(ends) == 2 and all(
        e.startswith("request r finished: ok after 1 attempt") for e in ends
    ), ends


@pytest.mark.parametrize("kind", ["server", "client"])
@pytest.mark.parametrize("prestream", [True, False], ids=["prestreamed", "whole-from-d"])
def test_a_decode_error_event_followed_by_done_leaves_the_request_failed(
    prestream: bool, kind: str
) -> None:
    """D streams a token, its own error event, then [DONE]: the client gets an error and
    [DONE]; the session's outcome stays "error" (a review asked whether D's [DONE] made it
    "ok": the relay ends at the error event and never reads the [DONE]), counted once as
    ``stream_error``. A server error is D's failure, as its stream breaking there: the
    proxy's ``upstream_error`` naming it, and D leaves the rotation (it stayed, "D
    reported it itself", while the same event before its first token took it out); the
    client's 4xx is D's answer to it: D's event as sent, D stays in rotation."""
    error: dict[str, Any] = {"error": {"message": "engine died", "type": "server_error"}}
    if kind == "client":
        error = {"error": {"message": "bad", "type": "invalid_request_error", "code": None}}

    async def decode(req: SeenRequest) -> bytes:
        return chunked(200, _sse(_token(7), _token(8), error))

    async def main() -> None:
        fields = {} if prestream else {"stop": ["zz"]}
        async with (
            _one_pair(_prefill, decode) as (cfg, pool),
            _session(cfg, pool, stream=True, **fields) as s,
        ):
            await asyncio.wait_for(s.start_stream(), 20)
            events = sse_chunk_events([c async for c in s.events()])
            assert s.outcome == "error", (s.outcome, events)
            if kind == "client":
                assert events[-1] == error, events
            else:
                assert events[-1]["error"]["code"] == "upstream_error", events
                assert "engine died" in events[-1]["error"]["message"], events
            scrape = text_string_to_metric_families(s.metrics.render().decode())
            errors = {
                x.labels["kind"]: x.value
                for fam in scrape
                for x in fam.samples
                if x.name == "pdproxy_request_errors_total"
            }
            assert errors["stream_error"] == 1 and errors["client_disconnect"] == 0, errors
            assert pool.nodes("decode")[0].healthy == (kind == "client")
            assert pool.nodes("prefill")[0].healthy

    asyncio.run(main())
