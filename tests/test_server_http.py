"""End-to-end HTTP tests against a real decode node (tiny model, CPU) in a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
from typing import Any

import httpx
import openai
import pytest
from harness import (
    GREEDY,
    MODEL,
    Proc,
    Procs,
    descendants,
    node_idle,
    sse_data,
    sse_events,
    wait_for,
    wait_gone,
    worker_pids,
)

pytestmark = pytest.mark.slow
# Priority scheduling: with every request at the default priority 0 it is FCFS.
NODE_ARGS = ("--model", MODEL, "--num-blocks", "256", "--scheduling-policy", "priority")


@pytest.fixture(scope="module")
def node(module_procs: Procs) -> Proc:
    return module_procs.node(*NODE_ARGS)


@pytest.fixture(scope="module")
def max_model_len(node: Proc) -> int:
    return int(httpx.get(node.url + "/v1/models").json()["data"][0]["max_model_len"])


# -- request helpers -----------------------------------------------------------------------


def _post(node: Proc, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(node.url + path, json=body, timeout=120, **kw)


def _stream(node: Proc, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    with httpx.stream("POST", node.url + path, json=body, timeout=120) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp, []
        assert resp.headers["content-type"].startswith("text/event-stream")
        return resp, sse_events(resp)


def _assert_error(resp: httpx.Response, status: int, mention: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if mention is not None:
        assert mention in err["message"] or err["param"] == mention, err
    return err


# -- basic endpoints -----------------------------------------------------------------------


def test_health_and_models(node: Proc) -> None:
    assert httpx.get(node.url + "/health").json() == {"status": "ok"}
    models = httpx.get(node.url + "/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == MODEL and card["object"] == "model"
    assert isinstance(card["max_model_len"], int) and card["max_model_len"] > 0


def test_banner_printed(node: Proc) -> None:
    out = node.stdout_path.read_text()
    assert f"pdserve decode node listening on {node.url} (model {MODEL}, tp 1)" in out


def test_completion_non_stream(node: Proc) -> None:
    resp = _post(
        node, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 6, **GREEDY}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and isinstance(choice["text"], str)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert len(choice["token_ids"]) == 6
    usage = body["usage"]
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6
    assert "kv_transfer_params" not in body
    assert resp.headers["x-request-id"] == body["id"].removeprefix("cmpl-")


def test_request_id_header_honoured(node: Proc) -> None:
    resp = _post(
        node,
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 2},
        headers={"X-Request-Id": "req-abc-1"},
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == "req-abc-1"
    assert resp.json()["id"] == "cmpl-req-abc-1"


def test_a_requests_priority_orders_it_and_does_not_change_its_tokens(node: Proc) -> None:
    body = {"prompt": "Hello", "max_tokens": 5, **GREEDY}
    want = _post(node, "/v1/completions", body).json()["choices"][0]["token_ids"]
    for priority in (-7, 3):
        resp = _post(node, "/v1/completions", {**body, "priority": priority})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == want


def test_prompt_token_ids(node: Proc) -> None:
    resp = _post(node, "/v1/completions", {"prompt": [72, 101, 108, 108, 111], "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == 5


def test_completion_stream_matches_non_stream(node: Proc) -> None:
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 10, **GREEDY}
    full = _post(node, "/v1/completions", body).json()
    resp, events = _stream(
        node, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert resp.status_code == 200
    assert events[-1] == "DONE"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 10
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["usage"] is None for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert ids == full["choices"][0]["token_ids"]
    assert text == full["choices"][0]["text"]


def test_stream_without_usage(node: Proc) -> None:
    resp, events = _stream(
        node, "/v1/completions", {"prompt": "abc", "max_tokens": 3, "stream": True}
    )
    assert resp.status_code == 200 and events[-1] == "DONE"
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_non_stream(node: Proc) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi!"}],
        "max_tokens": 5,
        **GREEDY,
    }
    resp = _post(node, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    (choice,) = out["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(
        choice["message"]["content"], str
    )
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 5
    assert out["usage"]["completion_tokens"] == 5


def test_chat_stream(node: Proc) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_completion_tokens": 6,
        **GREEDY,
    }
    full = _post(node, "/v1/chat/completions", body).json()
    resp, events = _stream(node, "/v1/chat/completions", {**body, "stream": True})
    assert resp.status_code == 200 and events[-1] == "DONE"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert ids == full["choices"][0]["token_ids"]
    assert text == full["choices"][0]["message"]["content"]


def test_stop_string(node: Proc) -> None:
    # Find a greedy output with some text, then stop on a piece of it.
    for prompt in ("Once upon a time", "abc", "Hello world", "1 2 3 4", "The", "xyz", "Zebra"):
        body = {"prompt": prompt, "max_tokens": 24, **GREEDY}
        text = _post(node, "/v1/completions", body).json()["choices"][0]["text"]
        if len(text.strip()) >= 3:
            break
    else:
        pytest.fail("the tiny model produced no text for any prompt")
    k = next(i for i, ch in enumerate(text) if i > 0 and not ch.isspace())
    stop = text[k : k + 2]
    expected = text[: text.find(stop)]
    out = _post(node, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    assert out["text"] == expected
    resp, events = _stream(node, "/v1/completions", {**body, "stop": stop, "stream": True})
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == stop
    _wait_idle(node)


def test_a_stop_string_that_starts_within_min_tokens_and_ends_after_them_stops(
    node: Proc,
) -> None:
    """vLLM's rule (v1 detokenizer): no stop string is looked for while the answer has at
    most ``min_tokens`` tokens; after that each new text is searched with a look-back of
    ``len(stop) - 1`` characters, so a stop string that starts in the first ``min_tokens``
    tokens and ends after them matches. The tiny model's tokens are bytes: a two-character
    stop at ``m - 1`` straddles ``min_tokens: m`` -- the text ends before it, in a stream
    too (its first character, within min_tokens, was held back), and with
    ``include_stop_str_in_output`` it ends after it. (The old rule looked for it in the
    text after min_tokens alone: it matched later, or not at all.)"""
    letters = list(range(ord("a"), ord("z") + 1))  # one character per token
    body = {"prompt": "Once upon a time", "max_tokens": 16, "allowed_token_ids": letters, **GREEDY}
    text = _post(node, "/v1/completions", body).json()["choices"][0]["text"]
    assert len(text) == 16 and text.isalpha(), text
    m = 4
    stop = text[m - 1 : m + 1]
    want = {**body, "stop": [stop], "min_tokens": m}
    out = _post(node, "/v1/completions", want).json()["choices"][0]
    assert (out["text"], out["finish_reason"], out["stop_reason"]) == (text[: m - 1], "stop", stop)
    kept = _post(node, "/v1/completions", {**want, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == text[: m + 1]
    _, events = _stream(node, "/v1/completions", {**want, "stream": True})
    chunks = [e["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == text[: m - 1], chunks
    assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("stop", stop)
    # One that ends within min_tokens is not matched there: the first that ends after.
    early = text[m - 2 : m]
    out = _post(node, "/v1/completions", {**body, "stop": [early], "min_tokens": m}).json()
    at = text.find(early, m - 1)
    assert out["choices"][0]["text"] == (text[:at] if at >= 0 else text)
    _wait_idle(node)


@pytest.mark.parametrize("chat", [False, True])
def test_a_stop_token_is_in_token_ids_not_in_the_text(node: Proc, chat: bool) -> None:
    """vLLM's rule: the token that stopped the answer stays in ``token_ids``, its text is left
    out (unless ``include_stop_str_in_output``); ``stop_reason`` is its id."""
    path = "/v1/chat/completions" if chat else "/v1/completions"

    def answer(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        c = _post(node, path, {**base, **body}).json()["choices"][0]
        return (c["message"]["content"] if chat else c["text"]), c

    # A prompt whose greedy answer has a token that did not come before (tiny repeats).
    for prompt in ("The capital of France is", "Once upon a time", "abc", "Hello world", "1 2 3"):
        base: dict[str, Any] = {"max_tokens": 16, **GREEDY}
        if chat:
            base["messages"] = [{"role": "user", "content": prompt}]
        else:
            base["prompt"] = prompt
        _, full = answer({})
        ids = full["token_ids"]
        assert full["stop_reason"] is None  # a length
        later = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), None)
        if later is not None:
            break
    else:
        pytest.fail("the tiny model repeated one token for every prompt")
    for k in (0, later):  # 0: the audit's case, the first token stops
        text, c = answer({"stop_token_ids": [ids[k]]})
        before = answer({"max_tokens": k})[0] if k else ""
        assert (text, c["token_ids"]) == (before, ids[: k + 1])
        assert (c["finish_reason"], c["stop_reason"]) == ("stop", ids[k])
        kept, c = answer({"stop_token_ids": [ids[k]], "include_stop_str_in_output": True})
        assert kept == answer({"max_tokens": k + 1})[0] and c["stop_reason"] == ids[k]
        resp, events = _stream(node, path, {**base, "stop_token_ids": [ids[k]], "stream": True})
        choices = [e["choices"][0] for e in events[:-1]]
        key = "delta" if chat else None
        got = "".join((ch[key].get("content") or "") if key else ch["text"] for ch in choices)
        assert got == before
        assert [t for ch in choices for t in ch["token_ids"]] == ids[: k + 1]
        assert [ch["stop_reason"] for ch in choices] == [None] * (len(choices) - 1) + [ids[k]]
    _wait_idle(node)


def test_concurrent_requests(node: Proc) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=node.url, timeout=120) as client:
            reqs = [
                client.post("/v1/completions", json={"prompt": f"request {i}", "max_tokens": 4 + i})
                for i in range(6)
            ]
            return await asyncio.gather(*reqs)

    for i, resp in enumerate(asyncio.run(run())):
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] <= 4 + i


# -- openai client -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(node: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.url + "/v1", api_key="EMPTY", max_retries=0)


def test_openai_client_completions(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert isinstance(resp.choices[0].text, str) and resp.usage is not None
    assert resp.usage.completion_tokens <= 5
    stream = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 5
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == resp.choices[0].text


def test_openai_client_chat(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Say hi"}]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0
    )
    msg = resp.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_openai_client_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert "max_tokens" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert "no-such-model" in str(info.value)


# -- bad input -----------------------------------------------------------------------------

_CHAT_MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path, body, mention",
    [
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, "model"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "abc"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "n": 129}, "n"),  # past MAX_CHOICES
        ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "x", "priority": "high"}, "priority"),
        ("/v1/completions", {"prompt": "x", "priority": 2**63}, "priority"),
        ("/v1/chat/completions", {"messages": _CHAT_MSG, "priority": 1.5}, "priority"),
        ("/v1/completions", ["not", "an", "object"], None),
        ("/v1/chat/completions", {"model": MODEL}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": _CHAT_MSG, "max_tokens": 0}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": _CHAT_MSG, "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": _CHAT_MSG,
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}},
            },
            "response_format.json_schema.schema",
        ),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": _CHAT_MSG}, "model"),
    ],
)
def test_bad_requests(node: Proc, path: str, body: Any, mention: str | None) -> None:
    err = _assert_error(_post(node, path, body), 400, mention)
    assert err["type"] == "invalid_request_error"
    if mention is not None:
        assert err["param"] == mention


def test_unknown_model_code(node: Proc) -> None:
    err = _assert_error(
        _post(node, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 400, "model"
    )
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_json(node: Proc, stream: bool) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = httpx.post(
            node.url + path,
            content=b'{"prompt": "x", "stream": ' + (b"true" if stream else b"false") + b",",
            headers={"content-type": "application/json"},
        )
        err = _assert_error(resp, 400, None)
        assert "JSON" in err["message"]


def test_context_length(node: Proc, max_model_len: int) -> None:
    resp = _post(node, "/v1/completions", {"prompt": "hello", "max_tokens": max_model_len})
    err = _assert_error(resp, 400, "max_tokens")
    assert f"maximum context length is {max_model_len} tokens" in err["message"]
    assert err["code"] == "context_length_exceeded"
    # Chat's max_completion_tokens is named as sent (the node said max_tokens; the proxy
    # named it right).
    messages = [{"role": "user", "content": "hello"}]
    body = {"messages": messages, "max_completion_tokens": max_model_len}
    err = _assert_error(_post(node, "/v1/chat/completions", body), 400, "max_completion_tokens")
    assert err["code"] == "context_length_exceeded"
    # A prompt as long as the context (ids, then text) leaves no room for the completion.
    resp = _post(node, "/v1/completions", {"prompt": [65] * max_model_len, "max_tokens": 1})
    assert _assert_error(resp, 400, "prompt")["param"] == "prompt"
    resp = _post(node, "/v1/completions", {"prompt": "a " * max_model_len, "max_tokens": 1})
    assert "maximum context length" in _assert_error(resp, 400, "prompt")["message"]
    resp = _post(
        node,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a " * max_model_len}]},
    )
    assert _assert_error(resp, 400, "messages")["param"] == "messages"


def test_echo_with_max_tokens_0_takes_a_prompt_as_long_as_the_context(
    node: Proc, max_model_len: int
) -> None:
    """vLLM accepts ``echo`` with ``max_tokens`` 0 for a prompt of ``max_model_len`` tokens
    (its length check counts the 0 requested tokens; the engine takes a prompt up to the
    context): lm-evaluation-harness cuts a loglikelihood request to its ``max_length``, so
    such prompts come. The answer is the prompt with its log probabilities; one token
    longer is a 400 naming ``prompt``, as is ``max_tokens`` 1."""
    ids = [65 + i % 26 for i in range(max_model_len)]
    body = {"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 1, **GREEDY}
    resp = _post(node, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    choice = out["choices"][0]
    assert choice["text"] == bytes(ids).decode() and choice["token_ids"] == []
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == max_model_len and lp["token_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)
    assert out["usage"] == {
        "prompt_tokens": max_model_len, "completion_tokens": 0, "total_tokens": max_model_len
    }  # fmt: skip
    # The same prompt cut by one token answers the same log probabilities for it.
    short = _post(node, "/v1/completions", {**body, "prompt": ids[:-1]}).json()
    assert short["choices"][0]["logprobs"]["tokens"] == lp["tokens"][:-1]
    _, events = _stream(node, "/v1/completions", {**body, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == choice["text"]
    for bad in ({**body, "prompt": [*ids, 65]}, {**body, "max_tokens": 1}):
        err = _assert_error(_post(node, "/v1/completions", bad), 400, "prompt")
        assert err["param"] == "prompt" and err["code"] == "context_length_exceeded", err
    _wait_idle(node)


def test_stream_errors_are_json_400(node: Proc) -> None:
    resp, _ = _stream(node, "/v1/completions", {"prompt": "x", "max_tokens": 0, "stream": True})
    _assert_error(resp, 400, "max_tokens")


def test_unknown_route_is_openai_error(node: Proc) -> None:
    _assert_error(httpx.get(node.url + "/v1/nope"), 404, None)


def test_still_serving_after_bad_requests(node: Proc) -> None:
    assert httpx.get(node.url + "/health").status_code == 200
    resp = _post(node, "/v1/completions", {"prompt": "still alive?", "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] <= 2


# -- aborts --------------------------------------------------------------------------------


def _wait_idle(node: Proc) -> None:
    wait_for(lambda: node_idle(node.url), 15, "the engine to drop every request")


def _aborted(node: Proc) -> float:
    return node.metric("pdserve_request_finished_total", {"finish_reason": "abort"})


def test_stream_disconnect_aborts(node: Proc, max_model_len: int) -> None:
    max_tokens = max_model_len - 64
    before = node.metric("pdserve_generation_tokens_total")
    body = {"prompt": "a long story", "max_tokens": max_tokens, "stream": True, **GREEDY}
    with httpx.stream("POST", node.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert got
    _wait_idle(node)
    generated = node.metric("pdserve_generation_tokens_total") - before
    assert generated < max_tokens


def test_non_stream_disconnect_aborts(node: Proc, max_model_len: int) -> None:
    """The client hangs up while the engine runs its request (not after a guessed time):
    the request is aborted, not generated to the end."""
    max_tokens = max_model_len - 64
    before, aborted = node.metric("pdserve_generation_tokens_total"), _aborted(node)
    body = json.dumps({"prompt": "another long story", "max_tokens": max_tokens, **GREEDY})
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    host, port = node.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall((head + body).encode())
        wait_for(lambda: node.metric("pdserve_num_requests_running") == 1, 30, "it to run")
    _wait_idle(node)
    assert _aborted(node) == aborted + 1
    assert node.metric("pdserve_generation_tokens_total") - before < max_tokens


def test_abort_endpoint(node: Proc, max_model_len: int) -> None:
    result: dict[str, Any] = {}
    body = {"prompt": "to be aborted", "max_tokens": max_model_len - 64, **GREEDY}

    def run() -> None:
        result["resp"] = _post(node, "/v1/completions", body, headers={"X-Request-Id": "abort-me"})

    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: node.metric("pdserve_num_requests_running") == 1, 30, "it to run")
    resp = _post(node, "/v1/abort", {"request_id": "abort-me"})
    assert resp.status_code == 200, resp.text
    t.join(30)
    assert not t.is_alive()
    out = result["resp"].json()
    assert out["choices"][0]["finish_reason"] == "abort"
    assert out["usage"]["completion_tokens"] < body["max_tokens"]
    _wait_idle(node)
    _assert_error(_post(node, "/v1/abort", {}), 400, "request_id")


# -- metrics -------------------------------------------------------------------------------


def test_metrics(node: Proc) -> None:
    _post(node, "/v1/completions", {"prompt": "count me", "max_tokens": 2})
    resp = httpx.get(node.url + "/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    for name in (
        "pdserve_engine_healthy",
        "pdserve_num_requests_running",
        "pdserve_num_requests_waiting",
        "pdserve_kv_blocks_used",
        "pdserve_kv_blocks_free",
        "pdserve_prompt_tokens_total",
        "pdserve_generation_tokens_total",
        "pdserve_http_requests_total",
        "pdserve_request_finished_total",
        "pdserve_time_to_first_token_seconds",
    ):
        assert name in resp.text, name
    assert node.metric("pdserve_generation_tokens_total") > 0
    assert node.metric("pdserve_engine_healthy") == 1
    ok = {"path": "/v1/completions", "status": "200"}
    assert node.metric("pdserve_http_requests_total", ok) > 0


# -- lifecycle -----------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_exits_cleanly(procs: Procs, sig: signal.Signals) -> None:
    node = procs.node(*NODE_ARGS)
    assert _post(node, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
    kids = descendants(node.pid)
    node.proc.send_signal(sig)
    assert node.proc.wait(60) == 0, node.logs()
    # A worker still importing torch notices the closed pipe once it has (seconds on a
    # loaded box: 15 s was once too short while other test runs shared the 2 cores).
    assert wait_gone(kids, 60) == [], f"orphaned children: {kids}\n{node.logs()}"


def test_signal_during_startup(procs: Procs) -> None:
    node = procs.node(*NODE_ARGS, wait=False)

    def workers_spawning() -> bool:
        assert node.proc.poll() is None, node.logs()
        return bool(descendants(node.pid))

    wait_for(workers_spawning, 240, "the node to start its workers")
    kids = descendants(node.pid)  # workers are being spawned / loading
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(60) == 0, node.logs()
    # A worker still importing torch notices the closed pipe once it has (seconds on a
    # loaded box: 15 s was once too short while other test runs shared the 2 cores).
    assert wait_gone(kids, 60) == [], f"orphaned children: {kids}\n{node.logs()}"


def test_engine_death_is_reported(procs: Procs) -> None:
    node = procs.node(*NODE_ARGS)
    workers = worker_pids(node.pid)
    assert workers, "no TP worker process found"
    body = {"prompt": "doomed", "max_tokens": 2000, "stream": True, **GREEDY}
    with httpx.stream("POST", node.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        events = sse_data(lines)
    assert events[-1] == "DONE"
    err = events[-2]["error"]
    assert err["type"] == "server_error" and err["message"]
    health = httpx.get(node.url + "/health")
    assert health.status_code == 503 and health.json()["reason"]
    resp = _post(node, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert _assert_error(resp, 503, None)["code"] == "engine_dead"
    assert node.metric("pdserve_engine_healthy") == 0
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(60) == 0, node.logs()


# -- request identity ----------------------------------------------------------------------


def test_two_requests_with_one_x_request_id_both_complete(node: Proc, max_model_len: int) -> None:
    """``X-Request-Id`` is the client's label, not the engine's key: a second request with
    the same label (a client retrying after a timeout) neither gets a 400 nor aborts the
    first one (its cleanup used to abort by the label)."""
    n = min(200, max_model_len - 64)
    body = {"prompt": "same label", "max_tokens": n, "stream": True, **GREEDY}
    headers = {"X-Request-Id": "same-label-1"}
    with httpx.stream(
        "POST", node.url + "/v1/completions", json=body, headers=headers, timeout=120
    ) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        running = next(line for line in lines if line.startswith("data: {"))  # it is running
        second = _post(
            node, "/v1/completions", {**body, "stream": False, "max_tokens": 2}, headers=headers
        )
        # (A chunk may carry several tokens: outputs are merged for a reader behind.)
        events = [json.loads(x[6:]) for x in [running, *lines] if x.startswith("data: {")]
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["token_ids"]) for e in events) == n
    # The label is echoed; each request has its own engine id (the abort key).
    ids = {r.headers["x-pdserve-request-id"] for r in (first, second)}
    assert len(ids) == 2 and all(i.startswith("same-label-1-") for i in ids)
    assert {r.headers["x-request-id"] for r in (first, second)} == {"same-label-1"}


def test_a_kv_cache_smaller_than_the_models_context_lowers_max_model_len(procs: Procs) -> None:
    """8 blocks x 16 tokens hold 128 tokens; tiny's config says 4096. The node advertised
    4096 and refused every chat request without max_tokens with a 400 naming max_tokens
    (it asked for the rest of the context, more blocks than the node has)."""
    small = procs.node("--model", MODEL, "--num-blocks", "8", name="small")
    card = httpx.get(small.url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == 128
    assert "max_model_len lowered from 4096 (the model's) to 128" in small.logs(20000)
    chat = {"messages": [{"role": "user", "content": "hello"}], **GREEDY}
    resp = _post(small, "/v1/chat/completions", chat)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 128
    assert resp.json()["choices"][0]["finish_reason"] == "length"
