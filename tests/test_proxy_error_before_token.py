"""A decode node's error before its first token, as a client of the proxy sees it.

No byte of the answer has gone to the client yet, so the proxy has not sent its headers
either: D's error event there is handled as D's answer of that error as an HTTP status
would be -- a failure of D retried on another node (502 ``upstream_error`` once
``--max-retries`` is spent), the client's own fault passed through as its 4xx with D's
body, load moved to a node not tried (429 with ``Retry-After`` when none is left) --
never a 200 stream holding only the error. Once P's first token went out (and none of
D's), D's error event is handled as D's connection breaking there: a failure reruns the
request on a pair that agrees on that token, load moves it, the client's 4xx ends the
stream with D's event. The proxy runs in process (its app, health checks included) over stand-in
nodes on loopback; chat completions, completions and /v1/responses, streamed and not
(a node answers a non-streamed request's error with its HTTP status: the same outcome).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from harness import sse_chunk_events, wait_for
from scripted_engine import ScriptedEngine, StubEngine, TemplateBytes

from engine.httpkit.serve import bind_socket, make_server
from engine.outputs import RequestOutput
from engine.server.app import build_app as build_node
from kvconnector.base import transfer_seed
from proxy.app import build_app
from proxy.config import ProxyConfig
from proxy.decode_events import carries_token
from proxy.nodes import NodePool
from tests.standin_http import SeenRequest, StandIn, answer, chunked, node_facts

pytestmark = pytest.mark.timeout(60)

Leg = Callable[[SeenRequest], Any]
SERVER = {"error": {"message": "engine failed", "type": "server_error", "param": None,
                    "code": None}}  # fmt: skip
CLIENT = {"error": {"message": "the grammar leaves no token", "type": "invalid_request_error",
                    "param": "response_format", "code": "structured_output_stuck"}}  # fmt: skip
VLLM_400 = {"error": {"message": "bad schema", "type": "BadRequestError", "param": None,
                      "code": 400}}  # vLLM's and SGLang's events carry the status  # fmt: skip
LOAD = {"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                  "code": "overloaded"}}  # fmt: skip
ENDPOINTS = {
    "completions": ("/v1/completions", {"prompt": "x", "max_tokens": 3}),
    "chat": ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}),
    "responses": ("/v1/responses", {"input": "x", "max_output_tokens": 3}),
}  # fmt: skip
WHOLE = {"disagg_min_prompt_tokens": 10**6}  # D alone: its stream is the whole answer
ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                     "token_ids": [], "finish_reason": None}], "model": "tiny"}  # fmt: skip


def _chat(req: SeenRequest) -> bool:
    return req.path == "/v1/chat/completions"


def _choice(chat: bool, ids: list[int], text: str, finish: str | None, key: str) -> Any:
    body = {key: {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"index": 0, "token_ids": ids, "finish_reason": finish, **body}


def _events(*events: Any) -> bytes:
    return chunked(200, [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"])  # fmt: skip


async def good(req: SeenRequest) -> bytes:
    """D's answer: tokens 7, 8, 9 ("t7t8t9")."""
    chat = _chat(req)
    if not req.json().get("stream"):
        choice = _choice(chat, [7, 8, 9], "t7t8t9", "length", "message")
        return answer(200, {"choices": [choice], "model": "tiny"})
    toks = [{"choices": [_choice(chat, [i], f"t{i}", "length" if i == 9 else None, "delta")],
             "model": "tiny"} for i in (7, 8, 9)]  # fmt: skip
    return _events(*([ROLE] if chat else []), *toks)


def error_first(event: dict[str, Any], status: int, delay: float = 0.0) -> Leg:
    """D failing before its first token: a stream opened (200; chat: its role chunk) whose
    first event is ``event``; a non-streamed request answered ``status`` with it; after
    ``delay`` seconds."""

    async def leg(req: SeenRequest) -> bytes:
        await asyncio.sleep(delay)
        if not req.json().get("stream"):
            return answer(status, event)
        return _events(*([ROLE] if _chat(req) else []), event)

    return leg


def _prefill(delay: float = 0.0) -> Leg:
    async def leg(req: SeenRequest) -> bytes:
        await asyncio.sleep(delay)
        choice = _choice(_chat(req), [7], "t7", "length", "message")
        return answer(200, {"choices": [choice], "kv_transfer_params": {"first_token": 7},
                            "model": "tiny"})  # fmt: skip

    return leg


def _node(role: str, leg: Leg) -> Any:
    """A stand-in node of ``role`` ("producer", "consumer"): healthy, its facts, aborts
    answered; its completions by ``leg``."""

    async def handler(req: SeenRequest) -> Any:
        facts = node_facts(req, role)
        return facts if facts is not None else await leg(req)

    return handler


@contextlib.asynccontextmanager
async def proxy_over(
    decodes: list[Any], prefill: Leg | tuple[str, Any] | None = None, **cfg_kw: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, list[StandIn], Any]]:
    """A client of an in-process proxy over one P (its leg, or a whole handler with
    ``("handler", h)``) and a D per entry of ``decodes`` (a leg, a whole handler, or the
    URL of a node; round robin: the first attempt goes to the first); the D's stand-ins
    and the proxy's node pool."""
    async with contextlib.AsyncExitStack() as stack:
        p_handler = (
            prefill[1] if isinstance(prefill, tuple) else _node("producer", prefill or _prefill())
        )
        p = await stack.enter_async_context(StandIn(p_handler))
        ds, urls = [], []
        for d in decodes:
            if isinstance(d, str):
                urls.append(d)
                continue
            handler = d[1] if isinstance(d, tuple) else _node("consumer", d)
            ds.append(await stack.enter_async_context(StandIn(handler)))
            urls.append(ds[-1].url)
        cfg = ProxyConfig(
            prefill=(p.url,), decode=tuple(urls), routing="round_robin",
            health_interval=0.2, **cfg_kw,
        )  # fmt: skip
        app = build_app(cfg)
        await stack.enter_async_context(app.router.lifespan_context(app))
        transport = httpx.ASGITransport(app=app)
        client = await stack.enter_async_context(
            httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=30)
        )
        yield client, ds, app.state.pool


def asked(d: StandIn) -> int:
    """How many completions ``d`` was asked for."""
    return len([r for r in d.seen if r.path.startswith(("/v1/completions", "/v1/chat"))])


async def post(client: httpx.AsyncClient, endpoint: str, stream: bool, **fields: Any) -> Any:
    path, body = ENDPOINTS[endpoint]
    return await client.post(path, json={"model": "tiny", **body, "stream": stream, **fields})


def answer_text(endpoint: str, resp: httpx.Response) -> tuple[str, list[Any]]:
    """The answer's text and its error events (a Responses stream's ``response.failed``)."""
    if resp.headers["content-type"].startswith("application/json"):
        body = resp.json()
        if endpoint == "responses":
            return body["output"][0]["content"][0]["text"], []
        choice = body["choices"][0]
        return (choice["message"]["content"] if endpoint == "chat" else choice["text"]), []
    events = sse_chunk_events([resp.text])
    if endpoint == "responses":
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        return text, [e for e in events if e["type"] == "response.failed"]
    errors = [e for e in events if "error" in e]
    pieces = [c.get("delta", {}).get("content") if endpoint == "chat" else c.get("text")
              for e in events for c in e.get("choices", [])]  # fmt: skip
    return "".join(p or "" for p in pieces), errors


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_decode_failure_before_any_token_is_retried_on_another_decode_node(
    endpoint: str, stream: bool
) -> None:
    """D1 fails the request before its first token (its stream's first event is an error;
    not streamed: its 500): the request moves to D2, whose answer the client gets whole,
    without an error (streamed, it was a 200 stream holding only D1's error)."""

    async def main() -> tuple[httpx.Response, list[int]]:
        async with proxy_over([error_first(SERVER, 500), good], **WHOLE) as (client, ds, _):
            resp = await post(client, endpoint, stream)
            return resp, [asked(d) for d in ds]

    resp, seen = asyncio.run(main())
    assert resp.status_code == 200, resp.text
    assert answer_text(endpoint, resp) == ("t7t8t9", []), resp.text
    assert seen == [1, 1]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_decode_failure_before_any_token_on_every_node_is_a_502(
    endpoint: str, stream: bool
) -> None:
    """Every D fails before its first token: once --max-retries is spent the client gets
    the proxy's 502 ``upstream_error`` as a JSON error body, not a 200 stream."""

    async def main() -> tuple[httpx.Response, list[int]]:
        legs = [error_first(SERVER, 500), error_first(SERVER, 500)]
        async with proxy_over(legs, **WHOLE) as (client, ds, _):
            resp = await post(client, endpoint, stream)
            return resp, [asked(d) for d in ds]

    resp, seen = asyncio.run(main())
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["code"] == "upstream_error", resp.text
    assert "engine failed" in resp.json()["error"]["message"]
    assert seen == [1, 1]


@pytest.mark.parametrize("mode", ["stream", "json", "after-p"])
def test_a_failure_on_the_only_decode_node_is_a_502_naming_it(mode: str) -> None:
    """The only D fails the request (its 500 event, or status): it leaves the rotation and
    no other D is left to retry on. The client gets what it gets when every D tried has
    failed (``--max-retries`` spent): 502 ``upstream_error`` naming D's error -- an
    ``upstream_error`` event after P's token went out. It got 503 ``no_healthy_nodes``
    ("no healthy decode node"), D's error nowhere, whenever the pool had one D."""
    delay = AFTER_P if mode == "after-p" else 0.0
    cfg = {} if mode == "after-p" else WHOLE

    async def main() -> tuple[httpx.Response, list[int]]:
        async with proxy_over([error_first(SERVER, 500, delay=delay)], **cfg) as (c, ds, _):
            resp = await post(c, "chat", mode != "json")
            return resp, [asked(d) for d in ds]

    resp, seen = asyncio.run(main())
    if mode == "after-p":
        assert resp.status_code == 200, resp.text
        text, errors = answer_text("chat", resp)
        assert text == "t7" and len(errors) == 1, resp.text
        error = errors[0]["error"]
    else:
        assert resp.status_code == 502, resp.text
        error = resp.json()["error"]
    assert error["code"] == "upstream_error", error
    assert "engine failed" in error["message"], error
    assert seen == [1]


@pytest.mark.parametrize(
    "mode", ["whole", "prefill-slow", "json"], ids=["d-whole", "prefill-slow", "json"]
)
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_the_clients_error_before_any_token_is_its_4xx(endpoint: str, mode: str) -> None:
    """D refuses the request itself before its first token (an ``invalid_request_error``
    event): the client gets that 400 with D's body, whether D's stream was the whole
    answer or came before a slow P's first token; no other node is asked and D stays in
    rotation (it was a 200 stream holding the error, or -- P slow -- D taken out of
    rotation and the request retried on D2)."""
    cfg = {} if mode == "prefill-slow" else WHOLE
    prefill = _prefill(3.0 if mode == "prefill-slow" else 0.0)

    async def main() -> tuple[httpx.Response, list[int], bool]:
        async with proxy_over([error_first(CLIENT, 400), good], prefill, **cfg) as (c, ds, pool):
            resp = await post(c, endpoint, mode != "json")
            return resp, [asked(d) for d in ds], pool.nodes("decode")[0].healthy

    resp, seen, healthy = asyncio.run(main())
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    param = "text.format" if endpoint == "responses" else "response_format"
    assert err == {**CLIENT["error"], "param": param}, err
    assert seen == [1, 0] and healthy


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_an_error_event_that_carries_its_status_is_answered_with_it(endpoint: str) -> None:
    """vLLM's and SGLang's streams carry the HTTP status in the error's ``code``: an event
    with 400 there before any token is the client's 400, D's body passed through."""

    async def main() -> tuple[httpx.Response, list[int]]:
        async with proxy_over([error_first(VLLM_400, 400), good], **WHOLE) as (client, ds, _):
            resp = await post(client, endpoint, True)
            return resp, [asked(d) for d in ds]

    resp, seen = asyncio.run(main())
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == "bad schema" and seen == [1, 0]


def test_a_load_error_before_any_token_on_every_node_is_a_429_with_retry_after() -> None:
    """Each D answers with load in its stream before any token: the request tries every
    D (not counted as retries, the nodes stay in rotation), then the client gets the
    429 and ``Retry-After``."""

    async def main() -> tuple[httpx.Response, list[int], list[bool]]:
        legs = [error_first(LOAD, 429)] * 3
        async with proxy_over(legs, **WHOLE) as (client, ds, pool):
            resp = await post(client, "chat", True)
            return resp, [asked(d) for d in ds], [n.healthy for n in pool.nodes("decode")]

    resp, seen, healthy = asyncio.run(main())
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1", resp.text
    assert resp.json()["error"]["message"] == "busy"
    assert seen == [1, 1, 1] and all(healthy)


# D's error comes this long after its leg was sent: P (answering at once) has had its
# first token streamed to the client by then.
AFTER_P = 0.5
GATEWAY = {"error": {"message": "kv transfer failed", "type": "GatewayTimeout", "param": None,
                     "code": 504}}  # fmt: skip


def _recording(seen: list[SeenRequest], leg: Leg) -> tuple[str, Any]:
    """A prefill node (``proxy_over``'s ``("handler", h)``) whose requests, its aborts
    included, go to ``seen``."""
    node = _node("producer", leg)

    async def handler(req: SeenRequest) -> Any:
        seen.append(req)
        return await node(req)

    return ("handler", handler)


def _legs(seen: list[SeenRequest]) -> list[dict[str, Any]]:
    """The bodies of the completion legs among ``seen``."""
    return [r.json() for r in seen if r.path.startswith(("/v1/completions", "/v1/chat"))]


def _aborted(seen: list[SeenRequest]) -> list[str]:
    """The transfer ids of the aborts among ``seen``."""
    return [r.json()["transfer_id"] for r in seen if r.path == "/v1/abort"]


@pytest.mark.parametrize(
    "event", [SERVER, {"error": "it broke"}, GATEWAY], ids=["server_error", "text", "504"]
)
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_decode_failure_after_the_prefill_token_is_rerun_on_another_pair(
    endpoint: str, event: dict[str, Any]
) -> None:
    """P's first token reached the client (the 200 with it), then D1's stream opens with
    a server error event (a KV transfer that failed, a worker error) before any token of
    its own: handled as D1's connection breaking there -- the attempt aborted on both
    nodes, the request rerun on a pair that agrees on P's token (P again, D2), unseeded
    with the seed the first transfer drew from, and the client gets D2's tokens after
    P's. It got P's token, D1's error event and [DONE]."""
    p_seen: list[SeenRequest] = []

    async def main() -> tuple[httpx.Response, list[StandIn]]:
        decodes = [error_first(event, 500, delay=AFTER_P), good]
        async with proxy_over(decodes, _recording(p_seen, _prefill())) as (client, ds, _):
            return await post(client, endpoint, True), ds

    resp, ds = asyncio.run(main())  # the proxy's exit waited for its aborts
    assert resp.status_code == 200, resp.text
    assert answer_text(endpoint, resp) == ("t7t8t9", []), resp.text
    assert [asked(d) for d in ds] == [1, 1]
    first, rerun = _legs(p_seen)  # P was asked again, to check its first token
    tid = _legs(ds[0].seen)[0]["kv_transfer_params"]["transfer_id"]
    assert first["kv_transfer_params"]["transfer_id"] == tid
    assert rerun["seed"] == transfer_seed(tid) and "seed" not in first
    assert rerun["kv_transfer_params"]["transfer_id"] != tid
    assert tid in _aborted(ds[0].seen) and tid in _aborted(p_seen)


def test_a_decode_failure_after_the_prefill_token_on_every_pair_ends_with_an_error_event() -> None:
    """Every D fails so after P's token: once --max-retries is spent the stream ends with
    the proxy's ``upstream_error`` event (naming D's error) and [DONE]; each D was tried
    once."""

    async def main() -> tuple[httpx.Response, list[int]]:
        legs = [error_first(SERVER, 500, delay=AFTER_P)] * 2
        async with proxy_over(legs, max_retries=1) as (client, ds, _):
            return await post(client, "chat", True), [asked(d) for d in ds]

    resp, seen = asyncio.run(main())
    assert resp.status_code == 200, resp.text
    text, errors = answer_text("chat", resp)
    assert text == "t7" and len(errors) == 1, resp.text
    assert errors[0]["error"]["code"] == "upstream_error", errors
    assert "engine failed" in errors[0]["error"]["message"], errors
    assert resp.text.endswith("data: [DONE]\n\n")
    assert seen == [1, 1]


def test_a_response_failing_after_the_prefill_token_closes_its_open_message() -> None:
    """Every D fails after P's token on ``/v1/responses``: as OpenAI's streams, the open
    message is closed before the failure -- its ``.done`` events carry the text streamed
    so far (``t7``), status ``incomplete`` -- then ``error`` and ``response.failed``,
    whose ``output`` holds that same item. It listed the message ``in_progress`` with no
    text, and no ``.done`` event was sent."""

    async def main() -> httpx.Response:
        legs = [error_first(SERVER, 500, delay=AFTER_P)] * 2
        async with proxy_over(legs, max_retries=1) as (client, _, _pool):
            return await post(client, "responses", True)

    resp = asyncio.run(main())
    assert resp.status_code == 200, resp.text
    events = sse_chunk_events([resp.text])
    kinds = [e["type"] for e in events]
    assert kinds[-5:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "error", "response.failed",
    ], kinds  # fmt: skip
    item = events[-3]["item"]
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "t7", item
    assert events[-5]["text"] == events[-4]["part"]["text"] == "t7"
    assert events[-1]["response"]["output"] == [item], events[-1]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_rerun_after_a_decode_error_event_must_agree_on_the_prefill_token() -> None:
    """The rerun's P samples another first token than the one the client has (a node
    with other weights): the stream ends with ``retry_diverged``, never two answers
    spliced; the diverged attempt is aborted on both nodes."""
    p_seen: list[SeenRequest] = []

    async def prefill(req: SeenRequest) -> bytes:
        tok = 7 if len(_legs(p_seen)) == 1 else 8
        choice = _choice(_chat(req), [tok], f"t{tok}", "length", "message")
        return answer(200, {"choices": [choice], "kv_transfer_params": {"first_token": tok},
                            "model": "tiny"})  # fmt: skip

    async def main() -> tuple[httpx.Response, list[StandIn]]:
        decodes = [error_first(SERVER, 500, delay=AFTER_P), good]
        async with proxy_over(decodes, _recording(p_seen, prefill)) as (client, ds, _):
            return await post(client, "completions", True), ds

    resp, ds = asyncio.run(main())
    text, errors = answer_text("completions", resp)
    assert text == "t7" and len(errors) == 1, resp.text
    assert errors[0]["error"]["code"] == "retry_diverged", errors
    rerun = _legs(ds[1].seen)[0]["kv_transfer_params"]["transfer_id"]
    assert rerun in _aborted(ds[1].seen) and rerun in _aborted(p_seen)


@pytest.mark.parametrize("event", [CLIENT, VLLM_400], ids=["invalid_request", "code_400"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_the_clients_error_after_the_prefill_token_ends_the_stream_with_it(
    endpoint: str, event: dict[str, Any]
) -> None:
    """P's first token reached the client, then D refuses the request itself (a 4xx
    event: the client's fault, another node would refuse it too): the stream holds P's
    token, D's error event as D sent it, and [DONE]; no other node is asked, D stays in
    rotation."""

    async def main() -> tuple[httpx.Response, list[int], bool]:
        decodes = [error_first(event, 400, delay=AFTER_P), good]
        async with proxy_over(decodes) as (client, ds, pool):
            resp = await post(client, endpoint, True)
            return resp, [asked(d) for d in ds], pool.nodes("decode")[0].healthy

    resp, seen, healthy = asyncio.run(main())
    assert resp.status_code == 200, resp.text
    text, errors = answer_text(endpoint, resp)
    assert text == "t7" and errors == [event], resp.text
    assert resp.text.endswith("data: [DONE]\n\n")
    assert seen == [1, 0] and healthy


def test_the_clients_error_after_the_prefill_token_fails_a_response_as_the_clients() -> None:
    """As above on ``/v1/responses``: the stream ends with ``response.failed`` whose
    ``error.code`` is the client's (``invalid_prompt``, not ``server_error``), D's own
    code after its message."""

    async def main() -> tuple[httpx.Response, list[int]]:
        async with proxy_over([error_first(CLIENT, 400, delay=AFTER_P), good]) as (client, ds, _):
            resp = await post(client, "responses", True)
            return resp, [asked(d) for d in ds]

    resp, seen = asyncio.run(main())
    text, failed = answer_text("responses", resp)
    assert text == "t7" and len(failed) == 1, resp.text
    assert failed[0]["response"]["error"] == {
        "code": "invalid_prompt",
        "message": "the grammar leaves no token (structured_output_stuck)",
    }
    assert seen == [1, 0]


def test_a_load_error_after_the_prefill_token_moves_to_a_decode_node_not_tried() -> None:
    """P's first token reached the client, then D1 answers with load in its stream: as
    D1's 429 there, the request moves to a decode node it has not tried (a pair that
    agrees on P's token), D1 stays in rotation and no retry is counted."""

    async def main() -> tuple[httpx.Response, list[int], bool]:
        decodes = [error_first(LOAD, 429, delay=AFTER_P), good]
        async with proxy_over(decodes, max_retries=0) as (client, ds, pool):
            resp = await post(client, "chat", True)
            return resp, [asked(d) for d in ds], pool.nodes("decode")[0].healthy

    resp, seen, healthy = asyncio.run(main())
    assert resp.status_code == 200, resp.text
    assert answer_text("chat", resp) == ("t7t8t9", []), resp.text
    assert seen == [1, 1] and healthy


def test_a_load_error_after_the_prefill_token_on_every_node_ends_with_an_error_event() -> None:
    """Every D answers with load after P's token: each is tried once (the nodes stay in
    rotation), then the stream ends with D's load answer as its error event, and [DONE]."""

    async def main() -> tuple[httpx.Response, list[int], list[bool]]:
        decodes = [error_first(LOAD, 429, delay=AFTER_P)] * 2
        async with proxy_over(decodes, max_retries=0) as (client, ds, pool):
            resp = await post(client, "chat", True)
            return resp, [asked(d) for d in ds], [n.healthy for n in pool.nodes("decode")]

    resp, seen, healthy = asyncio.run(main())
    text, errors = answer_text("chat", resp)
    assert text == "t7" and len(errors) == 1, resp.text
    assert "busy" in errors[0]["error"]["message"], errors
    assert resp.text.endswith("data: [DONE]\n\n")
    assert seen == [1, 1] and all(healthy)


NOT_RESERVED = {"error": {"message": "no decode node reserved blocks within 4 s",
                          "type": "invalid_request_error", "param": None,
                          "code": "kv_transfer_not_reserved"}}  # fmt: skip


@pytest.mark.parametrize("why", ["decode-load", "no-room"])
def test_load_with_no_node_left_after_the_prefill_token_ends_with_the_load_answer(
    why: str,
) -> None:
    """P's first token reached the client, then no node is left for load: every D
    answered with load (``decode-load``), or D1 did and the rerun's P ended its leg with
    409 ``kv_transfer_not_reserved`` (``no-room``). Before the headers these are the
    node's 429 (its body) and the proxy's 503 ``overloaded`` with ``Retry-After``; after
    them the stream ends with that same error object, load to retry later -- it was the
    proxy's ``upstream_error`` saying the request was "refused" ("busy"), as for a
    failed node. No node leaves the rotation and every node's load is released."""
    p_calls: list[SeenRequest] = []

    async def prefill(req: SeenRequest) -> bytes:
        p_calls.append(req)
        if why == "no-room" and len(p_calls) > 1:
            return answer(409, NOT_RESERVED)
        return await _prefill()(req)

    async def waiting(req: SeenRequest) -> bytes:
        await asyncio.sleep(30)  # never reserves: its leg waits until it is cancelled
        return answer(200, {})

    d2 = error_first(LOAD, 429, delay=AFTER_P) if why == "decode-load" else waiting

    async def main() -> tuple[httpx.Response, list[bool], list[int]]:
        decodes = [error_first(LOAD, 429, delay=AFTER_P), d2]
        async with proxy_over(decodes, prefill, max_retries=0) as (client, _, pool):
            resp = await post(client, "chat", True)
            return resp, [n.healthy for n in pool.all()], [n.outstanding for n in pool.all()]

    resp, healthy, load = asyncio.run(main())
    assert resp.status_code == 200, resp.text
    text, errors = answer_text("chat", resp)
    assert text == "t7" and len(errors) == 1, resp.text
    if why == "decode-load":
        assert errors == [LOAD], errors  # the body D's 429 would have carried
    else:
        assert errors[0]["error"]["code"] == "overloaded", errors
        assert "no room" in errors[0]["error"]["message"], errors
    assert resp.text.endswith("data: [DONE]\n\n")
    assert all(healthy) and load == [0, 0, 0], (healthy, load)


def test_a_decode_node_that_hangs_before_its_first_token_is_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D1 opens its stream (a chat stream's role chunk) and then hangs, its health checks
    unanswered too: the wait for its first token ends once D1 misses its checks, and the
    request moves to D2 -- the client gets D2's answer, not D1's role chunk and an error
    event."""
    import proxy.legs

    monkeypatch.setattr(proxy.legs, "MIN_HUNG_S", 0.5)
    hung = asyncio.Event()

    async def stalled(req: SeenRequest) -> Any:
        if req.path == "/health" and hung.is_set():
            await asyncio.sleep(30)
        if req.path != "/v1/chat/completions":
            return await _node("consumer", good)(req)

        async def pieces() -> AsyncIterator[bytes]:
            role = f"data: {json.dumps(ROLE)}\n\n".encode()
            yield b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            yield f"{len(role):x}\r\n".encode() + role + b"\r\n"
            hung.set()
            await asyncio.sleep(30)

        return pieces()

    async def main() -> tuple[httpx.Response, list[int], float]:
        decodes = [("handler", stalled), good]
        async with proxy_over(decodes, health_timeout=0.5, **WHOLE) as (client, ds, _):
            wall = time.monotonic()
            resp = await post(client, "chat", True)
            return resp, [asked(d) for d in ds], time.monotonic() - wall

    resp, seen, took = asyncio.run(main())
    assert resp.status_code == 200, resp.text
    assert answer_text("chat", resp) == ("t7t8t9", []), resp.text
    assert seen == [1, 1] and took < 20


class FailingEngine(StubEngine):
    """Fails every request before its first token: an engine fault, or (``code``
    ``structured_output_stuck``) the request's own."""

    def __init__(self, code: str | None = None) -> None:
        super().__init__(TemplateBytes())
        self.code, self.model_name = code, "tiny"

    async def generate(self, request_id: str, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        yield RequestOutput(request_id, [], True, "error", error="engine failed",
                            error_code=self.code)  # fmt: skip


@contextlib.contextmanager
def node_served(engine: Any) -> Iterator[str]:
    """A node's app over ``engine``, served by uvicorn on a loopback port (its own thread
    and loop): its URL."""
    sock = bind_socket("127.0.0.1", 0)
    srv = make_server(build_node(engine), log_level="WARNING", banner="", own_signals=True)
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        wait_for(lambda: srv.started, 30, "the node to serve")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(10)
        sock.close()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_real_decode_node_answers_a_failure_before_any_token_with_its_status(
    endpoint: str,
) -> None:
    """A node's own server never opens a stream before its first token: an engine that
    fails the request first is the node's 500 (or its 400 when the request is at fault),
    so through the proxy the client gets the retry on another node, or the 400 -- as
    before this change (the error events above are other servers' and the exception)."""
    scripted = ScriptedEngine("t7t8t9")
    scripted.model_name = "tiny"
    with (
        node_served(FailingEngine()) as broken,
        node_served(FailingEngine("structured_output_stuck")) as refusing,
        node_served(scripted) as fine,
    ):

        async def main(decodes: list[Any]) -> httpx.Response:
            async with proxy_over(decodes, **WHOLE) as (client, _, _):
                return await post(client, endpoint, True)

        retried = asyncio.run(main([broken, fine]))
        refused = asyncio.run(main([refusing, fine]))
    assert retried.status_code == 200, retried.text
    assert answer_text(endpoint, retried) == ("t7t8t9", []), retried.text
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "structured_output_stuck", refused.text


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (SERVER["error"], 500),
        (CLIENT["error"], 400),
        (VLLM_400["error"], 400),
        ({"message": "timeout", "type": "GatewayTimeout", "code": 504}, 504),
        ({"message": "x", "type": "BadRequestError", "code": True}, 500),  # not a status
        ({"message": "x", "type": "server_error", "code": 200}, 500),
        ({"message": "full", "type": "server_error", "code": "overloaded"}, 503),
        (LOAD["error"], 429),
        ({"message": "x", "type": "WeirdError"}, 500),  # an unknown type, no code
        ({"message": "x"}, 500),  # neither
        # A status as a string (a gateway's rendering of vLLM's int): the status it names.
        ({"message": "x", "type": "BadRequestError", "code": "400"}, 400),
        ({"message": "x", "type": "ServiceUnavailable", "code": "503"}, 503),
        ({"message": "x", "type": "server_error", "code": " 400"}, 500),  # not a status
        ({"message": "x", "type": "server_error", "code": "200"}, 500),
        # OpenAI's string codes (its type "requests"/"tokens" for a rate limit).
        ({"message": "slow down", "type": "requests", "code": "rate_limit_exceeded"}, 429),
        ({"message": "too long", "type": None, "code": "context_length_exceeded"}, 400),
        ({"message": "x", "type": None, "code": "server_error"}, 500),
    ],
)
def test_an_error_event_stands_for_the_status_it_names(error: dict[str, Any], status: int) -> None:
    from proxy.legs import event_status

    assert event_status(error) == status


def test_an_error_event_without_an_object_is_the_nodes_failure() -> None:
    from proxy.legs import event_error

    node = NodePool((), ("http://127.0.0.1:1",)).nodes("decode")[0]
    err = event_error(node, {"error": "it broke"})
    assert err.status == 500 and err.node_fault
    assert err.body == {"error": {"message": "it broke", "type": "server_error", "param": None,
                                  "code": None}}  # fmt: skip


def test_the_look_ahead_stops_at_the_answers_first_text_even_without_token_ids() -> None:
    """A role chunk is no token; a piece of the answer is one, ``token_ids`` or not (the
    client's headers wait for it: a node that leaves the ids out must not hold them)."""
    assert not carries_token(ROLE)
    for choice in ({"index": 0, "text": "a"}, {"index": 0, "delta": {"content": "a"}},
                   {"index": 0, "delta": {"tool_calls": [{"index": 0}]}},
                   {"index": 0, "delta": {"reasoning_content": "hm"}}):  # fmt: skip
        assert carries_token({"choices": [choice]}), choice
