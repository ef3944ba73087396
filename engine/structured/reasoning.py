"""A structured output on an answer with reasoning (``--reasoning-parser``): the grammar
waits for the reasoning to end (vLLM's ``StructuredOutputManager.should_advance`` /
``should_fill_bitmask``, which wait for ``reasoning_parser.is_reasoning_end``).

``ReasoningTags`` is the data: the parser's tags as the node's tokenizer writes them
(tokenized once by the HTTP layer; a request's ``SamplingParams.reasoning_tags``).
``ReasoningGate`` follows one answer token by token through the parser's parts, on the
tokens as ``engine/reasoning``'s parsers do on the text, so that the grammar and the
``reasoning_content``/``content`` split agree on where the content begins:

* ``deepseek_r1`` (no start tag): the answer starts in its reasoning, up to ``</think>``.
* ``qwen3``: the answer reasons when it opens with ``<think>``, up to ``</think>``; an
  answer that does not open with it is all content. While the answer is a prefix of
  ``<think>`` (``OPENING``) the tag's next token is allowed besides what the grammar
  allows; the first token off the tag decides: content, constrained from its first token.
  (vLLM waits for ``</think>`` whatever the answer opens with, so a Qwen3 answer without
  ``<think>`` is never constrained there, and its text split calls it all content.)

The tags are matched as the token sequences the tokenizer makes of them (one token each
for DeepSeek R1 and Qwen3); a tag the model spells with other tokens is not seen here,
while the text split sees it (vLLM matches the tag's token id too). The phases are the
engine's; ``GrammarState`` (``matcher.py``) keeps one gate per request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from engine.reasoning.base import END, START, ReasoningParser


@dataclass(frozen=True)
class ReasoningTags:
    """A reasoning parser's tags as token ids: ``end`` closes the reasoning; ``start``
    opens it (empty: the answer starts in its reasoning)."""

    end: tuple[int, ...]
    start: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.end or not all(t >= 0 for t in (*self.end, *self.start)):
            raise ValueError(f"reasoning tags must be token ids, got {self!r}")

    @classmethod
    def of(cls, parser: type[ReasoningParser], tokenizer: Any) -> ReasoningTags:
        """``parser``'s tags in ``tokenizer``'s ids (the start tag only for a parser
        whose answer opens its reasoning itself)."""

        def ids(tag: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(tag, add_special_tokens=False))

        return cls(end=ids(END), start=() if parser.initial == "start" else ids(START))


class Phase(enum.Enum):
    OPENING = "opening"  # the answer so far is a prefix of the start tag
    REASONING = "reasoning"  # the grammar waits
    CONTENT = "content"  # the grammar constrains every token from here on


class ReasoningGate:
    """One answer's phase, fed its output tokens one by one (``feed``)."""

    __slots__ = ("_seen", "phase", "tags")

    def __init__(self, tags: ReasoningTags) -> None:
        self.tags = tags
        self.phase = Phase.OPENING if tags.start else Phase.REASONING
        # OPENING: the start tag's tokens so far; REASONING: the last tokens (the end tag's
        # length at most), matched against the end tag.
        self._seen: list[int] = []

    @property
    def next_start_token(self) -> int:
        """OPENING: the start tag's token that may come next."""
        return self.tags.start[len(self._seen)]

    def feed(self, token: int) -> Phase:
        """The phase ``token`` leaves the answer in (``phase``: the next token's). The end
        tag's last token is the reasoning's (the content begins after it)."""
        if self.phase is Phase.OPENING:
            if token != self.next_start_token:
                self.phase = Phase.CONTENT
            else:
                self._seen.append(token)
                if len(self._seen) == len(self.tags.start):
                    self.phase, self._seen = Phase.REASONING, []
        elif self.phase is Phase.REASONING:
            end = self.tags.end
            self._seen.append(token)
            del self._seen[: -len(end)]
            if tuple(self._seen) == end:
                self.phase, self._seen = Phase.CONTENT, []
        return self.phase
