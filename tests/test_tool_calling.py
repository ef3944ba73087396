"""Tool calling (OpenAI ``tools`` / ``tool_choice`` on chat completions, vLLM's rules):
the fields parsed and checked at entry (each a 400 naming its field), the schema of a
"required" tool choice, the hermes parser and the named/required writers (whole and
token by token: the same calls), the chat template's tools and tool messages, and live
answers on the ``tiny`` model through a node and a P/D pair behind the proxy.

The ``tiny`` model's chat template is the built-in simple one: it renders the tools as a
``<|tools|>`` block, assistant tool calls as ``<tool_call>`` lines and tool messages as
``<|tool|>`` turns. Its random weights never write a ``<tool_call>`` by themselves:
"auto" is checked live on its plain answers and on hermes calls a regex (a structured
output, allowed with "auto") makes it write; the hermes parser also on hand-written text,
whole and in every chunking.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from engine.server.chat_protocol import parse_chat_request
from engine.server.request_fields import APIError
from engine.tools.output import NamedCall, RequiredCalls, ToolOutput, new_parser
from engine.tools.parsers import PARSERS, ToolDelta
from engine.tools.parsers.hermes import HermesToolParser
from engine.tools.spec import (
    MAX_TOOLS,
    MAX_TOOLS_BYTES,
    ToolCalling,
    parse_tool_calling,
    required_schema,
)

_MSG = [{"role": "user", "content": "what is the weather?"}]


def _tool(name: str, params: dict[str, Any] | None = None, **fn: Any) -> dict[str, Any]:
    f: dict[str, Any] = {"name": name, **fn}
    if params is not None:
        f["parameters"] = params
    return {"type": "function", "function": f}


def _obj(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}  # fmt: skip


WEATHER = _tool(
    "get_weather",
    _obj(city={"enum": ["paris", "rome", "oslo"]}, unit={"enum": ["c", "f"]}),
    description="The weather in a city",
)
CLOCK = _tool("get_time", _obj(tz={"enum": ["utc", "cet"]}, exact={"type": "boolean"}))
PING = _tool("ping")  # no parameters: an empty object
TOOLS = [WEATHER, CLOCK, PING]
NAMED_PING = {"type": "function", "function": {"name": "ping"}}
NAMES = {"get_weather", "get_time", "ping"}


def _chat(**fields: Any) -> Any:
    return parse_chat_request({"messages": _MSG, **fields})


def _err(**fields: Any) -> APIError:
    with pytest.raises(APIError) as e:
        _chat(**fields)
    return e.value


def _check_args(name: str, arguments: str) -> None:
    """``arguments`` is JSON matching tool ``name``'s schema (by hand)."""
    value = json.loads(arguments)
    assert isinstance(value, dict)
    if name == "get_weather":
        assert set(value) == {"city", "unit"}, value
        assert value["city"] in ("paris", "rome", "oslo") and value["unit"] in ("c", "f")
    elif name == "get_time":
        assert set(value) == {"tz", "exact"} and value["tz"] in ("utc", "cet"), value
        assert isinstance(value["exact"], bool)
    else:
        assert name == "ping", name


# -- parsing and validation --------------------------------------------------------------------


def test_tools_parse_into_one_frozen_tool_calling_with_vllms_defaults() -> None:
    req = _chat(tools=TOOLS)
    tc = req.tools
    assert isinstance(tc, ToolCalling) and tc.choice == "auto" and tc.parallel
    assert [t.name for t in tc.tools] == ["get_weather", "get_time", "ping"]
    assert tc.template_tools()[0] == WEATHER and tc.template_tools()[2] == PING
    assert req.structured_output is None  # auto: the text is parsed, not constrained
    with pytest.raises(AttributeError):
        tc.choice = "none"  # type: ignore[misc]
    assert _chat(tools=TOOLS, tool_choice="none").tools.choice == "none"
    assert _chat(tools=TOOLS, tool_choice="none").structured_output is None
    named = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.tools.choice == "named" and named.tools.name == "get_time"
    so = named.structured_output
    assert so.kind == "json" and json.loads(so.spec) == CLOCK["function"]["parameters"]
    assert so.param == "tools[1].function.parameters"
    ping = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}})
    assert json.loads(ping.structured_output.spec) == {
        "type": "object", "properties": {}, "additionalProperties": False}  # fmt: skip
    req = _chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert req.tools.choice == "required" and not req.tools.parallel
    assert json.loads(req.structured_output.spec) == required_schema(req.tools.tools, False)
    assert req.ignored_fields == ()


def test_neutral_values_ask_for_nothing() -> None:
    for fields in (
        {},
        {"tools": None},
        {"tools": []},
        {"tool_choice": "none"},
        {"tools": [], "tool_choice": "none"},
        {"tools": [], "tool_choice": "required"},  # vLLM (OpenAI): "none"
        {"functions": [], "function_call": "none"},
        {"parallel_tool_calls": False},
    ):
        req = _chat(**fields)
        assert req.tools is None and req.structured_output is None, fields


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": ["f"]}, "tools[0]"),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [_tool("")]}, "tools[0].function.name"),
        ({"tools": [_tool("a b")]}, "tools[0].function.name"),
        ({"tools": [_tool("x" * 65)]}, "tools[0].function.name"),
        ({"tools": [WEATHER, _tool("f", description=3)]}, "tools[1].function.description"),
        ({"tools": [_tool("f", [1])]}, "tools[0].function.parameters"),
        ({"tools": [_tool("f", {"type": "string"})]}, "tools[0].function.parameters"),
        ({"tools": [_tool("f", strict="yes")]}, "tools[0].function.strict"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [_tool(f"f{i}") for i in range(MAX_TOOLS + 1)]}, "tools"),
        ({"tools": [_tool("f", description="x" * MAX_TOOLS_BYTES)]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": 3}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ""}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),  # without tools (vLLM's rule)
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        # One constraint per request: a named or required tool choice is one.
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "ping"}},
          "guided_regex": "a+"}, "tool_choice"),
        # The legacy spellings: vLLM has neither.
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"function_call": {"name": "f"}}, "function_call"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_400s_naming_the_field(fields: dict[str, Any], param: str) -> None:
    e = _err(**fields)
    assert e.status_code == 400 and e.param == param, (e.param, e.message)
    assert param.split("[")[0] in e.message
    if param in ("functions", "function_call"):
        assert "tool" in e.message  # it says what to use instead


def test_auto_tool_choice_with_a_structured_output_is_allowed() -> None:
    req = _chat(tools=TOOLS, response_format={"type": "json_object"})
    assert req.tools.choice == "auto" and req.structured_output.kind == "json_object"


def test_tool_messages_and_assistant_tool_calls_are_the_conversation() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "rome", "unit": "c"}'}}  # fmt: skip
    msgs = [
        *_MSG,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    req = parse_chat_request({"messages": msgs, "tools": TOOLS})
    assert req.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather",
                                     "arguments": {"city": "rome", "unit": "c"}}}],
    }  # fmt: skip
    assert req.messages[2] == {"role": "tool", "content": "21 degrees", "tool_call_id": "call_1"}
    for bad, param in [
        ([{"role": "user", "content": "x", "tool_calls": [call]}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": "x"}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": 1}}]}],
         "messages[0].tool_calls[0].function.name"),
        ([{"role": "tool", "content": "x", "tool_call_id": 5}], "messages[0].tool_call_id"),
        ([{"role": "tool"}], "messages[0].content"),
        ([{"role": "assistant", "function_call": {"name": "f"}}], "messages[0].function_call"),
    ]:  # fmt: skip
        with pytest.raises(APIError) as e:
            parse_chat_request({"messages": bad})
        assert e.value.param == param, (e.value.param, e.value.message)


# -- the "required" schema -----------------------------------------------------------------------


def test_required_schema_is_vllms_array_of_named_calls() -> None:
    tc = parse_tool_calling({"tools": TOOLS, "tool_choice": "required"})
    schema = required_schema(tc.tools)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    items = schema["items"]["anyOf"]
    assert [i["properties"]["name"] for i in items] == [
        {"type": "string", "enum": [n]} for n in ("get_weather", "get_time", "ping")
    ]
    assert items[0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert items[2]["properties"]["parameters"] == {
        "type": "object", "properties": {}, "additionalProperties": False}  # fmt: skip
    assert all(i["required"] == ["name", "parameters"] for i in items)
    assert required_schema(tc.tools, parallel=False)["maxItems"] == 1
    # Each tool's schema stays whole where the array nests it, its $refs re-pointed there
    # (a tool's own $defs too: two tools may define one name differently).
    ref = _obj(p={"$ref": "#/$defs/P"}) | {"$defs": {"P": {"enum": [1, 2]}}}
    other = _obj(p={"$ref": "#/$defs/P"}) | {"$defs": {"P": {"enum": [3]}}}
    tc = parse_tool_calling({"tools": [_tool("a", ref), _tool("b", other)]})
    schema = required_schema(tc.tools)
    assert "$defs" not in schema
    params = [i["properties"]["parameters"] for i in schema["items"]["anyOf"]]
    assert [p["properties"]["p"]["$ref"] for p in params] == [
        f"#/items/anyOf/{i}/properties/parameters/$defs/P" for i in (0, 1)
    ]
    assert [p["$defs"] for p in params] == [ref["$defs"], other["$defs"]]


def test_required_keeps_each_tools_schema_whole_refs_and_all() -> None:
    """A tool's schema means under "required" what it means alone (a named choice): its
    local ``$ref``s -- ``#`` (a recursive schema), ``#/definitions/...``, ``#/properties/...``
    -- point into that tool's schema where the array nests it, and two tools may each
    define ``$defs`` of one name. (They pointed at the array's root: a tree's children
    became arrays of calls, the others were 400s.)"""
    pytest.importorskip("llguidance")
    from engine.structured.compiler import GrammarCompiler
    from engine.tokenizer import ByteTokenizer

    tree = _obj(v={"type": "integer"}, kids={"type": "array", "items": {"$ref": "#"}})
    tree["required"] = ["v"]
    old = {"type": "object", "definitions": {"U": {"enum": ["c", "f"]}},
           "properties": {"u": {"$ref": "#/definitions/U"}}, "required": ["u"],
           "additionalProperties": False}  # fmt: skip
    same = _obj(a={"type": "string"}, b={"$ref": "#/properties/a"})
    d1 = _obj(p={"$ref": "#/$defs/P"}) | {"$defs": {"P": {"enum": [1]}}}
    d2 = _obj(p={"$ref": "#/$defs/P"}) | {"$defs": {"P": {"enum": [2]}}}
    tools = [_tool("tree", tree), _tool("old", old), _tool("same", same), _tool("d1", d1),
             _tool("d2", d2)]  # fmt: skip
    compiler = GrammarCompiler(ByteTokenizer, 512)

    def accepts(choice: Any, text: str) -> bool:
        tc = parse_tool_calling({"tools": tools, "tool_choice": choice})
        so = tc.structured_output()
        assert so is not None
        m = compiler.new_matcher(so)
        return bool(m.consume_tokens(list(text.encode()))) and m.is_accepting()

    for name, good, bad in [
        ("tree", '{"v":1,"kids":[{"v":2,"kids":[]}]}',
         '{"v":1,"kids":[[{"name":"tree","parameters":{"v":2}}]]}'),
        ("old", '{"u":"c"}', '{"u":"x"}'),
        ("same", '{"a":"x","b":"y"}', '{"a":"x","b":1}'),
        ("d1", '{"p":1}', '{"p":2}'),
        ("d2", '{"p":2}', '{"p":1}'),
    ]:  # fmt: skip
        named = {"type": "function", "function": {"name": name}}
        assert accepts(named, good) and not accepts(named, bad), name
        call = '[{"name":"%s","parameters":%s}]'
        assert accepts("required", call % (name, good)), name
        assert not accepts("required", call % (name, bad)), name
    # The tools as the template gets them are the client's, untouched.
    tc = parse_tool_calling({"tools": tools, "tool_choice": "required"})
    assert tc.template_tools() == tools


def _walk(matcher: Any, rng: random.Random, limit: int = 600) -> bytes:
    """A random text the grammar allows: each step one of the bytes it allows (EOS once
    it may end, half the time)."""
    out = bytearray()
    for _ in range(limit):
        if matcher.is_stopped():
            return bytes(out)
        mask = matcher.compute_bitmask()
        allowed = [t for t in range(258) if mask[t // 8] >> (t % 8) & 1]
        if 257 in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return bytes(out)
        token = rng.choice([t for t in allowed if t < 256])
        assert matcher.consume_token(token)
        out.append(token)
    raise AssertionError(f"no end after {limit} bytes: {bytes(out)[:200]!r}")


@pytest.mark.parametrize("parallel", [True, False])
def test_every_array_the_required_grammar_allows_names_a_tool_and_fits_its_schema(
    parallel: bool,
) -> None:
    """Random walks through the compiled grammar (any byte it allows, each step): every
    text is a JSON array of calls naming the request's tools, each with arguments its
    tool's schema allows, and the writer parses it into the same calls."""
    pytest.importorskip("llguidance")
    from engine.structured.compiler import GrammarCompiler
    from engine.tokenizer import ByteTokenizer

    tc = parse_tool_calling({"tools": TOOLS, "tool_choice": "required",
                             "parallel_tool_calls": parallel})  # fmt: skip
    so = tc.structured_output()
    assert so is not None and so.param == "tools"
    compiler = GrammarCompiler(ByteTokenizer, 512)
    rng = random.Random(7)
    seen: set[str] = set()
    for _ in range(40):
        text = _walk(compiler.new_matcher(so), rng).decode()
        calls = json.loads(text)
        assert isinstance(calls, list) and len(calls) >= 1
        assert parallel or len(calls) == 1
        for call in calls:
            assert set(call) == {"name", "parameters"} and call["name"] in NAMES
            _check_args(call["name"], json.dumps(call["parameters"]))
            seen.add(call["name"])
        got = ToolOutput(tc, RequiredCalls()).message(text)["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == [
            (c["name"], c["parameters"]) for c in calls
        ]
    assert seen == NAMES
    # And what it refuses: an unknown name, arguments outside the schema, an empty array.
    for bad in (
        '[{"name":"nope","parameters":{}}]',
        '[{"name":"ping","parameters":{"x":1}}]',
        '[{"name":"get_time","parameters":{"tz":"pst","exact":true}}]',
        "[]",
    ):
        m = compiler.new_matcher(so)
        ok = m.consume_tokens(list(bad.encode())) and m.is_accepting()
        assert not ok, bad


# -- the parsers: whole and token by token ------------------------------------------------------


def _calls(pieces: list[ToolDelta]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) of the calls the pieces add up to."""
    content, calls = "", []
    for p in pieces:
        if p.call is None:
            content += p.content
        elif p.id is not None:
            assert p.id.startswith("chatcmpl-tool-") and len(p.id) == 14 + 32
            assert p.call == len(calls)
            calls.append([p.name, p.arguments])
        else:
            assert p.call == len(calls) - 1
            calls[-1][1] += p.arguments
    return content, [(n, a) for n, a in calls]


def _fed(parser: Any, text: str, size: int = 1) -> list[ToolDelta]:
    out: list[ToolDelta] = []
    for i in range(0, len(text), size):
        out += parser.feed(text[i : i + size])
    return out + parser.finish()


CALL_W = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "rome", "unit": "c"}}</tool_call>'
)
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "utc"}}\n</tool_call>'
# The arguments are the model's text as written (not re-serialised).
W = ("get_weather", '{"city": "rome", "unit": "c"}')
T = ("get_time", '{"tz": "utc"}')


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text, no tools.", "Just text, no tools.", []),
        ("ends with space \n", "ends with space \n", []),
        (CALL_W, "", [W]),
        (CALL_W + "\n" + CALL_T + "\n", "", [W, T]),
        ("Let me check.\n" + CALL_W, "Let me check.", [W]),
        ("a " + CALL_W + " b " + CALL_T + " c", "a b c", [W, T]),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ("x <tool_call>[1]</tool_call>", "x <tool_call>[1]</tool_call>", []),
        ('<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),
        ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
         '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', []),
        ("bad <tool_call>{</tool_call> " + CALL_W, "bad <tool_call>{</tool_call>", [W]),
        ('<tool_call>{"name": "ping"}</tool_call>', "", [("ping", "{}")]),
        ('<tool_call>{"name": "get_time", "arguments": {"tz": "utc"}}', "", [T]),  # unclosed
        ("<tool_call>{\"name\": \"get_ti", '<tool_call>{"name": "get_ti', []),
        ("text <tool_c", "text <tool_c", []),
        ("a < b <tool", "a < b <tool", []),
        ('<tool_call>{"name": "f", "arguments": {"s": "é</tool"}}</tool_call>', "",
         [("f", '{"s": "é</tool"}')]),
    ],
)  # fmt: skip
def test_hermes_parses_content_and_calls_whole_and_token_by_token(
    text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    assert _calls(HermesToolParser().parse(text)) == (content, calls)
    for size in (1, 2, 5, 13):
        assert _calls(_fed(HermesToolParser(), text, size)) == (content, calls), size


def test_hermes_without_parallel_calls_keeps_the_first() -> None:
    text = CALL_W + "\n" + CALL_T
    assert _calls(HermesToolParser(parallel=False).parse(text)) == ("", [W])
    assert PARSERS["hermes"] is HermesToolParser


def test_named_and_required_writers_stream_what_they_answer_whole() -> None:
    args = '{"city":"oslo","unit":"f"}'
    assert _calls(NamedCall("get_weather").parse(args)) == ("", [("get_weather", args)])
    assert _calls(_fed(NamedCall("get_weather"), args, 3)) == ("", [("get_weather", args)])
    assert _calls(NamedCall("ping").parse("")) == ("", [("ping", "")])  # one call regardless
    arr = ('[{"name":"get_weather","parameters":' + args + '},'
           '{"name":"get_time","parameters":{"tz":"cet","exact":false}},'
           '{"name":"ping","parameters":{"s":"}]\\"{"}}]')  # fmt: skip
    want = ("", [("get_weather", args), ("get_time", '{"tz":"cet","exact":false}'),
                 ("ping", '{"s":"}]\\"{"}')])  # fmt: skip
    assert _calls(RequiredCalls().parse(arr)) == want
    for size in (1, 4, 9):
        assert _calls(_fed(RequiredCalls(), arr, size)) == want
    # The arguments stream as generated: the call's name first, then its arguments.
    parser = RequiredCalls()
    assert parser.feed('[{"name":"get_time","param') == []
    first = parser.feed('eters":{"tz"')
    assert [(p.name, p.arguments) for p in first] == [("get_time", '{"tz"')]
    assert [(p.name, p.arguments) for p in parser.feed(':"u')] == [(None, ':"u')]
    # Not written head first (never by the grammar): parsed when the element closes.
    assert _calls(RequiredCalls().parse('[{"parameters":{"a":1},"name":"f"}]')) == (
        "", [("f", '{"a":1}')])  # fmt: skip
    # Cut off (max_tokens): what was generated of the arguments.
    assert _calls(RequiredCalls().parse('[{"name":"get_time","parameters":{"tz":"u')) == (
        "", [("get_time", '{"tz":"u')])  # fmt: skip


def test_tool_output_builds_the_stream_and_the_body_from_the_same_pieces() -> None:
    tc = parse_tool_calling({"tools": TOOLS})
    text = "Checking.\n" + CALL_W + "\n" + CALL_T
    body = ToolOutput(tc, HermesToolParser()).message(text)
    assert body["role"] == "assistant" and body["content"] == "Checking."
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"])
            for c in body["tool_calls"]] == [("function", *W), ("function", *T)]  # fmt: skip
    out = ToolOutput(tc, HermesToolParser())
    deltas = [out.delta(text[i : i + 3], i + 3 >= len(text)) for i in range(0, len(text), 3)]
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["type"] == "function" and c["index"] not in calls
                calls[c["index"]] = [c["function"]["name"], ""]
            calls[c["index"]][1] += c["function"]["arguments"]
    assert content == "Checking." and [tuple(v) for v in calls.values()] == [W, T]
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "tool_calls"
    plain = ToolOutput(tc, HermesToolParser())
    assert plain.message("hello") == {"role": "assistant", "content": "hello", "tool_calls": []}
    assert plain.finish_reason("stop") == "stop"
    # Named: vLLM's finish reason is the engine's; required: "tool_calls" when it stopped.
    named = parse_tool_calling({"tools": TOOLS, "tool_choice": NAMED_PING})
    out = ToolOutput(named, new_parser(named, None))
    assert out.message("{}")["content"] is None and out.finish_reason("stop") == "stop"
    req = parse_tool_calling({"tools": TOOLS, "tool_choice": "required"})
    out = ToolOutput(req, new_parser(req, None))
    assert len(out.message('[{"name":"ping","parameters":{}}]')["tool_calls"]) == 1
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"


# -- hermes streaming: the name once its head is read, then the arguments as generated ----------

SAMPLE = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", "unit": "c"}}\n'
    "</tool_call>\n"
    '<tool_call>{"name":"get_time","arguments":{"tz":"utc","s":"a}<b\\"{"}}</tool_call>'
)
SAMPLE_CALLS = [
    ("get_weather", '{"city": "rome", "unit": "c"}'),
    ("get_time", '{"tz":"utc","s":"a}<b\\"{"}'),
]


def _ordered(pieces: list[ToolDelta]) -> None:
    """Each call's first piece (index, id, name) comes before any of its arguments, calls
    are numbered 0, 1, ... in order, and no content comes between a call's pieces."""
    seen = -1
    for p in pieces:
        if p.call is None:
            continue
        if p.id is not None:
            assert p.call == seen + 1 and p.name and p.arguments == ""
            seen = p.call
        else:
            assert p.call == seen and p.name is None


def test_hermes_streams_a_calls_name_then_its_arguments_as_generated() -> None:
    parser = HermesToolParser()
    when: list[tuple[int, ToolDelta]] = []  # (how much text was fed, piece)
    for i, c in enumerate(SAMPLE):
        when += [(i + 1, p) for p in parser.feed(c)]
    when += [(len(SAMPLE), p) for p in parser.finish()]
    pieces = [p for _, p in when]
    _ordered(pieces)
    assert _calls(pieces) == ("Let me check.", SAMPLE_CALLS)
    assert _calls(HermesToolParser().parse(SAMPLE)) == ("Let me check.", SAMPLE_CALLS)
    for index, (name, args) in enumerate(SAMPLE_CALLS):
        head = SAMPLE.index('{"name":' if index else '{"name": ')
        opens = SAMPLE.index(args, head)  # the arguments' "{"
        got = [(n, p) for n, p in when if p.call == index]
        # The name goes out with the arguments' "{" (the head is whole): before any of
        # them, long before the tag closes.
        assert got[0] == (opens + 1, got[0][1]) and got[0][1].name == name
        # Then each character as it comes (a "<" waits for the next one: "</tool_call>"?).
        for n, p in got[1:]:
            assert SAMPLE[n - len(p.arguments) : n] == p.arguments or p.arguments[-1] == "<"
        assert "".join(p.arguments for _, p in got) == args
        assert got[-1][0] == opens + len(args)


def test_hermes_streams_the_same_pieces_whatever_the_chunks() -> None:
    whole = _calls(HermesToolParser().parse(SAMPLE))
    for cut in range(len(SAMPLE) + 1):  # two chunks, cut at every position
        parser = HermesToolParser()
        pieces = [*parser.feed(SAMPLE[:cut]), *parser.feed(SAMPLE[cut:]), *parser.finish()]
        _ordered(pieces)
        assert _calls(pieces) == whole, cut
    for size in range(1, len(SAMPLE) + 1):
        pieces = _fed(HermesToolParser(), SAMPLE, size)
        _ordered(pieces)
        assert _calls(pieces) == whole, size


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "f" oops}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments" {"a": 1}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": </tool_call>{"a": 1}}',
        '<tool_call>{"name": "f", "arguments":',  # cut before its arguments
        '<tool_call>{"name": "f</tool_call>", "arguments": {}}',
    ],
)
def test_hermes_never_streams_a_name_for_what_is_no_call(text: str) -> None:
    """Until the head is whole (``{"name": "...", "arguments": {``) nothing of a call is
    sent: what turns out to be no call is content, tags and all, at every chunking."""
    assert _calls(HermesToolParser().parse(text))[1] == []
    for size in range(1, len(text) + 1):
        pieces = _fed(HermesToolParser(), text, size)
        assert all(p.call is None for p in pieces), size
        assert "".join(p.content for p in pieces).startswith("<tool_call>")


@pytest.mark.parametrize(
    "text, calls, cut",
    [
        # The head was whole: a call, its arguments what the model wrote up to the tag.
        ('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>', [("f", '{"a": 1')],
         False),
        # Cut off (max_tokens): the arguments generated so far (a "<" held back included).
        ('<tool_call>{"name": "f", "arguments": {"a": "x<', [("f", '{"a": "x<')], True),
        # What follows the arguments' object in the tag is not looked at.
        ('<tool_call>{"name": "f", "arguments": {"a": 1}, junk</tool_call>', [("f", '{"a": 1}')],
         False),
        ('<tool_call>{"name": "f", "arguments": {}} ', [("f", "{}")], False),
        # Not head first: parsed whole when the tag closes, arguments the text as written.
        ('<tool_call>{"arguments": {"a": [1, 2]}, "name": "f"}</tool_call>',
         [("f", '{"a": [1, 2]}')], False),
        ('<tool_call>{"name": "f", "args": {"a": 1}}</tool_call>', [("f", "{}")], False),
        ('<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}}</tool_call>',
         [("f", '{"a": 1}')], False),
        ('<tool_call>{"name": "f\\u0031", "arguments": {"a": "\\u00e9"}}</tool_call>',
         [("f1", '{"a": "\\u00e9"}')], False),
        ('<tool_call> { "name" : "f" , "arguments" : {"a" : 1 } } </tool_call>',
         [("f", '{"a" : 1 }')], False),
    ],
)  # fmt: skip
def test_hermes_calls_whose_head_was_read(text: str, calls: list[Any], cut: bool) -> None:
    for size in range(1, len(text) + 1):
        parser = HermesToolParser()
        pieces = _fed(parser, text, size)
        _ordered(pieces)
        assert _calls(pieces) == ("", calls), size
        assert parser.cut == cut
    assert _calls(HermesToolParser().parse(text)) == ("", calls)


def test_hermes_stream_deltas_add_up_as_an_openai_client_adds_them() -> None:
    """The stream's ``delta.tool_calls`` merged by ``index`` as the ``openai`` package's
    stream helpers do: the first delta of a call has its id, type and name (and the
    arguments that came with it), later ones only arguments; the result is the body's."""
    tc = parse_tool_calling({"tools": TOOLS})
    body = ToolOutput(tc, HermesToolParser()).message(SAMPLE)
    out = ToolOutput(tc, HermesToolParser())
    acc: list[dict[str, Any]] = []
    content = ""
    args_deltas = 0
    for i in range(0, len(SAMPLE), 4):
        d = out.delta(SAMPLE[i : i + 4], i + 4 >= len(SAMPLE))
        content += d.get("content", "")
        indices = [c["index"] for c in d.get("tool_calls", [])]
        assert len(indices) == len(set(indices))  # one entry per call and chunk
        for c in d.get("tool_calls", []):
            if c["index"] == len(acc):
                assert set(c) == {"index", "id", "type", "function"}
                assert c["type"] == "function" and set(c["function"]) == {"name", "arguments"}
                acc.append({"id": c["id"], "type": "function", "function": dict(c["function"])})
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                acc[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
                args_deltas += 1
    assert content == (body["content"] or "") == "Let me check."
    assert [c["function"] for c in acc] == [c["function"] for c in body["tool_calls"]]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in acc] == SAMPLE_CALLS
    assert args_deltas > 10  # streamed, not sent whole
    assert out.finish_reason("stop") == "tool_calls"
    # An answer cut (max_tokens, a stop string, EOS) inside a call's arguments says so.
    cut = ToolOutput(tc, HermesToolParser())
    cut.message('<tool_call>{"name": "f", "arguments": {"a": ')
    assert cut.finish_reason("length") == "length" and cut.finish_reason("stop") == "stop"
    done = ToolOutput(tc, HermesToolParser())
    done.message(SAMPLE + " and more text, cut")
    assert done.finish_reason("length") == "tool_calls"


# -- the chat template: tools, tool calls, tool messages ------------------------------------------

# The tool parts of Qwen2.5's chat template (which renders tools; trimmed to them).
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "rome", "unit": "c"}'}}  # fmt: skip
HISTORY = [
    *_MSG,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    tok = Tokenizer(models.WordLevel({**vocab, "<unk>": len(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    path = tmp_path_factory.mktemp("qwen_tok")
    tok.save(str(path / "tokenizer.json"))
    cfg = {"eos_token": "<unk>", "chat_template": QWEN_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def _render(tok: Any, body: dict[str, Any]) -> str:
    from engine.server.tokenize import render_chat

    req = parse_chat_request(body)
    tools = req.tools.template_tools() if req.tools is not None else None
    return render_chat(tok, req.messages, req.chat_template_kwargs, True, False, tools)


def test_a_jinja_template_gets_the_tools_and_the_tool_conversation(qwen_dir: Any) -> None:
    from engine.tokenizer import HFTokenizer

    tok = HFTokenizer(str(qwen_dir))
    text = _render(tok, {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none"})
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n" in text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", "unit": "c"}}'
            "\n</tool_call>") in text  # fmt: skip
    assert "<tool_response>\n21 degrees\n</tool_response>" in text
    assert "<tools>" not in _render(tok, {"messages": HISTORY})
    # The request's tools win over a chat_template_kwargs "tools".
    both = {"messages": _MSG, "tools": [PING], "chat_template_kwargs": {"tools": [CLOCK]}}
    assert "get_time" not in _render(tok, both) and '"ping"' in _render(tok, both)


def test_the_tiny_models_template_renders_tools_calls_and_tool_turns() -> None:
    from engine.tokenizer import ByteTokenizer

    text = _render(ByteTokenizer(), {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none"})
    assert text.startswith("<|tools|>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n")
    assert ('<|assistant|>\n\n<tool_call>{"name": "get_weather", "arguments": '
            '{"city": "rome", "unit": "c"}}</tool_call>\n') in text  # fmt: skip
    assert text.endswith("<|tool|>\n21 degrees\n<|assistant|>\n")
    assert (
        _render(ByteTokenizer(), {"messages": _MSG})
        == "<|user|>\nwhat is the weather?\n<|assistant|>\n"
    )


def _app(tool_call_parser: str | None = None) -> Any:
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from engine.server.app import build_app
    from engine.tokenizer import ByteTokenizer

    engine = SimpleNamespace(model_name="m", max_model_len=4096, vocab_size=512,
                             tokenizer=ByteTokenizer(), dead_reason=None, healthy=True,
                             stats=lambda: {}, kv_info=lambda: {})  # fmt: skip
    kw = {"tool_call_parser": tool_call_parser} if tool_call_parser else {}
    return TestClient(build_app(engine, **kw))  # type: ignore[arg-type]


def test_auto_tool_choice_needs_the_node_flags() -> None:
    client = _app()
    for body in ({"messages": _MSG, "tools": TOOLS},
                 {"messages": _MSG, "tools": TOOLS, "tool_choice": "auto"}):  # fmt: skip
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "tool_choice"
        assert (
            "--enable-auto-tool-choice" in err["message"] and "--tool-call-parser" in err["message"]
        )
    resp = client.post("/v1/chat/completions", json={"messages": _MSG, "tool_choice": "auto"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"


def test_tokenize_renders_the_tools_as_chat_does() -> None:
    """The tools and a tool conversation add tokens to the prompt."""
    client = _app()
    counts = [
        client.post("/tokenize", json=body).json()["count"]
        for body in ({"messages": _MSG}, {"messages": _MSG, "tools": TOOLS},
                     {"messages": HISTORY, "tools": TOOLS})
    ]  # fmt: skip
    assert counts[0] < counts[1] < counts[2]
    resp = client.post("/tokenize", json={"messages": _MSG, "tools": [{"type": "function"}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools[0].function"


def test_the_node_flags() -> None:
    import argparse

    from engine.server.cli_args import add_server_args, auto_tool_parser, parse_config

    def parse(*argv: str) -> Any:
        parser = add_server_args(argparse.ArgumentParser())
        return parse_config(parser, list(argv))[0]

    assert auto_tool_parser(parse()) is None
    assert auto_tool_parser(parse("--tool-call-parser", "hermes")) is None  # vLLM: not enabled
    args = parse("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert auto_tool_parser(args) == "hermes"
    with pytest.raises(SystemExit):
        parse("--enable-auto-tool-choice")
    with pytest.raises(SystemExit):
        parse("--enable-auto-tool-choice", "--tool-call-parser", "nope")


# -- live: the tiny model through a node and a P/D pair behind the proxy --------------------------

TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def pd(module_procs: Any) -> tuple[Any, Any]:
    """A P/D pair behind a proxy, and a colocated node: all with auto tool choice."""
    pair = module_procs.pd(1, 1, "--num-blocks", "256", *TOOL_FLAGS, colocated=True)
    return pair, module_procs.proxy([pair.p.url], [pair.d.url])


def _post(url: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    import httpx
    from harness import MODEL

    resp = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=120)
    assert resp.status_code == status, resp.text
    return resp.json()


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Each choice's answer put together from the stream: content, calls, ids, finish."""
    from harness import chat_stream_choices

    out: dict[int, dict[str, Any]] = {}
    for index, chunks in chat_stream_choices(url, body).items():
        for c in chunks:
            one = out.setdefault(index, {"content": "", "calls": {}, "ids": [], "finish": None})
            delta = c["delta"]
            one["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                if "id" in call:
                    assert call["index"] not in one["calls"] and call["type"] == "function"
                    assert call["id"].startswith("chatcmpl-tool-")
                    one["calls"][call["index"]] = [call["function"]["name"], ""]
                one["calls"][call["index"]][1] += call["function"]["arguments"]
            one["ids"] += c.get("token_ids") or []
            one["finish"] = c["finish_reason"] or one["finish"]
    return [
        {**v, "calls": [tuple(x) for _, x in sorted(v["calls"].items())]}
        for _, v in sorted(out.items())
    ]


def _summary(choice: dict[str, Any]) -> dict[str, Any]:
    """A body's choice in ``_stream``'s terms (the calls' ids are random)."""
    msg = choice["message"]
    calls = msg.get("tool_calls") or []
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("chatcmpl-tool-")
        assert len(c["id"]) == len("chatcmpl-tool-") + 32
    return {
        "content": msg["content"] or "",
        "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
        "ids": choice["token_ids"],
        "finish": choice["finish_reason"],
    }


def _target(pd: tuple[Any, Any], through: str) -> tuple[str, str]:
    pair, proxy = pd
    ref = pair.colocated.url
    return ref, ref if through == "node" else proxy.url


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_named_tool_choice_is_one_call_of_that_tool(pd: tuple[Any, Any], through: str) -> None:
    ref, url = _target(pd, through)
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}):
        body = {"messages": _MSG, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 100,
                **sampling}  # fmt: skip
        got = _post(url, body)["choices"][0]
        assert got["message"]["content"] is None and got["finish_reason"] == "stop"
        one = _summary(got)
        assert [name for name, _ in one["calls"]] == ["get_weather"]
        _check_args("get_weather", one["calls"][0][1])
        assert one == _summary(_post(ref, body)["choices"][0])  # P/D: token for token
        assert _stream(url, body) == [one]


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_required_tool_choice_calls_known_tools(pd: tuple[Any, Any], through: str) -> None:
    ref, url = _target(pd, through)
    for extra in ({"parallel_tool_calls": False, "temperature": 0.0},
                  {"parallel_tool_calls": False, "temperature": 1.0, "seed": 5},
                  {"temperature": 1.0, "seed": 8, "n": 2}):  # fmt: skip
        body = {"messages": _MSG, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300,
                **extra}  # fmt: skip
        got = _post(url, body)["choices"]
        assert len(got) == extra.get("n", 1)
        for choice in got:
            one = _summary(choice)
            assert one["content"] == "" and one["calls"]
            assert choice["finish_reason"] in ("tool_calls", "length")
            if "parallel_tool_calls" in extra:
                assert len(one["calls"]) == 1 and choice["finish_reason"] == "tool_calls"
            complete = (
                one["calls"] if choice["finish_reason"] == "tool_calls" else one["calls"][:-1]
            )
            for name, args in complete:
                assert name in NAMES
                _check_args(name, args)
        summaries = [_summary(c) for c in got]
        assert summaries == [_summary(c) for c in _post(ref, body)["choices"]]
        assert _stream(url, body) == summaries


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_auto_and_none_answer_content(pd: tuple[Any, Any], through: str) -> None:
    """The random model writes no <tool_call>: "auto" (hermes) and "none" are content."""
    ref, url = _target(pd, through)
    for choice in ("auto", "none"):
        body = {"messages": _MSG, "tools": TOOLS, "tool_choice": choice, "max_tokens": 12,
                "temperature": 1.0, "seed": 2}  # fmt: skip
        got = _post(url, body)["choices"][0]
        assert got["finish_reason"] == "length" and got["message"]["content"]
        if choice == "auto":
            assert got["message"]["tool_calls"] == []
            one = _summary(got)
            assert one == _summary(_post(ref, body)["choices"][0])
            assert _stream(url, body) == [one]
        else:
            assert "tool_calls" not in got["message"]
            assert got["token_ids"] == _post(ref, body)["choices"][0]["token_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_continuous_usage_counts_the_tokens_streamed_so_far(
    pd: tuple[Any, Any], through: str
) -> None:
    """A parsed answer's stream (D's whole, through the proxy) with
    ``continuous_usage_stats``: the role chunk says 0 completion tokens (vLLM's; it said
    the first output's), each later chunk its choice's tokens so far."""
    import httpx
    from harness import MODEL, sse_events

    _, url = _target(pd, through)
    body = {"model": MODEL, "messages": _MSG, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 8, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        events = sse_events(resp)
    assert events[-1] == "DONE"
    seen = {0: 0, 1: 0}
    for e in events[:-2]:
        (choice,) = e["choices"]
        seen[choice["index"]] += len(choice["token_ids"])
        assert e["usage"]["completion_tokens"] == seen[choice["index"]], e
    assert seen == {0: 8, 1: 8} and events[-2]["usage"]["completion_tokens"] == 16


# "auto" with a regex that makes the random model write hermes calls (a structured output
# is allowed with "auto"): the parser sees them as it would a real model's.
HERMES_REGEX = (
    r"Checking\.\n<tool_call>\n\{\"name\": \"get_weather\", \"arguments\": "
    r"\{\"city\": \"(paris|rome|oslo)\", \"unit\": \"(c|f)\"\}\}\n</tool_call>\n"
    r"<tool_call>\n\{\"name\": \"get_time\", \"arguments\": \{\"tz\": \"(utc|cet)\", \"exact\": (true|false)\}\}\n"
    r"</tool_call>"
)


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_auto_hermes_calls_stream_their_arguments(pd: tuple[Any, Any], through: str) -> None:
    """A hermes answer streamed: each call's name first (index, id, type, name), then its
    arguments piece by piece as the tokens come; they add up to the body's calls."""
    from harness import chat_stream_choices

    ref, url = _target(pd, through)
    body = {"messages": _MSG, "tools": TOOLS, "max_tokens": 200, "temperature": 1.0, "seed": 4,
            "structured_outputs": {"regex": HERMES_REGEX}}  # fmt: skip
    got = _post(url, body)["choices"][0]
    one = _summary(got)
    assert one["content"] == "Checking." and got["finish_reason"] == "tool_calls"
    assert [name for name, _ in one["calls"]] == ["get_weather", "get_time"]
    for name, args in one["calls"]:
        _check_args(name, args)
    assert one["calls"][1][1].startswith('{"tz": "')  # as written, not re-serialised
    assert one == _summary(_post(ref, body)["choices"][0])
    assert _stream(url, body) == [one]
    pieces = []  # (index, has its name) of each call delta, in order
    for c in chat_stream_choices(url, body)[0]:
        for call in c["delta"].get("tool_calls") or []:
            pieces.append((call["index"], "name" in call["function"]))
            if "name" not in call["function"]:
                assert set(call) == {"index", "function"} and call["function"]["arguments"]
    firsts = [i for i, named in pieces if named]
    assert firsts == [0, 1] and pieces[0] == (0, True)
    assert pieces.index((1, True)) > 2 and len(pieces) - pieces.index((1, True)) > 2
    assert pieces == sorted(pieces, key=lambda p: p[0])


NOTE = _tool("note", _obj(text={"type": "string"}))


def _note_turn(system: str, letter: str) -> dict[str, Any]:
    """A first turn whose answer is one ``note`` call (a regex makes the model write it,
    as the built-in template renders a call: the next turn's prompt repeats its tokens)."""
    regex = r"\n<tool_call>\{\"name\": \"note\", \"arguments\": \{\"text\": \"" + letter * 400
    regex += r"\"\}\}</tool_call>"
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "note it down"}]
    return {"messages": msgs, "tools": [NOTE], "max_tokens": 500, "temperature": 0.0,
            "structured_outputs": {"regex": regex}}  # fmt: skip


def _next_note_turn(turn: dict[str, Any], call: tuple[str, str]) -> dict[str, Any]:
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function",
         "function": {"name": call[0], "arguments": call[1]}}]}  # fmt: skip
    tool = {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "done"}
    msgs = [*turn["messages"], assistant, tool]
    return {"messages": msgs, "tools": [NOTE], "max_tokens": 4, "temperature": 0.0}


@pytest.mark.slow
def test_live_the_proxy_learns_a_tool_call_answer_for_the_next_turn(
    pd: tuple[Any, Any], module_procs: Any
) -> None:
    """The prefix index learns an answer's tool calls: the next turn, which sends the call
    back, is found on the decode node (its prompt minus what D holds is short: D prefills
    it alone, computing only the tool's turn); a history with another call is not."""
    pair, _ = pd
    proxy = module_procs.proxy([pair.p.url], [pair.d.url], "--disagg-min-prompt-tokens", "200",
                               "--chars-per-token", "1")  # fmt: skip
    modes = {m: ("pdproxy_route_mode_total", {"mode": m}) for m in ("decode_only", "disaggregated")}

    def count(mode: str) -> float:
        return proxy.metric(*modes[mode])

    computed = "pdserve_prompt_tokens_total"
    for stream, system in ((True, "Keep notes. " * 60), (False, "Write things down. " * 40)):
        turn = _note_turn(system, "a")
        if stream:
            got = _stream(proxy.url, turn)[0]
        else:
            got = _summary(_post(proxy.url, turn)["choices"][0])
        assert got["finish"] == "tool_calls" and got["calls"][0][0] == "note", got
        assert count("disaggregated") == (1 if stream else 2)  # a long first prompt
        before, d_before = count("decode_only"), pair.d.metric(computed)
        _post(proxy.url, _next_note_turn(turn, got["calls"][0]))
        assert count("decode_only") == before + 1
        assert pair.d.metric(computed) - d_before < 64  # D held the call: the tool turn
    # A history whose call the decode node never saw: most of its prompt is not there.
    other = ("note", json.dumps({"text": "b" * 400}))
    _post(proxy.url, _next_note_turn(_note_turn("Keep notes. " * 60, "a"), other))
    assert count("disaggregated") == 3


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_tools_and_a_tool_conversation_are_in_the_prompt(
    pd: tuple[Any, Any], through: str
) -> None:
    _, url = _target(pd, through)
    base = {"max_tokens": 1, "temperature": 0.0}
    plain = _post(url, {"messages": _MSG, **base})["usage"]["prompt_tokens"]
    tools = _post(url, {"messages": _MSG, "tools": TOOLS, "tool_choice": "none", **base})
    history = _post(url, {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none", **base})
    assert plain < tools["usage"]["prompt_tokens"] < history["usage"]["prompt_tokens"]
    err = _post(url, {"messages": _MSG, "tool_choice": "required"}, status=400)["error"]
    assert err["param"] == "tool_choice"


def test_tools_within_their_bound_make_a_required_choice_whatever_its_schema_grows_to() -> None:
    # 128 tools just under the 64 KiB bound on ``tools``: the "required" schema built from
    # them (each wrapped in {"name", "parameters"}, its $refs re-pointed) is larger than
    # what a client may send as a schema itself -- it must not be refused for that.
    props = {f"p{j}": {"type": "string", "maxLength": 8} for j in range(10)}
    tools = [
        {"type": "function", "function": {"name": f"tool_{i:03d}", "parameters": {
            "type": "object", "properties": props, "$defs": {"D": {"$ref": "#/properties/p0"}},
        }}}
        for i in range(128)
    ]  # fmt: skip
    size = len(json.dumps(tools, separators=(",", ":")))
    assert 56 * 1024 < size <= 64 * 1024, size
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
    req = parse_chat_request({**body, "tool_choice": "required"})
    assert req.structured_output is not None
    assert len(req.structured_output.spec) > 64 * 1024  # larger than a client's may be


HERMES_GET = '<tool_call>{"name": "get", "arguments": {}}</tool_call>'


@pytest.mark.parametrize("per_output", [1, 3, 100])  # tokens a step: 100, the whole in one
def test_content_after_a_call_streams_after_it_and_the_body_says_where_the_call_was(
    per_output: int,
) -> None:
    """Content after a hermes call streams after the call's pieces even when one step
    holds both (a chunk of its own); the body's message has the same content and calls
    and says where each call was (``before_tool_calls``: the content's characters before
    it, and the tokens up to the step that began it), with content after a call or not."""
    from scripted_engine import ScriptedEngine
    from starlette.testclient import TestClient

    from engine.server.app import build_app

    text = f"a{HERMES_GET}b"
    app = build_app(ScriptedEngine(text, per_output=per_output), tool_call_parser="hermes")  # type: ignore[arg-type]
    client = TestClient(app)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 99,
            "tools": [{"type": "function", "function": {"name": "get", "parameters": {}}}]}  # fmt: skip
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        frames = [f.removeprefix("data: ") for f in r.read().decode().split("\n\n") if f]
    chunks = [json.loads(f) for f in frames if f != "[DONE]"]
    order: list[str] = []
    for c in chunks[1:]:
        delta = c["choices"][0]["delta"]
        for key in ("content", "tool_calls"):  # a delta's content goes before its calls
            if delta.get(key) and (not order or order[-1] != key):
                order.append(key)
    assert order == ["content", "tool_calls", "content"]
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
    assert ids == list(text.encode())
    msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    began = per_output * -(-len('a<tool_call>{"name": "get", "arguments": {') // per_output)
    assert (msg["content"], [c["function"]["name"] for c in msg["tool_calls"]]) == ("ab", ["get"])
    assert msg["before_tool_calls"] == [{"chars": 1, "tokens": min(began, len(text))}]
    plain = build_app(ScriptedEngine(f"a{HERMES_GET}", per_output=per_output),  # type: ignore[arg-type]
                      tool_call_parser="hermes")  # fmt: skip
    msg = TestClient(plain).post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert msg["content"] == "a"
    assert msg["before_tool_calls"] == [{"chars": 1, "tokens": min(began, len(f"a{HERMES_GET}"))}]


def test_chat_echo_with_tool_calls_leads_the_content_and_before_tool_calls_counts_it() -> None:
    """vLLM's chat echo with tools (vLLM takes it): the final assistant message's text
    leads the content, body and stream, and the body's ``before_tool_calls`` counts the
    characters of the content the client sees -- the echo's too -- as a stream says them
    before each call; a Responses answer built from the body puts the echo and the text
    before the call in the message before it. It was a 400 naming ``echo``."""
    from scripted_engine import ScriptedEngine
    from starlette.testclient import TestClient

    from engine.responses_api.request import to_chat
    from engine.responses_api.stream import response_object
    from engine.server.app import build_app

    echo, text = "Sure: ", f"a{HERMES_GET}b"
    client = TestClient(build_app(ScriptedEngine(text, per_output=3), tool_call_parser="hermes"))  # type: ignore[arg-type]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": echo}]
    body = {"model": "m", "messages": messages, "max_tokens": 99, "echo": True,
            "add_generation_prompt": False, "continue_final_message": True,
            "tools": [{"type": "function", "function": {"name": "get", "parameters": {}}}]}  # fmt: skip
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    chat = resp.json()
    msg = chat["choices"][0]["message"]
    assert msg["content"] == f"{echo}ab" and [c["function"]["name"] for c in msg["tool_calls"]] == [
        "get"
    ]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        frames = [f.removeprefix("data: ") for f in r.read().decode().split("\n\n") if f]
    said = 0  # the content a stream says before its call
    for f in frames[:-1]:
        delta = json.loads(f)["choices"][0]["delta"]
        if delta.get("tool_calls"):
            break
        said += len(delta.get("content") or "")
    assert said == len(f"{echo}a")
    assert [m["chars"] for m in msg["before_tool_calls"]] == [said], msg
    _, responses_echo = to_chat({"input": "x"})
    items = response_object(responses_echo, chat)["output"]
    assert [i["type"] for i in items] == ["message", "function_call", "message"], items
    assert [items[0]["content"][0]["text"], items[2]["content"][0]["text"]] == [f"{echo}a", "b"]
