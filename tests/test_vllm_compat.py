"""What a vLLM user expects from the nodes' CLI and API, found missing by a new-user
walkthrough: ``/ping``, ``return_token_ids``, ``--chat-template`` and a request's
``chat_template`` (``--trust-request-chat-template``), and the vLLM flags a node accepted
as unrecognized before. In-process: a node app over a scripted engine, the parsers."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from fastapi.testclient import TestClient

from engine.outputs import RequestOutput
from engine.server.app import build_app
from engine.tokenizer import ByteTokenizer

MSGS = [{"role": "user", "content": "hi"}]


class ScriptedEngine:
    """Answers ``text`` (its bytes as tokens) to every request; keeps each request's
    prompt ids and sampling parameters."""

    def __init__(self, text: str = "ok", tokenizer: Any = None) -> None:
        self.text = text
        self.model_name, self.max_model_len, self.vocab_size = "m", 4096, 512
        self.tokenizer = tokenizer or ByteTokenizer()
        self.healthy, self.dead_reason = True, None
        self.grammars = SimpleNamespace(compile=lambda so: None)
        self.seen: list[tuple[list[int], Any]] = []

    async def generate(self, request_id: str, prompt_ids: list[int], params: Any, **kw: Any) -> Any:
        self.seen.append((list(prompt_ids), params))
        ids = list(self.text.encode())
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            yield RequestOutput(request_id, [t], last, "length" if last else None)

    async def abort(self, request_id: str) -> None:
        return None

    async def abort_matching(self, key: str, by: str = "request_id") -> list[str]:
        return []

    def stats(self) -> dict[str, Any]:
        return {}

    def kv_info(self) -> dict[str, Any]:
        return {"engine_id": "e"}


def _client(engine: ScriptedEngine | None = None, **kw: Any) -> TestClient:
    return TestClient(build_app(engine or ScriptedEngine(), **kw))  # type: ignore[arg-type]


def _events(resp: Any) -> list[dict[str, Any]]:
    lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


# -- /ping ----------------------------------------------------------------------------------------


def test_ping_answers_like_health_on_get_and_post_without_the_api_key() -> None:
    engine = ScriptedEngine()
    client = _client(engine, api_key="k")
    for method in ("GET", "POST"):
        resp = client.request(method, "/ping")
        assert resp.status_code == 200, (method, resp.text)
    engine.healthy, engine.dead_reason = False, "worker died"
    resp = client.post("/ping")
    assert resp.status_code == 503 and "worker died" in resp.text


def test_the_proxy_answers_ping_like_health() -> None:
    from proxy.app import build_app as build_proxy
    from proxy.config import ProxyConfig

    cfg = ProxyConfig(prefill=("http://127.0.0.1:9",), decode=("http://127.0.0.1:9",),
                      health_interval=60.0, health_timeout=1.0, api_key="k")  # fmt: skip
    app = build_proxy(cfg)
    with TestClient(app) as client:
        for method in ("GET", "POST"):  # no node is reachable: unavailable, as /health says
            assert client.request(method, "/ping").status_code == 503
        assert client.get("/health").status_code == 503
        for node in app.state.pool.all():
            node.set_healthy(True)
            node.update_info({"side_channel": "tcp://127.0.0.1:5600"}, {"data": [{"id": "m"}]})
        for method in ("GET", "POST"):
            resp = client.request(method, "/ping")
            assert resp.status_code == 200, resp.text
            assert resp.json()["status"] == "ok"


# -- return_token_ids -----------------------------------------------------------------------------


def test_return_token_ids_adds_the_prompt_ids_where_vllm_puts_them() -> None:
    engine = ScriptedEngine("ok")
    client = _client(engine)
    prompt = list(b"hello")
    body = client.post("/v1/completions", json={"prompt": "hello", "return_token_ids": True}).json()
    (choice,) = body["choices"]  # completions: on the choice
    assert choice["prompt_token_ids"] == prompt and choice["token_ids"] == list(b"ok")
    chat_prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(MSGS))
    body = client.post("/v1/chat/completions", json={"messages": MSGS, "return_token_ids": True})
    body = body.json()  # chat: on the response
    assert body["prompt_token_ids"] == chat_prompt and "prompt_token_ids" not in body["choices"][0]
    # Without it (or false) there is no such field; token_ids are always there.
    for extra in ({}, {"return_token_ids": False}):
        body = client.post("/v1/completions", json={"prompt": "hello", **extra}).json()
        assert "prompt_token_ids" not in body["choices"][0] and body["choices"][0]["token_ids"]
        body = client.post("/v1/chat/completions", json={"messages": MSGS, **extra}).json()
        assert "prompt_token_ids" not in body


def test_return_token_ids_streams_the_prompt_ids_once_in_the_first_chunk() -> None:
    engine = ScriptedEngine("ok")
    client = _client(engine)
    body = {"prompt": "hello", "return_token_ids": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as resp:
        events = _events(resp)
    assert [e["choices"][0].get("prompt_token_ids") for e in events] == [list(b"hello"), None]
    chat_prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(MSGS))
    body = {"messages": MSGS, "return_token_ids": True, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        events = _events(resp)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [e.get("prompt_token_ids") for e in events] == [chat_prompt, None, None]


def test_return_token_ids_must_be_a_boolean() -> None:
    resp = _client().post("/v1/completions", json={"prompt": "x", "return_token_ids": "yes"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "return_token_ids"


def test_the_proxy_passes_the_prompt_ids_of_a_prestreamed_answer_once() -> None:
    from proxy.client_stream import ClientStream
    from proxy.validation import CHAT, COMPLETIONS, validate_request

    for endpoint, body in [
        (COMPLETIONS, {"prompt": "x", "stream": True, "return_token_ids": True}),
        (CHAT, {"messages": MSGS, "stream": True, "return_token_ids": True}),
    ]:
        chat = endpoint == CHAT
        req = validate_request(endpoint, json.dumps(body).encode(), ["m"], None)
        stream = ClientStream(req, "r", 1, node_skips_first=False)
        first = {"choices": [{"index": 0, "token_ids": [7], "text": "a",
                              "message": {"role": "assistant", "content": "a"}}]}  # fmt: skip
        (first if chat else first["choices"][0])["prompt_token_ids"] = [1, 2]
        event = json.loads(stream.first_chunk(first)[len("data: ") :])
        assert (event if chat else event["choices"][0])["prompt_token_ids"] == [1, 2]
        # D's stream repeats them with its first chunk (and P's token): dropped there.
        d = {"choices": [{"index": 0, "token_ids": [7, 8], "text": "ab",
                          "delta": {"content": "ab"}}]}  # fmt: skip
        (d if chat else d["choices"][0])["prompt_token_ids"] = [1, 2]
        out = stream.rewrite(d)
        assert out is not None and out["choices"][0]["token_ids"] == [8]
        assert "prompt_token_ids" not in out and "prompt_token_ids" not in out["choices"][0]
