"""Hostile HTTP input gets a clear 4xx naming the problem, never a 5xx, and never stalls the
node for other clients (a real node, tiny model)."""

from __future__ import annotations

import json
import socket
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


def _post_watching_health(
    node: Proc, body: bytes, path: str = "/v1/completions"
) -> tuple[httpx.Response, float]:
    """POST ``body``; meanwhile poll ``/health``: the answer and the slowest health check."""
    result: dict[str, httpx.Response] = {}

    def big() -> None:
        result["r"] = _post_raw(node, body, path)

    t = threading.Thread(target=big)
    t.start()
    worst = 0.0
    with httpx.Client(timeout=30) as client:  # one client: no per-check set-up in the times
        while t.is_alive():
            start = time.monotonic()
            assert client.get(node.url + "/health").status_code == 200
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.01)
    t.join()
    return result["r"], worst


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
    """Parsing, checking and templating a big body run off the event loop: /health keeps
    answering. A chat body of 200k messages: its Python-level work (the checks, the chat
    template: ~1 s here) is most of the request, so on the loop /health would wait about
    the whole request; off it, /health waits at most for ``json.loads``' own GIL-held
    parse (~0.2-0.3 s, ~20% of the request). A prompt of 2M token ids was used before:
    its request is mostly that parse, so it could not tell the two apart."""
    messages = [{"role": "user", "content": "hi"}] * 200_000  # ~6 MB of JSON
    body = json.dumps({"messages": messages, "max_tokens": 2}).encode()
    resp, worst = _post_watching_health(node, body, "/v1/chat/completions")
    _error(resp, 400)  # longer than the context
    # Measured: ~0.14 of the request off the loop, ~0.99 on it.
    assert worst < 0.6 * resp.elapsed.total_seconds(), (worst, resp.elapsed)


# -- the connection and the log: what a client can do to them -----------------------------


@pytest.fixture(scope="module")
def proxy(module_procs: Procs, node: Proc) -> Proc:
    """A proxy in front of the node (routing does not matter: these requests end before;
    a URL is one role, so the decode node is an address nothing answers at)."""
    p = module_procs.proxy([node.url], ["http://127.0.0.1:9"], wait=False)
    deadline = time.monotonic() + 60
    while True:  # serving, healthy or not
        try:
            httpx.get(p.url + "/health", timeout=2)
            return p
        except httpx.HTTPError:
            assert p.proc.poll() is None and time.monotonic() < deadline, p.logs()
            time.sleep(0.2)


def _log_lines(p: Proc) -> list[str]:
    return p.logs(10**7).splitlines()


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("which", ["node", "proxy"])
def test_a_client_gone_mid_body_is_a_disconnect_not_a_logged_error(request, which, path):
    """A client that sends part of a body and closes the connection is an ordinary
    disconnect: no ERROR line or traceback for anyone to be paged about (on the utility
    paths too, which a black-box round found still logging one)."""
    srv: Proc = request.getfixturevalue(which)
    before = len(_log_lines(srv))
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
            + b'Content-Length: 1000\r\n\r\n{"prompt": "hel'
        )
        time.sleep(0.3)
    time.sleep(1.0)  # the server notices the close
    assert httpx.get(srv.url + "/health", timeout=10).status_code in (200, 503)
    new = "\n".join(_log_lines(srv)[before:])
    assert "Traceback" not in new and " ERROR " not in new, new


@pytest.mark.parametrize("which", ["node", "proxy"])
def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_clients_host(request, which):
    srv: Proc = request.getfixturevalue(which)
    resp = httpx.post(
        srv.url + "/v1/completions/",
        json={"prompt": "hi", "max_tokens": 1},
        headers={"Host": "evil.example:666"},
        timeout=30,
    )
    assert resp.status_code == 404, (resp.status_code, resp.headers)
    assert "location" not in resp.headers
    assert resp.json()["error"]["message"]


def test_ids_given_to_abort_cannot_forge_log_lines(node):
    forged = "FORGED 2026-12-01 00:00:00 ERROR injected"
    for by in ("request_id", "transfer_id"):
        body = {by: f"zz\n{forged}\r\n{forged}" + "x" * 100_000}
        resp = httpx.post(node.url + "/v1/abort", json=body, timeout=30)
        assert resp.status_code == 200 and resp.json()["request_ids"] == []
    time.sleep(0.2)
    lines = _log_lines(node)
    assert not any(line.startswith("FORGED") for line in lines)
    assert max(len(line) for line in lines) < 10_000  # the 100 kB id is not logged whole


@pytest.mark.parametrize("which", ["node", "proxy"])
def test_a_compressed_body_is_a_415_naming_the_encoding(request, which):
    import gzip

    srv: Proc = request.getfixturevalue(which)
    raw = gzip.compress(json.dumps({"prompt": "hi", "max_tokens": 1}).encode())
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    resp = httpx.post(srv.url + "/v1/completions", content=raw, headers=headers, timeout=30)
    assert resp.status_code == 415, resp.text
    assert "gzip" in resp.json()["error"]["message"]


@pytest.mark.parametrize("which", ["node", "proxy"])
def test_health_answers_head_as_load_balancers_send_it(request, which):
    srv: Proc = request.getfixturevalue(which)
    get = httpx.get(srv.url + "/health", timeout=10)
    head = httpx.head(srv.url + "/health", timeout=10)
    assert head.status_code == get.status_code and head.content == b""


def test_tokenizing_a_huge_prompt_does_not_stall_other_clients(node):
    """The answer to /tokenize of a long prompt (millions of token ids) is built off the
    event loop: /health keeps answering meanwhile."""
    body = json.dumps({"prompt": "hello world " * 800_000}).encode()
    resp, worst = _post_watching_health(node, body, "/tokenize")
    assert resp.status_code == 200 and resp.json()["count"] > 1_000_000
    assert worst < 0.4 * resp.elapsed.total_seconds(), (worst, resp.elapsed)  # ~0.06 measured
