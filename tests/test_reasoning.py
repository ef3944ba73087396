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

import pytest

from engine.reasoning import PARSERS, ReasoningParser, parser_class
from engine.reasoning.base import ReasoningDelta

R1 = parser_class("deepseek_r1")
Q3 = parser_class("qwen3")


def _pieces(parser: ReasoningParser, text: str, size: int) -> list[ReasoningDelta]:
    out = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
    return [*out, parser.finish()]


def _split(pieces: list[ReasoningDelta]) -> tuple[str | None, str | None]:
    reasoning = "".join(p.reasoning for p in pieces)
    content = "".join(p.content for p in pieces)
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
