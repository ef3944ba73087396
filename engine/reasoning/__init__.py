"""Reasoning outputs (vLLM's ``--reasoning-parser``): a chat answer's ``<think>`` part
becomes ``reasoning_content``, the rest ``content``.

``base.py`` is the parser interface (``feed`` / ``finish`` for streams, ``parse`` for a
whole answer, tags split across pieces held back); one file per parser
(``deepseek_r1.py``, ``qwen3.py``) and this registry; ``output.py`` builds one chat
choice's stream deltas and body message from a parser's pieces (tool calls, when the
request has them, parsed from the content part). Pure: no engine, no I/O.
"""

from __future__ import annotations

from engine.reasoning.base import ReasoningDelta, ReasoningParser
from engine.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from engine.reasoning.qwen3 import Qwen3ReasoningParser

PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}

__all__ = ["PARSERS", "ReasoningDelta", "ReasoningParser", "parser_class"]


def parser_class(name: str) -> type[ReasoningParser]:
    """The parser called ``name`` (``KeyError`` if there is none)."""
    return PARSERS[name]
