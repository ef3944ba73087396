"""Property-based tests (hypothesis) of the HTTP API: generated bad input against a
colocated node, the two nodes of a P/D pair, and the proxy in front of that pair (real
processes, the ``tiny`` model).

For every generated request:

- never a 5xx. A 4xx carries an OpenAI error body (``{"error": {"message": ...}}``) and,
  for a request that changed some fields of a valid one, its ``param`` names one of them
  (or a field tied to it: the context budget, ``stream``/``stream_options``). A 413 is
  fine for anything too big. A 200 is a well-formed answer (completion, chat completion,
  an event stream ending in ``[DONE]`` without an error event, tokenize/detokenize/abort;
  for ``/v1/responses`` a ``response`` object, or OpenAI's typed events numbered in order
  and ending with the final ``response``, no ``[DONE]``). ``/v1/responses`` errors name
  the field as the Responses API does: ``input[3].content[0].type`` names ``input``.
- every server stays healthy: ``/health`` 200 after each example (for the proxy: its
  nodes too, still in rotation).

After each batch, a greedy request gets the answer it got before the barrage (node and
proxy agree); after the ``kv_transfer_params`` batches both KV pools are full again, and
the proxy never counted a node failure for a client's bad input.

The examples are fixed (``derandomize``, no example database), so CI runs the same inputs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fakes import fixed_examples
from harness import PD, Proc, Procs, kv_pool_full, metric, sse_data, wait_for, wait_healthy
from hypothesis import event, example, given
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

MAX_BODY = 1_000_000  # --max-request-bytes of every server here: 413 above it
KV_TIMEOUT_S = 1.0  # --kv-transfer-timeout of the pair: an unreachable "prefill" costs this


_settings = fixed_examples


# -- servers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pd_node_args() -> tuple[str, ...]:
    # 64 blocks of 16 tokens: a generated max_tokens cannot make a request run for long.
    return (
        "--num-blocks", "64", "--max-request-bytes", str(MAX_BODY),
        "--kv-transfer-timeout", str(KV_TIMEOUT_S),
    )  # fmt: skip


@pytest.fixture(scope="module")
def colocated(module_procs: Procs) -> Proc:
    # Not waited for here: it starts while pd_pair's nodes start.
    return module_procs.node(
        "--num-blocks", "64", "--max-request-bytes", str(MAX_BODY), name="colocated", wait=False
    )


REF_COMPLETION = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
                  "ignore_eos": True}  # fmt: skip
REF_CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}  # fmt: skip


class Cluster:
    def __init__(self, node: Proc, pd: PD, proxy: Proc) -> None:
        self.node, self.pd, self.proxy = node, pd, proxy
        self.client = httpx.Client(timeout=60)
        self.refs = {t: self.reference(t) for t in ("node", "proxy")}
        assert self.refs["node"] == self.refs["proxy"], self.refs
        self.node_failures = metric(proxy.url, "pdproxy_node_failures_total")

    def url(self, target: str) -> str:
        return {"node": self.node, "proxy": self.proxy, "prefill": self.pd.p,
                "decode": self.pd.d}[target].url  # fmt: skip

    def reference(self, target: str) -> tuple[list[int], list[int]]:
        """The token ids of a greedy completion and a greedy chat answer."""
        out = []
        for path, body in (("/v1/completions", REF_COMPLETION), ("/v1/chat/completions", REF_CHAT)):
            resp = self.client.post(self.url(target) + path, json=body)
            assert resp.status_code == 200, resp.text
            out.append(resp.json()["choices"][0]["token_ids"])
        return out[0], out[1]

    def assert_healthy(self, target: str) -> None:
        urls = [self.url(target)]
        if target != "node":
            urls = [self.proxy.url, self.pd.p.url, self.pd.d.url]
        for url in urls:
            resp = self.client.get(url + "/health")
            assert resp.status_code == 200, f"{url}: {resp.text}"
        if target != "node":
            health = self.client.get(self.proxy.url + "/health").json()
            assert all(n["healthy"] for n in health["prefill"] + health["decode"]), health

    def assert_still_right(self, target: str) -> None:
        """Healthy, the same greedy answers as before, no node failure seen by the proxy."""
        self.assert_healthy(target)
        ref = "node" if target == "node" else "proxy"
        assert self.reference(ref) == self.refs[ref]
        assert metric(self.proxy.url, "pdproxy_node_failures_total") == self.node_failures


@pytest.fixture(scope="module")
def cluster(colocated: Proc, pd_pair: PD, module_procs: Procs) -> Iterator[Cluster]:
    wait_healthy(colocated)
    proxy = module_procs.proxy(
        [pd_pair.p.url], [pd_pair.d.url], "--max-request-bytes", str(MAX_BODY)
    )
    c = Cluster(colocated, pd_pair, proxy)
    yield c
    c.client.close()


# -- strategies ------------------------------------------------------------------------------

SURROGATES = ["\ud800", "\udbff", "\udc00", "\udfff"]
HOSTILE_TEXT = [
    "", " ", "\x00", "\x7f", "<|endoftext|>", "</s>", "<s>", "\u202e", "\ufeff", "💥", "é",
    "\\u0000", "{{ 7 * 7 }}", "{% for x in y %}", "%s%n", "a" * 70_000, "\n" * 500,
]  # fmt: skip
EXTREME_NUMBERS = [
    0, -0.0, 1, -1, 2, 0.5, 1.0, 1e-45, 5e-324, 1e-5, 1e-6, 1e308, -1e308,
    1.7976931348623157e308, float("nan"), float("inf"), float("-inf"), 2**31, 2**53 + 1,
    2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**30, 10**4000, -(10**4000),
]  # fmt: skip
HUGE_LIST = list(range(100_000))  # ~590 kB of JSON: under the body cap, a big token list
DEEP: Any = 0
for _ in range(70):  # deeper than the parser's 64 levels
    DEEP = [DEEP]

numbers = st.one_of(st.sampled_from(EXTREME_NUMBERS), st.integers(), st.floats())
texts = st.one_of(
    st.text(max_size=12),
    st.sampled_from(HOSTILE_TEXT),
    st.tuples(st.text(max_size=4), st.sampled_from(SURROGATES), st.text(max_size=4)).map("".join),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(texts, kids, max_size=4)),
    max_leaves=10,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "tool"]),
                           json_values),
         "content": st.one_of(
             texts, json_values,
             st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                             "text": st.one_of(texts, json_values)}),
                      max_size=2))},
        optional={"tool_calls": json_values, "name": json_values},
    ),
    max_size=3,
)  # fmt: skip
near_valid = st.one_of(
    st.lists(st.integers(-5, 10**6), max_size=8),  # token ids
    st.lists(texts, max_size=3),
    st.dictionaries(st.sampled_from(["include_usage", "type", "enable_thinking", "x"]), scalars),
    messages,
)
values = st.one_of(json_values, near_valid, st.sampled_from([HUGE_LIST, DEEP, [HUGE_LIST]]))

COMMON_FIELDS = [
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
    "ignore_eos", "stream", "stream_options", "kv_transfer_params", "user", "n", "best_of",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
    "logprobs", "min_p", "allowed_token_ids", "bad_words", "priority", "cache_salt",
    "truncate_prompt_tokens", "return_tokens_as_token_ids", "structured_outputs",
    "prompt_cache_key",
]  # fmt: skip
COMPLETION_FIELDS = [*COMMON_FIELDS, "prompt", "echo", "suffix"]
CHAT_FIELDS = [
    *COMMON_FIELDS, "messages", "max_completion_tokens", "chat_template_kwargs", "top_logprobs",
    "tools", "functions", "tool_choice", "function_call", "response_format",
    "truncate_messages_to", "reasoning_effort", "add_generation_prompt",
    "continue_final_message",
]  # fmt: skip


def mutations(fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """1-3 fields (mostly known ones, some unknown) set to generated values."""
    names = st.one_of(st.sampled_from(fields), st.sampled_from(fields), texts)
    return st.dictionaries(names, values, min_size=1, max_size=3)


# Fields whose errors may name one another: the context budget, streaming options.
COUPLED = [
    {"prompt", "messages", "max_tokens", "max_completion_tokens"},
    {"stream", "stream_options"},
]
RID_OK = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


# -- checks ----------------------------------------------------------------------------------


def _encodable(s: str) -> bool:
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


def _depth(v: Any) -> int:
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    return 0


def names_a_changed_field(
    err: dict[str, Any], changed: dict[str, Any], coupled: list[set[str]] = COUPLED
) -> bool:
    """Whether error ``err``'s ``param`` is a field of ``changed``, a part of one
    (``input[3].content[0].type`` is part of ``input``), or a field ``coupled`` to one."""
    param = err.get("param")
    if err.get("code") == "invalid_json":  # nested deeper than the parser allows
        return any(_depth(v) > 60 for v in changed.values())
    if param == "body":  # a lone surrogate in a top-level key
        return not all(map(_encodable, changed))
    if not isinstance(param, str):
        return False
    related = set(changed)
    for group in coupled:
        if related & group:
            related |= group
    return any(param == f or param.startswith((f + ".", f + "[")) for f in related)


def _error(resp: httpx.Response) -> dict[str, Any]:
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.text[:300]
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"], err
    return err


def check_answer(
    resp: httpx.Response,
    path: str,
    changed: dict[str, Any] | None,
    coupled: list[set[str]] = COUPLED,
) -> None:
    """Never a 5xx; a 4xx is a JSON error naming a changed field (``changed`` given; or a
    field ``coupled`` to one); a 200 is a well-formed answer for ``path`` (a Responses one
    is ``check_responses_answer``'s)."""
    what = f"{path} changed={_short(changed)} -> {resp.status_code} {resp.text[:400]}"
    event(f"{path} {resp.status_code}")  # --hypothesis-show-statistics: what the inputs reached
    assert resp.status_code < 500, what
    assert RID_OK.fullmatch(resp.headers.get("x-request-id", "")), what
    if resp.status_code != 200:
        assert 400 <= resp.status_code < 500, what
        err = _error(resp)
        if changed is not None and resp.status_code == 400:
            assert names_a_changed_field(err, changed, coupled), what
        return
    if path == "/v1/responses":  # check_responses_answer's
        return
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_data(resp.text.splitlines())
        assert events and events[-1] == "DONE", what
        assert not any(isinstance(e, dict) and "error" in e for e in events), what
        return
    body = resp.json()
    if path in ("/v1/completions", "/v1/chat/completions"):
        choice = body["choices"][0]
        text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        assert isinstance(text, str), what
        assert choice["finish_reason"] in ("stop", "length"), what
        assert all(isinstance(t, int) for t in choice["token_ids"]), what
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    elif path == "/tokenize":
        assert body["count"] == len(body["tokens"]), what
        strs = body["token_strs"]
        assert strs is None or (len(strs) == body["count"] and all(map(_is_str, strs))), what
    elif path == "/detokenize":
        assert isinstance(body["prompt"], str), what
    elif path == "/v1/abort":
        assert body["aborted"] is True and isinstance(body["request_ids"], list), what


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _short(v: Any) -> str:
    return repr(v)[:300]


def dumps(body: Any) -> bytes:
    # ensure_ascii: lone surrogates travel as \ud800 escapes; NaN/Infinity as Python writes them.
    return json.dumps(body).encode()


def post(cluster: Cluster, target: str, path: str, raw: bytes, **headers: Any) -> httpx.Response:
    headers = {"content-type": "application/json", **headers}
    return cluster.client.post(cluster.url(target) + path, content=raw, headers=headers)


# -- generation endpoints, field by field ------------------------------------------------------

COMPLETION_BASE = {"prompt": "Hello there", "max_tokens": 2}
CHAT_BASE = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2,
             "max_completion_tokens": 2}  # fmt: skip
request_ids = st.binary(max_size=200).map(
    lambda b: bytes(c for c in b if 0x21 <= c <= 0x7E or c >= 0x80)
)


@pytest.mark.parametrize("target", ["node", "proxy"])
@_settings(80)
@given(changed=mutations(COMPLETION_FIELDS), rid=request_ids)
@example(changed={"stream": True, "stream_options": {"include_usage": 1}}, rid=b"")
def test_completions_with_generated_fields(cluster: Cluster, target: str, changed, rid) -> None:
    headers = {"X-Request-Id": rid} if rid else {}
    resp = post(
        cluster, target, "/v1/completions", dumps({**COMPLETION_BASE, **changed}), **headers
    )
    check_answer(resp, "/v1/completions", changed)
    cluster.assert_healthy(target)


@pytest.mark.parametrize("target", ["node", "proxy"])
@_settings(60)
@given(changed=mutations(CHAT_FIELDS))
def test_chat_with_generated_fields(cluster: Cluster, target: str, changed) -> None:
    resp = post(cluster, target, "/v1/chat/completions", dumps({**CHAT_BASE, **changed}))
    check_answer(resp, "/v1/chat/completions", changed)
    cluster.assert_healthy(target)


# -- /v1/responses, field by field ---------------------------------------------------------------

RESPONSES_BASE = {"input": "Hello there", "max_output_tokens": 2}
RESPONSES_FIELDS = [
    "model", "input", "instructions", "max_output_tokens", "tools", "tool_choice",
    "parallel_tool_calls", "text", "reasoning", "truncation", "include", "metadata", "user",
    "store", "stream", "stream_options", "top_logprobs", "previous_response_id", "background",
    "conversation", "prompt", "service_tier", "safety_identifier", "max_tool_calls",
    "prompt_cache_key", "cache_salt", "temperature", "top_p", "top_k", "seed", "stop",
    "logit_bias", "min_tokens", "bad_words", "priority", "chat_template_kwargs",
    "max_tokens", "messages", "n",  # chat's, not Responses': ignored
]  # fmt: skip
# Fields whose errors may name one another on /v1/responses: the context budget (the
# rendered conversation, with its tools, against max_output_tokens; an error there names
# "input"), the tools and the choice among them, log probabilities, streaming options.
RESPONSES_COUPLED = [
    {"input", "instructions", "max_output_tokens", "truncation", "tools"},
    {"tools", "tool_choice", "parallel_tool_calls"},
    {"include", "top_logprobs"},
    {"stream", "stream_options"},
]

flags_ = st.one_of(st.booleans(), st.booleans(), json_values)
ids = st.one_of(st.sampled_from(["call_1", "call_2", "", "x" * 300]), texts, json_values)
names_ = st.one_of(st.sampled_from(["get_weather", "f", "", "a b", "x" * 100]), texts, json_values)
arguments = st.one_of(
    st.sampled_from(['{"city": "Paris"}', "{}", "", "{", "null", "[1, 2]"]), texts, json_values
)
PART_TYPES = ["input_text", "output_text", "text", "input_image", "input_file", "input_audio",
              "refusal", "summary_text", "reasoning_text"]  # fmt: skip
content_parts = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(PART_TYPES), texts, json_values)},
    optional={"text": st.one_of(texts, texts, json_values), "annotations": json_values,
              "image_url": texts, "file_id": texts, "logprobs": json_values},
)  # fmt: skip
contents = st.one_of(texts, st.lists(content_parts, max_size=3), json_values)
ITEM_ROLES = ["user", "system", "developer", "assistant", "tool"]
message_items = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(ITEM_ROLES), json_values), "content": contents},
    optional={"type": st.just("message"), "id": ids, "status": texts},
)
function_calls = st.fixed_dictionaries(
    {"type": st.just("function_call"), "call_id": ids, "name": names_, "arguments": arguments},
    optional={"id": ids, "status": texts},
)
function_outputs = st.fixed_dictionaries(
    {"type": st.just("function_call_output"), "call_id": ids,
     "output": st.one_of(texts, st.lists(content_parts, max_size=2), json_values)},
    optional={"id": ids},
)  # fmt: skip
reasoning_items = st.fixed_dictionaries(
    {"type": st.just("reasoning")},
    optional={"id": ids, "summary": json_values, "content": contents,
              "encrypted_content": texts},
)  # fmt: skip
other_items = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["item_reference", "web_search_call", "computer_call",
                                        "mcp_call", "custom_tool_call", "image_generation_call"]),
                       texts, json_values)},
    optional={"id": ids, "call_id": ids},
)  # fmt: skip
input_items = st.one_of(
    message_items, message_items, function_calls, function_outputs, reasoning_items,
    other_items, json_values,
)  # fmt: skip
schemas = st.one_of(
    st.sampled_from([
        {"type": "object"}, {}, {"type": "string", "maxLength": 3}, {"enum": ["a", "b"]},
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
         "additionalProperties": False},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 1},
        {"type": "nope"}, {"$ref": "#/nowhere"},
    ]),
    json_values,
)  # fmt: skip
function_tools = st.fixed_dictionaries(
    {"type": st.just("function"), "name": names_},
    optional={"description": st.one_of(texts, json_values), "parameters": schemas,
              "strict": flags_, "function": json_values},
)  # fmt: skip
TOOL_TYPES = ["web_search", "web_search_preview", "file_search", "mcp", "code_interpreter",
              "image_generation", "computer_use_preview", "local_shell", "custom"]  # fmt: skip
other_tools = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(TOOL_TYPES), texts, json_values)},
    optional={"name": names_},
)
formats = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("json_schema"), "schema": schemas},
        optional={"name": names_, "strict": flags_, "description": texts},
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text", "grammar", "x"])}),
    json_values,
)
RESPONSES_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "input": st.one_of(texts, st.lists(input_items, max_size=5)),
    "instructions": texts,
    "max_output_tokens": st.one_of(st.integers(-2, 40), st.sampled_from([10**6, 2**63])),
    "tools": st.lists(st.one_of(function_tools, function_tools, other_tools), max_size=3),
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required", "any"]),
        st.fixed_dictionaries({"type": st.just("function"), "name": names_}),
        st.fixed_dictionaries({"type": st.sampled_from(["file_search", "allowed_tools", "mcp",
                                                        "custom", "web_search_preview"])}),
    ),  # fmt: skip
    "parallel_tool_calls": flags_,
    "text": st.fixed_dictionaries(
        {}, optional={"format": formats,
                      "verbosity": st.one_of(st.sampled_from(["low", "medium", "high", "x"]),
                                             json_values)},
    ),  # fmt: skip
    "reasoning": st.fixed_dictionaries(
        {}, optional={"effort": st.sampled_from(["minimal", "low", "medium", "high", "x", None]),
                      "summary": st.sampled_from(["auto", "concise", "detailed", "x", None]),
                      "generate_summary": texts},
    ),  # fmt: skip
    "truncation": st.sampled_from(["auto", "disabled", "x", None]),
    "include": st.lists(
        st.one_of(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content",
                                   "file_search_call.results"]), texts),
        max_size=3,
    ),  # fmt: skip
    "metadata": st.one_of(
        st.dictionaries(texts, st.one_of(texts, texts, json_values), max_size=4),
        st.sampled_from([{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}]),
    ),
    "user": st.one_of(texts, st.just("u" * 513)),
    "store": flags_, "stream": flags_, "background": flags_,
    "top_logprobs": st.one_of(st.integers(-2, 25), numbers),
    "previous_response_id": st.one_of(st.none(), texts),
    "prompt_cache_key": st.one_of(texts, st.just("k" * 65)),
    "cache_salt": texts,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": flags_,
                                                          "include_obfuscation": flags_}),
}  # fmt: skip


@st.composite
def responses_mutations(draw: st.DrawFn) -> dict[str, Any]:
    """1-3 Responses fields (mostly known ones, some unknown) set to values shaped as the
    field's (mostly) or to anything."""
    names = draw(st.lists(st.one_of(st.sampled_from(RESPONSES_FIELDS), texts),
                          min_size=1, max_size=3))  # fmt: skip
    if "tools" in names and draw(st.booleans()):  # without a choice, tools want a parser
        names.append("tool_choice")
    shaped = {n: RESPONSES_VALUES.get(n, values) for n in names}
    return {n: draw(st.one_of(shaped[n], shaped[n], values)) for n in shaped}


RESPONSE_ENDS = {"response.completed": "completed", "response.incomplete": "incomplete",
                 "response.failed": "failed"}  # fmt: skip
OUTPUT_ITEM_TYPES = ("message", "function_call", "reasoning")


def check_response_object(obj: Any, what: str, statuses: tuple[str, ...]) -> None:
    """A ``response`` object: its kind, status, output items and usage."""
    assert isinstance(obj, dict) and obj.get("object") == "response", what
    assert isinstance(obj.get("id"), str) and obj["id"].startswith("resp_"), what
    assert obj.get("status") in statuses, what
    if obj["status"] == "incomplete":
        assert obj["incomplete_details"] == {"reason": "max_output_tokens"}, what
    output = obj.get("output")
    assert isinstance(output, list), what
    for item in output:
        assert isinstance(item, dict) and item.get("type") in OUTPUT_ITEM_TYPES, what
        assert item.get("status") in ("completed", "incomplete"), what
    usage = obj.get("usage")
    if obj["status"] == "failed" and usage is None:
        return
    assert isinstance(usage, dict), what
    counts = [usage.get(k) for k in ("input_tokens", "output_tokens", "total_tokens")]
    assert all(isinstance(c, int) and c >= 0 for c in counts), what
    assert counts[2] == counts[0] + counts[1], what


def _not_json(literal: str) -> Any:
    raise AssertionError(f"{literal} is not JSON")


def responses_events(text: str) -> list[dict[str, Any]]:
    """A Responses stream's events: each an ``event: <type>`` line and a ``data:`` line
    whose JSON (JSON: no ``NaN``) has that ``type``."""
    out = []
    for frame in text.replace("\r\n", "\n").split("\n\n"):
        if not frame.strip():
            continue
        lines = frame.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: "), frame[:300]
        assert lines[1].startswith("data: "), frame[:300]
        data = json.loads(lines[1][len("data: ") :], parse_constant=_not_json)
        assert data["type"] == lines[0][len("event: ") :], frame[:300]
        out.append(data)
    return out


def check_responses_stream(text: str, what: str) -> None:
    """Typed events numbered from 0 in order, opening with ``response.created``, ending
    with the final ``response`` (no ``[DONE]``: OpenAI's streams have none); a failure is
    not the server's own (``server_error``); the text deltas add up to the final text."""
    events = responses_events(text)
    assert events and events[0]["type"] == "response.created", what
    assert [e["sequence_number"] for e in events] == list(range(len(events))), what
    last = events[-1]
    assert last["type"] in RESPONSE_ENDS, what
    assert not any(e["type"] in RESPONSE_ENDS for e in events[:-1]), what
    final = last["response"]
    check_response_object(final, what, (RESPONSE_ENDS[last["type"]],))
    if last["type"] == "response.failed":
        assert final["error"]["code"] != "server_error", what
    deltas: dict[str, str] = {}
    for e in events:
        if e["type"] == "response.output_text.delta":
            deltas[e["item_id"]] = deltas.get(e["item_id"], "") + e["delta"]
    for item in final["output"]:
        if item["type"] == "message" and item["content"]:
            assert item["content"][0]["text"] == deltas.get(item["id"], ""), what


def check_responses_answer(resp: httpx.Response, changed: dict[str, Any]) -> None:
    """``check_answer``'s error checks; a 200 is a ``response`` object, or its stream."""
    check_answer(resp, "/v1/responses", changed, RESPONSES_COUPLED)
    if resp.status_code != 200:
        return
    what = f"/v1/responses changed={_short(changed)} -> {resp.text[:600]}"
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        check_responses_stream(resp.text, what)
    else:
        obj = json.loads(resp.text, parse_constant=_not_json)
        check_response_object(obj, what, ("completed", "incomplete"))


@pytest.mark.parametrize("target", ["node", "proxy"])
@_settings(40)
@given(changed=responses_mutations(), stream=st.booleans())
@example(  # echoed back: a non-finite number in it was a 500, or NaN in the event stream
    changed={"text": {"format": {"type": "json_schema", "name": float("nan"),
                                 "schema": {"type": "object"}}}},
    stream=False,
)  # fmt: skip
@example(
    changed={"tools": [{"type": "function", "name": "f",
                        "parameters": {"type": "object", "x": float("inf")}}],
             "tool_choice": "none"},
    stream=True,
)  # fmt: skip
def test_responses_with_generated_fields(
    cluster: Cluster, target: str, changed: dict[str, Any], stream: bool
) -> None:
    body = {**RESPONSES_BASE, **({"stream": True} if stream else {}), **changed}
    resp = post(cluster, target, "/v1/responses", dumps(body))
    check_responses_answer(resp, changed)
    cluster.assert_healthy(target)


# Near-valid bodies: known shapes with valid values, for the node/proxy comparison below.
SCHEMA_A = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}},
            "required": ["a"], "additionalProperties": False}  # fmt: skip
plain_texts = st.text(max_size=8)
valid_input_items = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer", "assistant"]),
         "content": st.one_of(plain_texts, st.lists(st.fixed_dictionaries(
             {"type": st.sampled_from(["input_text", "output_text"]), "text": plain_texts}),
             max_size=2))},
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": st.sampled_from(["c1", "c2"]),
         "name": st.sampled_from(["f", "g"]), "arguments": st.sampled_from(["{}", "{"])},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": st.sampled_from(["c1", "zz"]),
         "output": plain_texts},
    ),
    st.just({"type": "reasoning", "summary": []}),
)  # fmt: skip
valid_tools = st.lists(
    st.fixed_dictionaries(
        {"type": st.just("function"), "name": st.sampled_from(["f", "g"])},
        optional={"parameters": st.sampled_from([{"type": "object"}, SCHEMA_A]),
                  "strict": st.booleans(), "description": plain_texts},
    ),
    min_size=1, max_size=2, unique_by=lambda t: t["name"],
)  # fmt: skip
VALID_FORMATS = [{"type": "json_object"}, {"type": "text"},
                 {"type": "json_schema", "name": "a", "schema": SCHEMA_A, "strict": True},
                 {"type": "json_schema", "name": "b", "schema": {"enum": ["x", "y"]}}]  # fmt: skip
VALID_EXTRAS: dict[str, st.SearchStrategy[Any]] = {
    "instructions": plain_texts,
    "include": st.just(["message.output_text.logprobs"]), "top_logprobs": st.integers(0, 3),
    "truncation": st.sampled_from(["auto", "disabled"]), "min_tokens": st.integers(0, 4),
    "reasoning": st.just({"effort": "low", "summary": "auto"}), "stop": st.just(["a", "}"]),
    "metadata": st.just({"k": "v"}), "user": st.just("u"), "prompt_cache_key": st.just("k"),
    "ignore_eos": st.booleans(), "logit_bias": st.just({"65": 5}),
}  # fmt: skip


@st.composite
def valid_responses_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A greedy /v1/responses body of known shapes and valid values (with or without
    tools and a choice among them, a text format, and some of ``VALID_EXTRAS``)."""
    items = st.lists(valid_input_items, min_size=1, max_size=5)
    body: dict[str, Any] = {"input": draw(st.one_of(plain_texts, items)), "temperature": 0,
                            "max_output_tokens": draw(st.integers(1, 8))}  # fmt: skip
    if draw(st.booleans()):
        body["tools"] = tools = draw(valid_tools)
        named = [{"type": "function", "name": t["name"]} for t in tools]
        body["tool_choice"] = draw(st.sampled_from(["none", "required", *named]))
    elif draw(st.booleans()):
        body["text"] = {"format": draw(st.sampled_from(VALID_FORMATS))}
    names = draw(st.lists(st.sampled_from(sorted(VALID_EXTRAS)), max_size=4))
    return {**body, **{n: draw(VALID_EXTRAS[n]) for n in names}}


def _outcome(resp: httpx.Response) -> tuple[int, Any]:
    """An answer's status, and its error's ``param`` or the response's ``status``."""
    body = resp.json()
    return resp.status_code, body["status"] if resp.status_code == 200 else body["error"]["param"]


@_settings(15)
@given(body=valid_responses_bodies())
@example(  # no max_output_tokens: the answer's budget is the context's rest (short here)
    body={"input": "a" * 950, "temperature": 0, "min_tokens": 3, "max_output_tokens": None}
)
def test_responses_answered_alike_by_a_node_and_the_proxy(
    cluster: Cluster, body: dict[str, Any]
) -> None:
    """The same near-valid body is refused or answered alike by a node and through the
    proxy's P/D pair: a 400 the fuzz above takes as the client's (it names a field it
    changed) may still be one only the pair answers."""
    raw = dumps(body)
    node, proxy = (post(cluster, t, "/v1/responses", raw) for t in ("node", "proxy"))
    check_responses_answer(node, body)
    check_responses_answer(proxy, body)
    assert _outcome(node) == _outcome(proxy), (
        f"{_short(body)}: {node.text[:300]} | {proxy.text[:300]}"
    )


@pytest.mark.parametrize("target", ["node", "proxy"])
def test_after_a_large_responses_body_the_connection_answers_json(
    cluster: Cluster, target: str
) -> None:
    """A /v1/responses body large enough that the server paused reading it, then a
    completion on the same keep-alive connection: a JSON answer. (The client's connection,
    read again inside the Responses answer's ``keeping_objects``, took that context along:
    the connection's next request answered 200 with an empty body; found by the barrage's
    reference answers after the /v1/responses fuzz.)"""
    with httpx.Client(timeout=60) as client:  # one connection, kept alive
        body = {**RESPONSES_BASE, "padding": "a" * 300_000}  # ignored, past 64 KiB
        resp = client.post(cluster.url(target) + "/v1/responses", json=body)
        assert resp.status_code == 200, resp.text[:300]
        for _ in range(2):
            resp = client.post(cluster.url(target) + "/v1/completions", json=REF_COMPLETION)
            assert resp.status_code == 200 and resp.text.startswith("{"), repr(resp.text[:300])


BUDGET_PROMPT = "a" * 950  # leaves an answer's default budget (the context's rest) short


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": BUDGET_PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": BUDGET_PROMPT}]}),
        ("/v1/responses", {"input": BUDGET_PROMPT}),
    ],
)
def test_min_tokens_without_max_tokens_answered_through_the_pair_as_by_a_node(
    cluster: Cluster, path: str, body: dict[str, Any]
) -> None:
    """``min_tokens`` and no ``max_tokens``: the answer's budget is the rest of the context
    on a node and through a P/D pair alike (the prefill leg's was 1: a 400 naming
    ``min_tokens`` only through the proxy; found comparing node and proxy on generated
    ``/v1/responses`` bodies, whose errors the fuzz above takes as the client's)."""
    for target in ("node", "proxy"):
        resp = post(cluster, target, path, dumps({**body, "min_tokens": 3}))
        assert resp.status_code == 200, f"{target}: {resp.text[:300]}"


@pytest.mark.parametrize("target", ["node", "proxy"])
def test_generation_answers_unchanged_after_the_barrage(cluster: Cluster, target: str) -> None:
    cluster.assert_still_right(target)


# -- bodies that are not a valid JSON object -------------------------------------------------

PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/abort"]
BAD_BYTES = [b"\xff", b"\xfe\xff", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80", b"\xed\xbf\xbf",
             b"\xf4\x90\x80\x80", b"\x80", b"\x00"]  # fmt: skip
BASES = {
    "/v1/completions": COMPLETION_BASE,
    "/v1/chat/completions": CHAT_BASE,
    "/tokenize": {"prompt": "Hello there"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/v1/abort": {"request_id": "no-such-request"},
}


@st.composite
def raw_bodies(draw: st.DrawFn, path: str) -> tuple[bytes, str | None]:
    """A body and, where one field is to blame, that field (the error must name it)."""
    valid = dumps(BASES[path])
    kind = draw(st.sampled_from(["bytes", "insert", "deep", "digits", "literal", "cut", "big",
                                 "json"]))  # fmt: skip
    if kind == "bytes":  # anything at all
        return draw(st.binary(max_size=64)), None
    if kind == "insert":  # invalid UTF-8 somewhere, mostly inside a string
        at = draw(st.integers(0, len(valid)))
        return valid[:at] + draw(st.sampled_from(BAD_BYTES)) + valid[at:], None
    if kind == "deep":
        n = draw(st.sampled_from([63, 64, 65, 66, 1000, 100_000]))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        key = draw(st.sampled_from(sorted(BASES[path]))).encode()
        return valid[:-1] + b', "' + key + b'": ' + opener * n + b"1" + closer * n + b"}", None
    field = draw(st.sampled_from([*BASES[path], *COMPLETION_FIELDS[:12], "unknown"]))
    if kind == "digits":  # integer literals past Python's 4300-digit conversion limit
        n = draw(st.sampled_from([4299, 4300, 4301, 5000, 100_000]))
        lit = draw(st.sampled_from([b"", b"-"])) + b"9" * n
        return valid[:-1] + b', "' + field.encode() + b'": ' + lit + b"}", field
    if kind == "literal":  # numbers JSON does not have, but Python's parser takes
        lit = draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e99999", b"-0",
                                    b"-0.0", b"1E-400", b"0.1e1", b"[NaN]", b"{\"a\": NaN}"]))  # fmt: skip
        return valid[:-1] + b', "' + field.encode() + b'": ' + lit + b"}", field
    if kind == "cut":
        return valid[: draw(st.integers(0, len(valid) - 1))], None
    if kind == "big":  # over --max-request-bytes
        return b'{"prompt": "' + b"a" * (MAX_BODY + 1) + b'"}', None
    return dumps(draw(json_values)), None  # valid JSON, mostly not an object


@pytest.mark.parametrize("target", ["node", "proxy"])
@_settings(60)
@given(data=st.data())
def test_bodies_that_are_not_a_valid_object(cluster: Cluster, target: str, data) -> None:
    paths = PATHS if target == "node" else PATHS[:4]
    path = data.draw(st.sampled_from(paths))
    raw, field = data.draw(raw_bodies(path))
    resp = post(cluster, target, path, raw)
    check_answer(resp, path, None if field is None else {field: None})
    cluster.assert_healthy(target)


# -- utility endpoints -------------------------------------------------------------------------

UTILITY_FIELDS = {
    "/tokenize": ["prompt", "messages", "add_special_tokens", "add_generation_prompt",
                  "chat_template_kwargs", "model", "tools", "continue_final_message",
                  "return_token_strs", "chat_template"],
    "/detokenize": ["tokens", "model"],
    "/v1/abort": ["request_id", "transfer_id"],
}  # fmt: skip
UTILITY_BASES = {
    "/tokenize": [{"prompt": "Hello there"}, {"messages": [{"role": "user", "content": "Hi"}]}],
    "/detokenize": [{"tokens": [1, 2, 3]}],
    "/v1/abort": [{"request_id": "no-such-request"}, {"transfer_id": "no-such-transfer"}],
}


# /tokenize's fields whose errors may name one another: "prompt" and "messages" exclude
# each other; the generation prompt and continuing the final message; the template and its
# arguments; what the template renders.
TOKENIZE_COUPLED = [
    {"prompt", "messages"},
    {"add_generation_prompt", "continue_final_message", "messages"},
    {"chat_template", "chat_template_kwargs"},
    {"messages", "tools", "chat_template", "chat_template_kwargs"},
]


@pytest.mark.parametrize("target", ["node", "proxy", "decode"])
@_settings(40)
@given(data=st.data())
def test_utility_endpoints_with_generated_fields(cluster: Cluster, target: str, data) -> None:
    paths = ["/tokenize", "/detokenize"] + (["/v1/abort"] if target != "proxy" else [])
    path = data.draw(st.sampled_from(paths))
    base = data.draw(st.sampled_from(UTILITY_BASES[path]))
    changed = data.draw(mutations(UTILITY_FIELDS[path]))
    body = {**base, **changed}
    resp = post(cluster, target, path, dumps(body))
    check_answer(resp, path, changed, TOKENIZE_COUPLED if path == "/tokenize" else [])
    cluster.assert_healthy(target)


# -- kv_transfer_params on the nodes of the pair ------------------------------------------------

P_SIDE_CHANNEL = "@p@"  # replaced by the prefill node's real side-channel address
side_channels = st.one_of(
    st.sampled_from([
        P_SIDE_CHANNEL, "tcp://", "tcp://:", "tcp://*:1", "tcp://127.0.0.1:1",
        "tcp://127.0.0.1:0", "tcp://127.0.0.1:99999", "tcp://[::1]:x", "tcp://localhost:-1",
        "tcp://" + "a" * 5000 + ":1", "tcp://é:1", "tcp://\x00:1", "tcp://1." * 1000,
        "ipc:///tmp/x", "inproc://x", "http://127.0.0.1:80", "tcp://127.0.0.1:1\ud800",
    ]),
    st.text(alphabet="*[]:/%@ .0123456789é\x00", max_size=20).map("tcp://".__add__),
    json_values,
)  # fmt: skip
transfer_ids = st.one_of(
    st.sampled_from(["unknown-transfer", "x" * 10_000, "", " ", "../../etc/passwd", "*", "é"]),
    texts,
    json_values,
)
flags = st.one_of(st.just(True), st.booleans(), json_values)
decode_leg = st.fixed_dictionaries(
    {"do_remote_prefill": flags, "transfer_id": transfer_ids,
     "remote_side_channel": side_channels},
    optional={"skip_first_token": flags, "remote_engine_id": json_values,
              "first_token": numbers, "do_remote_decode": flags},
)  # fmt: skip
prefill_leg = st.fixed_dictionaries(
    {"do_remote_decode": flags},
    optional={"transfer_id": transfer_ids, "first_token": numbers,
              "remote_side_channel": side_channels},
)  # fmt: skip
unknown_fields = st.fixed_dictionaries(  # huge block lists: not fields a client may send
    {"block_ids": st.sampled_from([HUGE_LIST, [[1, 2]] * 1000, {"0": 1}, -1])},
    optional={"remote_block_ids": st.just(HUGE_LIST), "do_remote_prefill": flags},
)
kv_params = st.one_of(decode_leg, decode_leg, prefill_leg, unknown_fields, json_values)
LEG = {"do_remote_prefill": True, "transfer_id": "unknown-transfer"}


def _with_side_channel(value: Any, address: str) -> Any:
    if isinstance(value, dict):
        return {k: _with_side_channel(v, address) for k, v in value.items()}
    return address if value == P_SIDE_CHANNEL else value


@pytest.mark.parametrize("target", ["decode", "prefill"])
@_settings(30)
@given(kv=kv_params, chat=st.booleans(), stream=st.booleans())
@example(kv={**LEG, "remote_side_channel": P_SIDE_CHANNEL}, chat=False, stream=False)
@example(kv={**LEG, "remote_side_channel": "tcp://127.0.0.1:1"}, chat=True, stream=True)
@example(kv={**LEG, "remote_side_channel": "tcp://[::1]:x"}, chat=False, stream=True)
def test_pair_nodes_with_hostile_kv_transfer_params(
    cluster: Cluster, target: str, kv, chat: bool, stream: bool
) -> None:
    info = cluster.client.get(cluster.pd.p.url + "/v1/kv_transfer_info").json()
    kv = _with_side_channel(kv, info["side_channel"])
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {**(CHAT_BASE if chat else COMPLETION_BASE), "stream": stream, "kv_transfer_params": kv}
    resp = post(cluster, target, path, dumps(body))
    check_answer(resp, path, {"kv_transfer_params": kv})
    cluster.assert_healthy(target)


def test_pair_pools_full_and_answers_unchanged_after_the_barrage(cluster: Cluster) -> None:
    """Nothing the barrages reserved, held or quarantined stays: both pools come back full
    (transfers end within their deadline), and the pair still answers as before."""
    for node in cluster.pd.nodes:
        wait_for(lambda n=node: kv_pool_full(n.url), 8 * KV_TIMEOUT_S + 20, f"{node.name} pool")
    cluster.assert_still_right("proxy")
    cluster.assert_still_right("node")
