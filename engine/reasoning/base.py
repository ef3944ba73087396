"""What a reasoning parser is: an answer's text in, its reasoning and its content out.

A reasoning model writes its thinking first, between ``<think>`` and ``</think>`` (the
template may have put ``<think>`` in the prompt), then the answer proper. A parser is fed
the answer's text as it is generated (``feed``) and told when it ended (``finish``);
each returns the ``ReasoningDelta`` that text completes. A tag's beginning at the end of
a piece is held back until the next piece says whether it is the tag. Fed the whole text
at once or a token at a time, the deltas add up to the same reasoning and content (the
non-streamed answer is built from the same pieces as the stream: ``parse``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START = "<think>"
END = "</think>"


def held_prefix(buf: str, tag: str) -> int:
    """The length of the longest suffix of ``buf`` that begins ``tag`` (held back: the
    next text may complete the tag)."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class ReasoningDelta:
    """The reasoning text and the content text one piece completes (either may be ""), in
    the text's order: ``lead`` (content written before this piece's reasoning: qwen3's
    text before ``<think>``, when the ``<think>`` is in the piece), the reasoning, the
    content after it. ``lead`` is "" unless ``reasoning`` follows it."""

    reasoning: str = ""
    content: str = ""
    lead: str = ""

    def __add__(self, other: ReasoningDelta) -> ReasoningDelta:
        if not self.reasoning and other.reasoning:  # all of self comes before other's reasoning
            return ReasoningDelta(other.reasoning, other.content,
                                  self.lead + self.content + other.lead)  # fmt: skip
        return ReasoningDelta(
            self.reasoning + other.reasoning, self.content + other.lead + other.content, self.lead
        )

    @property
    def text(self) -> str:
        """All its content: the lead and the content after the reasoning."""
        return self.lead + self.content


class ReasoningParser:
    """One choice's parser (a fresh one per choice): the answer's text goes through the
    states ``before`` (content before a ``<think>``), ``reasoning`` (up to ``</think>``,
    the tags left out) and ``after`` (content: the rest, tags and all). A parser's class
    picks where an answer starts (``initial``: ``before``, or ``start``, reasoning whose
    leading ``<think>``, if the model writes one, is dropped) and whether a request's
    answer has a reasoning part at all (``applies``)."""

    name: str = ""
    initial: str = "before"

    def __init__(self) -> None:
        self._state = self.initial
        self._buf = ""  # text held back: a tag's possible beginning

    @classmethod
    def applies(cls, chat_template_kwargs: dict[str, Any]) -> bool:
        """Whether a request's answer may have a reasoning part (False: it is all
        content, and no parser is used)."""
        return True

    def feed(self, text: str) -> ReasoningDelta:
        """The reasoning and content ``text`` (the answer's next text) completes."""
        self._buf += text
        out = ReasoningDelta()
        while self._buf:
            if self._state == "after":
                out, self._buf = out + ReasoningDelta(content=self._buf), ""
                break
            if self._state == "start":
                if START.startswith(self._buf) and len(self._buf) < len(START):
                    break  # may still be the leading <think>
                if self._buf.startswith(START):
                    self._buf = self._buf[len(START) :]
                self._state = "reasoning"
                continue
            tag = START if self._state == "before" else END
            at = self._buf.find(tag)
            if at < 0:
                keep = held_prefix(self._buf, tag)
                out += self._emit(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            out += self._emit(self._buf[:at])
            self._buf = self._buf[at + len(tag) :]
            if self._state == "before":  # the content so far comes before the reasoning
                out = ReasoningDelta(lead=out.content)
            self._state = "reasoning" if self._state == "before" else "after"
        return out if out.reasoning or not out.lead else ReasoningDelta(content=out.text)

    def finish(self) -> ReasoningDelta:
        """The answer ended: the text still held back, in the part it was in."""
        out, self._buf = self._emit(self._buf), ""
        return out

    def _emit(self, text: str) -> ReasoningDelta:
        if not text:
            return ReasoningDelta()
        if self._state in ("start", "reasoning"):
            return ReasoningDelta(reasoning=text)
        return ReasoningDelta(content=text)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer's (reasoning, content), each None when empty."""
        d = self.feed(text) + self.finish()
        return d.reasoning or None, d.text or None
