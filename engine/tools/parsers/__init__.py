"""The ``"auto"`` tool-choice parsers by name (``--tool-call-parser``): one file each."""

from __future__ import annotations

from engine.tools.parsers.base import ToolDelta, ToolParser, new_call_id
from engine.tools.parsers.hermes import HermesToolParser

PARSERS: dict[str, type[ToolParser]] = {HermesToolParser.name: HermesToolParser}

__all__ = ["PARSERS", "ToolDelta", "ToolParser", "new_call_id", "parser_class"]


def parser_class(name: str) -> type[ToolParser]:
    """The parser called ``name`` (``KeyError`` if there is none)."""
    return PARSERS[name]
