"""The ``hermes`` tool-call format (Hermes 2 Pro, Qwen 2.5 and later): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the text.

Text outside the tags is content (whitespace right before a call, and at the end of an
answer that made calls, is dropped). A call is sent once its closing tag is seen (an
answer that ends inside a tag: at its end), its arguments as compact JSON text. What
is inside a tag but is not a JSON object with a string ``name`` (and an object
``arguments``, ``{}`` if absent) stays content, tags and all.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from engine.tools.parsers.base import ToolDelta, ToolParser, new_call_id

logger = logging.getLogger(__name__)

START = "<tool_call>"
END = "</tool_call>"


def _held_prefix(buf: str, tag: str) -> int:
    """The length of the longest suffix of ``buf`` that begins ``tag`` (held back: the
    tag may be completed by the next text)."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._buf = ""  # text not yet handled (a tag's beginning; a call's body)
        self._ws = ""  # content's trailing whitespace, sent only if content follows
        self._before = ""  # that whitespace when a tag opened (restored if it is no call)
        self._inside = False
        self.calls = 0

    def feed(self, text: str) -> list[ToolDelta]:
        self._buf += text
        out: list[ToolDelta] = []
        while True:
            if self._inside:
                at = self._buf.find(END)
                if at < 0:
                    return out
                body, self._buf = self._buf[:at], self._buf[at + len(END) :]
                self._inside = False
                out.extend(self._call(body, closed=True))
                continue
            at = self._buf.find(START)
            if at < 0:
                keep = _held_prefix(self._buf, START)
                out.extend(self._content(self._buf[: len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep :]
                return out
            out.extend(self._content(self._buf[:at]))
            self._buf = self._buf[at + len(START) :]
            self._before, self._ws, self._inside = self._ws, "", True

    def finish(self) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        if self._inside:
            self._inside = False
            out.extend(self._call(self._buf, closed=False))
        else:
            out.extend(self._content(self._buf))
        self._buf = ""
        tail, self._ws = self._ws, ""
        if tail and not self.calls:
            out.append(ToolDelta(content=tail))
        return out

    def _content(self, text: str) -> list[ToolDelta]:
        """Content, its trailing whitespace held in ``_ws``."""
        if not text:
            return []
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        return [ToolDelta(content=body)] if body else []

    def _call(self, body: str, closed: bool) -> list[ToolDelta]:
        parsed = _parse_call(body)
        if parsed is None:
            raw = START + body + (END if closed else "")
            logger.debug("hermes: not a tool call, kept as content: %.80s", raw)
            before, self._before = self._before, ""
            self._ws = before
            return self._content(raw)
        self._before = ""
        if self.calls and not self.parallel:
            return []  # parallel_tool_calls false: the first call only
        index, self.calls = self.calls, self.calls + 1
        name, arguments = parsed
        return [ToolDelta(call=index, id=new_call_id(), name=name, arguments=arguments)]


def _parse_call(body: str) -> tuple[str, str] | None:
    try:
        value: Any = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":"))
