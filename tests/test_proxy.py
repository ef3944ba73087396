"""The proxy end to end: real prefill/decode nodes (tiny model, NIXL) and the real proxy.

One colocated node (``--kv-connector none``) gives the reference answers; 2 prefill and
2 decode nodes sit behind the proxy. All are subprocesses, stopped by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from typing import Any

import httpx
import openai
import pytest
from harness import (
    GREEDY,
    MODEL,
    NIXL,
    PD,
    Proc,
    Procs,
    free_port,
    kv_pool_full,
    metric,
    node_generate_requests,
    sse_data,
    sse_events,
    stream_ids,
    wait_for,
    wait_healthy,
)

pytestmark = pytest.mark.slow


class Cluster:
    def __init__(self, procs: Procs) -> None:
        self.procs = procs
        self.pd: PD = procs.pd(2, 2, "--num-blocks", "256", colocated=True)
        self.colo: Proc = self.pd.colocated  # type: ignore[assignment]
        self.prefill, self.decode, self.nodes = self.pd.prefill, self.pd.decode, self.pd.nodes
        self.proxy = self.start_proxy("proxy", wait=False)
        # Same, but D drops the first token itself (kv_transfer_params.skip_first_token).
        self.proxy_node_skip = self.start_proxy(
            "proxy-node-skip", "--node-skip-first-token", wait=False
        )
        wait_healthy(self.proxy, self.proxy_node_skip, timeout=60)

    def start_proxy(self, name: str, *extra: str, wait: bool = True) -> Proc:
        return self.procs.proxy(
            [n.url for n in self.prefill], [n.url for n in self.decode], *extra,
            name=name, wait=wait,
        )  # fmt: skip


@pytest.fixture(scope="module")
def cluster(module_procs: Procs) -> Cluster:
    return Cluster(module_procs)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)


def _ids(obj: Any) -> list[int]:
    return list(getattr(obj, "token_ids", None) or [])


# -- basics ----------------------------------------------------------------------------------


def test_health_models_and_request_id(cluster: Cluster) -> None:
    health = httpx.get(cluster.proxy.url + "/health").json()
    assert health["status"] == "ok"
    assert all(n["healthy"] for n in health["prefill"] + health["decode"])
    (card,) = httpx.get(cluster.proxy.url + "/v1/models").json()["data"]
    assert card["id"] == MODEL and card["max_model_len"] > 0
    resp = httpx.post(
        cluster.proxy.url + "/v1/completions",
        json={"prompt": "Hi there", "max_tokens": 3, **GREEDY},
        headers={"X-Request-Id": "rid-proxy-test-1"},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == "rid-proxy-test-1"
    assert resp.json()["id"] == "cmpl-rid-proxy-test-1"
    # The id reached a prefill node and a decode node (their logs name it).
    assert any("rid-proxy-test-1" in p.logs(10**6) for p in cluster.prefill)
    assert any("rid-proxy-test-1" in d.logs(10**6) for d in cluster.decode)
    text = httpx.get(cluster.proxy.url + "/metrics").text
    for name in (
        "pdproxy_requests_total",
        "pdproxy_request_errors_total",
        "pdproxy_time_to_first_token_seconds_bucket",
        "pdproxy_inter_token_latency_seconds_bucket",
        "pdproxy_node_outstanding_requests",
    ):
        assert name in text, name


# -- token-identical to a colocated node -------------------------------------------------------

PROMPTS = ["The quick brown fox", "Hello", "1 2 3 4 5 6 7 8"]


def _proxy_url(cluster: Cluster, skip: str) -> str:
    return (cluster.proxy_node_skip if skip == "node-skip" else cluster.proxy).url


@pytest.mark.parametrize("skip", ["proxy-skip", "node-skip"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_match_colocated(cluster: Cluster, prompt: str, skip: str) -> None:
    ref_client = _client(cluster.colo.url)
    proxy_client = _client(_proxy_url(cluster, skip))
    kw: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                          "extra_body": {"ignore_eos": True}}  # fmt: skip
    ref = ref_client.completions.create(**kw).choices[0]
    out = proxy_client.completions.create(**kw).choices[0]
    assert len(_ids(ref)) == 12
    assert _ids(out) == _ids(ref) and out.text == ref.text
    chunks = list(proxy_client.completions.create(**kw, stream=True))
    assert [t for c in chunks for ch in c.choices for t in _ids(ch)] == _ids(ref)
    if skip == "proxy-skip" or "\ufffd" not in ref.text:
        assert "".join(ch.text for c in chunks for ch in c.choices) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("skip", ["proxy-skip", "node-skip"])
@pytest.mark.parametrize("content", ["Hi!", "Tell me a story"])
def test_chat_match_colocated(cluster: Cluster, content: str, skip: str) -> None:
    ref_client = _client(cluster.colo.url)
    proxy_client = _client(_proxy_url(cluster, skip))
    kw: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": content}],
                          "max_tokens": 10, "temperature": 0,
                          "extra_body": {"ignore_eos": True}}  # fmt: skip
    ref = ref_client.chat.completions.create(**kw).choices[0]
    out = proxy_client.chat.completions.create(**kw).choices[0]
    assert _ids(out) == _ids(ref) and len(_ids(ref)) == 10
    assert out.message.content == ref.message.content and out.message.role == "assistant"
    chunks = list(
        proxy_client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.delta.role is None for c in chunks[1:] for ch in c.choices)
    # The first chunk is the role alone, as a colocated node (and vLLM, OpenAI) sends it;
    # P's pre-streamed token came in it before.
    ref_first = next(iter(ref_client.chat.completions.create(**kw, stream=True))).choices[0]
    assert (chunks[0].choices[0].delta.content, _ids(chunks[0].choices[0])) == ("", [])
    assert (ref_first.delta.content, _ids(ref_first)) == ("", [])
    assert [t for c in chunks for ch in c.choices for t in _ids(ch)] == _ids(ref)
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    if skip == "proxy-skip" or "\ufffd" not in (ref.message.content or ""):
        # Known limit of node-side skipping: when the first token ends inside a UTF-8
        # sequence, P's flushed text has a U+FFFD that D later completes (ids still equal).
        assert text == ref.message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_stream_with_stop_string_matches_colocated(cluster: Cluster) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 16, **GREEDY}
    full = httpx.post(cluster.colo.url + "/v1/completions", json=body, timeout=60).json()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2] or "zz"
    ref = httpx.post(
        cluster.colo.url + "/v1/completions", json={**body, "stop": stop}, timeout=60
    ).json()
    with httpx.stream(
        "POST", cluster.proxy.url + "/v1/completions",
        json={**body, "stop": stop, "stream": True}, timeout=60,
    ) as resp:  # fmt: skip
        events = sse_events(resp)
    assert events[-1] == "DONE"
    got = "".join(c["choices"][0]["text"] for c in events[:-1] if c["choices"])
    assert got == ref["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
    assert events[-2]["choices"][0]["stop_reason"] == ref["choices"][0]["stop_reason"]


def test_min_tokens_stop_strings_and_a_full_context_echo_match_colocated(cluster: Cluster) -> None:
    """Through P/D as on a colocated node (vLLM's rules, docs/api.md): a stop string that
    starts within ``min_tokens`` and ends after it stops the answer (P's first token is in
    what D looks at); ``echo`` with ``max_tokens`` 0 takes a prompt that fills the context
    (D alone serves it)."""
    letters = list(range(ord("a"), ord("z") + 1))
    body = {"prompt": "Once upon", "max_tokens": 12, "allowed_token_ids": letters, **GREEDY}
    text = httpx.post(cluster.colo.url + "/v1/completions", json=body, timeout=60).json()
    text = text["choices"][0]["text"]
    body = {**body, "stop": [text[0:2]], "min_tokens": 1}  # starts in P's token
    ref = httpx.post(cluster.colo.url + "/v1/completions", json=body, timeout=60).json()
    assert ref["choices"][0]["text"] == "" and ref["choices"][0]["stop_reason"] == text[0:2]
    got = httpx.post(cluster.proxy.url + "/v1/completions", json=body, timeout=60).json()
    assert got["choices"][0]["text"] == "" and got["choices"][0]["stop_reason"] == text[0:2]
    with httpx.stream(
        "POST", cluster.proxy.url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        events = sse_events(resp)
    assert "".join(c["choices"][0]["text"] for c in events[:-1] if c["choices"]) == ""
    assert events[-2]["choices"][0]["stop_reason"] == text[0:2]
    card = httpx.get(cluster.colo.url + "/v1/models", timeout=10).json()["data"][0]
    ids = [65 + i % 26 for i in range(card["max_model_len"])]
    echo = {"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 1, **GREEDY}
    ref = httpx.post(cluster.colo.url + "/v1/completions", json=echo, timeout=120)
    got = httpx.post(cluster.proxy.url + "/v1/completions", json=echo, timeout=120)
    assert ref.status_code == got.status_code == 200, (ref.text[:300], got.text[:300])
    r, g = ref.json(), got.json()
    assert g["choices"][0]["text"] == r["choices"][0]["text"] == bytes(ids).decode()
    assert g["choices"][0]["logprobs"]["tokens"] == r["choices"][0]["logprobs"]["tokens"]
    assert g["usage"] == r["usage"] == {
        "prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)
    }  # fmt: skip


def test_stop_strings_one_token_completes_end_on_the_first_listed_as_colocated(
    cluster: Cluster,
) -> None:
    """vLLM's rule (``check_stop_strings`` in its v1 detokenizer): when one token completes
    several stop strings, the first in the ``stop`` list is the one -- ``stop_reason`` and
    where the text ends -- wherever the others start. The tiny model's tokens are bytes:
    ``[c, bc]`` where token ``c`` follows ``b`` ends the text before ``c``; ``[bc, c]``
    before ``b``. Through P/D (D decodes after P's first token, and finds stop strings in
    its text too; non-streamed and streamed) as on a colocated node."""
    letters = list(range(ord("a"), ord("z") + 1))
    # Seeded sampling (greedy repeats one letter): P and D draw what a colocated node does.
    body = {"prompt": "Once upon", "max_tokens": 12, "allowed_token_ids": letters,
            "temperature": 1.0, "seed": 11, "ignore_eos": True}  # fmt: skip
    text = httpx.post(cluster.colo.url + "/v1/completions", json=body, timeout=60).json()
    text = text["choices"][0]["text"]
    # A letter that did not come before: neither stop string is found before it.
    j = next((i for i in range(1, len(text)) if text[i] not in text[:i]), None)
    assert j is not None, text
    for stops, cut in (
        ([text[j], text[j - 1 : j + 1]], j),
        ([text[j - 1 : j + 1], text[j]], j - 1),
    ):
        req = {**body, "stop": stops}
        want = (text[:cut], "stop", stops[0])
        for url in (cluster.colo.url, cluster.proxy.url):
            got = httpx.post(url + "/v1/completions", json=req, timeout=60).json()["choices"][0]
            assert (got["text"], got["finish_reason"], got["stop_reason"]) == want, (url, got)
            with httpx.stream(
                "POST", url + "/v1/completions", json={**req, "stream": True}, timeout=60
            ) as resp:
                events = sse_events(resp)
            chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
            streamed = "".join(c["text"] for c in chunks)
            last = chunks[-1]
            assert (streamed, last["finish_reason"], last["stop_reason"]) == want, (url, chunks)


@pytest.mark.parametrize("skip", ["proxy-skip", "node-skip"])
def test_stop_token_ids_match_colocated(cluster: Cluster, skip: str) -> None:
    """A stop token's text is left out and ``stop_reason`` is its id, through the proxy as on
    a colocated node: the first token (P's, pre-streamed) stopping, and a later one."""
    url = cluster.colo.url + "/v1/completions"
    for prompt in ("The capital of France is", "Once upon a time", "abc", "Hello world", "1 2 3"):
        body = {"prompt": prompt, "max_tokens": 16, **GREEDY}
        ids = httpx.post(url, json=body, timeout=60).json()["choices"][0]["token_ids"]
        later = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), None)
        if later is not None:
            break
    else:
        pytest.fail("the tiny model repeated one token for every prompt")
    for k in (0, later):
        for extra in ({}, {"include_stop_str_in_output": True}):
            req = {**body, "stop_token_ids": [ids[k]], **extra}
            ref = httpx.post(url, json=req, timeout=60).json()["choices"][0]
            assert (ref["token_ids"], ref["stop_reason"]) == (ids[: k + 1], ids[k])
            proxy = _proxy_url(cluster, skip) + "/v1/completions"
            out = httpx.post(proxy, json=req, timeout=60).json()["choices"][0]
            assert {key: out[key] for key in ref} == ref
            with httpx.stream("POST", proxy, json={**req, "stream": True}, timeout=60) as resp:
                events = sse_events(resp)
            choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
            assert "".join(c["text"] for c in choices) == ref["text"]
            assert [t for c in choices for t in c["token_ids"]] == ref["token_ids"]
            assert [c["stop_reason"] for c in choices] == [None] * (len(choices) - 1) + [ids[k]]
            assert choices[-1]["finish_reason"] == "stop"


# -- xPyD under load ---------------------------------------------------------------------------


def test_100_concurrent_requests_spread_over_nodes(cluster: Cluster) -> None:
    prompts = [f"request number {i} says" for i in range(5)]
    refs = [
        httpx.post(
            cluster.colo.url + "/v1/completions",
            json={"prompt": p, "max_tokens": 6, **GREEDY},
            timeout=60,
        ).json()["choices"][0]["token_ids"]
        for p in prompts
    ]
    before = {
        n.url: metric(cluster.proxy.url, "pdproxy_node_requests_total", {"url": n.url})
        for n in cluster.nodes
    }
    node_before = {n.url: node_generate_requests(n.url) for n in cluster.nodes}

    async def one(client: httpx.AsyncClient, i: int) -> list[int]:
        body = {"prompt": prompts[i % 5], "max_tokens": 6, **GREEDY}
        if i % 2:
            async with client.stream(
                "POST", "/v1/completions", json={**body, "stream": True}
            ) as resp:
                assert resp.status_code == 200
                lines = [ln async for ln in resp.aiter_lines() if ln]
            events = sse_data(lines)
            assert events.pop() == "DONE"
            assert all("error" not in e for e in events), events
            return stream_ids(events)
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    async def run() -> list[list[int]]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(
            base_url=cluster.proxy.url, timeout=180, limits=limits
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(100)))

    results = asyncio.run(run())
    for i, ids in enumerate(results):
        assert ids == refs[i % 5], f"request {i}"
    for n in cluster.nodes:
        routed = metric(cluster.proxy.url, "pdproxy_node_requests_total", {"url": n.url})
        assert routed - before[n.url] > 0, f"{n.name} got no requests"
        assert node_generate_requests(n.url) - node_before[n.url] > 0, n.name
    assert metric(cluster.proxy.url, "pdproxy_requests_inflight") == 0


def test_concurrent_requests_with_one_x_request_id_all_complete(cluster: Cluster) -> None:
    """A client's ``X-Request-Id`` is a label: 4 concurrent requests using one (more than
    there are nodes of a kind, so some share a P and a D) each get their own transfer and
    their whole answer. They used to share a transfer id and node request id: a 400 on a
    node, and the proxy's cleanup aborted the others by that id."""
    body = {"prompt": "one label, many requests", "max_tokens": 24, **GREEDY}
    ref = httpx.post(cluster.colo.url + "/v1/completions", json=body, timeout=60).json()
    ref_ids = ref["choices"][0]["token_ids"]

    async def one(client: httpx.AsyncClient) -> list[int]:
        async with client.stream(
            "POST", "/v1/completions", json={**body, "stream": True},
            headers={"X-Request-Id": "shared-label"},
        ) as resp:  # fmt: skip
            assert resp.status_code == 200
            assert resp.headers["x-request-id"] == "shared-label"
            lines = [ln async for ln in resp.aiter_lines() if ln]
        events = sse_data(lines)
        assert events.pop() == "DONE"
        assert all("error" not in e for e in events), events
        return stream_ids(events)

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=cluster.proxy.url, timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(4)))

    assert asyncio.run(run()) == [ref_ids] * 4


# -- client disconnect -------------------------------------------------------------------------


def test_client_disconnect_aborts_on_both_nodes(cluster: Cluster) -> None:
    rid = "disconnect-test-1"
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True, **GREEDY}
    with httpx.stream(
        "POST", cluster.proxy.url + "/v1/completions", json=body,
        headers={"X-Request-Id": rid}, timeout=60,
    ) as resp:  # fmt: skip
        assert resp.status_code == 200
        got = 0
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                got += 1
            if got >= 5:
                break  # leave mid-stream: closing the response drops the connection
    for n in cluster.nodes:
        wait_for(lambda n=n: kv_pool_full(n.url), 30, f"{n.name}'s KV pool to be full again")
    # The proxy sent the abort to the decode node that served it, and released its lease.
    assert any(f"abort requested for '{rid}" in d.logs(10**6) for d in cluster.decode)
    wait_for(
        lambda: metric(cluster.proxy.url, "pdproxy_node_outstanding_requests") == 0,
        10,
        "outstanding requests to drop to 0",
    )


# -- bad input ---------------------------------------------------------------------------------

_MSG = [{"role": "user", "content": "hi"}]
BAD_REQUESTS: list[tuple[str, Any, str]] = [
    ("/v1/completions", b"{not json", "JSON"),
    ("/v1/completions", [1, 2], "object"),
    ("/v1/completions", {"prompt": 123, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**7}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, "no-such-model"),
    ("/v1/completions", {"prompt": "x", "n": 129}, "choices"),  # past MAX_CHOICES
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),  # 21: the nodes' 400
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "kv_transfer_params": {}}, "kv_transfer_params"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": _MSG, "max_completion_tokens": 10**7},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": _MSG, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/v1/chat/completions", {"messages": _MSG, "top_logprobs": 2}, "top_logprobs"),
]  # fmt: skip


def test_bad_requests_get_400_and_reach_no_node(cluster: Cluster) -> None:
    before = {n.url: node_generate_requests(n.url) for n in cluster.nodes}
    routed = metric(cluster.proxy.url, "pdproxy_node_requests_total")
    for path, body, mention in BAD_REQUESTS:
        kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
        resp = httpx.post(cluster.proxy.url + path, timeout=30, **kw)
        assert resp.status_code == 400, (body, resp.text)
        err = resp.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error"
        assert mention in err["message"] or mention == err["param"], (body, err)
    assert metric(cluster.proxy.url, "pdproxy_node_requests_total") == routed
    for n in cluster.nodes:
        assert node_generate_requests(n.url) == before[n.url], f"{n.name} was reached"
    assert metric(cluster.proxy.url, "pdproxy_request_errors_total", {"kind": "bad_request"}) >= (
        len(BAD_REQUESTS)
    )


def test_prompt_too_long_for_the_context_is_the_nodes_400(cluster: Cluster) -> None:
    resp = httpx.post(
        cluster.proxy.url + "/v1/completions",
        json={"prompt": "word " * 3000, "max_tokens": 2000},
        timeout=60,
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "context_length_exceeded"


# -- limits and availability -------------------------------------------------------------------


def test_429_at_max_inflight_and_503_without_a_pair(cluster: Cluster) -> None:
    limited = cluster.start_proxy("proxy-limit1", "--max-inflight", "1")
    dead_p = f"http://127.0.0.1:{free_port()}"
    spawn_only = cluster.procs.proxy(
        [dead_p], [n.url for n in cluster.decode], name="proxy-nop", wait=False
    )
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "stream": True, **GREEDY}
    with httpx.stream("POST", limited.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # keep a reference: a dropped iterator closes the stream
        next(lines)
        second = httpx.post(limited.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert second.status_code == 429, second.text
        assert second.json()["error"]["code"] == "too_many_requests"
        assert second.headers.get("retry-after") == "1"
    # A proxy whose only prefill node refuses connections is up but not ready.
    answers: list[httpx.Response] = []

    def health_answers() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            answers.append(httpx.get(spawn_only.url + "/health", timeout=2))
        return bool(answers)

    wait_for(health_answers, 30, "the proxy to answer /health", 0.2)
    health = answers[0]
    assert health.status_code == 503 and "prefill" in health.json()["reason"]
    resp = httpx.post(
        spawn_only.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60
    )
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "no_healthy_nodes"


def test_prefill_fallback_serves_on_decode_nodes_while_no_prefill_node_is_ready(
    cluster: Cluster,
) -> None:
    """--prefill-fallback: the only prefill node refuses connections, so the decode nodes
    prefill by themselves: same tokens as the colocated node, /health says so, and the
    route counter counts it. A prefill leg is never tried."""
    dead_p = f"http://127.0.0.1:{free_port()}"
    fallback = cluster.procs.proxy(
        [dead_p], [n.url for n in cluster.decode], "--prefill-fallback", name="proxy-fallback"
    )
    health = httpx.get(fallback.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["prefill_fallback"] is True
    body = {"prompt": "Once upon a time", "max_tokens": 12, **GREEDY}
    want = httpx.post(cluster.colo.url + "/v1/completions", json=body, timeout=60).json()
    got = httpx.post(fallback.url + "/v1/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    with httpx.stream(
        "POST", fallback.url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        assert resp.status_code == 200
        assert stream_ids(sse_data(resp.iter_lines())) == want["choices"][0]["token_ids"]
    assert metric(fallback.url, "pdproxy_route_mode_total", {"mode": "prefill_fallback"}) == 2
    assert metric(fallback.url, "pdproxy_route_mode_total", {"mode": "disaggregated"}) == 0


# -- terminal clients --------------------------------------------------------------------------


def test_cli_complete_and_chat(cluster: Cluster) -> None:
    base = [sys.executable, "-m", "proxy"]
    url = ["--url", cluster.proxy.url, "--max-tokens", "5", "--temperature", "0"]
    for extra in ([], ["--stream"]):
        proc = subprocess.run(
            [*base, "complete", "Hello", *url, *extra], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        [*base, "chat", *url],
        input="Hello\nHow are you?\n/exit\nnot sent\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") >= 2
    bad = subprocess.run(
        [*base, "complete", "x", "--url", f"http://127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "error" in bad.stderr


def test_a_prefill_node_with_a_small_cache_serves_prompts_whose_answers_it_cannot_hold(
    cluster: Cluster, procs: Procs
) -> None:
    """P sized for prompts (8 blocks x 16 = 128 tokens), D for whole answers. A prefill
    leg computes the prompt and one token, so P's context bounds the prompt only: the
    answer's budget is D's. (Once a node's context was lowered to its cache, P refused
    such a leg with a 400 on max_tokens, and the proxy's limit fell to P's 128.) The
    reference is the module's colocated node (greedy: its cache size changes nothing)."""
    ref = cluster.colo
    assert httpx.get(ref.url + "/v1/models").json()["data"][0]["id"] == MODEL
    p = procs.node(*NIXL, "--num-blocks", "8", module="prefill_node", name="p", wait=False)
    d = procs.node(*NIXL, "--num-blocks", "64", module="decode_node", name="d", wait=False)
    wait_healthy(p, d)
    proxy = procs.proxy([p.url], [d.url])
    assert httpx.get(proxy.url + "/v1/models").json()["data"][0]["max_model_len"] == 1024
    body = {"prompt": "a prompt of a few tokens", "max_tokens": 200, **GREEDY}
    want = httpx.post(ref.url + "/v1/completions", json=body, timeout=60).json()
    got = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert len(want["choices"][0]["token_ids"]) == 200
    assert p.metric("pdserve_engine_kv_transfers_started_total") >= 1  # it went through P
    # A prompt longer than P's context is still P's to refuse.
    long = httpx.post(
        proxy.url + "/v1/completions",
        json={**body, "prompt": [5] * 200, "max_tokens": 4},
        timeout=60,
    )
    assert long.status_code == 400 and "128" in long.json()["error"]["message"], long.text
