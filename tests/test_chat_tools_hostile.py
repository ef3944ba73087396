"""Chat tool calling and reasoning on hostile and OpenAI-shaped input, on a fake engine
(``scripted_engine.ScriptedEngine``: every request answers a scripted text): the usage a
stream's role chunk reports, the finish reason of a call a stop string cut, and the
history messages vLLM and OpenAI clients send (``arguments`` null, ``refusal`` parts,
tool calls of another type)."""

from __future__ import annotations

from typing import Any

import pytest
from scripted_engine import ScriptedEngine, chat, chat_chunks
from starlette.testclient import TestClient

from engine.server.app import build_app

MSG = [{"role": "user", "content": "hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def _client(text: str, per_output: int = 3, **kw: Any) -> TestClient:
    engine = ScriptedEngine(text, per_output)
    return TestClient(build_app(engine, tool_call_parser="hermes", **kw))  # type: ignore[arg-type]


def _chat(client: TestClient, status: int = 200, **body: Any) -> dict[str, Any]:
    return chat(client, MSG, status, **body)


def _chunks(client: TestClient, **body: Any) -> list[dict[str, Any]]:
    return chat_chunks(client, MSG, **body)


def _prompt(client: TestClient, messages: list[dict[str, Any]]) -> str:
    resp = client.post("/tokenize", json={"messages": messages})
    assert resp.status_code == 200, resp.text
    return bytes(resp.json()["tokens"]).decode()


# -- continuous usage: the role chunk has no tokens -----------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("tools", [{}, {"tools": TOOLS, "tool_choice": "auto"}])
def test_continuous_usage_counts_the_tokens_streamed_so_far(n: int, tools: dict) -> None:
    """vLLM's rule: each chunk's usage counts its choice's tokens up to it; the role
    chunk, which carries none, says 0 (it said the first output's count)."""
    client = _client("hello there", per_output=2)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _chunks(client, n=n, stream_options=opts, **tools)
    seen: dict[int, int] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        i = choice["index"]
        seen[i] = seen.get(i, 0) + len(choice["token_ids"])
        if "role" in choice["delta"]:
            assert choice["token_ids"] == []
        assert chunk["usage"]["completion_tokens"] == seen[i], chunk
    assert chunks[-1]["usage"]["completion_tokens"] == n * len("hello there")


# -- a stop string inside a tool call --------------------------------------------------------------

CALL = '<tool_call>{"name": "get", "arguments": {"q": "xyz"}}</tool_call>'
ARRAY = '[{"name":"get","parameters":{"q":"xyz"}}]'


def _calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def _streamed(chunks: list[dict[str, Any]]) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            for call in choice["delta"].get("tool_calls") or []:
                one = calls.setdefault(call["index"], ["", ""])
                one[0] += call.get("function", {}).get("name") or ""
                one[1] += call["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return [(a, b) for _, (a, b) in sorted(calls.items())], finish


@pytest.mark.parametrize(
    ("text", "choice", "stop", "calls", "finish"),
    [
        # A stop string cut the call's arguments: the engine's "stop" (stop_reason names
        # the string), not "tool_calls" -- the call is not whole (it was "tool_calls").
        (CALL, "auto", "y", [("get", '{"q": "x')], "stop"),
        (ARRAY, "required", "y", [("get", '{"q":"x')], "stop"),
        # A stop string past the calls leaves them whole: "tool_calls".
        (CALL + " then", "auto", "then", [("get", '{"q": "xyz"}')], "tool_calls"),
        (ARRAY, "required", "]", [("get", '{"q":"xyz"}')], "tool_calls"),
    ],
)
def test_a_stop_string_inside_a_call_keeps_the_engines_finish_reason(
    text: str, choice: str, stop: str, calls: list[tuple[str, str]], finish: str
) -> None:
    client = _client(text, per_output=1)
    body = {"tools": TOOLS, "tool_choice": choice, "stop": [stop]}
    (got,) = _chat(client, **body)["choices"]
    assert (_calls(got["message"]), got["finish_reason"]) == (calls, finish)
    assert got["stop_reason"] == stop
    assert _streamed(_chunks(client, **body)) == (calls, finish)


# -- history messages as clients send them ---------------------------------------------------------


def _history(call: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        *MSG,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]


def test_a_history_calls_null_arguments_are_an_empty_object() -> None:
    """vLLM's rule (``_postprocess_messages``): null, absent and "" arguments are ``{}``."""
    client = _client("ok")
    prompts = []
    for args in ({"arguments": None}, {}, {"arguments": ""}, {"arguments": "{}"}):
        call = {"id": "c1", "type": "function", "function": {"name": "get", **args}}
        prompts.append(_prompt(client, _history(call)))
        _chat(client, messages=_history(call))
    assert len(set(prompts)) == 1 and '"arguments": {}' in prompts[0]


def test_a_history_call_of_another_type_is_a_400_naming_it() -> None:
    """vLLM: "chat completions only support assistant tool_calls of type 'function'"."""
    client = _client("ok")
    call = {"id": "c1", "type": "custom", "function": {"name": "get", "arguments": "{}"}}
    err = _chat(client, 400, messages=_history(call))["error"]
    assert err["param"] == "messages[1].tool_calls[0].type" and "'function'" in err["message"]
    untyped = {"id": "c1", "function": {"name": "get", "arguments": "{}"}}  # vLLM's default
    _chat(client, messages=_history(untyped))


def test_an_assistant_refusal_part_is_its_text() -> None:
    """OpenAI's assistant content parts are ``text`` and ``refusal`` (vLLM reads both as
    text); another type stays a 400 naming it."""
    client = _client("ok")
    refusal = {"type": "refusal", "refusal": "I cannot help with that."}
    messages = [*MSG, {"role": "assistant", "content": [refusal]}, *MSG]
    assert "I cannot help with that." in _prompt(client, messages)
    _chat(client, messages=messages)
    bad = [*MSG, {"role": "assistant", "content": [{"type": "refusal", "refusal": 3}]}, *MSG]
    assert _chat(client, 400, messages=bad)["error"]["param"] == "messages[1].content[0].refusal"
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
    assert _chat(client, 400, messages=audio)["error"]["param"] == "messages[0].content[0].type"


# -- a prefill leg's context-length refusal ---------------------------------------------------


def test_a_prefill_legs_context_refusal_counts_the_clients_max_tokens():
    # The proxy passes the client's body to P, which computes one token: a prompt too long
    # for the context is refused naming what the client asked for, as D would, not the
    # one token P computes (through the proxy either leg's 400 may reach the client).
    client = _client("never")
    long = [{"role": "user", "content": "x" * 5000}]  # the scripted engine's context: 4096
    kv = {"do_remote_decode": True, "transfer_id": "t-1"}
    for legs in ({}, {"kv_transfer_params": kv}):
        resp = client.post("/v1/chat/completions",
                           json={"messages": long, "max_tokens": 50, **legs})  # fmt: skip
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
        assert "50 for the completion" in err["message"], err["message"]
