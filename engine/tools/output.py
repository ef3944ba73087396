"""One chat choice's answer as content and tool calls: the stream's deltas and the
body's message, built from the same ``ToolDelta`` pieces (so a stream adds up to the
body).

* named tool choice (``NamedCall``): the whole text is the arguments of that tool (the
  grammar made it its schema's JSON); one call, sent as the text is generated;
* ``"required"`` (``RequiredCalls``): the text is a JSON array of ``{"name", "parameters"}``
  (``spec.required_schema``); each element is a call, its name sent once known and its
  ``parameters`` text streamed as generated;
* ``"auto"``: the node's ``--tool-call-parser`` (``parsers/``; hermes: each call's name
  once its head is read, then its arguments text as generated).

``finish_reason`` follows vLLM: named keeps the engine's; "required" is ``"tool_calls"``
when the answer ended by itself (``"stop"``); "auto" is ``"tool_calls"`` when a call was
parsed. A call cut off (``max_tokens``, a stop string inside its arguments) keeps the
engine's reason (``"length"``, ``"stop"``).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from engine.tools.parsers import ToolDelta, ToolParser, new_call_id, parser_class
from engine.tools.parsers.base import JsonNesting
from engine.tools.spec import ToolCalling

logger = logging.getLogger(__name__)

BEFORE_TOOL_CALLS = "before_tool_calls"


class NamedCall(ToolParser):
    """The answer is the arguments of tool ``name``."""

    def __init__(self, name: str) -> None:
        super().__init__(False)
        self.tool = name
        self._started = False

    def _piece(self, text: str) -> list[ToolDelta]:
        if self._started:
            return [ToolDelta(call=0, arguments=text)] if text else []
        self._started = True
        return [ToolDelta(call=0, id=new_call_id(), name=self.tool, arguments=text)]

    def feed(self, text: str) -> list[ToolDelta]:
        return self._piece(text) if text or not self._started else []

    def finish(self) -> list[ToolDelta]:
        return [] if self._started else self._piece("")


# An element's head as the grammar writes it: compact, "name" first.
_HEAD = re.compile(r'\{"name":"([A-Za-z0-9_-]{1,64})","parameters":')
_HEAD_MAX = len('{"name":"","parameters":') + 64


class RequiredCalls(ToolParser):
    """The answer is a JSON array of ``{"name": ..., "parameters": {...}}``: each element
    is a call. The text is scanned character by character (strings, nesting): an
    element's head names the call, what follows up to the element's closing brace is
    its arguments, streamed. An element not written head first is parsed whole when it
    closes (the grammar never writes one; a safety net)."""

    def __init__(self) -> None:
        super().__init__(True)
        self._nesting = JsonNesting()
        self._elem: str | None = None  # the element's text so far
        self._mode = "head"  # "head": its head not yet read; "args"; "whole"
        self.calls = 0

    def feed(self, text: str) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        for c in text:
            d = self._char(c)
            if d is None:
                continue
            last = out[-1] if out else None
            if last is not None and d.id is None and last.call == d.call:  # one piece per feed
                out[-1] = ToolDelta(call=d.call, id=last.id, name=last.name,
                                    arguments=last.arguments + d.arguments)  # fmt: skip
            else:
                out.append(d)
        return out

    def finish(self) -> list[ToolDelta]:
        # An element cut off (max_tokens, a stop string): its arguments are what was sent.
        self.cut = self._mode == "args" and self._elem is not None
        return []

    def _char(self, c: str) -> ToolDelta | None:
        before, depth = self._nesting.depth, self._nesting.step(c)
        if before == 1 and depth == 2:  # an element opens
            self._elem, self._mode = c, "head"
            return None
        if self._elem is None:
            return None  # the array's brackets and commas
        if before == 2 and depth == 1:  # the element closes
            elem, self._elem = self._elem + c, None
            return self._whole(elem) if self._mode != "args" else None
        self._elem += c
        if self._mode == "args":
            return ToolDelta(call=self.calls - 1, arguments=c)
        if self._mode == "head":
            m = _HEAD.fullmatch(self._elem)
            if m is not None:
                self._mode = "args"
                self.calls += 1
                return ToolDelta(call=self.calls - 1, id=new_call_id(), name=m.group(1))
            if len(self._elem) > _HEAD_MAX or not '{"name":"'.startswith(self._elem[:9]):
                self._mode = "whole"
        return None

    def _whole(self, elem: str) -> ToolDelta | None:
        try:
            value: Any = json.loads(elem)
            name, params = value["name"], value.get("parameters", {})
            assert isinstance(name, str)
        except (ValueError, KeyError, TypeError, AssertionError, RecursionError):
            logger.warning('a "required" tool call is not a call: %.80s', elem)
            return None
        self.calls += 1
        args = json.dumps(params, ensure_ascii=False, separators=(",", ":"))
        return ToolDelta(call=self.calls - 1, id=new_call_id(), name=name, arguments=args)


def new_parser(tc: ToolCalling, auto_parser: str | None) -> ToolParser:
    """The parser of a choice of a request with ``tc`` (its tool choice is not "none");
    ``auto_parser``: the node's ``--tool-call-parser`` (checked for "auto" at entry)."""
    if tc.choice == "named":
        assert tc.name is not None
        return NamedCall(tc.name)
    if tc.choice == "required":
        return RequiredCalls()
    assert auto_parser is not None, "auto tool choice without a --tool-call-parser"
    return parser_class(auto_parser)(tc.parallel)


class ToolOutput:
    """One choice's content and tool calls, fed its text step by step (``deltas``) or
    whole (``message``). ``marks``: for each call, the content said before it (in
    characters) and the tokens fed up to the step that began it (``message_of``'s
    ``before_tool_calls``, so that a Responses API answer keeps the text's order)."""

    def __init__(self, tc: ToolCalling, parser: ToolParser) -> None:
        self.choice = tc.choice
        self.parser = parser
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.marks: list[dict[str, int]] = []
        self.tokens = 0  # the tokens fed so far
        self._chars = 0  # the content's characters so far

    def _take(self, text: str, final: bool, tokens: int = 0) -> list[ToolDelta]:
        self.tokens += tokens
        pieces = self.parser.feed(text) if text else []
        if final:
            pieces += self.parser.finish()
        for p in pieces:
            if p.call is None:
                self.content.append(p.content)
                self._chars += len(p.content)
            elif p.id is not None:
                self.calls.append({"id": p.id, "type": "function",
                                   "function": {"name": p.name, "arguments": p.arguments}})  # fmt: skip
                self.marks.append({"chars": self._chars, "tokens": self.tokens})
            else:
                self.calls[-1]["function"]["arguments"] += p.arguments
        return pieces

    def deltas(self, text: str, final: bool, tokens: int = 0) -> list[dict[str, Any]]:
        """A stream step's deltas for the answer's next ``text`` (``final``: its last;
        ``tokens``: how many it is), ``content`` and ``tool_calls`` in OpenAI's shape, in
        the text's order: content after a call's piece begins a delta of its own. One
        delta at least (``{}``: nothing to send yet)."""
        out: list[dict[str, Any]] = [{}]
        for p in self._take(text, final, tokens):
            d = out[-1]
            calls = d.setdefault("tool_calls", []) if p.call is not None else []
            if p.call is None:
                if "tool_calls" in d:  # after a call: a delta of its own
                    if p.content:
                        out.append({"content": p.content})
                else:
                    d["content"] = d.get("content", "") + p.content
            elif p.id is not None:
                calls.append({"index": p.call, "id": p.id, "type": "function",
                              "function": {"name": p.name, "arguments": p.arguments}})  # fmt: skip
            elif calls and calls[-1]["index"] == p.call:
                calls[-1]["function"]["arguments"] += p.arguments
            else:
                calls.append({"index": p.call, "function": {"arguments": p.arguments}})
        return out

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """A stream chunk's ``delta`` for the answer's next ``text`` (``final``: its last):
        ``content`` and ``tool_calls`` in OpenAI's shape (``{}``: nothing to send yet;
        ``deltas``' parts in one)."""
        out: dict[str, Any] = {}
        for d in self.deltas(text, final):
            if "content" in d:
                out["content"] = out.get("content", "") + d["content"]
            if "tool_calls" in d:
                out["tool_calls"] = out.get("tool_calls", []) + d["tool_calls"]
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The body's ``message`` for the whole answer ``text``."""
        self._take(text, True)
        content = "".join(self.content)
        return {"role": "assistant", "content": content or None, "tool_calls": self.calls}

    def message_of(self, steps: list[tuple[str, int]]) -> dict[str, Any]:
        """The body's ``message`` for the answer the engine's ``steps`` (each its text and
        its tokens) make, fed as a stream feeds them: ``message``'s, with ``before_tool_calls``
        when it made calls."""
        for i, (text, tokens) in enumerate(steps):
            self._take(text, i == len(steps) - 1, tokens)
        if not steps:
            self._take("", True)
        content = "".join(self.content)
        msg = {"role": "assistant", "content": content or None, "tool_calls": self.calls}
        msg.update(self.order())
        return msg

    def order(self) -> dict[str, Any]:
        """``{"before_tool_calls": marks}`` when the answer made calls (pdserve's field:
        where each call sits in the content, and the tokens before it -- a Responses
        answer's message leaves a final call's tokens out of its log probabilities, as a
        stream does), else nothing."""
        if self.marks:
            return {BEFORE_TOOL_CALLS: [dict(m) for m in self.marks]}
        return {}

    def finish_reason(self, reason: str) -> str:
        """The choice's ``finish_reason`` for the engine's ``reason``. A call cut off
        (``max_tokens``, or a stop string inside its arguments) keeps the engine's reason
        ("length", "stop" with the string as ``stop_reason``): "tool_calls" says the calls
        are whole."""
        if not self.calls or self.choice == "named" or self.parser.cut:
            return reason
        if self.choice == "required":
            return "tool_calls" if reason == "stop" else reason
        return "tool_calls"
