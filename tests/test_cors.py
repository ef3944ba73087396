"""Browsers calling a node or the proxy from another origin (CORS, vLLM's flags): off until
``--allowed-origins`` names origins; then preflights are answered before the API key is
asked for, and allowed origins' answers carry the ``Access-Control-*`` headers."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine.config import ConfigError
from engine.httpkit.cors import CorsPolicy, cors_list, policy_from
from engine.server.app import build_app
from engine.server.node_main import build_parser
from engine.tokenizer import ByteTokenizer
from proxy.config import ProxyConfig, ProxyConfigError

UI = "https://ui.example"
PREFLIGHT = {"Origin": UI, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip


def _engine() -> SimpleNamespace:
    return SimpleNamespace(
        model_name="m", max_model_len=4096, vocab_size=512, tokenizer=ByteTokenizer(),
        dead_reason=None, healthy=True, stats=lambda: {}, kv_info=lambda: {},
    )  # fmt: skip


def _node(cors: CorsPolicy | None, api_key: str | None = "k") -> TestClient:
    return TestClient(build_app(_engine(), api_key=api_key, cors=cors))  # type: ignore[arg-type]


def test_a_node_answers_no_browser_origin_by_default() -> None:
    c = _node(None)
    resp = c.options("/tokenize", headers=PREFLIGHT)
    assert resp.status_code in (401, 405) and "access-control-allow-origin" not in resp.headers
    resp = c.get("/health", headers={"Origin": UI})
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


def test_an_allowed_origin_gets_its_preflight_without_the_key_and_the_headers_on_answers():
    c = _node(CorsPolicy(allowed_origins=(UI,)))
    pre = c.options("/v1/completions", headers=PREFLIGHT)  # no Authorization: browsers send none
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == UI
    assert "POST" in pre.headers["access-control-allow-methods"]
    other = c.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    ok = c.post(
        "/tokenize", json={"prompt": "hi"}, headers={"Origin": UI, "Authorization": "Bearer k"}
    )
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == UI
    refused = c.post("/tokenize", json={"prompt": "hi"}, headers={"Origin": UI})
    assert refused.status_code == 401  # the key still guards every call; the browser may read why
    assert refused.headers["access-control-allow-origin"] == UI
    assert "access-control-allow-credentials" not in ok.headers


def test_any_origin_when_asked_for_and_credentials_only_for_named_ones() -> None:
    c = _node(CorsPolicy(allowed_origins=("*",)), api_key=None)
    resp = c.post("/tokenize", json={"prompt": "hi"}, headers={"Origin": "http://x:1"})
    assert resp.headers["access-control-allow-origin"] == "*"
    with pytest.raises(ConfigError, match="--allow-credentials: not with --allowed-origins"):
        CorsPolicy(allowed_origins=("*",), allow_credentials=True)
    c = _node(CorsPolicy(allowed_origins=(UI,), allow_credentials=True))
    assert (
        c.options("/tokenize", headers=PREFLIGHT).headers["access-control-allow-credentials"]
        == "true"
    )


@pytest.mark.parametrize(
    ("values", "want"),
    [
        (['["https://a.example", "http://b:3000"]'], ("https://a.example", "http://b:3000")),
        (['["https://a.example",', '"http://b:3000"]'], ("https://a.example", "http://b:3000")),
        (["https://a.example", "http://b:3000,http://c:1"], ("https://a.example", "http://b:3000", "http://c:1")),
        (["*"], ("*",)),
        ([], ()),
    ],
)  # fmt: skip
def test_origin_lists_are_read_as_vllm_writes_them_or_as_values(values: list[str], want: Any):
    assert cors_list(values, "allowed_origins") == want


@pytest.mark.parametrize(
    ("origin", "why"),
    [
        ("https://ui.example/app", "is not an origin"),
        ("ui.example", "is not an origin"),
        ("ftp://ui.example", "is not an origin"),
        ('["https://ui.example"', "not a JSON array"),
    ],
)
def test_a_bad_origin_is_refused_naming_the_flag(origin: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"--allowed-origins: .*{why}"):
        CorsPolicy(allowed_origins=cors_list([origin], "allowed_origins"))


def test_node_flags_build_the_policy() -> None:
    args = build_parser("decode").parse_args(
        ["--allowed-origins", f'["{UI}"]', "--allow-credentials", "--allowed-methods", "POST"]
    )
    policy = policy_from(args)
    assert policy == CorsPolicy((UI,), True, ("POST",), ("*",))
    assert not policy_from(build_parser("decode").parse_args([])).enabled


def test_the_proxy_takes_the_same_flags_and_answers_preflights() -> None:
    from proxy.app import build_app as proxy_app

    base = {"prefill": ("http://127.0.0.1:1",), "decode": ("http://127.0.0.1:2",)}
    # As the proxy's list flags split a JSON array given in pieces.
    cfg = ProxyConfig(**base, allowed_origins=(f'["{UI}",', '"http://b:3000"]'), api_key="k")
    assert cfg.allowed_origins == (UI, "http://b:3000") and cfg.cors.enabled
    with pytest.raises(ProxyConfigError, match="--allowed-origins"):
        ProxyConfig(**base, allowed_origins=("https://ui.example/path",))
    pre = TestClient(proxy_app(cfg)).options("/v1/chat/completions", headers=PREFLIGHT)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == UI
    off = TestClient(proxy_app(ProxyConfig(**base))).options(
        "/v1/chat/completions", headers=PREFLIGHT
    )
    assert "access-control-allow-origin" not in off.headers


@pytest.mark.parametrize(
    "origin",
    ["http://localhost:3000", "https://ui.example", "http://[::1]:8080", "http://10.0.0.5"],
)
def test_origins_as_browsers_send_them_are_taken(origin: str) -> None:
    assert CorsPolicy(allowed_origins=(origin,)).allowed_origins == (origin,)


@pytest.mark.parametrize(
    ("origin", "form"),
    [
        ("https://ui.example/", "https://ui.example"),
        ("HTTPS://UI.Example", "https://ui.example"),
        ("http://ui.example:80", "http://ui.example"),
        ("https://[::1]:443", "https://[::1]"),
    ],
)
def test_an_origin_no_browser_sends_is_refused_naming_the_form_to_write(origin: str, form: str):
    with pytest.raises(ConfigError, match=f"--allowed-origins: .*write it as '{re.escape(form)}'"):
        CorsPolicy(allowed_origins=(origin,))


@pytest.mark.parametrize(
    ("headers", "ok"),
    [(("*",), True), (("Authorization", "content-type"), True), (("content-type",), False)],
)
def test_with_an_api_key_the_allowed_headers_must_let_the_key_through(
    headers: tuple[str, ...], ok: bool
) -> None:
    policy = CorsPolicy(allowed_origins=(UI,), allowed_headers=headers)
    policy.check_key_header(None)  # no key: any list
    if ok:
        policy.check_key_header("k")
    else:
        with pytest.raises(ConfigError, match="--allowed-headers: add authorization"):
            policy.check_key_header("k")
    CorsPolicy(allowed_headers=headers).check_key_header("k")  # CORS off: nothing to check
