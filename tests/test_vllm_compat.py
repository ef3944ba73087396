"""What a vLLM user expects from the nodes' CLI and API, found missing by a new-user
walkthrough: ``/ping``, ``return_token_ids``, ``--chat-template`` and a request's
``chat_template`` (``--trust-request-chat-template``), and the vLLM flags a node accepted
as unrecognized before. In-process: a node app over a scripted engine, the parsers."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
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


# -- chat templates -------------------------------------------------------------------------------

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% if shout %}!{% endif %}{% endif %}"
)


def test_chat_template_is_a_file_or_the_template_itself(tmp_path: Any) -> None:
    from engine.tokenizer import load_chat_template, load_tokenizer

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    # A template typed on a command line: its '\n' is a line break (vLLM's reading).
    assert load_chat_template("{{ 'a' }}\\n{{ 'é' }}") == "{{ 'a' }}\n{{ 'é' }}"
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    # The tiny model (no template of its own) renders chats with it, kwargs included.
    tok = load_tokenizer("tiny", str(path))
    assert tok.supports_template_kwargs
    assert tok.apply_chat_template(MSGS, {"shout": True}) == "[user]hi\n[assistant]!"


@pytest.mark.parametrize(
    "value, needle",
    [("/nonexistent/t.jinja", "looks like a file path"), ("{% for %}", "does not compile")],
)
def test_a_bad_chat_template_exits_2_naming_the_flag(
    value: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.server.cli_args import parse_config
    from engine.server.node_main import build_parser

    with pytest.raises(SystemExit) as info:
        parse_config(build_parser("decode"), ["--chat-template", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--chat-template" in err and needle in err, err


def test_chat_template_flag_reaches_the_config() -> None:
    from engine.server.cli_args import parse_config
    from engine.server.node_main import build_parser

    args, config = parse_config(build_parser("prefill"), ["--chat-template", TEMPLATE])
    assert config.model.chat_template == TEMPLATE
    assert TEMPLATE not in repr(config)  # logged as its length by the tokenizer's loader
    args, config = parse_config(build_parser("prefill"), [])
    assert config.model.chat_template is None and not args.trust_request_chat_template


def test_a_node_with_chat_template_renders_chats_with_it() -> None:
    from engine.tokenizer import load_tokenizer

    engine = ScriptedEngine(tokenizer=load_tokenizer("tiny", TEMPLATE))
    client = _client(engine)
    body = {"messages": MSGS, "chat_template_kwargs": {"shout": True}}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert engine.seen[-1][0] == list(b"[user]hi\n[assistant]!")
    tokens = client.post("/tokenize", json={"messages": MSGS}).json()["tokens"]
    assert tokens == list(b"[user]hi\n[assistant]")


def test_a_request_chat_template_needs_trust_request_chat_template() -> None:
    own = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    for body in (
        {"messages": MSGS, "chat_template": own},
        {"messages": MSGS, "chat_template_kwargs": {"chat_template": own}},
    ):
        client = _client()
        for path in ("/v1/chat/completions", "/tokenize"):
            resp = client.post(path, json=body)
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == "chat_template"
            assert "--trust-request-chat-template" in err["message"]
        engine = ScriptedEngine()
        client = _client(engine, trust_request_chat_template=True)
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert engine.seen[-1][0] == list(b"<hi>")
        assert client.post("/tokenize", json=body).json()["tokens"] == list(b"<hi>")
    # A template that does not compile: a 400 naming the field.
    client = _client(trust_request_chat_template=True)
    resp = client.post("/v1/chat/completions", json={"messages": MSGS, "chat_template": "{%"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template"
    # Null and "" are the server's own template.
    for neutral in (None, ""):
        resp = _client().post(
            "/v1/chat/completions", json={"messages": MSGS, "chat_template": neutral}
        )
        assert resp.status_code == 200, resp.text


def test_the_proxy_passes_a_request_chat_template_to_the_nodes() -> None:
    from proxy.validation import CHAT, validate_request

    body = {"messages": MSGS, "chat_template": "{{ messages[0]['content'] }}"}
    req = validate_request(CHAT, json.dumps(body).encode(), ["m"], None)
    assert req.body["chat_template"] == body["chat_template"]  # the nodes judge it
