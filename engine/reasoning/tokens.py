"""An answer's reasoning tokens, counted on its token ids (the chat usage's
``completion_tokens_details.reasoning_tokens``; the Responses API's
``output_tokens_details.reasoning_tokens``).

vLLM's rule (its reasoning parsers' ``count_reasoning_tokens``, on a choice's generated
ids): the tokens between the start tag and the end tag, the tags themselves in no part.
``ReasoningTokens`` follows the parts as ``base.py``'s parsers do on the text:

* ``start`` (``deepseek_r1``): the answer starts in its reasoning; a leading start tag
  is dropped (not counted); a start tag later on is reasoning.
* ``before`` (``qwen3``): tokens before the first start tag are content; the reasoning
  begins after it.
* ``reasoning`` runs up to the first end tag (to the answer's end without one); what
  follows is content (``after``), tags and all.

The tags are matched as the token sequences the tokenizer makes of them (``TagIds``;
one token each for DeepSeek R1 and Qwen3, whose tags are special tokens). A tag the
model spells with other tokens is not seen here while the text split sees it (as
``engine/structured/reasoning.py``'s gate, and vLLM, which matches the tags' ids).
Tokens are counted, never estimated from the text's length. The caller feeds the ids
whose text is the answer's (``server/jobs.py`` leaves out a stop token whose text is
left out).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.reasoning.base import END, START

STATES = ("start", "before", "reasoning", "after")


def held_tokens(seen: Sequence[int], tag: tuple[int, ...]) -> int:
    """The length of the longest suffix of ``seen`` that begins ``tag`` (not yet known to
    be the tag or not)."""
    for n in range(min(len(tag) - 1, len(seen)), 0, -1):
        if tuple(seen[-n:]) == tag[:n]:
            return n
    return 0


@dataclass(frozen=True)
class TagIds:
    """The reasoning tags as the node's tokenizer writes them."""

    start: tuple[int, ...]
    end: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError(f"reasoning tags must be token ids, got {self!r}")

    @classmethod
    def of(cls, tokenizer: Any) -> TagIds:
        def ids(tag: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(tag, add_special_tokens=False))

        return cls(start=ids(START), end=ids(END))


class ReasoningTokens:
    """One answer's reasoning tokens so far (``count``), fed its token ids in order
    (``feed``) and told when it ended (``finish``). ``initial``: the parser's
    (``ReasoningParser.initial``), or ``after`` for an answer without a reasoning part."""

    __slots__ = ("_count", "_ended", "_seen", "_state", "tags")

    def __init__(self, tags: TagIds, initial: str) -> None:
        if initial not in STATES:
            raise ValueError(f"unknown reasoning state {initial!r}")
        self.tags = tags
        self._state = initial
        self._seen: list[int] = []  # start: the leading tag so far; else the last tokens
        self._count = 0  # the tokens in the reasoning part, an end tag's included till seen
        self._ended = False

    @property
    def count(self) -> int:
        """The reasoning tokens so far: an end tag's possible beginning is not counted
        until the answer ends (it is reasoning then, as the text parser's held text)."""
        if self._state != "reasoning" or self._ended:
            return self._count
        return self._count - held_tokens(self._seen, self.tags.end)

    def feed(self, ids: Iterable[int]) -> None:
        for token in ids:
            self._feed(token)

    def finish(self) -> None:
        """The answer ended: a leading start tag cut short is reasoning (as the text's)."""
        if self._state == "start":
            self._state, held, self._seen = "reasoning", self._seen, []
            self.feed(held)
        self._ended = True

    def _feed(self, token: int) -> None:
        state, seen = self._state, self._seen
        if state == "after":
            return
        if state == "start":
            start = self.tags.start
            seen.append(token)
            if tuple(seen) == start[: len(seen)]:
                if len(seen) == len(start):  # the leading tag: dropped
                    self._state, self._seen = "reasoning", []
                return
            # Not the leading tag: these tokens are the reasoning's first.
            self._state, held, self._seen = "reasoning", seen, []
            self.feed(held)
            return
        if state == "before":
            start = self.tags.start
            seen.append(token)
            del seen[: -len(start)]
            if tuple(seen) == start:
                self._state, self._seen = "reasoning", []
            return
        end = self.tags.end
        self._count += 1
        seen.append(token)
        del seen[: -len(end)]
        if tuple(seen) == end:  # the end tag's tokens were counted: they are no reasoning
            self._count -= len(end)
            self._state, self._seen = "after", []
