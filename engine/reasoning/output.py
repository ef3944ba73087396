"""One chat choice's answer as reasoning and the rest: the stream's deltas and the body's
message, built from the same ``ReasoningDelta`` pieces (so a stream adds up to the body).

The content part goes on to a ``ToolOutput`` when the request's answer is parsed into
tool calls (vLLM's order: tool calls are looked for after the reasoning only); else it is
the ``content``. ``reasoning_content`` comes before ``content`` in a delta, and in the
message it is null when the answer has no reasoning (so is ``content`` when nothing
follows the reasoning).

The text's order is kept: content written before the reasoning (qwen3's text before
``<think>``) is a delta of its own, before the reasoning's, even when one step's text
holds both (``deltas``); the body's message, built by the same steps (``message_of``),
says what of it came before the reasoning (``before_reasoning``), so that a Responses
API answer puts its items in the same order streamed or not.
"""

from __future__ import annotations

from typing import Any

from engine.reasoning.base import ReasoningDelta, ReasoningParser
from engine.tools.output import ToolOutput

BEFORE_REASONING = "before_reasoning"


class ReasoningOutput:
    """One choice's reasoning and content, fed its text step by step (``deltas``) or
    whole (``message``); ``tools``: the choice's tool calls, parsed from the content part."""

    def __init__(self, parser: ReasoningParser, tools: ToolOutput | None = None) -> None:
        self.parser = parser
        self.tools = tools
        self.reasoning = ""  # the reasoning so far (deltas)
        self.content = ""  # the content so far, without tools (deltas)
        self.tokens = 0  # the tokens fed so far (deltas)
        # What came before the reasoning: the content and tool calls said before its first
        # delta, and the tokens up to the step that began it (None: no reasoning yet).
        self.before: dict[str, Any] | None = None
        self._content_before = ""
        self._calls_before = 0

    def _content(self, text: str, final: bool, tokens: int = 0) -> list[dict[str, Any]]:
        """The deltas of the content part ``text`` (with tools: in the text's order)."""
        if self.tools is not None:
            return self.tools.deltas(text, final, tokens)
        return [{"content": text} if text else {}]

    def deltas(self, text: str, final: bool, tokens: int = 0) -> list[dict[str, Any]]:
        """A stream step's deltas for the answer's next ``text`` (``final``: its last;
        ``tokens``: how many it is), in the text's order: the content written before
        this step's reasoning (a delta of its own), then ``reasoning_content`` and the
        content after it (or tool calls). One delta at least (``{}``: nothing yet)."""
        d = self.parser.feed(text) if text else ReasoningDelta()
        if final:
            d = d + self.parser.finish()
        self.tokens += tokens
        parts: list[dict[str, Any]] = []
        if d.lead:
            parts += [p for p in self._content(d.lead, False, tokens) if p]
            tokens = 0  # the tools count the step's tokens once
        main: dict[str, Any] = {}
        if d.reasoning:
            main["reasoning_content"] = d.reasoning
        first, *rest = self._content(d.content, final, tokens)
        main.update(first)
        parts += [main, *rest]
        for part in parts:
            self._note(part)
        return parts

    def _note(self, part: dict[str, Any]) -> None:
        reasoning = part.get("reasoning_content") or ""
        if reasoning and self.before is None:
            self.before = {"content": self._content_before, "tool_calls": self._calls_before,
                           "tokens": self.tokens}  # fmt: skip
        self.reasoning += reasoning
        self.content += part.get("content") or ""
        if self.before is None:
            self._content_before += part.get("content") or ""
            self._calls_before += sum("id" in c for c in part.get("tool_calls") or [])

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """A stream chunk's ``delta`` for the answer's next ``text`` (``final``: its last):
        ``reasoning_content``, then ``content`` (or tool calls); ``{}``: nothing yet.
        (``deltas``' parts in one: a content before the reasoning leads the content.)"""
        out: dict[str, Any] = {}
        for part in self.deltas(text, final):
            for key, value in part.items():
                out[key] = out[key] + value if key in out else value
        if "reasoning_content" in out:  # the reasoning first, as a delta's keys go
            out = {"reasoning_content": out.pop("reasoning_content"), **out}
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

    def message_of(self, steps: list[tuple[str, int]]) -> dict[str, Any]:
        """The body's ``message`` for the answer the engine's ``steps`` (each its text and
        its tokens) make, fed as a stream feeds them: the same message as ``message`` of
        their text, with ``before_reasoning`` when content or tool calls were said before
        the reasoning (``content``, the number of ``tool_calls``, and ``tokens``: those
        up to the step that began the reasoning)."""
        if not steps:
            return self.message("")
        for i, (text, tokens) in enumerate(steps):
            self.deltas(text, i == len(steps) - 1, tokens)
        msg: dict[str, Any] = {"role": "assistant", "reasoning_content": self.reasoning or None}
        if self.tools is not None:
            content = "".join(self.tools.content)
            msg.update(content=content or None, tool_calls=self.tools.calls)
            msg.update(self.tools.order())
        else:
            msg["content"] = self.content or None
        b = self.before
        if b is not None and (b["content"] or b["tool_calls"]):
            msg[BEFORE_REASONING] = b
        return msg

    def finish_reason(self, reason: str) -> str:
        return reason if self.tools is None else self.tools.finish_reason(reason)
