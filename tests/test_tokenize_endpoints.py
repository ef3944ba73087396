"""vLLM's /tokenize, /detokenize and /version on a node app (in-process, a fake engine), and
the request fields min_tokens and chat_template_kwargs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine.server.app import ROUTES, build_app
from engine.server.chat_protocol import parse_chat_request
from engine.server.protocol import parse_completion_request
from engine.server.request_fields import APIError
from engine.server.tokenize import pdserve_version
from engine.tokenizer import ByteTokenizer, HFTokenizer

MAX_LEN = 4096
# A template that uses an extra variable, the way Qwen3's uses enable_thinking.
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% if shout %} HELLO{% endif %}{% endif %}"
)
MSGS = [{"role": "user", "content": "hello world"}]


def _engine(tokenizer: Any, vocab_size: int = 512) -> SimpleNamespace:
    return SimpleNamespace(
        model_name="m",
        max_model_len=MAX_LEN,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        dead_reason=None,
        healthy=True,
        stats=lambda: {},
        kv_info=lambda: {},
    )


@pytest.fixture
def client() -> TestClient:
    return TestClient(build_app(_engine(ByteTokenizer())))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["hello world user assistant HELLO : system"] * 5, trainer)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def _err(resp: Any, status: int, param: str | None) -> None:
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_routes_are_known() -> None:
    assert {"/tokenize", "/detokenize", "/version"} <= ROUTES


def test_tokenize_prompt_and_detokenize_round_trip(client: TestClient) -> None:
    r = client.post("/tokenize", json={"model": "m", "prompt": "héllo"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == list("héllo".encode()) and body["count"] == 6
    assert body["max_model_len"] == MAX_LEN and body["token_strs"] is None
    r = client.post("/detokenize", json={"model": "m", "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "héllo"}
    r = client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True})
    assert r.status_code == 200 and r.json()["token_strs"] == ["h", "i"], r.text


def test_tokenize_chat_uses_the_template(client: TestClient) -> None:
    r = client.post("/tokenize", json={"messages": MSGS})
    assert r.status_code == 200, r.text
    want = ByteTokenizer().apply_chat_template(MSGS)
    assert r.json()["tokens"] == list(want.encode())


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": MSGS}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/tokenize", {"messages": MSGS, "add_generation_prompt": "no"}, "add_generation_prompt"),
        (
            "/tokenize",
            {"messages": MSGS, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),  # fmt: skip
        ("/tokenize", {"messages": MSGS, "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1, True]}, "tokens"),
        ("/detokenize", {"tokens": [1, 512]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "other"}, "model"),
    ],
)
def test_bad_requests_name_the_field(client: TestClient, path: str, body: Any, param: str) -> None:
    _err(client.post(path, json=body), 400, param)


def test_not_json_is_400(client: TestClient) -> None:
    r = client.post("/tokenize", content=b"{nope")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert client.post("/detokenize", json=[1, 2]).status_code == 400


def test_version(client: TestClient) -> None:
    r = client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": pdserve_version()}
    assert pdserve_version()


def test_api_key_protects_the_new_paths() -> None:
    app = build_app(_engine(ByteTokenizer()), api_key="k")  # type: ignore[arg-type]
    c = TestClient(app)
    assert c.post("/tokenize", json={"prompt": "x"}).status_code == 401
    assert c.post("/detokenize", json={"tokens": [1]}).status_code == 401
    assert c.get("/version").status_code == 401
    auth = {"Authorization": "Bearer k"}
    assert c.post("/tokenize", json={"prompt": "x"}, headers=auth).status_code == 200
    assert c.get("/version", headers=auth).status_code == 200


def test_chat_template_kwargs_reach_a_jinja_template(hf_dir: Path) -> None:
    tok = HFTokenizer(str(hf_dir))
    assert tok.supports_template_kwargs and not ByteTokenizer().supports_template_kwargs
    assert tok.apply_chat_template(MSGS).endswith("assistant:")
    assert tok.apply_chat_template(MSGS, {"shout": True}).endswith("assistant: HELLO")
    c = TestClient(build_app(_engine(tok, tok.vocab_size)))  # type: ignore[arg-type]
    plain = c.post("/tokenize", json={"messages": MSGS}).json()["tokens"]
    shout = c.post(
        "/tokenize", json={"messages": MSGS, "chat_template_kwargs": {"shout": True}}
    ).json()["tokens"]
    assert shout[: len(plain)] == plain and len(shout) > len(plain)
    with_bos = c.post("/tokenize", json={"prompt": "hello", "add_special_tokens": True})
    assert with_bos.status_code == 200


# -- request fields ---------------------------------------------------------------------------


def test_min_tokens_is_honoured_up_to_max_tokens() -> None:
    parse_completion_request({"prompt": "x", "min_tokens": 0})
    parse_chat_request({"messages": MSGS, "min_tokens": None})
    assert parse_completion_request({"prompt": "x", "min_tokens": 3}).min_tokens == 3
    assert (
        parse_chat_request({"messages": MSGS, "min_tokens": 1}).sampling_params(8).min_tokens == 1
    )
    for parse, body in (
        (parse_completion_request, {"prompt": "x", "min_tokens": -1}),
        (parse_completion_request, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}),
        (parse_chat_request, {"messages": MSGS, "max_completion_tokens": 1, "min_tokens": 2}),
    ):
        with pytest.raises(APIError) as err:
            parse(body)
        assert err.value.param == "min_tokens"


def test_chat_completions_refuse_what_they_cannot_honour(client: TestClient) -> None:
    """The tiny model's built-in template takes no variables: 400, not silently ignored."""
    body = {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}}
    _err(client.post("/v1/chat/completions", json=body), 400, "chat_template_kwargs")
    body = {"messages": MSGS, "max_tokens": 1, "min_tokens": 2}
    _err(client.post("/v1/chat/completions", json=body), 400, "min_tokens")
    _err(client.post("/v1/completions", json={"prompt": "x", "min_p": 1.5}), 400, "min_p")


def test_chat_template_kwargs_parsed() -> None:
    req = parse_chat_request({"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}})
    assert req.chat_template_kwargs == {"enable_thinking": False}
    assert parse_chat_request({"messages": MSGS}).chat_template_kwargs == {}
    for bad in ("x", [1], {"messages": []}):
        with pytest.raises(APIError) as err:
            parse_chat_request({"messages": MSGS, "chat_template_kwargs": bad})
        assert err.value.param == "chat_template_kwargs"


# -- through the proxy (real nodes) -----------------------------------------------------------


def test_proxy_forwards_tokenize_and_detokenize(procs) -> None:
    import httpx

    pd = procs.pd(1, 1, "--num-blocks", "64")
    proxy = procs.proxy([pd.p.url], [pd.d.url])
    body = {"prompt": "hello"}
    direct = httpx.post(pd.d.url + "/tokenize", json=body, timeout=30)
    via = httpx.post(proxy.url + "/tokenize", json=body, timeout=30)
    assert via.status_code == 200 and via.json() == direct.json()
    r = httpx.post(proxy.url + "/detokenize", json={"tokens": via.json()["tokens"]}, timeout=30)
    assert r.status_code == 200 and r.json() == {"prompt": "hello"}
    bad = httpx.post(proxy.url + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(proxy.url + "/version", timeout=30).json() == {"version": pdserve_version()}
    assert httpx.get(pd.p.url + "/version", timeout=30).json() == {"version": pdserve_version()}
