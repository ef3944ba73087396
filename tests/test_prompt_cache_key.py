"""OpenAI's ``prompt_cache_key``: a string (at most 64 characters, OpenAI's bound) that
names the cache a request should go to. Accepted on completions, chat and
``/v1/responses``, checked at entry -- a node's HTTP layer (a scripted engine) and the
proxy's (its app, no nodes) -- with a 400 naming the field, and never warned about as an
unknown field. The proxy's routing by it: ``tests/test_proxy_cache_key.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from scripted_engine import ScriptedEngine
from starlette.testclient import TestClient
from test_cache_salt import BODIES, MESSAGES, proxy_entry_answers

from engine.responses_api.request import to_chat
from engine.server.app import build_app
from engine.server.chat_protocol import parse_chat_request
from engine.server.field_parsers import MAX_PROMPT_CACHE_KEY_CHARS
from engine.server.protocol import parse_completion_request

BAD_KEYS = [123, 1.5, True, ["a"], {"a": "b"}, "x" * (MAX_PROMPT_CACHE_KEY_CHARS + 1)]


def test_openais_bound() -> None:
    assert MAX_PROMPT_CACHE_KEY_CHARS == 64


@pytest.fixture
def node() -> TestClient:
    return TestClient(build_app(ScriptedEngine("ok")))  # type: ignore[arg-type]


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("key", BAD_KEYS, ids=lambda s: repr(s)[:20])
def test_a_node_refuses_a_key_that_is_no_short_string(node: TestClient, path, key) -> None:
    resp = node.post(path, json={**BODIES[path], "prompt_cache_key": key})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "prompt_cache_key", resp.text


@pytest.mark.parametrize("path", list(BODIES))
def test_a_node_serves_a_request_with_a_key(node: TestClient, path) -> None:
    for key in ("conversation-1", "k" * MAX_PROMPT_CACHE_KEY_CHARS, "", None):
        resp = node.post(path, json={**BODIES[path], "prompt_cache_key": key})
        assert resp.status_code == 200, resp.text


def test_the_key_is_a_known_field_of_every_endpoint() -> None:
    """Parsed, not "present in the request but ignored" (the node's warning)."""
    comp = parse_completion_request({"prompt": "hi", "prompt_cache_key": "c-1"})
    chat = parse_chat_request({"messages": MESSAGES, "prompt_cache_key": "c-1"})
    for req in (comp, chat):
        assert req.ignored_fields == () and req.prompt_cache_key == "c-1"
    assert (
        parse_chat_request({"messages": MESSAGES, "prompt_cache_key": ""}).prompt_cache_key is None
    )
    # /v1/responses hands it to the chat request it is served as (the proxy routes by it).
    body, echo = to_chat({"input": "hi", "prompt_cache_key": "c-1"})
    assert body["prompt_cache_key"] == "c-1" and echo.ignored_fields == ()


@pytest.mark.parametrize("key", BAD_KEYS, ids=lambda s: repr(s)[:20])
def test_the_proxy_refuses_a_bad_key_before_any_node(key: Any) -> None:
    for resp in proxy_entry_answers("prompt_cache_key", key):
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "prompt_cache_key", resp.text
