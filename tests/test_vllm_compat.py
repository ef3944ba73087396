"""What a vLLM user expects from the nodes' CLI and API, found missing by a new-user
walkthrough: ``/ping``, ``return_token_ids``, ``--chat-template`` and a request's
``chat_template`` (``--trust-request-chat-template``), and the vLLM flags a node accepted
as unrecognized before. In-process: a node app over a scripted engine, the parsers."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
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

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        return None

    async def settle(self, request_id: str, stop_string: bool) -> None:
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

    cfg = ProxyConfig(prefill=("http://127.0.0.1:9",), decode=("http://127.0.0.1:10",),
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
        events = [
            json.loads(e[len("data: ") :]) for e in stream.first_chunk(first).split("\n\n") if e
        ]
        event = events[0]  # a chat stream's role chunk, or a completion's token chunk
        assert (event if chat else event["choices"][0])["prompt_token_ids"] == [1, 2]
        assert len(events) == (2 if chat else 1)
        if chat:  # the token's chunk after the role's carries none
            assert "prompt_token_ids" not in events[1]
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


def test_reasoning_effort_is_a_chat_template_variable_as_vllm_passes_it() -> None:
    """vLLM's ``reasoning_effort`` (the ``openai`` package sends it): one of its values or
    null, passed to a Jinja chat template as ``reasoning_effort`` (over a
    ``chat_template_kwargs`` one, as vLLM merges them); a template without the variable,
    and the built-in one, are unchanged. Another value is a 400 naming it, as vLLM's."""
    from engine.tokenizer import load_tokenizer
    from proxy.validation import CHAT, validate_request

    own = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}[{{ reasoning_effort }}]"
    engine = ScriptedEngine(tokenizer=load_tokenizer("tiny", own))
    client = _client(engine)
    for body, want in (
        ({"reasoning_effort": "low"}, b"<hi>[low]"),
        ({"reasoning_effort": None}, b"<hi>[]"),
        ({"chat_template_kwargs": {"reasoning_effort": "high"}}, b"<hi>[high]"),
        ({"reasoning_effort": "none", "chat_template_kwargs": {"reasoning_effort": "x"}},
         b"<hi>[none]"),
    ):  # fmt: skip
        resp = client.post("/v1/chat/completions", json={"messages": MSGS, **body})
        assert resp.status_code == 200, resp.text
        assert engine.seen[-1][0] == list(want)
    plain = ScriptedEngine()  # the built-in template: accepted, no variable to set
    resp = _client(plain).post(
        "/v1/chat/completions", json={"messages": MSGS, "reasoning_effort": "medium"}
    )
    assert resp.status_code == 200, resp.text
    for bad in ("bogus", 3, True):
        body = {"messages": MSGS, "reasoning_effort": bad}
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "reasoning_effort"
        with pytest.raises(Exception) as info:  # the proxy answers the same 400
            validate_request(CHAT, json.dumps(body).encode(), ["m"], None)
        assert getattr(info.value, "param", None) == "reasoning_effort"


def test_the_proxy_passes_a_request_chat_template_to_the_nodes() -> None:
    from proxy.validation import CHAT, validate_request

    body = {"messages": MSGS, "chat_template": "{{ messages[0]['content'] }}"}
    req = validate_request(CHAT, json.dumps(body).encode(), ["m"], None)
    assert req.body["chat_template"] == body["chat_template"]  # the nodes judge it


# -- vLLM's flags -------------------------------------------------------------------------------


def _parse(*argv: str, role: str = "decode") -> Any:
    from engine.server.cli_args import parse_config
    from engine.server.node_main import build_parser

    return parse_config(build_parser(role), list(argv))  # type: ignore[arg-type]


def _refused(capsys: pytest.CaptureFixture[str], *argv: str, role: str = "decode") -> str:
    with pytest.raises(SystemExit) as info:
        _parse(*argv, role=role)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_flags_a_vllm_command_line_carries_are_accepted() -> None:
    args, config = _parse(
        "--trust-remote-code", "--disable-log-requests", "--enable-chunked-prefill",
        "--uvicorn-log-level", "WARNING", "--max-logprobs", "5", "--generation-config", "vllm",
        "--served-model-name", "first", "second",
    )  # fmt: skip
    assert args.trust_remote_code and not args.log_requests and args.enable_chunked_prefill
    assert args.uvicorn_log_level == "warning"
    assert config.model.max_logprobs == 5 and config.model.generation_config == "vllm"
    assert config.model.served_names == ("first", "second") and config.model.name == "first"
    args, config = _parse("--enable-log-requests")
    assert args.log_requests and args.uvicorn_log_level is None
    args, config = _parse()  # the defaults: requests logged, vLLM's 20 and auto
    assert args.log_requests and not args.trust_remote_code
    assert config.model.max_logprobs == 20 and config.model.generation_config == "auto"
    assert config.model.served_names == ("tiny",)


def test_served_model_names_in_a_config_file(tmp_path: Any) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("served-model-name: [a, b]\n")
    assert _parse("--config", str(path))[1].model.served_names == ("a", "b")
    path.write_text("served-model-name: one\n")
    assert _parse("--config", str(path))[1].model.served_names == ("one",)


def test_what_pdserve_cannot_do_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    err = _refused(capsys, "--no-enable-chunked-prefill")
    assert "--no-enable-chunked-prefill" in err and "always chunks" in err
    assert "--max-logprobs" in _refused(capsys, "--max-logprobs", "-2")
    assert "--generation-config" in _refused(capsys, "--generation-config", str(tmp_path / "no"))
    assert "--uvicorn-log-level" in _refused(capsys, "--uvicorn-log-level", "loud")


NIXL_BOTH = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'


@pytest.mark.parametrize(
    "role, text, want",
    [
        ("prefill", NIXL_BOTH, {"kv_connector": "nixl", "kv_role": "both"}),
        ("decode", '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}',
         {"kv_connector": "nixl", "kv_role": "consumer"}),
        ("prefill", '{"kv_connector": "NixlConnector"}',  # the node's role stays
         {"kv_connector": "nixl", "kv_role": "producer"}),
        ("decode", '{"kv_connector": "NixlConnector", "engine_id": "e1", "kv_buffer_device": '
         '"cpu", "kv_load_failure_policy": "fail", "kv_connector_extra_config": {}}',
         {"kv_connector": "nixl", "engine_id": "e1", "kv_failure_policy": "fail"}),
    ],
)  # fmt: skip
def test_kv_transfer_config_maps_to_pdserves_flags(
    role: str, text: str, want: dict[str, Any]
) -> None:
    args, config = _parse("--kv-transfer-config", text, role=role)
    for key, value in want.items():
        assert getattr(config.kv_transfer, key) == value, key
    # The same flag given as well: fine when it agrees.
    _parse("--kv-transfer-config", text, "--kv-connector", "nixl", role=role)


def test_kv_transfer_config_as_a_mapping_in_a_config_file(tmp_path: Any) -> None:
    # vLLM's --config turns a nested mapping into the flag's JSON; a vLLM config with
    # 'kv-transfer-config:' as a mapping was "invalid value {...}" here (a new-user
    # walkthrough of the README's --config).
    path = tmp_path / "node.yaml"
    path.write_text("kv-transfer-config:\n  kv_connector: NixlConnector\n  kv_role: kv_both\n")
    config = _parse("--config", str(path), role="decode")[1]
    assert (config.kv_transfer.kv_connector, config.kv_transfer.kv_role) == ("nixl", "both")
    path.write_text(f"kv-transfer-config: '{NIXL_BOTH}'\n")  # JSON text, as before
    assert _parse("--config", str(path))[1].kv_transfer.kv_role == "both"
    path.write_text("max-num-seqs: {a: 1}\n")  # a flag that takes no JSON: still refused
    with pytest.raises(SystemExit):
        _parse("--config", str(path))


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1"}'], "NixlConnector"),
        (["--kv-transfer-config", "{nope"], "not JSON"),
        (["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_x"}'],
         "kv_role"),
        (["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_port": 14579}'],
         "kv_port"),
        (["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_buffer_device": '
          '"cuda"}'], "kv_buffer_device"),
        (["--kv-transfer-config", NIXL_BOTH, "--kv-role", "consumer"], "--kv-role"),
        (["--kv-transfer-config", '{"kv_connector": "NixlConnector", '
          '"kv_load_failure_policy": "retry"}'], "kv_load_failure_policy"),
    ],
)  # fmt: skip
def test_kv_transfer_config_refuses_what_pdserve_cannot_do(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(capsys, *argv)
    assert "--kv-transfer-config" in err and needle in err, err


def test_max_logprobs_is_a_400_naming_the_flag() -> None:
    client = _client(max_logprobs=3)
    for path, body, param in [
        ("/v1/completions", {"prompt": "x", "logprobs": 4}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 4}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 4},
         "top_logprobs"),
    ]:  # fmt: skip
        resp = client.post(path, json=body)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == param and "--max-logprobs 3" in err["message"]
    assert client.post("/v1/completions", json={"prompt": "x", "logprobs": 3}).status_code == 200
    # Past the default (vLLM's 20) on a node that allows more.
    resp = _client(max_logprobs=30).post("/v1/completions", json={"prompt": "x", "logprobs": 25})
    assert resp.status_code == 200, resp.text
    assert (
        _client().post("/v1/completions", json={"prompt": "x", "logprobs": 21}).status_code == 400
    )


def test_disable_log_requests_keeps_request_lines_out_of_the_info_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for log_requests in (True, False):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="engine.server.serving"):
            resp = _client(log_requests=log_requests).post("/v1/completions", json={"prompt": "x"})
            assert resp.status_code == 200
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
        assert any("finished" in ln for ln in lines) == log_requests, lines


def test_uvicorn_log_level_sets_the_http_servers_level() -> None:
    from engine.httpkit.serve import make_server

    for level, uvicorn_level, access in [
        ("INFO", None, False), ("DEBUG", None, True), ("INFO", "debug", True),
        ("DEBUG", "warning", False),
    ]:  # fmt: skip
        server = make_server(object(), log_level=level, banner="", uvicorn_log_level=uvicorn_level)
        want = (uvicorn_level or level).lower()
        assert logging.getLogger("uvicorn.error").level == logging.getLevelName(want.upper())
        assert server.config.access_log == access


def test_generation_config_auto_reads_the_checkpoints_sampling_defaults(tmp_path: Any) -> None:
    from engine.generation_config import sampling_defaults

    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.05,
           "max_new_tokens": 3, "do_sample": True, "eos_token_id": [1, 2]}  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    # top_k 50 is transformers' own default: vLLM does not apply it either.
    want = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05, "max_tokens": 3}
    assert sampling_defaults(str(tmp_path), "auto") == want
    assert sampling_defaults(str(tmp_path), "vllm") == {}
    assert sampling_defaults("tiny", "auto") == {}
    assert sampling_defaults("tiny", str(tmp_path)) == want  # a directory's file

    engine = ScriptedEngine("abcdef")
    client = _client(engine, sampling_defaults=want)
    body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10}).json()
    params = engine.seen[-1][1]
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.6, 0.9, 1.05)
    assert params.top_k == -1 and params.max_tokens == 3  # max_new_tokens caps the answer
    assert body["choices"][0]["text"] == "abcdef"  # (the scripted engine ignores the cap)
    client.post("/v1/chat/completions", json={"messages": MSGS, "temperature": 0, "top_p": None})
    params = engine.seen[-1][1]
    assert (params.temperature, params.top_p, params.max_tokens) == (0.0, 0.9, 3)


def test_several_served_model_names() -> None:
    engine = ScriptedEngine()
    client = _client(engine, served_model_names=["first", "second"])
    cards = client.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["first", "second"]  # vLLM lists every name
    for name in ("first", "second", None):
        body = {"prompt": "x"} if name is None else {"prompt": "x", "model": name}
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200 and resp.json()["model"] == "m"  # the engine's name
        assert client.post("/tokenize", json=body).status_code == 200
    resp = client.post("/v1/completions", json={"prompt": "x", "model": "third"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_not_found"
    assert "'first', 'second'" in resp.json()["error"]["message"]


def test_the_proxy_accepts_every_name_its_nodes_serve() -> None:
    from proxy.nodes import NodePool
    from proxy.validation import COMPLETIONS, validate_request

    pool = NodePool(("http://p:1",), ("http://d:1",))
    for node in pool.all():
        node.set_healthy(True)
        cards = [{"id": "first", "max_model_len": 64}, {"id": "second", "max_model_len": 64}]
        node.update_info({"side_channel": "tcp://127.0.0.1:5600"}, {"data": cards})
    assert pool.model_names() == ["first", "second"]
    body = json.dumps({"prompt": "x", "model": "second"}).encode()
    assert validate_request(COMPLETIONS, body, pool.model_names(), None).parsed.model == "second"


# -- live: a vLLM command line's flags on a P/D pair behind the proxy -----------------------------

VLLM_FLAGS = (
    "--trust-remote-code", "--disable-log-requests", "--enable-chunked-prefill",
    "--uvicorn-log-level", "warning", "--max-logprobs", "5", "--generation-config", "auto",
    "--served-model-name", "first", "second", "--chat-template", TEMPLATE,
    "--kv-transfer-config", NIXL_BOTH, "--num-blocks", "128",
)  # fmt: skip


@pytest.mark.slow
def test_live_a_pd_pair_started_with_vllm_flags(procs: Any) -> None:
    """Both nodes take the flags of a `vllm serve` command line; P and D render chats with
    the same --chat-template, so the proxy's answer is a colocated node's."""
    import httpx

    p = procs.node(*VLLM_FLAGS, module="prefill_node", name="p", wait=False)
    d = procs.node(*VLLM_FLAGS, module="decode_node", name="d", wait=False)
    from harness import wait_healthy

    wait_healthy(p, d)
    proxy = procs.proxy([p.url], [d.url])
    want = list(b"[user]hi\n[assistant]!")
    body = {"model": "second", "messages": MSGS, "max_tokens": 4, "temperature": 0,
            "chat_template_kwargs": {"shout": True}, "return_token_ids": True}  # fmt: skip
    for url in (d.url, proxy.url):
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        assert answer["prompt_token_ids"] == want and answer["model"] == "first"
        assert len(answer["choices"][0]["token_ids"]) == 4
        resp = httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120)
        events = _events(resp)
        assert events[0]["prompt_token_ids"] == want
        assert sum(len(e["choices"][0]["token_ids"]) for e in events if e["choices"]) == 4
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["first", "second"]
        assert [m["root"] for m in models] == ["tiny", "tiny"]  # vLLM's: the --model given
        for method in ("GET", "POST"):
            assert httpx.request(method, url + "/ping", timeout=10).status_code == 200
        resp = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": MSGS, "logprobs": True, "top_logprobs": 6})  # fmt: skip
        assert resp.status_code == 400 and "--max-logprobs 5" in resp.text
    info = httpx.get(p.url + "/v1/kv_transfer_info", timeout=10).json()
    assert info["role"] == "both"  # kv_both, as vLLM's NIXL deployments give both nodes
    for node in (p, d):
        logs = node.logs()
        assert "--trust-remote-code: no effect" in logs
        assert " finished: " not in logs  # --disable-log-requests: the request lines are DEBUG


def test_nodes_advertise_their_chat_template_and_the_proxy_warns_when_p_and_d_differ(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from engine.tokenizer import load_tokenizer
    from proxy.health import HealthChecker
    from proxy.nodes import NodePool

    plain = _client().get("/v1/kv_transfer_info").json()["chat_template"]
    own = _client(ScriptedEngine(tokenizer=load_tokenizer("tiny", TEMPLATE)))
    templated = own.get("/v1/kv_transfer_info").json()["chat_template"]
    assert plain == "builtin" and templated not in (None, "builtin")

    pool = NodePool(("http://p:1",), ("http://d:1", "http://d:2"))
    for node, digest in zip(pool.all(), (templated, templated, plain), strict=True):
        node.update_info({"side_channel": "tcp://127.0.0.1:5600", "chat_template": digest},
                         {"data": [{"id": "m"}]})  # fmt: skip
        node.set_healthy(True)
    checker = HealthChecker(pool, SimpleNamespace(timeout=1.0), 60.0)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="proxy.health"):
        for _ in range(2):  # said once per pair
            for node in pool.all():
                checker._check_templates(node)
    warnings = [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "http://p:1" in warnings[0] and "http://d:2" in warnings[0]
    assert "--chat-template" in warnings[0]


def test_vllms_side_channel_environment_sets_the_side_channel_below_the_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.0.0.7")
    kv = _parse(role="prefill")[1].kv_transfer
    assert (kv.side_channel_host, kv.side_channel_port) == ("10.0.0.7", 5600)
    kv = _parse("--side-channel-port", "5700", role="prefill")[1].kv_transfer
    assert (kv.side_channel_host, kv.side_channel_port) == ("10.0.0.7", 5700)  # the flag wins
    path = tmp_path / "c.yaml"
    path.write_text("side-channel-port: 5800\n")
    assert _parse("--config", str(path))[1].kv_transfer.side_channel_port == 5800
    for bad in ("port", "70000", "-1"):
        monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", bad)
        err = _refused(capsys)
        assert "VLLM_NIXL_SIDE_CHANNEL_PORT" in err and "--side-channel-port" in err, err
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT")
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST")
    kv = _parse()[1].kv_transfer
    assert (kv.side_channel_host, kv.side_channel_port) == ("127.0.0.1", 0)  # the defaults


def test_vllms_api_key_variable_sets_the_key_below_pdserves_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # `vllm serve` reads its key from VLLM_API_KEY when --api-key is not given; a vLLM
    # deployment's environment (a Secret as VLLM_API_KEY) left a pdserve node without any
    # key, open to every client, and nothing said so (a walkthrough of --api-key).
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    assert _parse()[0].api_key == "vllm-key"
    assert _parse("--api-key", "flag-key")[0].api_key == "flag-key"  # the flag wins
    path = tmp_path / "c.yaml"
    path.write_text("api-key: file-key\n")
    assert _parse("--config", str(path))[0].api_key == "file-key"
    monkeypatch.setenv("PDSERVE_API_KEY", "pdserve-key")  # pdserve's own variable wins
    assert _parse()[0].api_key == "pdserve-key"
    monkeypatch.delenv("PDSERVE_API_KEY")
    monkeypatch.delenv("VLLM_API_KEY")
    assert _parse()[0].api_key is None


def test_default_sampling_params_are_the_checkpoints_generation_config(tmp_path: Any) -> None:
    from engine.generation_config import default_sampling_params

    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "max_new_tokens": 7}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    p = default_sampling_params(str(tmp_path), "auto")
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.6, 0.9, 20, 0.05, 7)
    assert default_sampling_params(str(tmp_path), "vllm") == SamplingParams()
    assert default_sampling_params("tiny", "auto") == SamplingParams()  # vLLM's defaults too
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json.*temperature"):
        default_sampling_params(str(tmp_path), "auto")


@pytest.mark.slow
def test_the_offline_llm_samples_with_the_checkpoints_defaults(tmp_path: Any) -> None:
    from engine.bench.models import PRESETS, make_model
    from engine.config import CacheConfig, EngineConfig, ModelConfig
    from engine.llm import LLM

    model = tmp_path / "m"
    make_model(str(model), PRESETS["tiny-llama"])
    gen = {"temperature": 0.0, "max_new_tokens": 5}  # greedy, 5 tokens
    (model / "generation_config.json").write_text(json.dumps(gen))
    cfg = EngineConfig(model=ModelConfig(model=str(model)), cache=CacheConfig(num_blocks=64))
    with LLM(cfg) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
        prompt = [[1, 5, 6, 7]]
        out = llm.generate_token_ids(prompt)  # vLLM's LLM.generate without sampling params
        assert out == llm.generate_token_ids(prompt, SamplingParams(temperature=0.0, max_tokens=5))
        assert len(out[0]) == 5


def test_reasoning_effort_sets_enable_thinking_unless_the_request_does() -> None:
    """vLLM's mapping (its PR 43401): a request's ``reasoning_effort`` gives the template
    ``enable_thinking`` -- false for "none", true otherwise -- unless
    ``chat_template_kwargs`` sets it; the reasoning parser follows the same value (qwen3:
    no thinking, no split)."""
    from scripted_engine import ScriptedEngine as Scripted
    from starlette.testclient import TestClient

    from engine.server.app import build_app
    from engine.tokenizer import load_tokenizer

    own = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}[{{ reasoning_effort }}|{{ enable_thinking }}]"  # noqa: E501
    engine = ScriptedEngine(tokenizer=load_tokenizer("tiny", own))
    client = _client(engine)
    for body, want in (
        ({"reasoning_effort": "low"}, b"<hi>[low|True]"),
        ({"reasoning_effort": "none"}, b"<hi>[none|False]"),
        ({}, b"<hi>[|]"),
        ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
         b"<hi>[none|True]"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, b"<hi>[|False]"),
    ):  # fmt: skip
        resp = client.post("/v1/chat/completions", json={"messages": MSGS, **body})
        assert resp.status_code == 200, resp.text
        assert engine.seen[-1][0] == list(want), bytes(engine.seen[-1][0])
    answer = "<think>\nadd them</think>\n\nIt is 4."
    qwen3 = TestClient(build_app(Scripted(answer), reasoning_parser="qwen3"))  # type: ignore[arg-type]
    for effort, reasoning, content in (
        ("high", "\nadd them", "\n\nIt is 4."),
        ("none", None, answer),
    ):
        body = {"messages": MSGS, "max_tokens": 64, "reasoning_effort": effort}
        msg = qwen3.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert (msg.get("reasoning_content"), msg["content"]) == (reasoning, content)
