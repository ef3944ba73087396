"""A fuzz harness for the HTTP entry: valid bodies mutated at and past every field's edge,
hostile heads and raw bodies, against a LIVE colocated node and a LIVE proxy in front of
a P/D pair (real processes, ``tiny``), started once for the module.

Where ``tests/test_property_http.py`` sets fields to arbitrary JSON (mostly type errors),
this one keeps requests mostly *valid* and pushes each field to its documented edge, one
past it, or a wrong JSON type (``docs/api.md``), several fields at once, so requests get
through the parser and reach the engine with unusual combinations. For every request:

- never a 5xx (a 429/503 only with ``Retry-After``); a 4xx is an OpenAI error body
  ``{"error": {"message", "type", "param", "code"}}``;
- a 200 keeps what the request asked for: ``n`` x prompts choices, at most ``max_tokens``
  tokens each, only ``allowed_token_ids``, no stop before ``min_tokens``, usage that adds
  up; a stream ends with ``[DONE]`` and has no error event.

At the end the node and the pair answer a greedy request with the tokens they gave at the
start, hold no request, no admission place and no KV block, and the proxy holds nothing
in flight and counted no node failure.

CI runs a bounded, fixed set of examples (``derandomize``); ``PDSERVE_FUZZ_EXAMPLES=N``
multiplies every count by N for a long local run::

    PDSERVE_FUZZ_EXAMPLES=20 python -m pytest tests/test_fuzz_http.py tests/test_fuzz_protocol.py
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fakes import fixed_examples
from harness import (
    PD,
    Proc,
    Procs,
    kv_pool_full,
    metric,
    node_idle,
    sse_data,
    wait_for,
    wait_healthy,
)
from hypothesis import event, example, given
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

SCALE = max(1, int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "1")))
MAX_BODY = 1_000_000  # --max-request-bytes everywhere here
API_KEY = "fuzz-key"  # the proxy's --api-key (the nodes have none)
REGISTRATION_KEY = "fuzz-registration-key"  # the proxy's --registration-key
VOCAB = 512  # tiny's vocabulary (checked against /detokenize below)
MAX_MODEL_LEN = 1024  # 64 blocks of 16 tokens


def examples(n: int) -> Any:
    return fixed_examples(n * SCALE)


# -- servers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pd_node_args() -> tuple[str, ...]:
    return (
        "--num-blocks",
        "64",
        "--max-request-bytes",
        str(MAX_BODY),
        "--kv-transfer-timeout",
        "2",
    )


REF = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


class Servers:
    def __init__(self, node: Proc, pd: PD, proxy: Proc) -> None:
        self.node, self.pd, self.proxy = node, pd, proxy
        self.client = httpx.Client(timeout=120)
        self.auth = {"Authorization": f"Bearer {API_KEY}"}
        self.refs = {t: self.reference(t) for t in ("node", "proxy")}
        assert self.refs["node"] == self.refs["proxy"], self.refs
        self.failures = metric(proxy.url, "pdproxy_node_failures_total")

    def url(self, target: str) -> str:
        return (self.node if target == "node" else self.proxy).url

    def post(self, target: str, path: str, raw: bytes, headers: dict[str, Any] | None = None):
        h = {"content-type": "application/json", **self.auth, **(headers or {})}
        return self.client.post(self.url(target) + path, content=raw, headers=h)

    def reference(self, target: str) -> list[int]:
        resp = self.post(target, "/v1/completions", json.dumps(REF).encode())
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def servers(module_procs: Procs, pd_pair: PD) -> Iterator[Servers]:
    node = module_procs.node("--num-blocks", "64", "--max-request-bytes", str(MAX_BODY))
    proxy = module_procs.proxy(
        [pd_pair.p.url], [pd_pair.d.url], "--max-request-bytes", str(MAX_BODY),
        "--api-key", API_KEY, "--registration-key", REGISTRATION_KEY,
    )  # fmt: skip
    wait_healthy(node, proxy)
    s = Servers(node, pd_pair, proxy)
    yield s
    s.client.close()


# -- field values: at the edge, one past it, the wrong JSON type -----------------------------

NAN, INF = float("nan"), float("inf")
WRONG = [None, True, False, 0, -1, 1.5, -0.0, NAN, INF, -INF, 1e308, 2**63, -(2**63) - 1,
         "", "1", "\ud800", "\x00", [], [1], ["a"], {}, {"a": 1}, [[[[[]]]]]]  # fmt: skip
BIG_LIST = [65] * 16_385  # one past allowed_token_ids' bound
COMMON: dict[str, list[Any]] = {
    "model": ["tiny", "", "other", "\x00", "tiny " * 1000],
    "max_tokens": [1, 2, 3, 8, 64, 1000, 1023, 1024, 0, -1, 2**63 - 1, 1.0, 2.5],
    "min_tokens": [0, 1, 2, 3, 8, 9, -1, 2**63 - 1],
    "temperature": [0, -0.0, 5e-324, 1e-5, 0.7, 1, 2, 1e30, 3.4e38, 3.5e38, 1e308, -1e-9],
    "top_p": [5e-324, 1e-45, 1e-9, 0.5, 1, 0, 1.0000001],
    "top_k": [-1, 0, 1, 2, VOCAB - 1, VOCAB, 10**6, 2**63 - 1, -2],
    "min_p": [0, 5e-324, 0.5, 0.999, 1, 1.0000001, -1e-300],
    "seed": [0, 1, -1, 2**63 - 1, -(2**63), 2**63],
    "stop": [
        "",
        "a",
        "💥",
        " ",
        "\u202e",
        ["\x00"],
        ["e", "t", "a"],
        ["a"] * 64,
        ["a"] * 65,
        ["x" * 4096],
        ["x" * 4097],
        ["<|endoftext|>"],
        [None],
    ],  # fmt: skip
    "stop_token_ids": [
        [],
        [0],
        [65],
        [VOCAB - 1],
        [VOCAB],
        [2**63 - 1],
        [0] * 1024,
        [0] * 1025,
        [-1],
    ],  # fmt: skip
    "ignore_eos": [True, False],
    "include_stop_str_in_output": [True, False],
    "skip_special_tokens": [True, False],
    "return_tokens_as_token_ids": [True, False],
    "stream": [True, False],
    "stream_options": [
        {"include_usage": True},
        {"include_usage": False},
        {"include_usage": True, "continuous_usage_stats": True},
        {},
        {"unknown": 1},
    ],  # fmt: skip
    "n": [1, 2, 3, 0, -1, 128, 129],
    "best_of": [None, 1, 2, 3],
    "prompt_logprobs": [0, 1, 20, 21, -1],
    "truncate_prompt_tokens": [1, 2, 3, -1, 0, -2, MAX_MODEL_LEN, MAX_MODEL_LEN + 1],
    "allowed_token_ids": [
        [],
        [65],
        [65, 66, 67],
        [0],
        [VOCAB - 1],
        [VOCAB],
        [-1],
        [2**63 - 1],
        list(range(300)),
        BIG_LIST[:-1],
        BIG_LIST,
    ],  # fmt: skip
    "logit_bias": [
        {},
        {"65": 100},
        {"65": -100, "66": 100},
        {"0": 1e308},
        {"-1": 1},
        {str(VOCAB): 1},
        {"💥": 1},
        {"٣": 1},
        {"9" * 20: 1},
        {"65": "1"},
        {str(i): 1 for i in range(1025)},
    ],  # fmt: skip
    "presence_penalty": [-2, 2, 2.0001, -2.0001, 0],
    "frequency_penalty": [-2, 2, 2.0001, -2.0001, 0],
    "repetition_penalty": [1e-6, 1e6, 9e-7, 1.1e6, 0, 1],
    "user": ["", "\x00", "\u202e💥", "a" * 70_000],
    "kv_transfer_params": [{}, {"do_remote_decode": True}, {"unknown": 1}],
    "request_id": ["\x00\n", "x" * 10_000, "other-clients-id"],  # vLLM's field: ignored here
    "use_beam_search": [False, True],
    "length_penalty": [1, 1.0, 2],
    "guided_json": [None, {}, {"type": "object"}],
}
COMPLETION: dict[str, list[Any]] = {
    **COMMON,
    "prompt": [
        "Hello",
        "",
        "\x00",
        "\u202e💥 é",
        [],
        [0],
        [VOCAB - 1],
        [VOCAB],
        [-1],
        [2**63],
        [65] * 1100,
        ["a", [65, 66]],
        ["a", ""],
        [[]],
        [["a"]],
        ["a"] * 129,
        [[65]] * 3,
        "x" * 20_000,
        "<|endoftext|>" * 3,
    ],  # fmt: skip
    "logprobs": [0, 1, 5, 20, 21, -1, True],
    "echo": [True, False],
    "suffix": ["", "x"],
    "response_format": [{"type": "text"}, {"type": "json_object"}],
}
PARTS = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}},
         {"type": "input_audio"}, {"type": "text"}, {"type": None}, {"text": "a"}, "a"]  # fmt: skip
CHAT: dict[str, list[Any]] = {
    **COMMON,
    "messages": [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "\x00"}, {"role": "user", "content": "\u202e💥"}],
        [{"role": "developer", "content": "x"}, {"role": "assistant", "content": None}],
        [{"role": "user", "content": [PARTS[0], PARTS[0]]}],
        *([{"role": "user", "content": [p]}] for p in PARTS[1:]),
        [{"content": "a"}],
        [{"role": "tool", "content": "a", "tool_call_id": "x"}],
        [{"role": "function", "content": "a"}],
        [{"role": "", "content": "a"}],
        [{"role": "user", "content": "a", "tool_calls": [{"id": "x"}]}],
        [{"role": "user", "content": "a", "name": {"a": 1}}],
        [{"role": "assistant", "content": "I"}],
        [{"role": "user", "content": "a"}] * 300,
        [{"role": "user", "content": "a" * 5000}],
        [],
        [None],
        "Hi",
    ],
    "logprobs": [True, False],
    "top_logprobs": [0, 1, 20, 21, -1],
    "max_completion_tokens": [1, 2, 8, 1023, 0, -1],
    "chat_template_kwargs": [{}, {"enable_thinking": False}, {"messages": []}],
    "add_generation_prompt": [True, False],
    "continue_final_message": [True, False],
    "tools": [[], [{"type": "function"}]],
    "tool_choice": ["none", "auto", {"type": "function"}],
    "response_format": [{"type": "text"}, {"type": "json_schema"}],
    "echo": [False, True],
}
COMPLETION_BASE = {"prompt": "Hello there", "max_tokens": 3}
CHAT_BASE = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3}


def mutated(fields: dict[str, list[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """1-4 fields, each mostly at one of its own edges, sometimes a wrong JSON type."""

    def value(name: str) -> st.SearchStrategy[Any]:
        own = st.sampled_from(fields[name])
        return st.one_of(own, own, own, st.sampled_from(WRONG))

    names = st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=4, unique=True)
    return names.flatmap(lambda ns: st.fixed_dictionaries({n: value(n) for n in ns}))


# -- checks ----------------------------------------------------------------------------------


def check_error(resp: httpx.Response, what: str) -> dict[str, Any]:
    assert resp.headers.get("content-type", "").startswith("application/json"), what
    body = resp.json()
    assert isinstance(body, dict) and set(body) == {"error"}, what
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, what
    assert isinstance(err["message"], str) and err["message"], what
    assert isinstance(err["type"], str), what
    assert err["param"] is None or isinstance(err["param"], str), what
    assert err["code"] is None or isinstance(err["code"], str), what
    return err


def check_status(resp: httpx.Response, what: str) -> None:
    """No 5xx but a 503 with Retry-After; 429 with Retry-After; a 4xx is an OpenAI error."""
    event(f"status {resp.status_code}")
    if resp.status_code in (429, 503):
        assert resp.headers.get("retry-after"), what
    else:
        assert resp.status_code < 500, what
    if resp.status_code >= 400:
        check_error(resp, what)


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def expectations(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """What a 200 answer to ``body`` must keep (only what the body sets validly)."""
    out: dict[str, Any] = {}
    n = body.get("n", 1)
    prompts = 1
    p = body.get("prompt")
    if not chat and isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
        prompts = len(p)
    out["choices"] = (n if _is(n, int) else 1) * prompts
    mt = body.get("max_completion_tokens") if chat else None
    mt = mt if mt is not None else body.get("max_tokens")
    if _is(mt, int) or (isinstance(mt, float) and mt.is_integer()):
        out["max_tokens"] = int(mt)
    allowed = body.get("allowed_token_ids")
    if isinstance(allowed, list) and allowed:
        out["allowed"] = set(allowed)
    mn = body.get("min_tokens")
    if _is(mn, int):
        out["min_tokens"] = mn
    return out


def check_choice_tokens(ids: list[int], finish: str | None, want: dict[str, Any], what: str):
    assert all(_is(t, int) and 0 <= t < VOCAB for t in ids), what
    if "max_tokens" in want:
        assert len(ids) <= want["max_tokens"], what
    if "allowed" in want:
        assert set(ids) <= want["allowed"], what
    if finish == "stop" and "min_tokens" in want:
        assert len(ids) >= want["min_tokens"], what
    assert finish in ("stop", "length"), what


def check_answer(resp: httpx.Response, body: dict[str, Any], chat: bool, what: str) -> None:
    check_status(resp, what)
    if resp.status_code != 200:
        return
    want = expectations(body, chat)
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_data(resp.text.splitlines())
        assert events and events[-1] == "DONE", what
        assert not any(isinstance(e, dict) and "error" in e for e in events), what
        ids: dict[int, list[int]] = {}
        finish: dict[int, str | None] = {}
        for e in events[:-1]:
            for c in e["choices"]:
                ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
                if c.get("finish_reason") is not None:
                    finish[c["index"]] = c["finish_reason"]
        assert sorted(finish) == list(range(want["choices"])), what
        for i, reason in finish.items():
            check_choice_tokens(ids.get(i, []), reason, want, what)
        return
    answer = resp.json()
    choices = answer["choices"]
    assert [c["index"] for c in choices] == list(range(want["choices"])), what
    for c in choices:
        text = c["message"]["content"] if chat else c["text"]
        assert isinstance(text, str), what
        check_choice_tokens(c["token_ids"], c["finish_reason"], want, what)
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], what
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in choices), what


# -- generation endpoints ---------------------------------------------------------------------

header_ids = st.one_of(  # X-Request-Id bytes a client can send (no CR/LF/NUL: h11 refuses)
    st.binary(max_size=64).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F)),
    st.sampled_from([b"a" * 10_000, "é💥".encode(), b"..", b"-", b"other-clients-id"]),
)


def run_one(servers: Servers, target: str, chat: bool, changed: dict[str, Any], rid: bytes):
    base = CHAT_BASE if chat else COMPLETION_BASE
    body = {**base, **changed}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    raw = json.dumps(body).encode()  # NaN/Infinity as Python writes them, surrogates escaped
    headers = {"X-Request-Id": rid.strip()} if rid.strip() else {}
    resp = servers.post(target, path, raw, headers)
    check_answer(resp, body, chat, f"{target} {path} {repr(changed)[:400]} -> "
                 f"{resp.status_code} {resp.text[:400]}")  # fmt: skip


@pytest.mark.parametrize("target", ["node", "proxy"])
@examples(40)
@given(changed=mutated(COMPLETION), rid=header_ids)
# Found by this harness: an infinite float32 temperature drew token 0 (tests/test_server_protocol.py)
@example(changed={"temperature": 1e39, "allowed_token_ids": [65, 66, 67]}, rid=b"")
def test_completions_at_and_past_every_fields_edge(servers: Servers, target, changed, rid):
    run_one(servers, target, False, changed, rid)


@pytest.mark.parametrize("target", ["node", "proxy"])
@examples(30)
@given(changed=mutated(CHAT), rid=header_ids)
@example(changed={"temperature": 1e39, "min_tokens": 3, "allowed_token_ids": [65]}, rid=b"")
def test_chat_at_and_past_every_fields_edge(servers: Servers, target, changed, rid):
    run_one(servers, target, True, changed, rid)


# -- utility endpoints ------------------------------------------------------------------------

UTILITY: dict[str, tuple[dict[str, Any], dict[str, list[Any]]]] = {
    "/tokenize": (
        {"prompt": "Hello"},
        {
            "prompt": ["", "\x00" * 10, "x" * 100_000, "💥"],
            "add_special_tokens": [True, False],
            "return_token_strs": [True, False],
            "messages": CHAT["messages"],
            "add_generation_prompt": [True, False],
            "continue_final_message": [True, False],
            "chat_template_kwargs": [{}, {"a": 1}],
            "model": COMMON["model"],
        },
    ),  # fmt: skip
    "/detokenize": (
        {"tokens": [72, 105]},
        {
            "tokens": [
                [],
                [0],
                [VOCAB - 1],
                [VOCAB],
                [-1],
                [2**63],
                list(range(VOCAB)) * 20,
                [1.0],
                [True],
            ],
            "model": COMMON["model"],
        },
    ),  # fmt: skip
}


@pytest.mark.parametrize("target", ["node", "proxy"])
@examples(15)
@given(data=st.data())
def test_utility_endpoints_at_their_edges(servers: Servers, target: str, data) -> None:
    path = data.draw(st.sampled_from(sorted(UTILITY)))
    base, fields = UTILITY[path]
    changed = data.draw(mutated(fields))
    resp = servers.post(target, path, json.dumps({**base, **changed}).encode())
    what = f"{target} {path} {repr(changed)[:300]} -> {resp.status_code} {resp.text[:300]}"
    check_status(resp, what)
    if resp.status_code == 200:
        answer = resp.json()
        if path == "/tokenize":
            assert answer["count"] == len(answer["tokens"]), what
        else:
            assert isinstance(answer["prompt"], str), what


def test_the_vocabulary_is_the_one_the_checks_assume(servers: Servers) -> None:
    for target in ("node", "proxy"):
        ok = servers.post(target, "/detokenize", json.dumps({"tokens": [VOCAB - 1]}).encode())
        past = servers.post(target, "/detokenize", json.dumps({"tokens": [VOCAB]}).encode())
        assert (ok.status_code, past.status_code) == (200, 400), (ok.text, past.text)


# -- raw heads and bodies -----------------------------------------------------------------------

GOOD = b'{"prompt": "Hello", "max_tokens": 2}'


def head(method: bytes, path: bytes, extra: list[bytes], body: bytes | None, length: bool = True):
    lines = [
        method + b" " + path + b" HTTP/1.1",
        b"Host: x",
        b"Authorization: Bearer " + API_KEY.encode(),
    ]
    if body is not None and length:
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines + extra) + b"\r\n\r\n" + (body or b"")


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


TE = [b"Transfer-Encoding: chunked"]
RAW: dict[str, tuple[bytes, bytes, list[bytes], bytes | None, bool]] = {
    # name: (method, path, extra header lines, body, send Content-Length)
    "GET a POST path": (b"GET", b"/v1/completions", [], None, True),
    "PUT": (b"PUT", b"/v1/completions", [], GOOD, True),
    "DELETE": (b"DELETE", b"/v1/chat/completions", [], None, True),
    "OPTIONS": (b"OPTIONS", b"/v1/completions", [], None, True),
    "HEAD a POST path": (b"HEAD", b"/v1/completions", [], None, True),
    "POST /health": (b"POST", b"/health", [], GOOD, True),
    "POST /metrics": (b"POST", b"/metrics", [], GOOD, True),
    "POST /v1/models": (b"POST", b"/v1/models", [], GOOD, True),
    "POST /version": (b"POST", b"/version", [], GOOD, True),
    "GET /tokenize": (b"GET", b"/tokenize", [], None, True),
    "trailing slash": (b"POST", b"/v1/completions/", [], GOOD, True),
    "query string": (b"POST", b"/v1/completions?stream=true&n=5&x=%00%ff%%", [], GOOD, True),
    "percent-encoded path": (b"POST", b"/v1/%63ompletions", [], GOOD, True),
    "NUL in the path": (b"POST", b"/v1/completions%00", [], GOOD, True),
    "absolute-form target": (b"POST", b"http://evil/v1/completions", [], GOOD, True),
    "dot segments": (b"POST", b"/v1/../v1/completions", [], GOOD, True),
    "text/plain": (b"POST", b"/v1/completions", [b"Content-Type: text/plain"], GOOD, True),
    "form": (b"POST", b"/v1/completions", [b"Content-Type: multipart/form-data; boundary=x"],
             GOOD, True),  # fmt: skip
    "gzip": (b"POST", b"/v1/completions", [b"Content-Encoding: gzip"], GOOD, True),
    "br, identity": (b"POST", b"/v1/chat/completions", [b"Content-Encoding: br, identity"],
                     GOOD, True),  # fmt: skip
    "empty body": (b"POST", b"/v1/completions", [], b"", True),
    "no body, no length": (b"POST", b"/v1/completions", [], None, True),
    "not UTF-8": (b"POST", b"/v1/completions", [], b'{"prompt": "\xff\xfe", "max_tokens": 2}', True),
    "UTF-16": (b"POST", b"/v1/completions", [], GOOD.decode().encode("utf-16"), True),
    "BOM": (b"POST", b"/v1/completions", [], b"\xef\xbb\xbf" + GOOD, True),
    "duplicate keys": (b"POST", b"/v1/completions", [],
                       b'{"prompt": "a", "max_tokens": 2, "max_tokens": 99999999}', True),  # fmt: skip
    "NaN literal": (b"POST", b"/v1/completions", [], b'{"prompt": "a", "temperature": NaN}', True),
    "10k nesting": (b"POST", b"/v1/completions", [], b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", True),
    "chunked": (b"POST", b"/v1/completions", TE, chunked(GOOD[:10], GOOD[10:]), False),
    "chunked past the cap": (b"POST", b"/v1/completions", TE,
                             chunked(*[b"a" * 300_000] * 4), False),  # fmt: skip
    "chunked, bad size": (b"POST", b"/v1/completions", TE, b"zz\r\nab\r\n0\r\n\r\n", False),
    "length past the cap": (b"POST", b"/v1/completions", [b"Content-Length: 99999999999"], b"", False),
    "two lengths": (b"POST", b"/v1/completions", [b"Content-Length: 3", b"Content-Length: 4"], GOOD, False),
    "length and chunked": (b"POST", b"/v1/completions", TE, GOOD, True),
    "Expect: 100-continue": (b"POST", b"/v1/completions", [b"Expect: 100-continue"], GOOD, True),
    "giant header": (b"POST", b"/v1/completions", [b"X-Big: " + b"a" * 50_000], GOOD, True),
    "head past 64 KiB": (b"POST", b"/v1/completions", [b"X-Big: " + b"a" * 70_000], GOOD, True),
    "3000 headers": (b"POST", b"/v1/completions", [b"X-H%d: a" % i for i in range(3000)], GOOD, True),
    "X-Request-Id 10 KB": (b"POST", b"/v1/completions", [b"X-Request-Id: " + b"a" * 10_000], GOOD, True),
    "X-Request-Id control": (b"POST", b"/v1/completions", [b"X-Request-Id: a\x01b\x7f"], GOOD, True),
    "X-Request-Id non-ASCII": (b"POST", b"/v1/completions", [b"X-Request-Id: \xc3\xa9\xff"], GOOD, True),
    "two X-Request-Ids": (b"POST", b"/v1/completions", [b"X-Request-Id: a", b"X-Request-Id: b"], GOOD, True),
    "Upgrade: websocket": (b"POST", b"/v1/completions", [b"Connection: Upgrade", b"Upgrade: websocket"], GOOD, True),
    "Upgrade: h2c": (b"POST", b"/v1/completions", [b"Connection: Upgrade, HTTP2-Settings",
                     b"Upgrade: h2c", b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"], GOOD, True),  # fmt: skip
}  # fmt: skip
AUTH = {  # Authorization values the proxy (--api-key) must refuse with a 401
    "no scheme": b"fuzz-key",
    "Basic": b"Basic ZnV6ejprZXk=",
    "empty token": b"Bearer ",
    "other key": b"Bearer fuzz-keyy",
    "prefix": b"Bearer fuzz",
    "non-ASCII": b"Bearer fuzz-key\xc3\xa9",
    "10 KB": b"Bearer " + b"k" * 10_000,
    "NUL-free control": b"Bearer fuzz\x01key",
}


def exchange(url: str, raw: bytes, timeout: float = 30) -> bytes:
    """``raw`` sent on a fresh connection; what came back until the answer ended (its
    Content-Length, a chunked end, or the server closed). The answer to a HEAD request
    ends with its head: it has no body, whatever its Content-Length says (RFC 9110, 9.3.2;
    waiting for one waited out the server's keep-alive timeout)."""
    no_body = raw.startswith(b"HEAD ")
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as s:
        with contextlib.suppress(OSError):  # refused while we sent (past a cap): read on
            s.sendall(raw)
        got = b""
        while True:
            try:
                piece = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not piece:
                break
            got += piece
            head_, sep, rest = got.partition(b"\r\n\r\n")
            if sep and head_.startswith(b"HTTP/1.1 100"):
                head_, sep, rest = rest.partition(b"\r\n\r\n")
            if sep and no_body:
                break
            lines = head_.lower().split(b"\r\n")
            length = [ln.split(b":", 1)[1] for ln in lines if ln.startswith(b"content-length:")]
            if sep and length and len(rest) >= int(length[0]):
                break
            if sep and rest.endswith(b"0\r\n\r\n"):
                break
        return got


def status_of(answer: bytes) -> tuple[int, bytes]:
    if answer.startswith(b"HTTP/1.1 100"):
        answer = answer.partition(b"\r\n\r\n")[2]
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    head_, _, body = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head_.lower():
        body = dechunk(body)
    return int(answer[9:12]), body if b"content-type: application/json" in head_.lower() else b""


def dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size, _, body = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, body = out + body[:n], body[n + 2 :]
    return out


@pytest.mark.parametrize("target", ["node", "proxy"])
@pytest.mark.parametrize("case", sorted(RAW))
def test_hostile_heads_and_raw_bodies(servers: Servers, target: str, case: str) -> None:
    method, path, extra, body, length = RAW[case]
    answer = exchange(servers.url(target), head(method, path, extra, body, length))
    status, json_body = status_of(answer)
    what = f"{target} {case}: {answer[:300]!r}"
    assert status < 500, what
    if json_body:  # the app's answer (the HTTP parser's own 400s are plain text)
        err = json.loads(json_body)
        if status >= 400:
            assert set(err["error"]) == {"message", "type", "param", "code"}, what


@pytest.mark.parametrize("case", sorted(AUTH))
def test_malformed_authorization_is_a_401(servers: Servers, case: str) -> None:
    answer = exchange(servers.proxy.url, head(b"POST", b"/v1/completions", [], GOOD).replace(
        b"Authorization: Bearer " + API_KEY.encode(), b"Authorization: " + AUTH[case]))  # fmt: skip
    status, body = status_of(answer)
    assert status in (400, 401), answer[:300]  # 400: the HTTP parser refused the header
    if status == 401:
        assert json.loads(body)["error"]["code"] == "invalid_api_key"


REGISTRATION_BODIES = {  # none registers a node (the pool stays P and D)
    "4000 levels": b"[" * 4000,
    "deep url": b'{"role": "decode", "url": ' + b"[" * 2000 + b"]" * 2000 + b"}",
    "not JSON": b"\xff{",
    "surrogate": b'{"role": "decode", "url": "http://a\\ud800:1"}',
    "NaN port": b'{"role": "decode", "url": NaN}',
    "no port": b'{"role": "prefill", "url": "http://10.0.0.1"}',
    "unspecified": b'{"role": "decode", "url": "http://0.0.0.0:1"}',
    "past 4 KiB": b'{"role": "decode", "url": "' + b"a" * 5000 + b'"}',
    "deregister": b'{"role": "decode", "url": "http://10.0.0.9:1"}',
}


@pytest.mark.parametrize("case", sorted(REGISTRATION_BODIES))
def test_registration_bodies_are_4xx(servers: Servers, case: str) -> None:
    """Behind ``--registration-key``, a registrant's body is still input: a 4xx, no node
    added (a body nested 4000 levels was a 500: ``json.loads``'s RecursionError)."""
    path = "/v1/nodes/deregister" if case == "deregister" else "/v1/nodes/register"
    resp = servers.client.post(
        servers.proxy.url + path,
        content=REGISTRATION_BODIES[case],
        headers={"Authorization": f"Bearer {REGISTRATION_KEY}"},
    )
    what = f"{case}: {resp.status_code} {resp.text[:300]}"
    if case == "deregister":
        assert resp.status_code == 200 and resp.json()["status"] == "not_registered", what
        return
    assert 400 <= resp.status_code < 500, what
    check_error(resp, what)


# -- streams: a client that stops reading, then leaves ------------------------------------------


@pytest.mark.parametrize("target", ["node", "proxy"])
def test_a_stream_its_client_stops_reading_holds_nobody_up_and_leaves_nothing(
    servers: Servers, target: str
) -> None:
    """A client asks for a long stream and reads nothing (a small receive buffer): other
    clients get their answers meanwhile, the engine stops at ``max_tokens``; when it
    leaves, every request, KV block and admission place is given back (node, or P and D
    behind the proxy) and the proxy holds nothing in flight or outstanding."""
    # 20 alternatives per token: ~0.5 MB of events.
    body = {"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True,
            "logprobs": 20}  # fmt: skip
    raw = json.dumps(body).encode()
    parts = urlsplit(servers.url(target))
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(60)
        s.connect((parts.hostname, parts.port))
        s.sendall(head(b"POST", b"/v1/completions", [], raw))
        assert s.recv(12).startswith(b"HTTP/1.1 200")  # then nothing more is read
        nodes = [servers.node] if target == "node" else servers.pd.nodes
        wait_for(
            lambda: sum(metric(n.url, "pdserve_num_requests_admitted") for n in nodes) >= 1,
            30, "the stream to be admitted",
        )  # fmt: skip
        assert servers.reference(target) == servers.refs[target]  # served meanwhile
        # The engine makes its max_tokens and no more (its unread outputs merge into one
        # pending output); over loopback the ~0.5 MB of events fit in the kernel's send
        # buffer (4 MB), so the write deadline itself is shown by tests/test_http_guards.py
        # (small buffers on both ends).
        wait_for(lambda: all(node_idle(n.url) for n in nodes), 60, "the tokens to be made")
    for node in nodes:
        wait_for(lambda u=node.url: node_holds_nothing(u), 30, f"{node.name} to hold nothing")
    wait_for(lambda: proxy_holds_nothing(servers.proxy.url), 30, "the proxy to hold nothing")


# -- afterwards: nothing held, the same answers ------------------------------------------------


def proxy_holds_nothing(url: str) -> bool:
    """No request in flight, none outstanding on any node (no pair held)."""
    return (
        metric(url, "pdproxy_requests_inflight") == 0
        and metric(url, "pdproxy_node_outstanding_requests") == 0
    )


def node_holds_nothing(url: str) -> bool:
    return kv_pool_full(url) and metric(url, "pdserve_num_requests_admitted") == 0


def test_nothing_is_held_and_answers_are_unchanged_after_the_barrage(servers: Servers) -> None:
    """Every request ended: no request running or waiting, every KV block free and every
    admission place back (node, P and D), nothing in flight in the proxy, no node failure
    counted for a client's input; greedy answers equal those from the start."""
    for node in (servers.node, *servers.pd.nodes):
        wait_for(lambda u=node.url: node_holds_nothing(u), 30, f"{node.name} to hold nothing")
    wait_for(lambda: proxy_holds_nothing(servers.proxy.url), 30, "the proxy to hold nothing")
    assert metric(servers.proxy.url, "pdproxy_node_failures_total") == servers.failures
    health = servers.client.get(servers.proxy.url + "/health").json()
    assert all(n["healthy"] for n in health["prefill"] + health["decode"]), health
    for target in ("node", "proxy"):
        assert servers.reference(target) == servers.refs[target]
