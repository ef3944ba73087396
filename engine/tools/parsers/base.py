"""What a tool-call parser is: text in, content and tool-call pieces out, token by token.

A parser is fed the answer's text as it is generated (``feed``) and told when it ended
(``finish``); each returns ``ToolDelta`` pieces in order. Fed the whole text at once or a
token at a time, the pieces add up to the same content and calls (the non-streamed
answer is built from the same pieces as the stream).
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass


def new_call_id() -> str:
    """A tool call's id: ``chatcmpl-tool-<32 hex>`` (vLLM's ``random_tool_call_id``)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolDelta:
    """Content text (``call`` None), or a piece of tool call ``call`` (0, 1...): its
    first piece has ``id`` and ``name``, every piece may add ``arguments`` text (the
    arguments are the concatenation of a call's pieces')."""

    content: str = ""
    call: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class JsonNesting:
    """JSON text's nesting, fed character by character: brackets and braces counted
    outside strings (escapes inside them skipped). The streaming parsers use it to find
    where an object being generated ends."""

    __slots__ = ("_esc", "_in_str", "depth")

    def __init__(self) -> None:
        self.depth = 0
        self._in_str = False
        self._esc = False

    def step(self, c: str) -> int:
        """The depth after ``c``."""
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
        elif c == '"':
            self._in_str = True
        elif c in "[{":
            self.depth += 1
        elif c in "]}":
            self.depth -= 1
        return self.depth


class ToolParser(ABC):
    """One choice's parser (a fresh one per choice). ``parallel`` false: at most one call
    is returned (later ones are dropped). ``cut``: set by ``finish`` when the answer
    ended inside a call's arguments (sent as far as they went)."""

    name: str = ""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.cut = False

    @abstractmethod
    def feed(self, text: str) -> list[ToolDelta]:
        """The pieces ``text`` (the answer's next text) completes."""

    @abstractmethod
    def finish(self) -> list[ToolDelta]:
        """The answer ended: the pieces still held back."""

    def parse(self, text: str) -> list[ToolDelta]:
        """A whole answer's pieces."""
        return [*self.feed(text), *self.finish()]
