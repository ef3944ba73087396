"""What the offline ``LLM`` returns, in vLLM's shapes (``vllm.outputs``): a
``RequestOutput`` per prompt holding a ``CompletionOutput`` per answer (``n``), and
vLLM's ``Logprob`` entries. (``engine.outputs.RequestOutput`` is the engine's per-step
output, which these are built from.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import outputs as engine_outputs
    from engine.server.answer_text import AnswerText


@dataclass
class Logprob:
    """vLLM's: a token's log probability, its place among all tokens (1: the most
    likely; None where not computed) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's: per position, token id -> Logprob (the token itself and the k most likely), or
# None where nothing was computed (the first prompt token).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """vLLM's: one answer to a prompt. ``finish_reason``: "stop" (EOS, a stop token or a
    stop string), "length" or "abort"; ``stop_reason``: the stop string or stop token id
    that ended it (None for EOS or a length)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """vLLM's: a prompt and its answers. ``prompt`` is None for a token-id prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    # The prompt tokens the prefix cache held (not computed) for its first answer (``n`` >
    # 1: answer 0's; vLLM's field), None when it never started.
    num_cached_tokens: int | None = None


def position_logprobs(
    entry: engine_outputs.TokenLogprob | None, k: int, name: Callable[[int], str]
) -> PositionLogprobs | None:
    """vLLM's entry of one position: the token itself (its own rank) and the ``k`` most
    likely tokens (ranks 1..k), each named by ``name`` (its text)."""
    if entry is None:
        return None
    out = {entry.token_id: Logprob(entry.logprob, entry.rank, name(entry.token_id))}
    for rank, (t, lp) in enumerate(zip(entry.top_ids[:k], entry.top_logprobs[:k], strict=True), 1):
        out.setdefault(t, Logprob(lp, rank, name(t)))
    return out


@dataclass
class Answer:
    """One answer being collected: its engine outputs through ``AnswerText`` (the node's
    text and stop strings), until it ends."""

    index: int
    text: AnswerText
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    entries: engine_outputs.Logprobs = field(default_factory=list)
    prompt_entries: engine_outputs.Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    # Prompt tokens the prefix cache held when it started (vLLM's ``num_cached_tokens``).
    num_cached_tokens: int | None = None

    def add(self, out: engine_outputs.RequestOutput) -> bool:
        """Take the engine's next output; True when the answer ended (the engine finished
        it, or a stop string did: the caller aborts the engine request)."""
        piece = self.text.add(out)
        self.pieces.append(piece.text)
        self.token_ids.extend(piece.token_ids)
        self.entries.extend(piece.logprobs or [None] * len(piece.token_ids))
        self.prompt_entries = self.prompt_entries or out.prompt_logprobs
        if out.num_cached_tokens is not None:
            self.num_cached_tokens = out.num_cached_tokens
        if piece.stop_hit or out.finished:
            self.finish_reason = "stop" if piece.stop_hit else out.finish_reason or "stop"
            self.stop_reason, self.error = piece.stop_reason, out.error
            return True
        return False

    def output(self, name: Callable[[int], str]) -> CompletionOutput:
        k = self.text.params.logprobs
        lps = None
        cumulative = None
        if k is not None:
            lps = [position_logprobs(e, k, name) or {} for e in self.entries]
            cumulative = sum(e.logprob for e in self.entries if e is not None)
        return CompletionOutput(
            self.index, "".join(self.pieces), self.token_ids, cumulative, lps,
            self.finish_reason, self.stop_reason,
        )  # fmt: skip
