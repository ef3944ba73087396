"""The ``hermes`` tool-call format (Hermes 2 Pro, Qwen 2.5 and later): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the text.

Text outside the tags is content (whitespace right before a call, and at the end of an
answer that made calls, is dropped). A call streams: once its head -- ``{"name": "N",
"arguments": {`` (whitespace allowed between the tokens) -- is read, its name goes out,
then the text of its arguments object as it is generated, up to the object's closing
brace (the rest of the tag is not looked at). ``arguments`` is the model's text as
written, whole or streamed. A tag whose text cannot begin with such a head is parsed
whole when it closes (or the answer ends): a JSON object with a string ``name`` and an
object ``arguments`` (``{}`` if absent) is a call, anything else stays content, tags and
all. So nothing of a call is sent before it is sure to be one: what the client got is
never taken back. The first ``</tool_call>`` closes a tag, even inside a JSON string.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from engine.tools.parsers.base import JsonNesting, ToolDelta, ToolParser, new_call_id

logger = logging.getLogger(__name__)

START = "<tool_call>"
END = "</tool_call>"
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_MORE = "more"  # a head not yet decided


def _held_prefix(buf: str, tag: str) -> int:
    """The length of the longest suffix of ``buf`` that begins ``tag`` (held back: the
    tag may be completed by the next text)."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


def _head(body: str) -> tuple[str, int] | str | None:
    """``body`` (a tag's text so far) read as a call's head ``{"name": "N", "arguments":
    {``: (N, where the arguments' ``{`` is), ``_MORE`` while ``body`` may still become
    one, None once it cannot. Whatever follows ``body`` keeps a decided answer."""
    i = 0
    for token in ("{", '"name"', ":", None, ",", '"arguments"', ":", "{"):
        i = _WS.match(body, i).end()
        if i == len(body):
            return _MORE
        if token is None:  # the name: a JSON string
            if body[i] != '"':
                return None
            j, esc = i + 1, False
            while j < len(body) and (esc or body[j] != '"'):
                esc = not esc and body[j] == "\\"
                j += 1
            if j == len(body):
                return _MORE
            try:
                name = json.loads(body[i : j + 1])
            except ValueError:
                return None
            i = j + 1
            continue
        got = body[i : i + len(token)]
        if not token.startswith(got):
            return None
        if len(got) < len(token):
            return _MORE
        i += len(token)
    return name, i - 1


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._buf = ""  # text not yet handled (a tag's beginning; a call's body)
        self._ws = ""  # content's trailing whitespace, sent only if content follows
        self._before = ""  # that whitespace when a tag opened (restored if it is no call)
        self._inside = False
        # Inside a tag: "head" (not yet decided), "args" (a call's arguments streaming),
        # "skip" (the rest of the tag: after the arguments, or a call dropped), "whole"
        # (not written head first: parsed when the tag closes).
        self._mode = "head"
        self._nesting = JsonNesting()  # the arguments' ("args")
        self.calls = 0

    def feed(self, text: str) -> list[ToolDelta]:
        self._buf += text
        out: list[ToolDelta] = []
        while True:
            if not self._inside:
                at = self._buf.find(START)
                if at < 0:
                    keep = _held_prefix(self._buf, START)
                    out.extend(self._content(self._buf[: len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.extend(self._content(self._buf[:at]))
                self._buf = self._buf[at + len(START) :]
                self._before, self._ws, self._inside = self._ws, "", True
                self._mode = "head"
            at = self._buf.find(END)
            if self._mode == "head":
                head = _head(self._buf if at < 0 else self._buf[:at])
                if head is None:
                    self._mode = "whole"
                elif head != _MORE:
                    name, opens = head
                    out.extend(self._open(name))
                    self._buf = self._buf[opens:]
                    at = self._buf.find(END)
            if self._mode in ("args", "skip"):
                upto = at if at >= 0 else len(self._buf) - _held_prefix(self._buf, END)
                out.extend(self._args(self._buf[:upto]))
                self._buf = self._buf[upto:]
                if at < 0:
                    return out
                self._buf = self._buf[len(END) :]
                self._inside = False
                continue
            if at < 0:
                return out
            body, self._buf = self._buf[:at], self._buf[at + len(END) :]
            self._inside = False
            out.extend(self._whole(body, closed=True))

    def finish(self) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        if not self._inside:
            out.extend(self._content(self._buf))
        elif self._mode in ("args", "skip"):
            out.extend(self._args(self._buf))  # a held-back "<" that began no tag
            self.cut = self._mode == "args"  # ended inside the arguments
        else:
            out.extend(self._whole(self._buf, closed=False))
        self._inside = False
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

    def _open(self, name: str) -> list[ToolDelta]:
        """A call's head was read: its first piece (none for a call dropped)."""
        self._before = ""
        self._nesting = JsonNesting()
        if self.calls and not self.parallel:
            self._mode = "skip"  # parallel_tool_calls false: the first call only
            return []
        self._mode = "args"
        self.calls += 1
        return [ToolDelta(call=self.calls - 1, id=new_call_id(), name=name)]

    def _args(self, text: str) -> list[ToolDelta]:
        """The arguments' next ``text`` (from their ``{``), up to the object's end."""
        if self._mode != "args" or not text:
            return []
        for i, c in enumerate(text):
            if self._nesting.step(c) == 0 and c in "]}":
                self._mode = "skip"
                text = text[: i + 1]
                break
        return [ToolDelta(call=self.calls - 1, arguments=text)]

    def _whole(self, body: str, closed: bool) -> list[ToolDelta]:
        """A tag not written head first, parsed whole."""
        parsed = _parse_call(body)
        if parsed is None:
            raw = START + body + (END if closed else "")
            logger.debug("hermes: not a tool call, kept as content: %.80s", raw)
            before, self._before = self._before, ""
            self._ws = before
            return self._content(raw)
        name, arguments = parsed
        out = self._open(name)
        if self._mode == "args":
            self._mode = "skip"
            out.append(ToolDelta(call=self.calls - 1, arguments=arguments))
        return out


def _parse_call(body: str) -> tuple[str, str] | None:
    """``body`` as a call: its name and the text of its arguments (the last
    ``"arguments"`` key's, as ``json.loads`` keeps; ``{}`` if absent), or None."""
    try:
        value: Any = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if "arguments" not in value:
        return value["name"], "{}"
    if not isinstance(value["arguments"], dict):
        return None
    # The object's members, read again for where each value's text is (body is valid).
    arguments, i = "", _WS.match(body).end() + 1
    while True:
        i = _WS.match(body, i).end()
        if body[i] == "}":
            break
        key, i = _DECODER.raw_decode(body, i)
        i = _WS.match(body, _WS.match(body, i).end() + 1).end()  # past the ":"
        _, j = _DECODER.raw_decode(body, i)
        if key == "arguments":
            arguments = body[i:j]
        i = _WS.match(body, j).end()
        if body[i] != ",":
            break
        i += 1
    return value["name"], arguments
