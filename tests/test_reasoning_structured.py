"""Structured outputs on a node with a reasoning parser (vLLM's behaviour): the answer
reasons freely, the grammar constrains only its content -- from the token after the
reasoning's end (``</think>``) on; an answer that never ends its reasoning within
``max_tokens`` was never constrained and finishes "length".

Live, the ``tiny`` model (byte tokenizer, random weights) is steered with request fields
only: ``logit_bias`` keeps it to the tags' characters, and ``bad_words`` make a ``<``
go on as ``</think>`` (``STEER``): its reasoning is tag characters no JSON grammar
allows first, and ends after its first ``</``. Through a node, and P/D behind the proxy
(P samples the first token: in the reasoning, or opening it), equal to a colocated node.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np
import pytest
from fakes import RemotePrefill
from harness import MODEL, chat_stream_choices
from test_reasoning import CASES
from test_request_metrics import _config

from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput
from engine.reasoning import ReasoningParser, parser_class
from engine.sampling_params import SamplingParams
from engine.structured.compiler import GrammarCompiler
from engine.structured.matcher import GrammarState, bitmask_words, fill_bitmask
from engine.structured.reasoning import Phase, ReasoningGate, ReasoningTags
from engine.structured.spec import StructuredOutput
from engine.tokenizer import ByteTokenizer
from kvconnector.params import KVTransferParams

pytest.importorskip("llguidance")

VOCAB = 512  # the tiny model's logits (its byte tokenizer: ids 0-257)

MSG = [{"role": "user", "content": "is it ok?"}]
START, END = "<think>", "</think>"
TAGS = sorted(set(START + END))  # < / t h i n k >
# No free strings: content never holds a "<" (which STEER would make go on as "</think>").
SCHEMA = {
    "type": "object",
    "properties": {"word": {"enum": ["think", "ink", "hint"]}, "ok": {"type": "boolean"}},
    "required": ["word", "ok"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
TOOLS = [{"type": "function", "function": {"name": "judge", "parameters": SCHEMA}}]


def _steer_words() -> list[str]:
    """``bad_words`` under which a "<" goes on as "</" or "<t" (the start tag's own way),
    and a "</" as "</think>": each other tag character banned after each prefix."""
    words = [f"<{c}" for c in TAGS if c not in "/t"]
    for k in range(2, len(END)):
        words += [END[:k] + c for c in TAGS if c != END[k]]
    return words


def steer(reason: bool = True, end: bool = True) -> dict[str, Any]:
    """Request fields that keep the tiny model to the tags' characters (``reason``: "<"
    too, which opens a qwen3 answer's reasoning) and make it close its reasoning at its
    first "</" (``end``; else never: "</" is banned)."""
    bias = {str(ord(c)): 100 for c in TAGS if reason or c != "<"}
    if not reason:
        bias[str(ord("<"))] = -100
    words = _steer_words() if end else ["</"]
    return {"logit_bias": bias, "bad_words": words}


STEER = steer()


def _check_schema(text: str | None) -> dict[str, Any]:
    assert text is not None
    value = json.loads(text)
    assert set(value) == {"word", "ok"}, value
    assert value["word"] in ("think", "ink", "hint") and isinstance(value["ok"], bool)
    return value


def _is_free_reasoning(text: str | None) -> bool:
    """Reasoning the grammar did not constrain: tag characters (JSON starts with "{")."""
    return bool(text) and set(text) <= set(TAGS)  # type: ignore[arg-type]


# -- the gate and the grammar state, token by token ------------------------------------------------

R1, Q3 = parser_class("deepseek_r1"), parser_class("qwen3")
R1_TAGS = ReasoningTags(end=tuple(END.encode()))
Q3_TAGS = ReasoningTags(end=tuple(END.encode()), start=tuple(START.encode()))


def test_the_tags_are_the_parsers_tags_in_the_nodes_ids() -> None:
    assert ReasoningTags.of(R1, ByteTokenizer()) == R1_TAGS  # the answer starts reasoning
    assert ReasoningTags.of(Q3, ByteTokenizer()) == Q3_TAGS
    for bad in ((), (-1,)):
        with pytest.raises(ValueError):
            ReasoningTags(end=bad)


def _content_start(tags: ReasoningTags, text: str) -> int | None:
    """The index of the first content token of ``text`` (bytes), as the gate finds it."""
    gate = ReasoningGate(tags)
    if gate.phase is Phase.CONTENT:
        return 0
    for i, t in enumerate(text.encode()):
        before = gate.phase
        if gate.feed(t) is Phase.CONTENT:
            return i if before is Phase.OPENING else i + 1
    return None


@pytest.mark.parametrize("cls, text, reasoning, content", CASES)
def test_the_gate_finds_the_content_where_the_parser_does(
    cls: type[ReasoningParser], text: str, reasoning: str | None, content: str | None
) -> None:
    tags = ReasoningTags.of(cls, ByteTokenizer())
    at = _content_start(tags, text)
    if cls is Q3 and "<think>" in text and not text.startswith("<"):
        # Content before a later <think>: under a grammar from its first token on (the
        # answer did not open its reasoning), which never lets it write the tag.
        assert at == 0
        return
    got = None if at is None else text[at:]
    assert (got or None) == content, (text, at)


def _state(so: StructuredOutput, tags: ReasoningTags | None) -> GrammarState:
    compiler = GrammarCompiler(ByteTokenizer, VOCAB)
    return GrammarState(compiler.new_matcher(so), tags)


def _mask(state: GrammarState) -> list[int]:
    """The ids the state's mask allows."""
    buf = fill_bitmask([(0, state)], VOCAB)
    row = buf[: bitmask_words(VOCAB)].view(np.uint32)
    return [t for t in range(VOCAB) if (int(row[t // 32]) >> (t % 32)) & 1]


DIGITS = list(range(ord("0"), ord("9") + 1))


def test_deepseek_r1_the_grammar_waits_for_the_reasonings_end() -> None:
    state = _state(StructuredOutput.regex("[0-9]{2}"), R1_TAGS)
    for t in b"no digits here <think> </thin":  # none of it is the grammar's
        assert not state.constrains and state.accept(t) and not state.finished
    for t in b"k>":
        assert state.accept(t)
    assert state.constrains and _mask(state) == DIGITS  # the grammar's start: not advanced
    assert state.accept(ord("4")) and not state.finished
    assert not state.accept(ord("x"))  # the content follows the grammar
    state = _state(StructuredOutput.regex("[0-9]{2}"), R1_TAGS)
    for t in b"</think>42":
        assert state.accept(t)
    # Complete: only EOS may follow, and the answer ends with it (vLLM's convention).
    assert not state.finished and _mask(state) == [ByteTokenizer.EOS]
    assert state.accept(ByteTokenizer.EOS) and state.finished
    # Without tags (no reasoning part) the grammar constrains from the first token.
    plain = _state(StructuredOutput.regex("[0-9]{2}"), None)
    assert plain.constrains and _mask(plain) == DIGITS and not plain.accept(ord("<"))


def test_qwen3_an_answer_may_open_its_reasoning_else_it_is_content() -> None:
    so = StructuredOutput.regex("[0-9]{2}")
    state = _state(so, Q3_TAGS)
    assert state.constrains and _mask(state) == sorted([*DIGITS, ord("<")])
    tag = START.encode()
    for k, t in enumerate(tag[:-1]):  # a tag the grammar does not allow: only it may go on
        assert state.accept(t) and _mask(state) == [tag[k + 1]]
    assert state.accept(tag[-1])
    assert not state.constrains  # reasoning: the grammar waits, at its start
    for t in b"x</think>":
        assert state.accept(t)
    assert state.constrains and _mask(state) == DIGITS
    # Off the tag at once: content, constrained from its first token.
    state = _state(so, Q3_TAGS)
    assert state.accept(ord("1")) and state.constrains and _mask(state) == DIGITS
    assert state.reasoning is not None and state.reasoning.phase is Phase.CONTENT
    # A grammar that allows the tag's beginning: the prefix is content if the answer
    # leaves the tag (the parser's split: "<x" is content).
    state = _state(StructuredOutput.regex("<[a-z]+"), Q3_TAGS)
    assert _mask(state) == [ord("<")]
    assert state.accept(ord("<")) and _mask(state) == list(range(ord("a"), ord("z") + 1))
    assert state.accept(ord("x")) and state.accept(ord("y"))
    assert state.reasoning is not None and state.reasoning.phase is Phase.CONTENT
    state = _state(StructuredOutput.regex("<[a-z]+"), Q3_TAGS)
    for t in b"<think>":  # ... and nothing when it goes on to open its reasoning
        assert state.accept(t)
    for t in b"!</think>":
        assert state.accept(t)
    assert _mask(state) == [ord("<")]


def _decode_node(tags: ReasoningTags | None) -> tuple[Scheduler, RemotePrefill]:
    conn = RemotePrefill(_config())
    grammars = GrammarCompiler(ByteTokenizer, VOCAB)
    sch = Scheduler(_config(), 64, 256, conn, grammars, VOCAB)
    params = KVTransferParams(
        do_remote_prefill=True, transfer_id="t", remote_side_channel="tcp://127.0.0.1:1"
    )
    sp = SamplingParams(max_tokens=8, structured_output=StructuredOutput.regex("[0-9]{2}"),
                        reasoning_tags=tags)  # fmt: skip
    sch.add_request(Request("d", list(range(1, 9)), sp, kv_transfer_params=params))
    sch.update_from_output(sch.schedule(), ModelRunnerOutput())
    return sch, conn


@pytest.mark.parametrize("first, constrained", [(ord("|"), True), (ord("x"), False)])
def test_a_decode_node_takes_the_prefill_nodes_first_token_through_the_gate(
    first: int, constrained: bool
) -> None:
    """P sampled the first token: the reasoning's end (a one-token tag here, as Qwen3's
    and R1's are) -- D's first sample is the content's, under the grammar's start -- or a
    reasoning token: D's sample is free."""
    sch, conn = _decode_node(ReasoningTags(end=(ord("|"),)))
    conn.landed = {"d": {"first_token": first}}
    (out,) = sch.update_from_output(sch.schedule(), ModelRunnerOutput())
    assert out.new_token_ids == [first] and not out.finished
    step = sch.schedule()
    if constrained:
        assert step.grammar_bitmask is not None and list(step.grammar_bitmask[-1:]) == [0]
        (out,) = sch.update_from_output(step, ModelRunnerOutput(sampled_token_ids={"d": 55}))
        (out,) = sch.update_from_output(
            sch.schedule(), ModelRunnerOutput(sampled_token_ids={"d": 56})
        )
        assert not out.finished  # complete: its EOS comes next
        (out,) = sch.update_from_output(
            sch.schedule(), ModelRunnerOutput(sampled_token_ids={"d": ByteTokenizer.EOS})
        )
        assert out.finished and out.finish_reason == "stop" and out.ended_by_grammar
    else:
        assert step.grammar_bitmask is None
        (out,) = sch.update_from_output(step, ModelRunnerOutput(sampled_token_ids={"d": 300}))
        assert not out.finished  # not the grammar's: it waits


@pytest.mark.parametrize(
    "tags", [None, ReasoningTags(start=(ord("<"),), end=(ord("|"),))], ids=["plain", "opening"]
)
def test_a_prefill_nodes_first_token_its_grammar_refuses_is_computed_again_on_the_decode_node(
    tags: ReasoningTags | None,
) -> None:
    """A first token from P that D's grammar refuses (P and D started with different
    ``--reasoning-parser``s, or a hand-made decode leg): D computes the first token itself
    under its grammar, as for a token outside the vocabulary, rather than failing the
    request with an internal error."""
    sch, conn = _decode_node(tags)
    conn.landed = {"d": {"first_token": ord("x")}}
    outs = sch.update_from_output(sch.schedule(), ModelRunnerOutput())
    assert all(not o.new_token_ids and not o.finished for o in outs), outs
    step = sch.schedule()
    (seq,) = step.seqs
    assert seq.token_ids == [8] and step.grammar_bitmask is not None  # the last prompt token
    (out,) = sch.update_from_output(step, ModelRunnerOutput(sampled_token_ids={"d": ord("4")}))
    assert out.new_token_ids == [ord("4")] and not out.finished


def _post(url: str, body: dict[str, Any], status: int = 200) -> Any:
    resp = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=120)
    assert resp.status_code == status, resp.text
    return resp.json()


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Each choice's stream put together: reasoning, content, tool calls, ids, finish."""
    out = []
    for chunks in chat_stream_choices(url, body).values():
        one: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "ids": [],
                               "finish": None}  # fmt: skip
        for c in chunks:
            d = c["delta"]
            one["reasoning"] += d.get("reasoning_content") or ""
            one["content"] += d.get("content") or ""
            for call in d.get("tool_calls") or []:
                got = one["calls"].setdefault(call["index"], ["", ""])
                got[0] += call["function"].get("name") or ""
                got[1] += call["function"].get("arguments") or ""
            one["ids"] += c.get("token_ids") or []
            one["finish"] = c["finish_reason"] or one["finish"]
        one["calls"] = [tuple(v) for _, v in sorted(one["calls"].items())]
        out.append(one)
    return out


def _summary(choice: dict[str, Any]) -> dict[str, Any]:
    """A body's choice in ``_stream``'s terms."""
    msg = choice["message"]
    calls = msg.get("tool_calls") or []
    return {
        "reasoning": msg["reasoning_content"] or "",
        "content": msg["content"] or "",
        "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
        "ids": choice["token_ids"],
        "finish": choice["finish_reason"],
    }


def _node_set(procs: Any, parser: str) -> tuple[str, dict[str, str]]:
    pair = procs.pd(1, 1, "--num-blocks", "256", "--reasoning-parser", parser, colocated=True)
    proxy = procs.proxy([pair.p.url], [pair.d.url])
    return pair.colocated.url, {"node": pair.colocated.url, "proxy": proxy.url}


@pytest.fixture(scope="module")
def r1(module_procs: Any) -> tuple[str, dict[str, str]]:
    """deepseek_r1: a colocated node (the reference), and P/D behind a proxy."""
    return _node_set(module_procs, "deepseek_r1")


@pytest.fixture(scope="module")
def qwen3(module_procs: Any) -> tuple[str, dict[str, str]]:
    return _node_set(module_procs, "qwen3")


def _answers(ref: str, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The choices ``url`` answers, checked equal to the reference's, whole and streamed."""
    got = [_summary(c) for c in _post(url, body)["choices"]]
    assert got == [_summary(c) for c in _post(ref, body)["choices"]]  # P/D: token for token
    assert _stream(url, body) == got
    return got


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_deepseek_r1_reasons_freely_then_the_content_follows_the_schema(
    r1: tuple[str, dict[str, str]], through: str
) -> None:
    ref, urls = r1
    for extra in ({"seed": 1}, {"seed": 2, "n": 2}):
        body = {"messages": MSG, "max_tokens": 120, "temperature": 1.0,
                "response_format": SCHEMA_FORMAT, **STEER, **extra}  # fmt: skip
        for one in _answers(ref, urls[through], body):
            assert _is_free_reasoning(one["reasoning"]), one
            _check_schema(one["content"])
            assert one["finish"] == "stop"
            # The reasoning's end and the content are the answer's tokens, in that order,
            # then EOS (the grammar's end: vLLM's convention).
            assert one["ids"][-1] == ByteTokenizer.EOS
            text = bytes(one["ids"][:-1]).decode()
            assert text == one["reasoning"] + END + one["content"]


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_deepseek_r1_named_tool_choice_and_other_grammars(
    r1: tuple[str, dict[str, str]], through: str
) -> None:
    ref, urls = r1
    named = {"type": "function", "function": {"name": "judge"}}
    body = {"messages": MSG, "max_tokens": 120, "temperature": 1.0, "seed": 3, "tools": TOOLS,
            "tool_choice": named, **STEER}  # fmt: skip
    (one,) = _answers(ref, urls[through], body)
    assert _is_free_reasoning(one["reasoning"]) and one["content"] == ""
    ((name, args),) = one["calls"]
    assert name == "judge"
    _check_schema(args)
    for field, check in (
        ({"structured_outputs": {"choice": ["hint", "kit"]}}, lambda t: t in ("hint", "kit")),
        ({"guided_regex": "[hint]{3}!"}, lambda t: len(t) == 4 and t.endswith("!")),
    ):
        body = {"messages": MSG, "max_tokens": 120, "temperature": 1.0, "seed": 4, **STEER,
                **field}  # fmt: skip
        (one,) = _answers(ref, urls[through], body)
        assert _is_free_reasoning(one["reasoning"]) and check(one["content"]), one


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_an_answer_that_never_ends_its_reasoning_finishes_length_unconstrained(
    r1: tuple[str, dict[str, str]], through: str
) -> None:
    ref, urls = r1
    body = {"messages": MSG, "max_tokens": 12, "temperature": 1.0, "seed": 5,
            "response_format": SCHEMA_FORMAT, **steer(end=False)}  # fmt: skip
    (one,) = _answers(ref, urls[through], body)
    assert one["finish"] == "length" and one["content"] == ""
    assert _is_free_reasoning(one["reasoning"]) and len(one["ids"]) == 12


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_qwen3_opens_its_reasoning_or_answers_content_under_the_schema(
    qwen3: tuple[str, dict[str, str]], through: str
) -> None:
    """A qwen3 answer reasons when it opens with <think> (P samples that "<" under the
    grammar's mask with the tag's first token allowed too); one that does not is content,
    constrained from its first token (as the parser splits it: all content)."""
    ref, urls = qwen3
    base = {"messages": MSG, "max_tokens": 120, "temperature": 1.0,
            "response_format": SCHEMA_FORMAT}  # fmt: skip
    for seed in (1, 2):
        (one,) = _answers(ref, urls[through], {**base, "seed": seed, **STEER})
        assert _is_free_reasoning(one["reasoning"]) and one["finish"] == "stop", one
        _check_schema(one["content"])
        assert one["ids"][-1] == ByteTokenizer.EOS  # the grammar's end
        assert bytes(one["ids"][:-1]).decode() == START + one["reasoning"] + END + one["content"]
        (plain,) = _answers(ref, urls[through], {**base, "seed": seed, **steer(reason=False)})
        assert plain["reasoning"] == "" and plain["finish"] == "stop"
        assert bytes(plain["ids"][:-1]).decode() == plain["content"]
        _check_schema(plain["content"])


# -- the engine, offline: preemption and async scheduling keep the gate ---------------------------


def _generate(cfg: Any, prompts: list[str]) -> list[str]:
    """Each prompt's answer (steered: reasoning, then JSON), seeded, on an engine of ``cfg``;
    a tight one must have preempted."""
    from engine.bad_words import tokenize_bad_words
    from engine.llm import LLM

    tok = ByteTokenizer()
    params = [
        SamplingParams(
            max_tokens=150,
            temperature=1.0,
            seed=i,
            reasoning_tags=R1_TAGS,
            structured_output=StructuredOutput.json_schema(SCHEMA),
            logit_bias={int(k): float(v) for k, v in STEER["logit_bias"].items()},
            bad_words_token_ids=tokenize_bad_words(tok, STEER["bad_words"]),
        )
        for i in range(len(prompts))
    ]
    with LLM(cfg) as llm:
        outs = llm.generate_token_ids([tok.encode(p) for p in prompts], params)
        if cfg.cache.num_blocks < 64:
            assert llm.stats()["num_preemptions_total"] > 0, "the test should preempt"
    return [tok.decode(ids) for ids in outs]


@pytest.mark.slow
def test_preempted_and_async_scheduled_requests_keep_their_reasoning_and_grammar() -> None:
    """Few blocks and a small token budget (requests preempted and recomputed) under async
    scheduling: the answers are what a roomy synchronous engine gives -- reasoning, then
    content matching the schema."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig

    prompts = ["p" * n for n in (5, 40, 70, 90, 20, 60)]
    roomy = EngineConfig(
        cache=CacheConfig(num_blocks=256), scheduler=SchedulerConfig(async_scheduling=False)
    )
    want = _generate(roomy, prompts)
    for text in want:
        reasoning, _, content = text.partition(END)
        assert _is_free_reasoning(reasoning), text
        _check_schema(content)
    tight = EngineConfig(
        cache=CacheConfig(num_blocks=20),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8,
                                  async_scheduling=True),
    )  # fmt: skip
    assert _generate(tight, prompts) == want
