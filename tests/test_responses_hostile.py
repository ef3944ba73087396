"""Hostile input on ``POST /v1/responses`` in process: what a request may put in the
fields a ``response`` object repeats back, and the shapes those fields take."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.responses_api.request import to_chat
from engine.responses_api.stream import ResponsesStream, response_object
from engine.server.request_fields import APIError

openai_types = pytest.importorskip("openai.types.responses")

JUNK = {"junk": list(range(5))}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
CHAT = {"id": "chatcmpl-a", "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}


def test_the_echo_repeats_only_the_keys_it_knows():
    """Keys a request adds to ``text``, ``tools``, ``tool_choice`` or ``reasoning`` change
    nothing and are not repeated: a 10 MB list there was deep-copied and serialized on
    the event loop for the body and three times for a stream (30 s of a stalled node)."""
    _, echo = to_chat(
        {
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA, **JUNK},
                     "verbosity": "low", **JUNK},
            "tools": [{"type": "function", "name": "f", "parameters": SCHEMA, **JUNK}],
            "tool_choice": {"type": "function", "name": "f", **JUNK},
            "reasoning": {"effort": "low", "summary": "auto", **JUNK},
        }
    )  # fmt: skip
    fields = echo.fields()
    assert "junk" not in json.dumps(fields)
    assert fields["text"] == {
        "format": {"type": "json_schema", "name": "s", "schema": SCHEMA},
        "verbosity": "low",
    }
    assert fields["tools"] == [{"type": "function", "name": "f", "parameters": SCHEMA}]
    assert fields["tool_choice"] == {"type": "function", "name": "f"}
    assert fields["reasoning"] == {"effort": "low", "summary": "auto"}
    body = response_object(echo, CHAT)
    openai_types.Response.model_validate(body)
    stream = ResponsesStream(echo)
    events = stream.feed({**CHAT, "choices": []}) + stream.finish()
    assert "junk" not in json.dumps(events)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"reasoning": {"summary": ["x"] * 3}}, "reasoning.summary"),
        ({"reasoning": {"summary": "everything"}}, "reasoning.summary"),
        ({"text": {"verbosity": {"x": 1}}}, "text.verbosity"),
        ({"text": {"verbosity": "loud"}}, "text.verbosity"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "function", "name": 5}}, "tool_choice.name"),
    ],
)  # fmt: skip
def test_echoed_fields_of_the_wrong_shape_are_400s(body: dict[str, Any], param: str):
    with pytest.raises(APIError) as e:
        to_chat({"input": "x", **body})
    assert e.value.status_code == 400 and e.value.param == param, e.value.message
    assert "function." not in e.value.message
