"""The offline half of the HTTP fuzz harness (``tests/test_fuzz_http.py``): the parsing layer
called directly, no server, so it takes thousands of examples in seconds.

Every body a client can send goes through ``parse_json_body`` and then the parser of its
endpoint -- a node's (``parse_completion_request``, ``parse_chat_request``, the
``/tokenize`` helpers) and the proxy's (``validate_request``, which also hashes the prompt
for routing) -- and what a node does next without an engine: each choice's sampling
parameters within the context budget, truncation, the vocabulary checks, the stop-string
matcher. Whatever the bytes, the only exception allowed out is ``APIError`` with a 4xx
status: never ``TypeError``, ``KeyError``, ``OverflowError``, ``RecursionError``,
``UnicodeEncodeError``...

``PDSERVE_FUZZ_EXAMPLES=N`` multiplies the example counts (as in ``test_fuzz_http.py``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from fakes import fixed_examples
from hypothesis import given
from hypothesis import strategies as st

from engine.server.chat_protocol import (
    parse_chat_request,
    parse_chat_template_kwargs,
    parse_generation_prompt,
    parse_messages,
)
from engine.server.field_parsers import CHAT_FIELDS, COMPLETION_FIELDS
from engine.server.json_body import parse_json_body
from engine.server.protocol import BaseRequest, parse_completion_request
from engine.server.request_checks import (
    check_model,
    check_token_ids,
    resolve_max_tokens,
    truncate_prompt,
)
from engine.server.request_fields import APIError
from engine.server.stop_strings import StopStringMatcher
from proxy.validation import CHAT, COMPLETIONS, validate_request

SCALE = max(1, int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "1")))
VOCAB, MAX_MODEL_LEN = 512, 1024


def examples(n: int) -> Any:
    return fixed_examples(n * SCALE)


# -- values --------------------------------------------------------------------------------------

NUMBERS = [0, -0.0, 1, -1, 2, 20, 21, 128, 129, 1023, 1024, 1025, 0.5, 1e-45, 5e-324, 1e-6,
           1e-5, 1e6, 1e308, -1e308, 3.4e38, 3.5e38, float("nan"), float("inf"), float("-inf"),
           2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**30, 10**400]  # fmt: skip
TEXTS = ["", " ", "\x00", "\ud800", "a\udfffb", "\u202e", "\ufeff", "💥", "é", "٣", "0", "65",
         "-1", "<|endoftext|>", "text", "image_url", "user", "assistant", "system", "developer",
         "tool", "none", "auto", "tcp://127.0.0.1:1", "x" * 5000]  # fmt: skip
numbers = st.one_of(st.sampled_from(NUMBERS), st.integers(), st.floats())
texts = st.one_of(st.sampled_from(TEXTS), st.text(max_size=8))
names = st.one_of(
    st.sampled_from(sorted(COMPLETION_FIELDS | CHAT_FIELDS)),
    st.sampled_from(
        [
            "role",
            "content",
            "type",
            "text",
            "include_usage",
            "continuous_usage_stats",
            "do_remote_decode",
            "do_remote_prefill",
            "transfer_id",
            "first_token",
            "remote_side_channel",
            "enable_thinking",
            "messages",
            "tokens",
        ]
    ),  # fmt: skip
    texts,
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=5), st.dictionaries(names, kids, max_size=5)),
    max_leaves=20,
)
token_lists = st.lists(st.one_of(st.integers(-2, VOCAB + 2), st.sampled_from(NUMBERS)), max_size=6)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.one_of(
            st.sampled_from(["user", "system", "assistant", "developer", "tool"]), json_values
        ),  # fmt: skip
        "content": st.one_of(
            texts,
            json_values,
            st.lists(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "type": st.one_of(st.sampled_from(["text", "image_url"]), json_values),
                        "text": st.one_of(texts, json_values),
                    },
                ),
                max_size=3,
            ),
        ),  # fmt: skip
        "tool_calls": json_values,
        "name": json_values,
    },
)
values = st.one_of(
    json_values,
    token_lists,
    st.lists(st.one_of(texts, token_lists), max_size=4),  # batches of prompts
    st.lists(message, max_size=3),
    st.dictionaries(st.sampled_from(["65", "0", "512", "-1", "٣", "9" * 20]), numbers, max_size=3),
)


@st.composite
def bodies(draw: st.DrawFn, base: dict[str, Any]) -> bytes:
    """A valid body with 1-5 fields set to generated values, written as JSON (NaN and
    Infinity as Python writes them), sometimes cut or with a byte or a literal spliced in."""
    body = {**base, **draw(st.dictionaries(names, values, min_size=1, max_size=5))}
    raw = json.dumps(body).encode()
    how = draw(st.sampled_from(["as is"] * 6 + ["cut", "byte", "literal", "not an object"]))
    if how == "cut":
        return raw[: draw(st.integers(0, len(raw)))]
    if how == "byte":
        at = draw(st.integers(0, len(raw)))
        return (
            raw[:at]
            + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"]))
            + raw[at:]
        )
    if how == "literal":
        lit = draw(st.sampled_from([b"NaN", b"-Infinity", b"1e99999", b"9" * 5000, b"[" * 100]))
        return raw[:-1] + b', "' + draw(names).encode("utf-8", "replace") + b'": ' + lit + b"}"
    if how == "not an object":
        return json.dumps(draw(json_values)).encode()
    return raw


# -- what a node and the proxy do with a parsed body ---------------------------------------------


def node_prepares(req: BaseRequest, chat: bool) -> None:
    """The engine-free steps of ``JobBuilder.prepare_*`` and ``_job`` for every choice."""
    check_model(req.model, "tiny")
    check_token_ids(list(req.logit_bias), VOCAB, "logit_bias")
    if req.allowed_token_ids:
        check_token_ids(req.allowed_token_ids, VOCAB, "allowed_token_ids")
    for child in req.children():
        ids = [65] * 7 if chat else (getattr(child, "prompt_token_ids", None) or [65] * 7)
        if not chat and child.prompt_token_ids is not None:  # type: ignore[attr-defined]
            check_token_ids(ids, VOCAB)
        ids = truncate_prompt(ids, child.truncate_prompt_tokens, MAX_MODEL_LEN)
        budget = resolve_max_tokens(child.max_tokens, len(ids), MAX_MODEL_LEN)
        params = child.sampling_params(budget)
        params.banned_token_ids([0])
        matcher = StopStringMatcher(child.stop, child.include_stop_str_in_output)
        for piece in ("He", "llo 💥", "\x00a", ""):
            matcher.feed(piece)
        matcher.feed("", final=True)


def only_api_errors(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except APIError as e:
        assert 400 <= e.status_code < 500, (e.status_code, e.message)
        assert isinstance(e.message, str) and e.message
        body = e.body()["error"]
        assert set(body) == {"message", "type", "param", "code"}
        json.dumps(body)  # the error itself can be written (no lone surrogate in it...)
        json.dumps(body).encode()
        return None


def completion(raw: bytes) -> None:
    req = parse_completion_request(parse_json_body(raw))
    node_prepares(req, chat=False)


def chat(raw: bytes) -> None:
    req = parse_chat_request(parse_json_body(raw))
    node_prepares(req, chat=True)


def tokenize(raw: bytes) -> None:
    body = parse_json_body(raw)
    if not isinstance(body, dict):
        raise APIError("not an object")
    if body.get("messages") is not None:
        parse_generation_prompt(body)
        parse_messages(body)
        parse_chat_template_kwargs(body)


COMPLETION_BASE = {"prompt": "Hello", "max_tokens": 3}
CHAT_BASE = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}


@examples(300)
@given(raw=bodies(COMPLETION_BASE))
def test_completion_bodies_raise_only_a_4xx_api_error(raw: bytes) -> None:
    only_api_errors(completion, raw)
    only_api_errors(validate_request, COMPLETIONS, raw, ["tiny"], MAX_MODEL_LEN)


@examples(300)
@given(raw=bodies(CHAT_BASE))
def test_chat_bodies_raise_only_a_4xx_api_error(raw: bytes) -> None:
    only_api_errors(chat, raw)
    only_api_errors(validate_request, CHAT, raw, ["tiny"], MAX_MODEL_LEN)
    only_api_errors(tokenize, raw)


@examples(200)
@given(raw=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode())))
def test_any_bytes_raise_only_a_4xx_api_error(raw: bytes) -> None:
    for fn in (completion, chat, tokenize):
        only_api_errors(fn, raw)
    for endpoint in (COMPLETIONS, CHAT):
        only_api_errors(validate_request, endpoint, raw, ["tiny", "other"], None)
