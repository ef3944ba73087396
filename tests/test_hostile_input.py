"""Hostile HTTP input gets a clear 4xx naming the problem, never a 5xx, and never stalls the
node for other clients (a real node, tiny model)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from harness import Proc, Procs

pytestmark = pytest.mark.slow

MAX_BODY = 12_000_000


@pytest.fixture(scope="module")
def node(module_procs: Procs) -> Proc:
    return module_procs.node(
        "--model", "tiny", "--num-blocks", "64", "--max-request-bytes", str(MAX_BODY)
    )


def _post_raw(node: Proc, raw: bytes, path: str = "/v1/completions") -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(node.url + path, content=raw, headers=headers, timeout=60)


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"]
    return err


def test_deeply_nested_json_is_a_400(node):
    err = _error(_post_raw(node, b"[" * 100_000 + b"]" * 100_000), 400)
    assert "nested" in err["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "hi \ud800 there", "max_tokens": 2}, "prompt"),
        ({"prompt": "hi", "max_tokens": 2, "stop": ["ok", "\udc00"]}, "stop[1]"),
        ({"prompt": "hi", "max_tokens": 2, "user": "\udc00"}, "user"),
    ],
)
def test_lone_surrogates_are_refused_naming_the_field(node, body, field):
    err = _error(_post_raw(node, json.dumps(body).encode()), 400)
    assert err["param"] == field, err


def test_lone_surrogates_in_chat_messages_are_refused(node):
    body = {"messages": [{"role": "user", "content": "x\ud83d"}], "max_tokens": 2}
    err = _error(_post_raw(node, json.dumps(body).encode(), "/v1/chat/completions"), 400)
    assert err["param"] == "messages[0].content", err


def test_a_body_over_max_request_bytes_is_a_413(node):
    body = json.dumps({"prompt": "a" * (MAX_BODY + 10), "max_tokens": 2}).encode()
    err = _error(_post_raw(node, body), 413)
    assert "--max-request-bytes" in err["message"]


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_a_seed_outside_64_bits_is_a_400(node, seed):
    body = {"prompt": "hi", "max_tokens": 2, "seed": seed}
    assert _error(_post_raw(node, json.dumps(body).encode()), 400)["param"] == "seed"


def test_health_answers_while_a_huge_prompt_is_checked(node):
    """Parsing and checking a big body run off the event loop: /health keeps answering."""
    ids = list(range(3, 200)) * 10_000  # ~2M token ids, ~8 MB of JSON
    body = json.dumps({"prompt": ids, "max_tokens": 2}).encode()
    result: dict[str, httpx.Response] = {}

    def big() -> None:
        result["r"] = _post_raw(node, body)

    t = threading.Thread(target=big)
    t.start()
    worst = 0.0
    while t.is_alive():
        start = time.monotonic()
        assert httpx.get(node.url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.01)
    t.join()
    _error(result["r"], 400)  # longer than the context
    # Holding the event loop for the whole check would block /health for about as long.
    assert worst < 0.4 * result["r"].elapsed.total_seconds()
