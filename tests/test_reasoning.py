"""Reasoning outputs (vLLM's ``--reasoning-parser``): a chat answer's ``<think>`` part as
``reasoning_content``, the rest as ``content``. The parsers on hand-written text (whole and
piece by piece: the same split), the chat answer's message and stream deltas built from
them (tool calls from the content part), the serving layer on a fake engine, and live
answers on the ``tiny`` model through a node and a P/D pair behind the proxy.

The ``tiny`` model's random weights never write ``<think>`` nor ``</think>``: live,
``deepseek_r1`` answers are all reasoning (no ``</think>``) and ``qwen3`` answers all
content (no ``<think>``) -- enough to see the fields, and that a P/D stream does not send
P's first token as content.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from scripted_engine import ScriptedEngine, chat, chat_chunks
from starlette.testclient import TestClient

from engine.outputs import RequestOutput
from engine.reasoning import PARSERS, ReasoningParser, parser_class
from engine.reasoning.base import ReasoningDelta
from engine.reasoning.output import ReasoningOutput
from engine.reasoning.tokens import ReasoningTokens, TagIds
from engine.server.app import build_app
from engine.server.chat_protocol import parse_chat_request
from engine.structured.reasoning import ReasoningTags
from engine.tools.output import ToolOutput, new_parser

R1 = parser_class("deepseek_r1")
Q3 = parser_class("qwen3")


def _pieces(parser: ReasoningParser, text: str, size: int) -> list[ReasoningDelta]:
    out = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
    return [*out, parser.finish()]


def _split(pieces: list[ReasoningDelta]) -> tuple[str | None, str | None]:
    reasoning = "".join(p.reasoning for p in pieces)
    content = "".join(p.text for p in pieces)
    return reasoning or None, content or None


CASES = [
    # (parser, text, reasoning, content)
    (R1, "I should add.\n</think>\n\nIt is 4.", "I should add.\n", "\n\nIt is 4."),
    (R1, "<think>\nhmm</think>4", "\nhmm", "4"),  # R1-0528 writes <think> itself
    (R1, "still thinking when cut off", "still thinking when cut off", None),  # vLLM's rule
    (R1, "done</think>", "done", None),
    (R1, "</think>just the answer", None, "just the answer"),
    (R1, "a <think> inside</think>b", "a <think> inside", "b"),  # only a leading one goes
    (R1, "x</think>y</think><think>z", "x", "y</think><think>z"),  # after: all content
    (R1, "<thin", "<thin", None),  # a cut leading tag is reasoning text
    (R1, "a</thi", "a</thi", None),  # a cut closing tag too
    (R1, "", None, None),
    (Q3, "<think>\nI should add.\n</think>\n\nIt is 4.", "\nI should add.\n", "\n\nIt is 4."),
    (Q3, "no tags at all", None, "no tags at all"),
    (Q3, "Sure. <think>why</think> 4", "why", "Sure.  4"),  # text before <think>: content
    (Q3, "<think>cut off", "cut off", None),  # never closed: reasoning to the end
    (Q3, "stray </think> only", None, "stray </think> only"),  # no <think>: all content
    (Q3, "<think></think>4", None, "4"),  # an empty thinking block
    (Q3, "a <thin", None, "a <thin"),
    (Q3, "<think>r</think>c<think>d</think>", "r", "c<think>d</think>"),
]


@pytest.mark.parametrize("cls, text, reasoning, content", CASES)
def test_the_parsers_split_whole_and_piece_by_piece_alike(
    cls: type[ReasoningParser], text: str, reasoning: str | None, content: str | None
) -> None:
    assert cls().parse(text) == (reasoning, content)
    for size in (1, 2, 3, 5, 8):  # every tag split across pieces somewhere
        assert _split(_pieces(cls(), text, size)) == (reasoning, content), size


def test_a_tag_split_across_pieces_is_held_back_not_sent() -> None:
    p = Q3()
    assert p.feed("hi <th") == ReasoningDelta(content="hi ")  # "<th" may begin <think>
    assert p.feed("ink>ab</") == ReasoningDelta(reasoning="ab")  # "</" may begin </think>
    assert p.feed("thin") == ReasoningDelta()
    assert p.feed("k>ok") == ReasoningDelta(content="ok")
    assert p.finish() == ReasoningDelta()
    r = R1()
    assert r.feed("<") == ReasoningDelta()  # may be the leading <think>
    assert r.feed("think>x") == ReasoningDelta(reasoning="x")
    assert r.feed("<y") == ReasoningDelta(reasoning="<y")  # cannot begin </think>
    assert r.feed("</") == ReasoningDelta()
    assert r.finish() == ReasoningDelta(reasoning="</")  # held text, in its part, at the end


def test_enable_thinking_false_means_no_reasoning_part() -> None:
    assert Q3.applies({}) and Q3.applies({"enable_thinking": True})
    assert not Q3.applies({"enable_thinking": False})
    assert R1.applies({"enable_thinking": False})  # vLLM's deepseek_r1 reads no kwargs


def test_the_registry_names_the_parsers() -> None:
    assert sorted(PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(KeyError):
        parser_class("nope")


# -- the reasoning tokens, counted on the ids (engine/reasoning/tokens.py) -------------------------

BYTE_TAGS = TagIds(start=tuple(b"<think>"), end=tuple(b"</think>"))


def _count(cls: type[ReasoningParser], ids: list[int], size: int, tags: TagIds = BYTE_TAGS) -> int:
    counter = ReasoningTokens(tags, cls.initial)
    for i in range(0, len(ids), size):
        before = counter.count
        counter.feed(ids[i : i + size])
        assert counter.count >= before  # a stream's usage never counts back
    counter.finish()
    return counter.count


@pytest.mark.parametrize("cls, text, reasoning, content", CASES)
def test_the_count_is_the_reasoning_parts_tokens(
    cls: type[ReasoningParser], text: str, reasoning: str | None, content: str | None
) -> None:
    """The byte tokenizer spells each tag as the tokenizer writes it: the tokens counted are
    the reasoning text's bytes, whatever pieces the ids come in."""
    for size in (1, 2, 3, 8, 100):
        assert _count(cls, list(text.encode()), size) == len((reasoning or "").encode()), size


def test_the_count_with_one_token_tags_and_no_reasoning_part() -> None:
    tags = TagIds(start=(900,), end=(901,))  # DeepSeek R1's and Qwen3's: special tokens
    assert _count(R1, [5, 6, 901, 7], 1, tags) == 2
    assert _count(R1, [900, 5, 901, 7, 900, 8], 2, tags) == 1
    assert _count(R1, [5, 900, 6], 1, tags) == 3  # only a leading <think> is dropped
    assert _count(Q3, [5, 900, 6, 7, 901, 8, 900, 9], 3, tags) == 2
    assert _count(Q3, [5, 901, 6], 1, tags) == 0
    counter = ReasoningTokens(tags, "after")  # qwen3 without thinking: all content
    counter.feed([900, 5, 901])
    assert counter.count == 0
    # A cut end tag is not counted while it may still be the tag; at the end it is text.
    counter = ReasoningTokens(BYTE_TAGS, "reasoning")
    counter.feed(list(b"ab</thi"))
    assert counter.count == 2
    counter.finish()
    assert counter.count == 7
    with pytest.raises(ValueError):
        TagIds(start=(), end=(1,))
    with pytest.raises(ValueError):
        ReasoningTokens(tags, "nope")


# -- one chat choice's message and deltas (engine/reasoning/output.py) ----------------------------


def _deltas(out: Any, text: str, size: int) -> list[dict[str, Any]]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    return [out.delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]


def _added(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The deltas put together; reasoning_content never after content in one delta."""
    got: dict[str, Any] = {"reasoning_content": "", "content": "", "calls": []}
    for d in deltas:
        keys = [k for k in d if k in ("reasoning_content", "content")]
        assert keys in ([], ["reasoning_content"], ["content"], ["reasoning_content", "content"])
        got["reasoning_content"] += d.get("reasoning_content", "")
        got["content"] += d.get("content", "")
        for c in d.get("tool_calls") or []:  # a call's first piece names it; then arguments
            if "id" in c:
                got["calls"].append((c["function"]["name"], ""))
            name, args = got["calls"][c["index"]]
            got["calls"][c["index"]] = (name, args + c["function"]["arguments"])
    return got


@pytest.mark.parametrize("cls, text, reasoning, content", CASES)
def test_the_message_and_the_stream_add_up_alike(
    cls: type[ReasoningParser], text: str, reasoning: str | None, content: str | None
) -> None:
    msg = ReasoningOutput(cls()).message(text)
    assert msg == {"role": "assistant", "reasoning_content": reasoning, "content": content}
    assert list(msg) == ["role", "reasoning_content", "content"]
    for size in (1, 4, 100):
        got = _added(_deltas(ReasoningOutput(cls()), text, size))
        assert got == {"reasoning_content": reasoning or "", "content": content or "", "calls": []}


def test_tool_calls_come_from_the_content_part_only() -> None:
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    text = f"maybe {call} here?</think>Calling.{call}"
    tc = parse_chat_request(
        {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}
    ).tools
    assert tc is not None and tc.choice == "auto"

    def output() -> ReasoningOutput:
        return ReasoningOutput(R1(), ToolOutput(tc, new_parser(tc, "hermes")))

    whole = output()
    msg = whole.message(text)
    assert msg["reasoning_content"] == f"maybe {call} here?"  # a call in the reasoning is text
    assert msg["content"] == "Calling."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("f", '{"a": 1}')
    ]
    assert whole.finish_reason("stop") == "tool_calls"
    for size in (1, 7):
        got = _added(_deltas(output(), text, size))
        assert got == {"reasoning_content": f"maybe {call} here?", "content": "Calling.",
                       "calls": [("f", '{"a": 1}')]}  # fmt: skip
    plain = ReasoningOutput(R1(), ToolOutput(tc, new_parser(tc, "hermes"))).message("all thought")
    assert plain == {"role": "assistant", "reasoning_content": "all thought", "content": None,
                     "tool_calls": []}  # fmt: skip


# -- the serving layer on a fake engine -----------------------------------------------------------

MSG = [{"role": "user", "content": "what is 2 + 2?"}]


def _client(text: str, reasoning_parser: str | None, **kw: Any) -> TestClient:
    engine = ScriptedEngine(text)
    app = build_app(engine, reasoning_parser=reasoning_parser, **kw)  # type: ignore[arg-type]
    return TestClient(app)


def _chat(client: TestClient, status: int = 200, **body: Any) -> dict[str, Any]:
    return chat(client, MSG, status, **body)


def _chat_stream(client: TestClient, **body: Any) -> list[dict[str, Any]]:
    return chat_chunks(client, MSG, **body)


ANSWER = "<think>\nadd them</think>\n\nIt is 4."


def test_the_node_answers_reasoning_content_and_content() -> None:
    client = _client(ANSWER, "qwen3")
    body = _chat(client, logprobs=True)
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "reasoning_content": "\nadd them",
                                 "content": "\n\nIt is 4."}  # fmt: skip
    # Tokens are tokens: ids, log probabilities and usage cover the whole answer.
    assert choice["token_ids"] == list(ANSWER.encode())
    assert len(choice["logprobs"]["content"]) == len(ANSWER)
    assert body["usage"]["completion_tokens"] == len(ANSWER)
    chunks = _chat_stream(client, logprobs=True, stream_options={"include_usage": True})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert _added(deltas[1:]) == {"reasoning_content": "\nadd them", "content": "\n\nIt is 4.",
                                  "calls": []}  # fmt: skip
    # Reasoning streams before content: no reasoning after the first content.
    kinds = [k for d in deltas[1:] for k in d if k in ("reasoning_content", "content")]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content")
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert ids == list(ANSWER.encode())
    assert chunks[-1]["usage"]["completion_tokens"] == len(ANSWER)
    assert {} in deltas  # "<th" held back: a chunk with its ids and an empty delta


def test_each_choice_has_its_own_parser() -> None:
    client = _client(ANSWER, "deepseek_r1")
    body = _chat(client, n=3)
    assert [c["message"]["reasoning_content"] for c in body["choices"]] == ["\nadd them"] * 3
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3 * 9}
    chunks = _chat_stream(client, n=2)
    for i in range(2):
        deltas = [c["choices"][0]["delta"] for c in chunks
                  if c["choices"] and c["choices"][0]["index"] == i]  # fmt: skip
        assert _added(deltas[1:])["reasoning_content"] == "\nadd them"


class _EndsWithEOS(ScriptedEngine):
    """The scripted answer, then EOS: the engine's "stop" on a token whose text is left out."""

    async def generate(self, request_id: str, *args: Any, **kw: Any) -> Any:
        async for out in super().generate(request_id, *args, **kw):
            if out.finished:
                out.finished, out.finish_reason = False, None
                yield out
                eos = self.tokenizer.eos_token_id
                yield RequestOutput(request_id, [eos], True, "stop", new_logprobs=None)
                return
            yield out


def test_the_usage_counts_the_reasoning_tokens_as_they_come() -> None:
    """``completion_tokens_details.reasoning_tokens`` (vLLM's): the reasoning part's tokens,
    the tags and a stop token whose text is left out in no part; a stream's usage chunks
    count them so far; none without a reasoning parser or for completions."""
    text = "I add.</think>4"  # deepseek_r1: 6 tokens of reasoning, 8 of tag, 1 of content
    app = build_app(_EndsWithEOS(text), reasoning_parser="deepseek_r1")  # type: ignore[arg-type]
    client = TestClient(app)
    body = _chat(client)
    assert body["choices"][0]["message"]["reasoning_content"] == "I add."
    assert body["usage"]["completion_tokens"] == len(text) + 1  # EOS is a token
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}
    cut = TestClient(build_app(_EndsWithEOS("thinking"), reasoning_parser="deepseek_r1"))  # type: ignore[arg-type]
    assert _chat(cut)["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}  # not EOS
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _chat_stream(client, stream_options=opts)
    counts = [c["usage"]["completion_tokens_details"]["reasoning_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6
    assert chunks[-1]["usage"]["completion_tokens"] == len(text) + 1
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _chat(_client(ANSWER, "qwen3"), **off)["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": 0  # a node with a parser counts; this answer has no reasoning part
    }
    assert "completion_tokens_details" not in _chat(_client(ANSWER, None))["usage"]
    resp = _client(ANSWER, "deepseek_r1").post("/v1/completions", json={"prompt": "hi"})
    assert "completion_tokens_details" not in resp.json()["usage"]


def test_without_the_flag_or_without_thinking_the_answer_is_content() -> None:
    plain = _chat(_client(ANSWER, None))["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": ANSWER}  # no reasoning_content key
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    msg = _chat(_client(ANSWER, "qwen3"), **off)["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": ANSWER}
    chunks = _chat_stream(_client("x</think>y", "qwen3"))
    assert _added([c["choices"][0]["delta"] for c in chunks][1:])["content"] == "x</think>y"
    # deepseek_r1 reads no template variables (vLLM's): still reasoning.
    msg = _chat(_client("x</think>y", "deepseek_r1"), **off)["choices"][0]["message"]
    assert msg["reasoning_content"] == "x" and msg["content"] == "y"


def test_completions_are_not_parsed() -> None:
    client = _client(ANSWER, "deepseek_r1")
    resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 64})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == ANSWER


def test_a_structured_output_with_reasoning_waits_for_the_reasonings_end() -> None:
    """vLLM's rule (it was a 400 here): the grammar constrains the content, after the
    reasoning. The engine request carries the node's parser's tags in its token ids; the
    answer is split as any other (the scripted engine runs no grammar)."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    letters = list(range(ord("a"), ord("z") + 1))
    for parser in ("deepseek_r1", "qwen3"):
        engine = ScriptedEngine(ANSWER)
        client = TestClient(build_app(engine, reasoning_parser=parser))  # type: ignore[arg-type]
        tags = ReasoningTags.of(parser_class(parser), engine.tokenizer)
        assert tags.end == tuple(b"</think>")
        assert tags.start == (() if parser == "deepseek_r1" else tuple(b"<think>"))
        for field in (
            {"response_format": {"type": "json_object"}},
            {"structured_outputs": {"regex": "[a-z]+"}},
            {"guided_choice": ["a", "b"]},
            {"tools": tools, "tool_choice": "required"},
            {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}},
            # The first token is the reasoning's: not checked against the grammar's start.
            {"response_format": {"type": "json_object"}, "allowed_token_ids": letters},
        ):
            msg = _chat(client, **field)["choices"][0]["message"]
            assert msg["reasoning_content"] == "\nadd them", (parser, field)
            assert engine.params[-1].reasoning_tags == tags
        _chat(client)
        assert engine.params[-1].reasoning_tags is None  # no grammar: nothing to hold back
    # No reasoning part (qwen3 without thinking, no parser, completions): the grammar
    # constrains the answer from its first token.
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for parser, kw in (("qwen3", off), (None, {})):
        engine = ScriptedEngine(ANSWER)
        client = TestClient(build_app(engine, reasoning_parser=parser))  # type: ignore[arg-type]
        msg = _chat(client, structured_outputs={"regex": "[a-z]+"}, **kw)
        assert msg["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
        assert engine.params[-1].reasoning_tags is None
    engine = ScriptedEngine(ANSWER)
    client = TestClient(build_app(engine, reasoning_parser="deepseek_r1"))  # type: ignore[arg-type]
    resp = client.post("/v1/completions", json={"prompt": "hi", "guided_regex": "[a-z]+"})
    assert resp.status_code == 200 and engine.params[-1].reasoning_tags is None


def test_the_flag_and_what_the_node_tells_proxies() -> None:
    import argparse

    from engine.server.cli_args import add_server_args, parse_config

    def parse(*argv: str) -> Any:
        parser = add_server_args(argparse.ArgumentParser())
        return parse_config(parser, list(argv))[0]

    assert parse().reasoning_parser is None
    assert parse("--reasoning-parser", "qwen3").reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        parse("--reasoning-parser", "nope")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        _client(ANSWER, "nope")
    info = _client(ANSWER, "qwen3").get("/v1/kv_transfer_info").json()
    assert info == {
        "engine_id": "e", "reasoning_parser": "qwen3", "chat_template": "builtin",
        "prompt_tokens_details": False,
    }  # fmt: skip
    assert _client(ANSWER, None).get("/v1/kv_transfer_info").json()["reasoning_parser"] is None


# -- the proxy ----------------------------------------------------------------------------------


def test_the_proxy_learns_a_nodes_reasoning_parser() -> None:
    from proxy.nodes import Node

    node = Node("http://d", "decode")
    assert node.reasoning_parser is None
    node.update_info({"side_channel": "tcp://x:1", "reasoning_parser": "qwen3"}, None)
    assert node.reasoning_parser == "qwen3"
    for off in (None, "", 3):  # off, or not what a node sends: no parser
        node.update_info({"side_channel": "tcp://x:1", "reasoning_parser": off}, None)
        assert node.reasoning_parser is None
    node.update_info({"side_channel": "tcp://x:1"}, None)  # an older node: none
    assert node.reasoning_parser is None


def test_the_proxys_rewrite_keeps_reasoning_deltas() -> None:
    from proxy.client_stream import ClientStream
    from proxy.validation import CHAT, validate_request

    raw = json.dumps({"messages": MSG, "stream": True}).encode()
    req = validate_request(CHAT, raw, ["m"], None)
    out = ClientStream(req, "r", 0, False)
    chunk = {"choices": [{"index": 0, "delta": {"reasoning_content": "x"}, "token_ids": [],
                          "finish_reason": None}]}  # fmt: skip
    got = out.rewrite(chunk)
    assert got is not None
    assert got["choices"][0]["delta"] == {"role": "assistant", "reasoning_content": "x"}
    chunk = {"choices": [{"index": 0, "delta": {"reasoning_content": "y"}, "token_ids": [],
                          "finish_reason": None}]}  # fmt: skip
    got = out.rewrite(chunk)
    assert got is not None and got["choices"][0]["delta"] == {"reasoning_content": "y"}


# -- live: the tiny model through a node and a P/D pair behind the proxy --------------------------


@pytest.fixture(scope="module")
def pd(module_procs: Any) -> tuple[Any, Any]:
    """A P/D pair behind a proxy, and a colocated node: all with ``deepseek_r1``."""
    flags = ("--num-blocks", "256", "--reasoning-parser", "deepseek_r1")
    pair = module_procs.pd(1, 1, *flags, colocated=True)
    return pair, module_procs.proxy([pair.p.url], [pair.d.url])


def _post(url: str, body: dict[str, Any], status: int = 200, path: str = "chat/completions") -> Any:
    import httpx
    from harness import MODEL

    resp = httpx.post(f"{url}/v1/{path}", json={"model": MODEL, **body}, timeout=120)
    assert resp.status_code == status, resp.text
    return resp.json()


def _live_stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Each choice's answer put together from the stream (and its first delta)."""
    from harness import chat_stream_choices

    out = []
    for chunks in chat_stream_choices(url, body).values():
        deltas = [c["delta"] for c in chunks]
        ids = [t for c in chunks for t in c.get("token_ids") or []]
        finish = next((c["finish_reason"] for c in reversed(chunks) if c["finish_reason"]), None)
        out.append({"first": deltas[0], **_added(deltas[1:]), "ids": ids, "finish": finish})
    return out


def _as_stream(choice: dict[str, Any]) -> dict[str, Any]:
    msg = choice["message"]
    return {"first": {"role": "assistant", "content": ""},
            "reasoning_content": msg["reasoning_content"] or "", "content": msg["content"] or "",
            "calls": [], "ids": choice["token_ids"], "finish": choice["finish_reason"]}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_deepseek_r1_answers_are_reasoning_and_pd_equals_colocated(
    pd: tuple[Any, Any], through: str
) -> None:
    """The random model never writes </think>: every answer is all reasoning. Through the
    proxy P's first token is not pre-streamed as content: the stream equals a colocated
    node's, token for token and part for part."""
    pair, proxy = pd
    ref = pair.colocated.url
    url = ref if through == "node" else proxy.url
    for extra in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 4, "n": 2}):
        body = {"messages": MSG, "max_tokens": 10, "logprobs": True, **extra}
        got = _post(url, body)
        assert len(got["choices"]) == extra.get("n", 1)
        for choice in got["choices"]:
            msg = choice["message"]
            assert msg["content"] is None and msg["reasoning_content"], msg
            assert choice["finish_reason"] == "length"
            assert len(choice["token_ids"]) == 10 == len(choice["logprobs"]["content"])
        assert got["usage"]["completion_tokens"] == 10 * extra.get("n", 1)
        want = _post(ref, body)
        assert [c["message"] for c in got["choices"]] == [c["message"] for c in want["choices"]]
        assert [c["token_ids"] for c in got["choices"]] == [c["token_ids"] for c in want["choices"]]
        assert _live_stream(url, body) == [_as_stream(c) for c in got["choices"]]
    # Completions are not parsed (vLLM: chat only).
    text = _post(url, {"prompt": "hi", "max_tokens": 5, "temperature": 0.0}, path="completions")
    assert text["choices"][0]["text"] and "reasoning_content" not in text["choices"][0]
    # A structured output: the grammar waits for the reasoning's end, which the random
    # model never writes: unconstrained, cut by max_tokens (tests/test_reasoning_structured.py
    # steers it to end its reasoning). Greedy: a sampled answer may draw EOS first ("stop").
    body = {"messages": MSG, "max_tokens": 6, "temperature": 0.0,
            "response_format": {"type": "json_object"}}  # fmt: skip
    (choice,) = _post(url, body)["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_responses_count_the_reasoning_tokens(pd: tuple[Any, Any], through: str) -> None:
    """``POST /v1/responses``: every token of a deepseek_r1 answer is reasoning (the random
    model never writes </think>; EOS ignored): ``reasoning_tokens`` is ``output_tokens``,
    streamed and not; through the proxy the decode node's count, as a colocated node's."""
    openai = pytest.importorskip("openai")
    from harness import MODEL

    pair, proxy = pd
    url = pair.colocated.url if through == "node" else proxy.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    ask = {"model": MODEL, "input": "what is 2 + 2?", "max_output_tokens": 9,
           "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    r = client.responses.create(**ask)
    assert [o.type for o in r.output] == ["reasoning"]
    assert r.usage.output_tokens == 9 == r.usage.output_tokens_details.reasoning_tokens
    events = list(client.responses.create(stream=True, **ask))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.usage == r.usage
    chat = _post(url, {"messages": [{"role": "user", "content": "what is 2 + 2?"}],
                       "max_tokens": 9, "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": 9}


def test_reasoning_tokens_end_at_a_stop_string_whatever_the_outputs_carry() -> None:
    """A stop string in the reasoning ends the count at the token that completed it, as
    when every token came alone (an output may carry several ids: merged, async)."""
    counts = []
    for per_output in (1, 8):
        engine = ScriptedEngine("thinking hard</think>4", per_output=per_output)
        client = TestClient(build_app(engine, reasoning_parser="deepseek_r1"))  # type: ignore[arg-type]
        body = _chat(client, stop=["in"])
        counts.append((body["usage"], body["choices"][0]["message"]))
    assert counts[0] == counts[1]
    assert counts[1][0]["completion_tokens"] == 4  # "t", "h", "i", "n"
    assert counts[1][0]["completion_tokens_details"] == {"reasoning_tokens": 4}


@pytest.mark.parametrize("per_output", [1, 3, 100])  # tokens a step: 100, the whole in one
def test_content_before_the_reasoning_streams_before_it_and_the_body_says_so(
    per_output: int,
) -> None:
    """qwen3's text before ``<think>`` is content, streamed before the reasoning even when
    one step holds both (a chunk of its own, the step's tokens with it); the body's
    message has the same content and says what of it came before the reasoning
    (``before_reasoning``), and after how many tokens the reasoning began."""
    text = "Sure. <think>why</think> 4"
    app = build_app(ScriptedEngine(text, per_output=per_output), reasoning_parser="qwen3")  # type: ignore[arg-type]
    client = TestClient(app)
    chunks = _chat_stream(client, logprobs=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]][1:]
    parts = [(k, d[k]) for d in deltas for k in d if k in ("reasoning_content", "content")]
    merged: list[list[str]] = []
    for kind, piece in parts:  # consecutive pieces of a kind, added up
        if merged and merged[-1][0] == kind:
            merged[-1][1] += piece
        elif piece:
            merged.append([kind, piece])
    assert merged == [["content", "Sure. "], ["reasoning_content", "why"], ["content", " 4"]]
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert ids == list(text.encode())
    (choice,) = _chat(client, logprobs=True)["choices"]
    began = per_output * -(-len("Sure. <think>w") // per_output)  # the step with the "w"
    assert choice["message"] == {
        "role": "assistant", "reasoning_content": "why", "content": "Sure.  4",
        "before_reasoning": {"content": "Sure. ", "tool_calls": 0,
                             "tokens": min(began, len(text))},
    }  # fmt: skip
    # Without text before the reasoning the message says nothing of it.
    plain = TestClient(build_app(ScriptedEngine(ANSWER, per_output=per_output),  # type: ignore[arg-type]
                                 reasoning_parser="qwen3"))  # fmt: skip
    assert "before_reasoning" not in _chat(plain)["choices"][0]["message"]


@pytest.mark.parametrize("pre", ["Sure. ", ""])  # content before the reasoning, or none
def test_chat_echo_is_content_said_before_the_reasoning(pre: str) -> None:
    """vLLM's chat echo leads the content, and a stream says it first (its role chunk),
    before the reasoning: the body's ``before_reasoning`` counts it -- the content said
    before the reasoning is the echo and what the answer wrote there, the tokens those
    the answer had said (none for the echo) -- so the places are in the content the
    client sees. It said the answer's content alone, and nothing when the echo was all."""
    echo, text = "Go: ", f"{pre}<think>why</think> 4"
    client = TestClient(build_app(ScriptedEngine(text, per_output=3), reasoning_parser="qwen3"))  # type: ignore[arg-type]
    messages = [*MSG, {"role": "assistant", "content": echo}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    chunks = chat_chunks(client, messages, echo=True, **body)
    said = ""  # the content a stream says before the reasoning
    for c in chunks:
        delta = c["choices"][0]["delta"] if c["choices"] else {}
        if delta.get("reasoning_content"):
            break
        said += delta.get("content") or ""
    assert said == echo + pre
    msg = chat(client, messages, echo=True, **body)["choices"][0]["message"]
    assert msg["content"] == f"{echo}{pre} 4" and msg["reasoning_content"] == "why"
    alone = chat(client, messages, **body)["choices"][0]["message"].get("before_reasoning")
    tokens = alone["tokens"] if alone else 0
    assert msg["before_reasoning"] == {"content": said, "tool_calls": 0, "tokens": tokens}, msg


@pytest.mark.parametrize("before", ["", "a"])  # the call before the reasoning, or after it
def test_a_call_with_a_reasoning_parser_finishes_tool_calls_streamed_or_not(before: str) -> None:
    """With a reasoning parser and tool calls the body's ``finish_reason`` is the stream's:
    "tool_calls" when the answer holds whole calls (the engine's "length" otherwise)."""
    call = '<tool_call>\n{"name": "get", "arguments": {}}\n</tool_call>'
    text = f"{before}<think>r</think>{call}" if before else f"{call}<think>r</think>ok"
    engine = ScriptedEngine(text, per_output=1)
    client = TestClient(build_app(engine, reasoning_parser="qwen3", tool_call_parser="hermes"))  # type: ignore[arg-type]
    tools = [{"type": "function", "function": {"name": "get", "parameters": {}}}]
    (choice,) = _chat(client, tools=tools)["choices"]
    chunks = _chat_stream(client, tools=tools)
    ends = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert choice["finish_reason"] == ends[-1] == "tool_calls"
    assert len(choice["message"]["tool_calls"]) == 1
