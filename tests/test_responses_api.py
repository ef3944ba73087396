"""The Responses API (``POST /v1/responses``) in process: a request translated into a
chat request (each refusal a 400 naming the Responses field), a chat body into a
``response`` object, a chat stream into typed events that add up to the same object, and
both checked against the ``openai`` SDK's own models."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.responses import JSONResponse

from engine.responses_api.output import usage
from engine.responses_api.request import to_chat
from engine.responses_api.route import answer, events, responses_param
from engine.responses_api.stream import ResponsesStream, response_object
from engine.server.request_fields import APIError

openai_types = pytest.importorskip("openai.types.responses")
pydantic = pytest.importorskip("pydantic")
EVENT = pydantic.TypeAdapter(openai_types.ResponseStreamEvent)


def _err(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as e:
        to_chat(body)
    return e.value


def test_string_input_is_one_user_message_after_the_instructions():
    chat, echo = to_chat(
        {"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 5}
    )
    assert chat == {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 5,
    }
    assert echo.instructions == "be brief" and echo.max_output_tokens == 5
    fields = echo.fields()
    assert fields["store"] is False and fields["tool_choice"] == "auto"
    assert fields["text"] == {"format": {"type": "text"}}


def test_input_items_become_chat_messages_with_tool_calls_on_the_assistant_turn():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    chat, _ = to_chat(
        {
            "input": [
                {"role": "developer", "content": "rules"},
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]},
                call,
                {**call, "call_id": "c2"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "function_call_output", "call_id": "c2",
                 "output": [{"type": "input_text", "text": "two"}]},
            ]
        }
    )  # fmt: skip
    fn = {"name": "f", "arguments": "{}"}
    assert chat["messages"] == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "let me see", "tool_calls": [
            {"id": "c1", "type": "function", "function": fn},
            {"id": "c2", "type": "function", "function": fn},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]  # fmt: skip
    # A function call with no assistant turn before it opens one.
    chat, _ = to_chat({"input": [{"role": "user", "content": "x"}, call]})
    assert chat["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": fn}]}  # fmt: skip


def test_sampling_fields_pass_and_chat_only_fields_do_not():
    chat, echo = to_chat(
        {
            "input": "x", "temperature": 0.5, "top_p": 0.9, "seed": 3, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": "smuggled"}], "n": 4,
            "max_tokens": 99,
        }
    )  # fmt: skip
    assert chat["messages"] == [{"role": "user", "content": "x"}]
    assert (chat["temperature"], chat["top_p"], chat["seed"], chat["ignore_eos"]) == (
        0.5, 0.9, 3, True,
    )  # fmt: skip
    assert "n" not in chat and "max_tokens" not in chat
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert echo.ignored_fields == ("messages", "n", "max_tokens")


def test_tools_tool_choice_text_format_reasoning_and_logprobs_translate():
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    chat, echo = to_chat(
        {
            "input": "x",
            "tools": [{"type": "function", "name": "f", "parameters": schema, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}},
            "reasoning": {"effort": "low"},
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 2,
        }
    )
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "s", "schema": schema},
    }
    assert chat["reasoning_effort"] == "low"
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2
    assert echo.reasoning == {"effort": "low", "summary": None}
    assert to_chat({"input": "x", "text": {"format": {"type": "json_object"}}})[0][
        "response_format"
    ] == {"type": "json_object"}
    assert "logprobs" not in to_chat({"input": "x", "include": ["reasoning.encrypted_content"]})[0]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "background": True}, "background"),
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": 7}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]},
         "input[0].output"),
        ({"input": "x", "instructions": 5}, "instructions"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": {"type": "function"}}, "tools"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
        ({"input": "x", "reasoning": "high"}, "reasoning"),
        ({"input": "x", "include": "logprobs"}, "include"),
        ({"input": "x", "top_logprobs": -1}, "top_logprobs"),
        ({"input": "x", "truncation": "middle"}, "truncation"),
        ({"input": "x", "metadata": ["a"]}, "metadata"),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
        ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata.k"),
        ({"input": "x", "stream": "yes"}, "stream"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": "x", "max_tool_calls": "3"}, "max_tool_calls"),
        ({"input": "x", "stream_options": True}, "stream_options"),
        ({"input": "x", "service_tier": 1}, "service_tier"),
        ({"input": "x", "user": "u" * 513}, "user"),
        # Repeated back in the response object: no NaN/Infinity (no JSON has them), the
        # json_schema format's fields as OpenAI types them.
        ({"input": "x", "tools": [{"type": "function", "name": "f",
                                   "parameters": {"type": "object", "x": [float("inf")]}}],
          "tool_choice": "none"}, "tools[0].parameters.x[0]"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"a": float("nan")},
                                            "name": "n"}}}, "text.format.schema.a"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {},
                                            "name": float("nan")}}}, "text.format.name"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {},
                                            "strict": "yes"}}}, "text.format.strict"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {},
                                            "description": 1}}}, "text.format.description"),
    ],
)  # fmt: skip
def test_refusals_name_the_responses_field(body, param):
    e = _err(body)
    assert e.status_code == 400 and e.param == param, (e.param, e.message)


def test_chat_errors_are_renamed_to_responses_fields():
    assert responses_param("messages[3].content") == "input"
    assert responses_param("max_tokens") == "max_output_tokens"
    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("tools[2].function.name") == "tools[2].name"
    assert responses_param("reasoning_effort") == "reasoning.effort"
    assert responses_param("temperature") == "temperature"
    assert responses_param(None) is None
    _, echo = to_chat({"input": "x"})
    body = {"error": {"message": "'tools[0].function.name' must be", "type": "invalid_request_error",
                      "param": "tools[0].function.name", "code": None}}  # fmt: skip
    resp = answer(JSONResponse(body, status_code=400, headers={"x-keep": "1"}), echo)
    out = json.loads(resp.body)
    assert resp.status_code == 400 and resp.headers["x-keep"] == "1"
    assert out["error"]["param"] == "tools[0].name"
    assert out["error"]["message"] == "'tools[0].name' must be"


def _chat_body(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "created": 7,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
                  "prompt_tokens_details": {"cached_tokens": 4}},
    }  # fmt: skip


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}


def test_response_object_holds_reasoning_then_message_then_calls():
    _, echo = to_chat({"input": "x", "max_output_tokens": 9})
    msg = {"role": "assistant", "reasoning_content": "hmm", "content": "yes", "tool_calls": [CALL]}
    r = response_object(echo, _chat_body(msg))
    openai_types.Response.model_validate(r)
    assert r["id"] == "resp_abc" and r["status"] == "completed" and r["created_at"] == 7
    assert [o["type"] for o in r["output"]] == ["reasoning", "message", "function_call"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert r["output"][1]["content"][0]["text"] == "yes"
    assert r["output"][2] | {} == {
        "id": "fc_abc_0", "type": "function_call", "call_id": "call_1", "name": "f",
        "arguments": '{"a":1}', "status": "completed",
    }  # fmt: skip
    assert r["usage"] == {
        "input_tokens": 5, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14,
    }  # fmt: skip
    assert r["max_output_tokens"] == 9 and r["store"] is False
    # Calls alone: no message; an empty answer: one empty message; cut: incomplete.
    only_calls = response_object(echo, _chat_body({"content": None, "tool_calls": [CALL]}))
    assert [o["type"] for o in only_calls["output"]] == ["function_call"]
    empty = response_object(echo, _chat_body({"content": ""}))
    assert [o["content"][0]["text"] for o in empty["output"]] == [""]
    cut = response_object(echo, _chat_body({"content": "ab"}, "length"))
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete"
    # Text, then a call the length cut: the message was whole, as a stream says; the call not.
    both = response_object(echo, _chat_body({"content": "ab", "tool_calls": [CALL]}, "length"))
    assert [o["status"] for o in both["output"]] == ["completed", "incomplete"]
    _, streamed = to_chat({"input": "x"})
    evs = _stream(
        [_chunk({"content": "ab"}),
         _chunk({"tool_calls": [{"index": 0, **CALL}]}, "length")], streamed,
    )  # fmt: skip
    assert (
        evs[-1]["response"]["output"]
        == response_object(streamed, _chat_body({"content": "ab", "tool_calls": [CALL]}, "length"))[
            "output"
        ]
    )


def _chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, **extra}
    return {"id": "chatcmpl-abc", "created": 7, "model": "m", "choices": [choice]}


def _stream(chunks: list[dict[str, Any]], echo: Any) -> list[dict[str, Any]]:
    s = ResponsesStream(echo)
    out = [e for c in chunks for e in s.feed(c)] + s.finish()
    for e in out:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_a_stream_adds_up_to_the_body():
    _, echo = to_chat({"input": "x"})
    usage = _chat_body({})["usage"]
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "hm"}),
        _chunk({"reasoning_content": "m"}),
        _chunk({"content": "ye"}),
        _chunk({"content": "s"}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                "function": {"name": "f", "arguments": '{"a"'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}, "tool_calls"),
        {"id": "chatcmpl-abc", "created": 7, "model": "m", "choices": [], "usage": usage},
    ]  # fmt: skip
    evs = _stream(chunks, echo)
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = evs[-1]["response"]
    msg = {"role": "assistant", "reasoning_content": "hmm", "content": "yes", "tool_calls": [CALL]}
    body = response_object(echo, _chat_body(msg, "tool_calls"))
    assert final == body
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.done"] == [0, 1, 2]


def test_a_cut_stream_ends_incomplete_and_an_empty_one_with_an_empty_message():
    _, echo = to_chat({"input": "x", "max_output_tokens": 2})
    evs = _stream(
        [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "ab"}, "length")], echo
    )
    assert evs[-1]["type"] == "response.incomplete"
    assert evs[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert evs[-1]["response"] == response_object(echo, _chat_body({"content": "ab"}, "length")) | {
        "usage": None
    }
    empty = _stream([_chunk({"role": "assistant", "content": ""}, "stop")], echo)
    assert [o["type"] for o in empty[-1]["response"]["output"]] == ["message"]


def test_logprobs_follow_the_text_they_belong_to():
    _, echo = to_chat({"input": "x", "top_logprobs": 1})
    lp = {"content": [{"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": []}]}
    evs = _stream([_chunk({"content": ""}, logprobs=lp), _chunk({"content": "a"})], echo)
    deltas = [e for e in evs if e["type"] == "response.output_text.delta"]
    assert [d["logprobs"][0]["token"] for d in deltas] == ["a"]
    assert evs[-1]["response"]["output"][0]["content"][0]["logprobs"][0]["logprob"] == -1.0


def _run_events(pieces: list[str]) -> list[dict[str, Any]]:
    _, echo = to_chat({"input": "x"})

    async def chunks():
        for p in pieces:
            yield p

    async def collect():
        return [e async for e in events(chunks(), echo)]

    out = []
    for frame in asyncio.run(collect()):
        kind, data = frame.split("\n")[:2]
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


def test_sse_frames_split_anywhere_are_read_whole():
    text = (
        "".join(
            f"data: {json.dumps(c)}\n\n"
            for c in [
                _chunk({"role": "assistant", "content": ""}),
                _chunk({"content": "hi"}, "stop"),
            ]
        )
        + "data: [DONE]\n\n"
    )
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    evs = _run_events(pieces)
    assert evs[-1]["type"] == "response.completed"
    assert evs[-1]["response"]["output"][0]["content"][0]["text"] == "hi"


def test_an_error_event_fails_the_response_and_a_cut_stream_fails_too():
    err = {
        "error": {"message": "engine unavailable", "type": "server_error", "code": "engine_dead"}
    }
    first = f"data: {json.dumps(_chunk({'content': 'a'}))}\n\n"
    evs = _run_events([first, f"data: {json.dumps(err)}\n\n", "data: [DONE]\n\n"])
    assert evs[-1]["type"] == "response.failed"
    assert evs[-1]["response"]["error"] == {
        "code": "server_error",
        "message": "engine unavailable (engine_dead)",
    }
    assert [e["type"] for e in evs].count("response.failed") == 1
    cut = _run_events([first])
    assert cut[-1]["type"] == "response.failed"
    assert cut[-1]["response"]["error"]["message"] == "the stream ended early"
    odd = _run_events([f"data: {json.dumps({'choices': {'0': 1}})}\n\n", "data: [DONE]\n\n"])
    assert [e["type"] for e in odd][-1] == "response.failed"  # a shape never sent: failed
    assert [e["type"] for e in odd].count("response.failed") == 1
    nothing = _run_events([])  # cut before its first chunk
    assert [e["type"] for e in nothing] == [
        "response.created", "response.in_progress", "error", "response.failed",
    ]  # fmt: skip
    for e in evs + cut + odd + nothing:
        EVENT.validate_python(e)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ({"message": "the grammar leaves no token", "type": "invalid_request_error",
          "param": "response_format", "code": "structured_output_stuck"}, "invalid_prompt"),
        ({"message": "bad schema", "type": "BadRequestError", "code": 400}, "invalid_prompt"),
        ({"message": "too long", "type": None, "code": "context_length_exceeded"},
         "context_length_exceeded"),
        ({"message": "busy", "type": "rate_limit_error", "code": "overloaded"},
         "rate_limit_exceeded"),
        ({"message": "slow down", "type": "requests", "code": "rate_limit_exceeded"},
         "rate_limit_exceeded"),
        ({"message": "full", "type": "server_error", "code": "overloaded"},
         "rate_limit_exceeded"),
        ({"message": "engine unavailable", "type": "server_error", "code": "engine_dead"},
         "server_error"),
        ({"message": "upstream failure", "type": "server_error", "code": "upstream_error"},
         "server_error"),
        ({"message": "timeout", "type": "GatewayTimeout", "code": 504}, "server_error"),
        ({"message": "x"}, "server_error"),
    ],
)  # fmt: skip
def test_a_failed_stream_keeps_the_kind_of_its_error(error: dict[str, Any], code: str):
    """An error event mid-stream: the client's own error (a 4xx: the request refused)
    stays the client's (``invalid_prompt``; a context too long ``context_length_exceeded``,
    as OpenAI's API says it and the Codex CLI reads it: not retried), load stays load, the
    rest is the server's; the error's own code follows the message."""
    first = f"data: {json.dumps(_chunk({'content': 'a'}))}\n\n"
    evs = _run_events([first, f"data: {json.dumps({'error': error})}\n\n", "data: [DONE]\n\n"])
    failed = evs[-1]
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"]["code"] == code, failed["response"]["error"]
    assert failed["response"]["error"]["message"].startswith(error["message"])
    if error.get("code") not in (None, "server_error"):
        assert failed["response"]["error"]["message"].endswith(f"({error['code']})")
    if code == "context_length_exceeded":  # not on the SDK's closed list: the rest checked
        response = {**failed["response"], "error": {**failed["response"]["error"],
                                                    "code": "invalid_prompt"}}  # fmt: skip
        failed = {**failed, "response": response}
    EVENT.validate_python(failed)


@pytest.mark.parametrize(
    ("error", "code", "param"),
    [
        ({"message": "too long", "type": "invalid_request_error", "param": "messages",
          "code": "context_length_exceeded"}, "context_length_exceeded", "input"),
        ({"message": "the grammar leaves no token", "type": "invalid_request_error",
          "param": "response_format", "code": "structured_output_stuck"},
         "structured_output_stuck", "text.format"),
        ({"message": "max_tokens is too large", "type": "BadRequestError", "param": "max_tokens",
          "code": 400}, "invalid_prompt", "max_output_tokens"),
        ({"message": "busy", "type": "rate_limit_error", "code": "overloaded"}, "overloaded", None),
        ({"message": "upstream failure", "type": "server_error", "code": "upstream_error"},
         "upstream_error", None),
        ({"message": "x"}, "server_error", None),
    ],
)  # fmt: skip
def test_a_failed_stream_sends_an_error_event_then_response_failed(
    error: dict[str, Any], code: str, param: str | None
):
    """As OpenAI's streams end when they fail: an ``error`` event (its own ``code``, not
    held to ``response.error``'s closed list; ``param`` named as the Responses API names
    it), then ``response.failed``, the last event, whose ``error`` has OpenAI's code."""
    first = f"data: {json.dumps(_chunk({'content': 'a'}))}\n\n"
    evs = _run_events([first, f"data: {json.dumps({'error': error})}\n\n", "data: [DONE]\n\n"])
    assert [e["type"] for e in evs[-2:]] == ["error", "response.failed"]
    said = evs[-2]
    assert said == {"type": "error", "sequence_number": evs[-1]["sequence_number"] - 1,
                    "code": code, "message": error["message"], "param": param}  # fmt: skip
    EVENT.validate_python(said)
    assert evs[-1]["response"]["error"]["message"].startswith(error["message"])
    for cut in (_run_events([first]), _run_events([])):  # the stream ended early
        assert [e["type"] for e in cut[-2:]] == ["error", "response.failed"]
        assert cut[-2]["code"] == cut[-1]["response"]["error"]["code"] == "server_error"
        assert [e["type"] for e in cut].count("error") == 1


# -- the node's route, on an engine answering scripted text ---------------------------------------


def _node(text: str, **kw: Any) -> Any:
    from scripted_engine import ScriptedEngine
    from starlette.testclient import TestClient

    from engine.server.app import build_app

    return TestClient(build_app(ScriptedEngine(text), **kw))  # type: ignore[arg-type]


def _both(client: Any, **body: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The body and the stream's events of one request (each checked by the SDK's models)."""
    body = {"model": "m", "input": "2 + 2?", "max_output_tokens": 64, **body}
    resp = client.post("/v1/responses", json=body)
    assert resp.status_code == 200, resp.text
    whole = resp.json()
    openai_types.Response.model_validate(whole)
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in resp.read().decode().split("\n\n") if f]
    evs = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
    for e in evs:
        EVENT.validate_python(e)
    return whole, evs


def _shape(r: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (o["type"], [c.get("text") for c in o.get("content") or []], o.get("name"),
         o.get("arguments"), o.get("status"))
        for o in r["output"]
    ]  # fmt: skip


def test_a_node_answers_reasoning_then_text_streamed_or_not():
    client = _node("<think>\nadd them</think>\n\nIt is 4.", reasoning_parser="qwen3")
    whole, evs = _both(client)
    assert _shape(whole) == [
        ("reasoning", ["\nadd them"], None, None, "completed"),
        ("message", ["\n\nIt is 4."], None, None, "incomplete"),
    ]
    assert whole["status"] == "incomplete"  # the scripted engine ends with "length"
    assert evs[-1]["type"] == "response.incomplete"
    assert _shape(evs[-1]["response"]) == _shape(whole)
    assert evs[-1]["response"]["usage"] == whole["usage"]


def test_a_node_answers_a_parsed_tool_call_as_a_function_call_item():
    call = '<tool_call>\n{"name": "get", "arguments": {"q": "x"}}\n</tool_call>'
    client = _node(call, tool_call_parser="hermes")
    tools = [{"type": "function", "name": "get",
              "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]  # fmt: skip
    whole, evs = _both(client, tools=tools, tool_choice="auto")
    assert _shape(whole) == [("function_call", [], "get", '{"q": "x"}', "completed")]
    assert _shape(evs[-1]["response"]) == _shape(whole)
    kinds = [e["type"] for e in evs]
    assert "response.function_call_arguments.done" in kinds
    assert "response.output_text.delta" not in kinds


def test_a_node_refuses_before_the_engine_and_names_the_responses_field():
    client = _node("never")
    resp = client.post("/v1/responses", json={"model": "m", "input": "x", "max_output_tokens": 0})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "max_output_tokens"
    resp = client.post("/v1/responses", json={"model": "nope", "input": "x"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_not_found"
    resp = client.post("/v1/responses", content=b"{not json")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"


def test_a_body_within_the_size_cap_is_not_refused_for_its_translation():
    """The chat body a Responses body translates into may be longer (each message's
    wrapping; non-ASCII text was written as \\u escapes, 6 bytes for a 2-byte "é"): it
    is not held to the cap again, which the client's own body passed."""
    client = _node("ok", max_request_bytes=2000)
    for text in ("é" * 600, "x" * 1900):
        raw = json.dumps({"model": "m", "input": text}, ensure_ascii=False).encode()
        assert len(raw) <= 2000
        resp = client.post("/v1/responses", content=raw)
        assert resp.status_code == 200, resp.text
    too_big = json.dumps({"model": "m", "input": "x" * 2000}).encode()
    resp = client.post("/v1/responses", content=too_big)
    assert resp.status_code == 413 and "2000 bytes" in resp.json()["error"]["message"]


def test_the_usage_repeats_the_nodes_reasoning_count_and_nothing_else():
    """A node's ``completion_tokens_details.reasoning_tokens`` (through the proxy: over
    the network) is repeated when it is a count; anything else is 0, never passed on."""
    base = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    for details, want in [
        ({"reasoning_tokens": 4}, 4),
        ({"reasoning_tokens": 0}, 0),
        (None, 0),  # a node without a reasoning parser: no reasoning part
        ({"reasoning_tokens": -2}, 0),
        ({"reasoning_tokens": "4"}, 0),
        ({"reasoning_tokens": True}, 0),
        ({"reasoning_tokens": 2.5}, 0),
        ("4", 0),
    ]:
        got = usage({**base, "completion_tokens_details": details})
        assert got is not None and got["output_tokens_details"] == {"reasoning_tokens": want}
        assert got["output_tokens"] == 9


def _unnamed(r: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output items, each id with its response's own part as "ID"."""
    rid = r["id"].removeprefix("resp_")
    return [{**o, "id": o["id"].replace(rid, "ID", 1)} for o in r["output"]]


@pytest.mark.parametrize("per_output", [1, 3, 100])  # tokens a step: 100, the whole in one
@pytest.mark.parametrize("logprobs", [False, True])
def test_content_before_think_is_answered_in_the_texts_order_streamed_or_not(
    per_output: int, logprobs: bool
):
    """qwen3 keeps text before ``<think>`` as content: a message, the reasoning, another
    message, in the text's order, the stream's final ``output`` the whole response's
    (ids, texts, log probabilities) however the engine's steps cut the text. Each
    streamed item has an id of its own, its ``added`` and ``done`` events the same one."""
    from scripted_engine import ScriptedEngine
    from starlette.testclient import TestClient

    from engine.server.app import build_app

    engine = ScriptedEngine("Sure. <think>why</think> 4", per_output=per_output)
    client = TestClient(build_app(engine, reasoning_parser="qwen3"))  # type: ignore[arg-type]
    extra: dict[str, Any] = {}
    if logprobs:
        extra = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}
    whole, evs = _both(client, **extra)
    final = evs[-1]["response"]
    assert [o["type"] for o in whole["output"]] == ["message", "reasoning", "message"]
    assert _unnamed(final) == _unnamed(whole)  # ids: each request's own
    for key in ("status", "incomplete_details", "usage", "error"):
        assert final[key] == whole[key], key
    assert [o["content"][0]["text"] for o in whole["output"]] == ["Sure. ", "why", " 4"]
    ids = [o["id"] for o in final["output"]]
    assert len(set(ids)) == len(ids), ids
    added = [e["item"]["id"] for e in evs if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in evs if e["type"] == "response.output_item.done"]
    assert added == done == ids
    deltas = [e["item_id"] for e in evs if e["type"].endswith("_text.delta")]
    assert list(dict.fromkeys(deltas)) == ids, deltas
    if logprobs:  # every token's entry, once, on a message (the reasoning's: after it)
        entries = [lp for o in whole["output"] if o["type"] == "message"
                   for lp in o["content"][0]["logprobs"]]  # fmt: skip
        assert len(entries) == len(b"Sure. <think>why</think> 4")


@pytest.mark.parametrize(
    "parser, text, reasoning",
    [
        ("qwen3", "<think>\nadd them</think>\n\nIt is 4.", "\nadd them"),
        ("qwen3", "Sure. <think>why</think> 4", "why"),  # text before <think>: content
        ("qwen3", "no tags at all", ""),
        ("deepseek_r1", "I should add.</think>It is 4.", "I should add."),
        ("deepseek_r1", "<think>hm</think>4", "hm"),  # a leading <think> is no reasoning
        ("deepseek_r1", "cut off while thinking", "cut off while thinking"),
    ],
)
def test_a_node_counts_the_reasoning_tokens_apart(parser: str, text: str, reasoning: str):
    """``output_tokens_details.reasoning_tokens``: the answer's tokens in its reasoning part
    (the byte tokenizer: one token a byte; the tags in none), streamed or not; the chat
    answer's usage says it as vLLM's does (``completion_tokens_details``)."""
    client = _node(text, reasoning_parser=parser)
    whole, evs = _both(client)
    want = len(reasoning.encode())
    assert whole["usage"]["output_tokens"] == len(text.encode())
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": want}
    assert evs[-1]["response"]["usage"] == whole["usage"]
    got = [o["content"][0]["text"] for o in whole["output"] if o["type"] == "reasoning"]
    assert got == ([reasoning] if reasoning else [])
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 64}
    chat = client.post("/v1/chat/completions", json=body).json()
    assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": want}


@pytest.mark.parametrize(
    ("parser", "text", "kinds"),
    [
        ("qwen3", "<think>cut off while", ["reasoning"]),
        ("qwen3", "Sure. <think>cut off", ["message", "reasoning"]),
        ("qwen3", "<think>why</think>cut off", ["reasoning", "message"]),
        ("deepseek_r1", "cut off while thinking", ["reasoning"]),
    ],
)
def test_an_answer_cut_by_max_output_tokens_is_incomplete_streamed_or_not(
    parser: str, text: str, kinds: list[str]
):
    """``max_output_tokens`` cut the answer (the scripted engine ends with "length"):
    status ``incomplete`` with reason ``max_output_tokens``, the last item (the one cut,
    reasoning too) ``incomplete``, the others ``completed``; the stream ends with
    ``response.incomplete`` holding the same status, items and usage."""
    client = _node(text, reasoning_parser=parser)
    whole, evs = _both(client)
    assert whole["status"] == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [o["type"] for o in whole["output"]] == kinds
    assert [o["status"] for o in whole["output"]] == ["completed"] * (len(kinds) - 1) + [
        "incomplete"
    ]
    final = evs[-1]
    assert final["type"] == "response.incomplete"
    assert _unnamed(final["response"]) == _unnamed(whole)
    for key in ("status", "incomplete_details", "usage"):
        assert final["response"][key] == whole[key], key
    assert whole["usage"]["output_tokens"] == len(text.encode())
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert [o["status"] for o in done] == [o["status"] for o in whole["output"]]


CALL_TEXT = '<tool_call>{"name": "get", "arguments": {}}</tool_call>'


@pytest.mark.parametrize("per_output", [1, 3, 100])  # tokens a step: 100, the whole in one
@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize(
    "parser, text, kinds, texts",
    [
        (None, f"a{CALL_TEXT}b", ["message", "function_call", "message"], ["a", "b"]),
        ("qwen3", f"a{CALL_TEXT}b<think>r</think>c",
         ["message", "function_call", "message", "reasoning", "message"], ["a", "b", "r", "c"]),
        ("qwen3", f"<think>r</think>a{CALL_TEXT}b{CALL_TEXT}c",
         ["reasoning", "message", "function_call", "message", "function_call", "message"],
         ["r", "a", "b", "c"]),
        # Content between two calls, none after the last.
        (None, f"a{CALL_TEXT}b{CALL_TEXT}",
         ["message", "function_call", "message", "function_call"], ["a", "b"]),
        # Content, then a call, nothing after it: the call's tokens have no item's
        # log probabilities, streamed or not.
        (None, f"ab{CALL_TEXT}", ["message", "function_call"], ["ab"]),
        ("qwen3", f"<think>r</think>ab{CALL_TEXT}", ["reasoning", "message", "function_call"],
         ["r", "ab"]),
    ],
)  # fmt: skip
def test_text_after_a_tool_call_is_answered_in_the_texts_order_streamed_or_not(
    per_output: int, logprobs: bool, parser: str | None, text: str, kinds: list[str],
    texts: list[str],
) -> None:  # fmt: skip
    """Content after a tool call is a message after the function call, streamed or not
    and however the engine's steps cut the text: the stream's final ``output`` is the
    whole response's (ids, texts, log probabilities)."""
    from scripted_engine import ScriptedEngine
    from starlette.testclient import TestClient

    from engine.server.app import build_app

    engine = ScriptedEngine(text, per_output=per_output)
    client = TestClient(build_app(engine, tool_call_parser="hermes", reasoning_parser=parser))  # type: ignore[arg-type]
    extra: dict[str, Any] = {"tools": [{"type": "function", "name": "get", "parameters": {}}]}
    if logprobs:
        extra.update(include=["message.output_text.logprobs"], top_logprobs=1)
    whole, evs = _both(client, **extra)
    final = evs[-1]["response"]
    assert [o["type"] for o in final["output"]] == kinds
    assert [o["type"] for o in whole["output"]] == kinds
    got = [o["content"][0]["text"] for o in whole["output"] if o["type"] != "function_call"]
    assert got == texts

    # Call ids are each request's own (random).
    def named(r: dict[str, Any]) -> list[dict[str, Any]]:
        return [{k: v for k, v in o.items() if k != "call_id"} for o in _unnamed(r)]

    assert named(final) == named(whole)
    for key in ("status", "incomplete_details", "usage", "error"):
        assert final[key] == whole[key], key
    ids = [o["id"] for o in final["output"]]
    assert len(set(ids)) == len(ids), ids


@pytest.mark.parametrize(
    "marks",
    [
        None, "x", [], [{"chars": 1}], [{"chars": True, "tokens": 0}], [{"chars": 9, "tokens": 0}],
        [{"chars": -1, "tokens": 0}], [{"chars": 1, "tokens": 0}, {"chars": 0, "tokens": 0}],
        [{"chars": 1, "tokens": 5}, {"chars": 2, "tokens": 4}], [1, 2],
    ],
)  # fmt: skip
def test_before_tool_calls_that_does_not_fit_the_message_puts_the_calls_last(marks: Any):
    """A node's ``before_tool_calls`` (it came over the network) is checked against the
    message: one that fits puts each call after its content; one that does not (its
    length, types, bounds, order) is ignored: the calls go after all of the content."""
    _, echo = to_chat({"input": "x"})
    calls = [CALL, {**CALL, "id": "call_2"}]
    fits = [{"chars": 1, "tokens": 3}, {"chars": 2, "tokens": 5}]
    msg = {"role": "assistant", "content": "abc", "tool_calls": calls}
    r = response_object(echo, _chat_body({**msg, "before_tool_calls": fits}))
    kinds = [(o["type"], o.get("content") and o["content"][0]["text"]) for o in r["output"]]
    assert kinds == [("message", "a"), ("function_call", None), ("message", "b"),
                     ("function_call", None), ("message", "c")]  # fmt: skip
    r = response_object(echo, _chat_body({**msg, "before_tool_calls": marks}))
    kinds = [(o["type"], o.get("content") and o["content"][0]["text"]) for o in r["output"]]
    assert kinds == [("message", "abc"), ("function_call", None), ("function_call", None)]


# -- truncation: "auto" on a node's real engine (tiny, a 256-token context, in process) ----

CONTEXT = 256
SENTENCE = "the river runs by the old stone road to the lake "  # 49 bytes: 49 tokens


@pytest.fixture(scope="module")
def tiny_node() -> Any:
    from inproc_node import app_on_loop, uni_config

    with app_on_loop(uni_config(max_model_len=CONTEXT, num_blocks=64)) as node:
        yield node


def _respond(node: Any, items: Any, truncation: str, **body: Any) -> Any:
    import httpx

    app, loop = node
    body = {"model": "tiny", "input": items, "truncation": truncation, "temperature": 0,
            "ignore_eos": True, "max_output_tokens": 8, **body}  # fmt: skip

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://n") as client:
            return await client.post("/v1/responses", json=body)

    return loop.run_until_complete(main())


def _turns(n: int) -> list[dict[str, Any]]:
    """``n`` messages, user and assistant in turn (odd ``n``: the last is the user's)."""
    return [{"role": ("user", "assistant")[i % 2], "content": f"{i}: {SENTENCE}"} for i in range(n)]


def _kept_alone(node: Any, head: list[Any], items: list[Any], **body: Any) -> tuple[int, Any]:
    """The fewest leading ``items`` whose drop lets ``head + items[k:]`` fit with
    ``truncation: disabled`` and leaves a user turn first, and that request's answer."""
    for k in range(1, len(items)):
        if items[k].get("role") != "user":
            continue
        resp = _respond(node, head + items[k:], "disabled", **body)
        if resp.status_code == 200:
            return k, resp.json()
        assert resp.json()["error"]["code"] == "context_length_exceeded", resp.text
    raise AssertionError("no suffix fits")


@pytest.mark.parametrize("max_output_tokens", [8, 120])
def test_truncation_auto_drops_the_oldest_items_and_answers_as_the_kept_ones_alone(
    tiny_node: Any, max_output_tokens: int, caplog: Any
):
    """The instructions and the leading developer message stay; the fewest oldest items
    go that let the prompt and ``max_output_tokens`` fit; the answer is the one the kept
    items alone get (greedy), and ``usage.input_tokens`` counts them. The node logs the
    count it dropped."""
    head = [{"role": "developer", "content": "answer briefly"}]
    items = _turns(11)
    ask = {"instructions": "be kind", "max_output_tokens": max_output_tokens}
    refused = _respond(tiny_node, head + items, "disabled", **ask)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    with caplog.at_level("INFO", logger="engine.server.job_builder"):
        resp = _respond(tiny_node, head + items, "auto", **ask)
    assert resp.status_code == 200, resp.text
    got = resp.json()
    k, want = _kept_alone(tiny_node, head, items, **ask)
    assert f"dropped the first {k} of {len(items) + 2} messages" in caplog.text
    assert _shape(got) == _shape(want)
    assert got["usage"] == want["usage"]
    assert got["usage"]["input_tokens"] + max_output_tokens <= CONTEXT
    assert got["truncation"] == "auto"


def test_truncation_auto_changes_nothing_for_a_conversation_that_fits(tiny_node: Any):
    items = _turns(3)
    auto = _respond(tiny_node, items, "auto", instructions="be kind")
    disabled = _respond(tiny_node, items, "disabled", instructions="be kind")
    assert auto.status_code == disabled.status_code == 200, auto.text
    assert _shape(auto.json()) == _shape(disabled.json())
    assert auto.json()["usage"] == disabled.json()["usage"]


def test_truncation_auto_drops_a_function_call_with_its_output(tiny_node: Any):
    """A cut never keeps a function call's output without the call: where dropping up to
    the call would fit, the output goes with it."""
    args = json.dumps({"q": SENTENCE * 2})
    items = [
        {"role": "user", "content": SENTENCE},
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": args},
        {"type": "function_call_output", "call_id": "c1", "output": SENTENCE},
        {"role": "user", "content": SENTENCE},
    ]
    # The setting: dropping the first message is not enough; dropping the call too (the
    # output left an orphan) would fit.
    assert _respond(tiny_node, items[1:], "disabled").status_code == 400
    assert _respond(tiny_node, items[2:], "disabled").status_code == 200
    resp = _respond(tiny_node, items, "auto")
    assert resp.status_code == 200, resp.text
    want = _respond(tiny_node, items[3:], "disabled").json()
    assert _shape(resp.json()) == _shape(want)
    assert resp.json()["usage"] == want["usage"]


def test_truncation_auto_refuses_a_last_item_too_long_alone_as_disabled_does(tiny_node: Any):
    items = [*_turns(3), {"role": "user", "content": SENTENCE * 6}]
    auto = _respond(tiny_node, items, "auto", instructions="be kind")
    disabled = _respond(tiny_node, items, "disabled", instructions="be kind")
    assert auto.status_code == disabled.status_code == 400, auto.text
    assert auto.json() == disabled.json()
    assert auto.json()["error"]["code"] == "context_length_exceeded"


def test_the_cut_keeps_the_leading_rules_and_tool_results_with_their_calls():
    """``fit_messages`` on a render that counts characters: the fewest drops a scan from
    the start finds, found by bisection; leading system/developer messages and tool
    messages are never where the kept part begins."""
    from engine.server.chat_truncation import cut_points, fit_messages

    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [
        {"role": "system", "content": "s" * 5},
        {"role": "developer", "content": "d" * 5},
        *[{"role": ("user", "assistant")[i % 2], "content": "x" * 10} for i in range(6)],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "t" * 10},
        {"role": "tool", "tool_call_id": "c", "content": "t" * 10},
        {"role": "user", "content": "u" * 10},
    ]
    assert cut_points(msgs) == [4, 6, 11]

    def render(ms: list[dict[str, Any]]) -> list[int]:
        return [0] * sum(len(m["content"]) + 2 for m in ms)

    full = len(render(msgs))
    for context in range(2, full + 5):
        got = fit_messages(msgs, render, context, 3)
        want = next(
            (i for i in cut_points(msgs) if len(render(msgs[:2] + msgs[i:])) + 3 <= context), None
        )
        if full + 3 <= context or want is None:
            assert (got.dropped, len(got.ids)) == (0, full), context
        else:
            kept = len(render(msgs[:2] + msgs[want:]))
            assert (got.dropped, len(got.ids)) == (want - 2, kept), context
    assert fit_messages(msgs, render, full + 1, None).dropped == 0  # one token of room
    assert fit_messages(msgs, render, full, None).dropped == 2  # back to a user turn


def test_a_cut_conversation_resumes_at_a_user_turn_when_it_has_one():
    """Templates that insist on user/assistant turns alternating after the system message
    (Mistral's, Llama 2's) refuse a conversation resuming at an assistant turn: a cut keeps
    a user turn first where the conversation has one to resume at, any other message but a
    tool result only where it has none."""
    from engine.server.chat_truncation import cut_points

    turns = [{"role": r, "content": "x"} for r in ("user", "assistant") * 3]
    assert cut_points([{"role": "system", "content": "s"}, *turns]) == [3, 5]
    assert cut_points(turns) == [2, 4]
    lone = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}] * 1
    assert cut_points([*lone, {"role": "assistant", "content": "z"}]) == [1, 2]


def test_the_response_repeats_the_cache_key_the_safety_identifier_and_max_tool_calls():
    """OpenAI's ``response`` object repeats them (null when the request left them out);
    the strings it repeats are bounded (``safety_identifier`` as OpenAI bounds it, 64
    characters; ``service_tier`` 64, ``user`` 512): they are in every event of a stream."""
    _, echo = to_chat(
        {"input": "x", "prompt_cache_key": "conv-1", "safety_identifier": "u-9",
         "max_tool_calls": 3}
    )  # fmt: skip
    fields = echo.fields()
    assert (fields["prompt_cache_key"], fields["safety_identifier"]) == ("conv-1", "u-9")
    assert fields["max_tool_calls"] == 3
    none = to_chat({"input": "x"})[1].fields()
    assert [none[k] for k in ("prompt_cache_key", "safety_identifier", "max_tool_calls")] == [
        None, None, None
    ]  # fmt: skip
    for name, most in (("safety_identifier", 64), ("service_tier", 64), ("user", 512)):
        to_chat({"input": "x", name: "s" * most})
        with pytest.raises(APIError) as e:
            to_chat({"input": "x", name: "s" * (most + 1)})
        assert e.value.param == name


def test_an_input_of_reasoning_items_alone_is_refused_saying_why():
    """Reasoning items are dropped; an input of nothing else says so (it said "'input'
    must not be empty" of a list that was not)."""
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": []}
    with pytest.raises(APIError) as e:
        to_chat({"input": [reasoning, reasoning], "instructions": "be brief"})
    assert e.value.param == "input" and "reasoning items are dropped" in str(e.value)
