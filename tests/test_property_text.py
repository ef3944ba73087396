"""Differential property tests (hypothesis) of the node's text layer, in-process.

* ``AnswerText`` (incremental detokenization and stop strings) over the byte tokenizer,
  whose characters of 2-4 bytes span several tokens: a drawn answer's ids, cut into drawn
  engine outputs, give the text, ``stop_reason`` and kept ids of a reference that decodes
  the whole ids at each token and applies vLLM's stop-string rule to that text (a stop
  string must end in the token's new text; of several, the first listed) -- and so do
  the same ids one per output.
* A node (``build_app`` over ``DrawnEngine``: each choice answers drawn ids in drawn
  outputs) answers a drawn request -- completions or chat, ``n`` choices, ``echo``,
  log probabilities, stop strings (one in the echoed prompt), ``min_tokens``,
  ``include_usage``, a reasoning parser, hermes tool calls -- streamed as whole: each
  choice's deltas add up to its text (or content, reasoning and calls), ids, log
  probabilities (``text_offset`` aside: a stream's differ by design, docs/api.md),
  finish and stop reason, and the usage; a completion's text is the reference's.
* ``/v1/responses``: the stream's final response equals the whole one, its deltas add up
  to each item (the case left alone: qwen3 content before ``<think>``, below).
* The reasoning and tool-call parsers: fed a drawn text in drawn pieces, the same
  reasoning, content and calls as fed whole.

About 10 s in CI.

The examples are fixed (``derandomize``, no example database: ``fakes.fixed_examples``);
``PDSERVE_TEXT_EXAMPLES=N`` multiplies their counts for a local hunt.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fakes import example_scale, fixed_examples, hunt_timeout
from hypothesis import given, note
from hypothesis import strategies as st
from scripted_engine import StubEngine, TemplateBytes
from starlette.testclient import TestClient

from engine.outputs import RequestOutput, TokenLogprob
from engine.reasoning.base import ReasoningDelta
from engine.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from engine.reasoning.qwen3 import Qwen3ReasoningParser
from engine.sampling_params import SamplingParams
from engine.server.answer_text import AnswerText
from engine.server.app import build_app
from engine.tokenizer import REPLACEMENT_CHAR, ByteTokenizer, IncrementalDetokenizer
from engine.tools.output import RequiredCalls
from engine.tools.parsers.base import ToolParser
from engine.tools.parsers.hermes import HermesToolParser

logger = logging.getLogger(__name__)

SCALE = example_scale("PDSERVE_TEXT_EXAMPLES")
pytestmark = hunt_timeout(SCALE)
TOK = ByteTokenizer()
EOS = ByteTokenizer.EOS
# Characters of 1-4 bytes, U+FFFD itself (which the detokenizer holds back like a broken
# sequence) and the stop-string-prone ASCII.
CHARS = ["a", "b", "ab", " ", "\n", "é", "€", "😀", "\ufffd", "<", ">", "/"]
# Bytes that begin or continue a character but make none here (a model may sample them).
BROKEN = [b"\x80", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xff"]


def _settings(n: int):  # type: ignore[no-untyped-def]
    return fixed_examples(n * SCALE)


@st.composite
def answer_bytes(draw: st.DrawFn) -> list[int]:
    """An answer's ids: mostly whole characters, some broken sequences."""
    units = draw(
        st.lists(
            st.one_of(
                st.sampled_from(CHARS).map(str.encode),
                st.sampled_from(BROKEN),
            ),
            min_size=0,
            max_size=14,
        )
    )
    return list(b"".join(units))


@st.composite
def stop_strings(draw: st.DrawFn, text: str) -> list[str]:
    """1-3 stop strings: pieces of ``text`` (so they hit) or drawn characters."""
    pieces = []
    if text:
        i = draw(st.integers(0, len(text) - 1))
        j = draw(st.integers(i + 1, min(len(text), i + 4)))
        pieces.append(text[i:j])
    one = st.lists(st.sampled_from(CHARS), min_size=1, max_size=3).map("".join)
    stops = draw(st.lists(st.one_of(st.sampled_from(pieces) if pieces else one, one),
                          min_size=1, max_size=3))  # fmt: skip
    return stops


@dataclass(frozen=True)
class Expected:
    text: str
    ids: list[int]
    stop_reason: str | int | None
    stop_hit: bool


def reference(
    prompt: list[int], ids: list[int], finish: str, stops: list[str], include: bool,
    min_tokens: int,
) -> Expected:  # fmt: skip
    """The answer by whole decodes: after each token the text of the ids so far (held
    back while it ends in U+FFFD, but at the last token), each stop string looked for in
    order where it would end in that token's new text (vLLM's ``check_stop_strings``)."""
    stop_token = finish == "stop"
    shown = ids[:-1] if stop_token and not include else ids
    ctx = prompt[-IncrementalDetokenizer.CONTEXT_TOKENS :]
    base = TOK.decode(ctx)
    visible = ""
    for k in range(1, len(shown) + 1):
        full = TOK.decode(ctx + shown[:k])[len(base) :]
        if k < len(shown) and full.endswith(REPLACEMENT_CHAR):
            continue  # held back: no new text
        new = len(full) - len(visible)
        visible = full
        if k <= min_tokens:
            continue
        for stop in stops:
            at = visible.find(stop, max(0, len(visible) - new - len(stop) + 1))
            if at >= 0:
                cut = at + len(stop) if include else at
                return Expected(visible[:cut], ids[:k], stop, True)
    why = (None if ids[-1] == EOS else ids[-1]) if stop_token and ids else None
    return Expected(visible, ids, why, False)


def run_answer(
    prompt: list[int], ids: list[int], finish: str, cuts: list[int], stops: list[str],
    include: bool, min_tokens: int, skip_first: bool = False,
) -> Expected:  # fmt: skip
    """``AnswerText`` fed ``ids`` as engine outputs cut at ``cuts`` (``skip_first``: a
    decode leg's, the first token's text already with the client)."""
    params = SamplingParams(max_tokens=len(ids), min_tokens=min_tokens)
    detok = IncrementalDetokenizer(TOK, prompt)
    answer = AnswerText(detok, params, stops, include, skip_first=skip_first)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(ids))), len(ids)]
    text, kept, reason, hit = "", [], None, False
    for a, b in zip(bounds, bounds[1:], strict=False):
        last = b == len(ids)
        out = RequestOutput("r", ids[a:b], last, finish if last else None)  # type: ignore[arg-type]
        piece = answer.add(out)
        text += piece.text
        kept += piece.token_ids
        if piece.stop_hit or last:
            reason, hit = piece.stop_reason, piece.stop_hit
            break
    return Expected(text, kept, reason, hit)


@st.composite
def answers(draw: st.DrawFn) -> tuple:  # type: ignore[type-arg]
    prompt = list(draw(st.sampled_from(["", "Say: ", "a<b", "é€"])).encode())
    ids = draw(answer_bytes())
    finish = draw(st.sampled_from(["length", "stop", "stop_id"]))
    if finish == "stop":
        ids = [*ids, EOS]
    elif finish == "stop_id":
        finish = "stop"
        if not ids:
            ids = [ord("a")]
    if not ids:
        ids = [ord("b")]
    text = TOK.decode(ids)
    stops = draw(stop_strings(text))
    include = draw(st.booleans())
    min_tokens = draw(st.sampled_from([0, 0, 0, 1, 3]))
    cuts = draw(st.lists(st.integers(1, max(1, len(ids) - 1)), max_size=4))
    return prompt, ids, finish, cuts, stops, include, min_tokens


@_settings(300)
@given(answers())
def test_answer_text_is_the_whole_decodes_with_vllms_stop_rule(case: tuple) -> None:  # type: ignore[type-arg]
    prompt, ids, finish, cuts, stops, include, min_tokens = case
    note(f"ids={bytes(i for i in ids if i < 256)!r} eos={ids[-1] == EOS}")
    want = reference(prompt, ids, finish, stops, include, min_tokens)
    one_by_one = run_answer(prompt, ids, finish, list(range(len(ids))), stops, include,
                            min_tokens)  # fmt: skip
    assert one_by_one == want
    merged = run_answer(prompt, ids, finish, cuts, stops, include, min_tokens)
    assert merged == want
    # A decode leg (the client got the first token, a whole character, from the prefill
    # node, whose answer did not stop there): the rest of the same answer; nothing when
    # the stop string began in that first token (the client has its start).
    first_alone = reference(prompt, ids[:1], "length", stops, include, min_tokens)
    if ids[0] < 0x80 and len(ids) > 1 and not first_alone.stop_hit and want.ids[1:]:
        leg = run_answer(prompt, ids, finish, cuts, stops, include, min_tokens, True)
        first = chr(ids[0])
        rest = want.text[1:] if want.text.startswith(first) else ""
        assert leg == Expected(rest, want.ids[1:], want.stop_reason, want.stop_hit)


def test_a_stop_string_the_last_flush_completes_before_a_stop_token_drops_that_token() -> None:
    """A broken byte's U+FFFD shows only when the answer ends: a stop string ending in it
    is completed by the last token with text, whether the stop token (EOS) that ended
    the answer comes in the same engine output or the next -- and so not in the ids."""
    for cuts in ([], [1]):
        got = run_answer([], [0x80, EOS], "stop", cuts, ["\ufffd"], False, 0)
        assert got == Expected("", [0x80], "\ufffd", True), cuts
        # With min_tokens 1 that token is within them: no stop string ends in its text.
        got = run_answer([], [0x80, EOS], "stop", cuts, ["\ufffd"], False, 1)
        assert got == Expected("\ufffd", [0x80, EOS], None, False), cuts


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_chat_echo_comes_before_the_content_with_a_reasoning_parser(parser: str) -> None:
    """vLLM's chat echo (the final assistant message's text before the answer) is in the
    content of the whole answer as in the stream's first chunk, a reasoning parser or not."""
    engine = DrawnEngine()
    engine.scripts = {0: Script(tuple(b"<think>x</think>ok"), (), "length")}
    client = TestClient(build_app(engine, reasoning_parser=parser))  # type: ignore[arg-type]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}]
    body = {"messages": msgs, "echo": True, "max_tokens": 20}
    msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("x", "Sure: ok")
    chunks = _stream(client, "/v1/chat/completions", body)
    got = _streamed_choices(chunks, True)[0]
    assert (got["reasoning_content"], got["content"]) == ("x", "Sure: ok")


# -- the node's answers, streamed and whole -------------------------------------------------------


@dataclass(frozen=True)
class Script:
    """One choice's engine outputs: ``ids`` cut at ``cuts``, the last one ``finish``."""

    ids: tuple[int, ...]
    cuts: tuple[int, ...]
    finish: str


def _entry(token: int, k: int) -> TokenLogprob:
    """A made-up log probability of ``token`` and ``k`` alternatives (a function of it)."""
    top = tuple((token + j) % 256 for j in range(k))
    return TokenLogprob(token, -(token % 7) - 0.5, top, tuple(-1.0 - j for j in range(k)))


class DrawnEngine(StubEngine):
    """Answers each choice (keyed by its seed: choice ``j`` samples with ``seed + j``)
    its ``Script``, with log probabilities (and the prompt's) when asked."""

    def __init__(self) -> None:
        super().__init__(TemplateBytes())
        self.scripts: dict[int, Script] = {}

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       **kw: Any) -> AsyncIterator[RequestOutput]:  # fmt: skip
        s = self.scripts[params.seed or 0]
        bounds = [0, *sorted({c for c in s.cuts if 0 < c < len(s.ids)}), len(s.ids)]
        for n, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            ids, last = list(s.ids[a:b]), b == len(s.ids)
            k = params.logprobs
            lps = None if k is None else [_entry(t, k) for t in ids]
            plp = None
            if n == 0 and params.prompt_logprobs is not None:
                plp = [None, *(_entry(t, params.prompt_logprobs) for t in prompt[1:])]
            yield RequestOutput(request_id, ids, last, s.finish if last else None,  # type: ignore[arg-type]
                                new_logprobs=lps, prompt_logprobs=plp)  # fmt: skip


@pytest.fixture(scope="module")
def engine() -> DrawnEngine:
    return DrawnEngine()


@pytest.fixture(scope="module")
def clients(engine: DrawnEngine) -> Iterator[dict[str, TestClient]]:
    """A plain node, and nodes with the hermes tool parser and each reasoning parser."""
    apps = {
        None: build_app(engine),  # type: ignore[arg-type]
        "qwen3": build_app(engine, tool_call_parser="hermes", reasoning_parser="qwen3"),  # type: ignore[arg-type]
        "deepseek_r1": build_app(
            engine,
            tool_call_parser="hermes",  # type: ignore[arg-type]
            reasoning_parser="deepseek_r1",
        ),  # fmt: skip
    }
    with contextlib.ExitStack() as stack:
        yield {k: stack.enter_context(TestClient(a)) for k, a in apps.items()}  # type: ignore[misc]


# Pieces of a chat answer: tags, a tool call's parts, characters of 1-4 bytes.
CHAT_PIECES = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", '{"name": "get", ',
    '"arguments": {"q": "é€"}}', '{"name": "put", "arguments": {}}', "x", " ", "\n",
    "😀", "ok.", "{", "}", '"',
]  # fmt: skip
# A whole hermes call, drawn into an answer's text (text before and after it).
WHOLE_CALL = '<tool_call>{"name": "get", "arguments": {}}</tool_call>'


@st.composite
def scripts(draw: st.DrawFn, chat: bool, n: int) -> tuple[list[Script], str]:
    """``n`` choices' scripts and a text stop strings are drawn from."""
    out, texts = [], []
    for _ in range(n):
        if chat and draw(st.booleans()):
            alphabet = CHAT_PIECES + REQUIRED_PIECES + HERMES_PIECES
            pieces = draw(st.lists(st.sampled_from(alphabet), max_size=8))
            for _ in range(draw(st.integers(0, 2))):  # content after a call, or around it
                pieces.insert(draw(st.integers(0, len(pieces))), WHOLE_CALL)
            text = "".join(pieces)
            ids = list(text.encode())
        else:
            ids = draw(answer_bytes())
        finish = draw(st.sampled_from(["length", "stop", "stop_id"]))
        if finish == "stop":
            ids.append(EOS)
        elif finish == "stop_id":
            finish, ids = "stop", ids or [ord("a")]
        ids = ids or [ord("b")]
        cuts = draw(st.lists(st.integers(1, max(1, len(ids) - 1)), max_size=6))
        out.append(Script(tuple(ids), tuple(cuts), finish))
        texts.append(TOK.decode(ids))
    return out, "".join(texts)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str | None, str, dict[str, Any], list[Script]]:
    """A node (its reasoning parser), an endpoint, a body (unstreamed) and its scripts."""
    chat = draw(st.booleans())
    n = draw(st.integers(1, 3))
    script, text = draw(scripts(chat, n))
    body: dict[str, Any] = {"max_tokens": 200, "seed": 7, "n": n}
    if draw(st.booleans()):
        body["stop"] = draw(stop_strings(text))
        body["include_stop_str_in_output"] = draw(st.booleans())
        body["min_tokens"] = draw(st.sampled_from([0, 0, 2]))
    if draw(st.booleans()):
        body["stream_options"] = {"include_usage": True,
                                  "continuous_usage_stats": draw(st.booleans())}  # fmt: skip
    if draw(st.booleans()):  # EOS's text "<|eos|>" (with include_stop_str_in_output)
        body["skip_special_tokens"] = False
    if draw(st.booleans()):
        body["return_tokens_as_token_ids"] = True
    node = None
    if chat:
        body["messages"] = [{"role": "user", "content": "hi <think>"}]
        if draw(st.booleans()):
            body["logprobs"] = True
            body["top_logprobs"] = draw(st.integers(0, 2))
        node = draw(st.sampled_from([None, "qwen3", "deepseek_r1"]))
        named = {"type": "function", "function": {"name": "get"}}
        choices = ["required", named] + (["auto", "auto"] if node is not None else [])
        if draw(st.booleans()):
            tool = {"type": "function", "function": {"name": "get", "parameters": {}}}
            body["tools"] = [tool]
            body["tool_choice"] = draw(st.sampled_from(choices))
            body["parallel_tool_calls"] = draw(st.booleans())
        elif draw(st.booleans()):  # vLLM's chat echo: the final assistant message's text
            body["messages"].append({"role": "assistant", "content": "Sure: é"})
            body["echo"] = True
    else:
        body["prompt"] = draw(st.sampled_from(["Say: ", "é€😀 </think>", "a"]))
        if "stop" in body and draw(st.booleans()):  # one in the echoed prompt: no stop there
            body["stop"].append(body["prompt"][-3:])
        body["echo"] = draw(st.booleans())
        if body["echo"] and draw(st.booleans()):  # vLLM's echo without generation
            body["max_tokens"], body["min_tokens"] = 0, 0
        if draw(st.booleans()):
            body["logprobs"] = draw(st.integers(0, 2))
    return node, "/v1/chat/completions" if chat else "/v1/completions", body, script


def _stream(client: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _whole_choice(choice: dict[str, Any], chat: bool) -> dict[str, Any]:
    """What a client compares of a choice of a whole answer."""
    out = {k: choice.get(k) for k in ("finish_reason", "stop_reason", "token_ids")}
    lp = choice.get("logprobs")
    if chat:
        msg = choice["message"]
        out["content"] = msg.get("content") or ""
        out["reasoning_content"] = msg.get("reasoning_content") or ""
        calls = msg.get("tool_calls") or []
        out["calls"] = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        out["logprobs"] = None if lp is None else lp["content"]
    else:
        out["text"] = choice["text"]
        out["logprobs"] = None if lp is None else {
            k: lp[k] for k in ("tokens", "token_logprobs", "top_logprobs")
        }  # fmt: skip
    return out


def _streamed_choices(chunks: list[dict[str, Any]], chat: bool) -> dict[int, dict[str, Any]]:
    """Each choice's chunks added up as a client adds them (OpenAI's ``index``)."""
    got: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            g = got.setdefault(c["index"], {
                "finish_reason": None, "stop_reason": None, "token_ids": [], "logprobs": None,
                "content": "", "reasoning_content": "", "calls": {}, "text": "",
            })  # fmt: skip
            assert g["finish_reason"] is None, f"a chunk after the finish: {c}"
            g["finish_reason"], g["stop_reason"] = c["finish_reason"], c.get("stop_reason")
            g["token_ids"] += c.get("token_ids") or []
            lp = c.get("logprobs")
            if chat:
                d = c["delta"]
                g["content"] += d.get("content") or ""
                g["reasoning_content"] += d.get("reasoning_content") or ""
                for call in d.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    name, args = g["calls"].get(call["index"], (None, ""))
                    g["calls"][call["index"]] = (
                        name or fn.get("name"),
                        args + (fn.get("arguments") or ""),
                    )
                if lp is not None:
                    g["logprobs"] = (g["logprobs"] or []) + lp["content"]
            else:
                g["text"] += c["text"]
                if lp is not None:
                    g["logprobs"] = g["logprobs"] or {
                        "tokens": [],
                        "token_logprobs": [],
                        "top_logprobs": [],
                    }
                    for k in g["logprobs"]:
                        g["logprobs"][k] += lp[k]
    for g in got.values():
        g["calls"] = [g["calls"][i] for i in sorted(g["calls"])]
        for k in ("text",) if chat else ("content", "reasoning_content", "calls"):
            del g[k]
    return got


@_settings(150)
@given(requests())
def test_a_stream_adds_up_to_the_whole_answer(
    clients: dict[str | None, TestClient], engine: DrawnEngine, case: tuple
) -> None:  # type: ignore[type-arg]
    node, path, body, script = case
    engine.scripts = {7 + j: s for j, s in enumerate(script)}
    client, chat = clients[node], path.endswith("chat/completions")
    opts = body.pop("stream_options", None)
    resp = client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    whole = resp.json()
    chunks = _stream(client, path, {**body, "stream_options": opts} if opts else body)
    want = {c["index"]: _whole_choice(c, chat) for c in whole["choices"]}
    got = _streamed_choices(chunks, chat)
    assert got == want
    opened = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    assert list(dict.fromkeys(opened)) == sorted(want)  # choices open in index order
    # A completion's text is the reference's (after the echoed prompt); the reference
    # decodes as skip_special_tokens does (EOS's text "<|eos|>" left out).
    if not chat and body["max_tokens"] == 0:
        for c in whole["choices"]:
            assert (c["text"], c["token_ids"], c["finish_reason"]) == (body["prompt"], [], "length")
    elif not chat and body.get("skip_special_tokens", True):
        for j, s in enumerate(script):
            c = whole["choices"][j]
            prompt = list(body["prompt"].encode())
            ref = reference(prompt, list(s.ids), s.finish, body.get("stop", []),
                            body.get("include_stop_str_in_output", False),
                            body.get("min_tokens", 0))  # fmt: skip
            assert c["text"] == (body["prompt"] if body["echo"] else "") + ref.text
            assert (c["token_ids"], c["stop_reason"]) == (ref.ids, ref.stop_reason)
    if opts:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
        if opts["continuous_usage_stats"]:  # each chunk: its choice's tokens so far
            seen: dict[int, int] = {}
            for c in chunks[:-1]:
                (choice,) = c["choices"]
                i = choice["index"]
                seen[i] = seen.get(i, 0) + len(choice["token_ids"])
                assert c["usage"]["completion_tokens"] == seen[i], c
    else:
        assert all(c.get("usage") is None for c in chunks)


def _shape(r: dict[str, Any]) -> list[tuple[Any, ...]]:
    """A response's output items as a client reads them."""
    return [
        (o["type"], [c.get("text") for c in o.get("content") or []],
         [c.get("logprobs") for c in o.get("content") or []], o.get("name"),
         o.get("arguments"), o.get("status"))
        for o in r["output"]
    ]  # fmt: skip


def _unnamed(r: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output items, each id with its response's own part as "ID" (a call's
    ``call_id``, each request's own, left out)."""
    rid = r["id"].removeprefix("resp_")
    return [{**{k: v for k, v in o.items() if k != "call_id"}, "id": o["id"].replace(rid, "ID", 1)}
            for o in r["output"]]  # fmt: skip


@_settings(60)
@given(st.sampled_from(["qwen3", "deepseek_r1"]), st.booleans(), st.booleans(), scripts(True, 1))
def test_a_responses_stream_adds_up_to_the_whole_response(
    clients: dict[str | None, TestClient], engine: DrawnEngine, node: str, tools: bool,
    logprobs: bool, drawn: tuple[list[Script], str],
) -> None:  # fmt: skip
    (script,), _ = drawn
    engine.scripts = {0: script}
    body: dict[str, Any] = {"model": "m", "input": "hi", "max_output_tokens": 200}
    if tools:
        body["tools"] = [{"type": "function", "name": "get", "parameters": {}}]
    if logprobs:
        body["include"] = ["message.output_text.logprobs"]
        body["top_logprobs"] = 1
    client = clients[node]
    resp = client.post("/v1/responses", json=body)
    assert resp.status_code == 200, resp.text
    whole = resp.json()
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        frames = [f for f in r.read().decode().split("\n\n") if f]
    evs = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
    last = evs[-1]["response"]
    ids = [o["id"] for o in last["output"]]
    assert len(set(ids)) == len(ids), ids
    assert (_shape(last), last["status"], last["usage"]) == (
        _shape(whole),
        whole["status"],
        whole["usage"],
    )
    # The same response streamed or not: its items (ids, texts, log probabilities, in
    # the text's order: qwen3's content before "<think>" is a message before the
    # reasoning), its status and why, its usage.
    # Ids are each request's own (random): items are named after their response's.
    assert _unnamed(last) == _unnamed(whole)
    for key in ("status", "incomplete_details", "usage", "error"):
        assert last[key] == whole[key], key
    if whole["status"] == "incomplete":
        assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
        assert evs[-1]["type"] == "response.incomplete"
        assert whole["output"][-1]["status"] == "incomplete"  # the item cut
    else:
        assert whole["incomplete_details"] is None and evs[-1]["type"] == "response.completed"
    texts: dict[int, str] = {}
    for e in evs:
        if e["type"] in ("response.output_text.delta", "response.reasoning_text.delta",
                         "response.function_call_arguments.delta"):  # fmt: skip
            texts[e["output_index"]] = texts.get(e["output_index"], "") + e["delta"]
    for i, o in enumerate(whole["output"]):
        full = o.get("arguments") or "".join(c.get("text") or "" for c in o.get("content") or [])
        assert texts.get(i, "") == full, (i, o)


# -- the parsers, fed in pieces and whole ---------------------------------------------------------

REQUIRED_PIECES = ['[', ']', ',', '{"name":"get","parameters":', '{"q":"]}"}', '{}', '}',
                   '{"parameters":{},"name":"put"}', ' ', '"', '\\', "é"]  # fmt: skip


# A call's head and arguments in other spellings (escapes, spaces, a tag in a string).
HERMES_PIECES = ['{"name": "a\\"b", ', '"arguments": ', '{"k": "</tool_call>"}', " \n", "\\"]


def _pieces(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=8))))
    bounds = [0, *(c for c in cuts if c < len(text)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _added(deltas: list[Any]) -> tuple[str, list[tuple[Any, str]]]:
    """Tool-call pieces as a client adds them: the content, each call's name and args."""
    content, calls = "", []
    for d in deltas:
        if d.call is None:
            content += d.content
        elif d.id is not None:
            calls.append((d.name, d.arguments))
        else:
            calls[-1] = (calls[-1][0], calls[-1][1] + d.arguments)
    return content, calls


@_settings(300)
@given(st.data())
def test_tool_parsers_fed_in_pieces_answer_as_fed_whole(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["hermes", "hermes-single", "required"]))
    alphabet = REQUIRED_PIECES if kind == "required" else CHAT_PIECES + HERMES_PIECES
    text = "".join(data.draw(st.lists(st.sampled_from(alphabet), max_size=10)))
    pieces = _pieces(data.draw, text)

    def parser() -> ToolParser:
        if kind == "required":
            return RequiredCalls()
        return HermesToolParser(parallel=kind == "hermes")

    whole = parser()
    want = _added(whole.parse(text))
    fed = parser()
    got = _added([d for p in pieces for d in fed.feed(p)] + fed.finish())
    assert (got, fed.cut) == (want, whole.cut)


@_settings(200)
@given(st.data())
def test_reasoning_parsers_fed_in_pieces_answer_as_fed_whole(data: st.DataObject) -> None:
    cls = data.draw(st.sampled_from([Qwen3ReasoningParser, DeepSeekR1ReasoningParser]))
    text = "".join(data.draw(st.lists(st.sampled_from(CHAT_PIECES), max_size=10)))
    fed = cls()
    d = ReasoningDelta()
    for p in _pieces(data.draw, text):
        d += fed.feed(p)
    d += fed.finish()
    assert (d.reasoning or None, d.text or None) == cls().parse(text)
