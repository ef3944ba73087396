"""One chat choice's answer as reasoning and the rest: the stream's deltas and the body's
message, built from the same ``ReasoningDelta`` pieces (so a stream adds up to the body).

The content part goes on to a ``ToolOutput`` when the request's answer is parsed into
tool calls (vLLM's order: tool calls are looked for after the reasoning only); else it is
the ``content``. ``reasoning_content`` comes before ``content`` in a delta, and in the
message it is null when the answer has no reasoning (so is ``content`` when nothing
follows the reasoning).
"""

from __future__ import annotations

from typing import Any

from engine.reasoning.base import ReasoningParser
from engine.tools.output import ToolOutput


class ReasoningOutput:
    """One choice's reasoning and content, fed its text step by step (``delta``) or whole
    (``message``); ``tools``: the choice's tool calls, parsed from the content part."""

    def __init__(self, parser: ReasoningParser, tools: ToolOutput | None = None) -> None:
        self.parser = parser
        self.tools = tools

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """A stream chunk's ``delta`` for the answer's next ``text`` (``final``: its last):
        ``reasoning_content``, then ``content`` (or tool calls); ``{}``: nothing yet."""
        d = self.parser.feed(text) if text else None
        if final:
            d = self.parser.finish() if d is None else d + self.parser.finish()
        out: dict[str, Any] = {}
        if d is not None and d.reasoning:
            out["reasoning_content"] = d.reasoning
        content = "" if d is None else d.content
        if self.tools is not None:
            out.update(self.tools.delta(content, final))
        elif content:
            out["content"] = content
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The body's ``message`` for the whole answer ``text``."""
        reasoning, content = self.parser.parse(text)
        msg: dict[str, Any] = {"role": "assistant", "reasoning_content": reasoning}
        if self.tools is not None:
            msg.update(self.tools.message(content or ""))
        else:
            msg["content"] = content
        return msg

    def finish_reason(self, reason: str) -> str:
        return reason if self.tools is None else self.tools.finish_reason(reason)
