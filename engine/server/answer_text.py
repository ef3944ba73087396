"""One answer's text from its engine outputs: incremental detokenization and stop strings.

``AnswerText`` is the one implementation of how an answer's token ids become its text
(``server/jobs.py:generate_steps`` for a node's requests, ``engine/llm.py`` for the offline
``LLM``): each token's text from the ``IncrementalDetokenizer``, fed one token at a time to
the ``StopStringMatcher`` (vLLM's look-back rule; no stop string may end within
``min_tokens``), the text of a stop token (EOS or a ``stop_token_ids`` entry) left out
unless ``include_stop_str_in_output``. Torch- and framework-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.server.stop_strings import StopStringMatcher

if TYPE_CHECKING:
    from engine.outputs import Logprobs, RequestOutput
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import IncrementalDetokenizer


def stop_token_reason(token: int, params: SamplingParams, eos_token_id: int | None) -> int | None:
    """``stop_reason`` of an answer a token stopped (vLLM's rule): None for the tokenizer's
    EOS (unless ``ignore_eos``), else the id (a ``stop_token_ids`` entry, or another EOS id
    of the model's generation config: vLLM counts those as stop token ids)."""
    return None if token == eos_token_id and not params.ignore_eos else token


@dataclass
class TextPiece:
    """What one engine output adds to the answer."""

    text: str
    # The output's ids (less a skipped first token); when a stop string ended the answer
    # within them, up to the one that completed it (as if each token came alone).
    token_ids: list[int]
    logprobs: Logprobs | None
    # A stop string ended the answer (``text`` ends before it, or after with
    # ``include_stop_str_in_output``).
    stop_hit: bool = False
    # With a hit, the stop string; with the engine's "stop" on a token, that token's
    # ``stop_token_reason``; else None.
    stop_reason: str | int | None = None
    # ``skip_first``: the text of the first token, which the client already has.
    skipped_text: str = ""
    # The output's last id stopped the answer (EOS, a ``stop_token_ids`` entry) and its
    # text is left out: in neither of a chat answer's parts (reasoning, content).
    stop_token_hidden: bool = False
    # The output's ids after the one that completed a stop string: not the answer's.
    dropped: int = 0


class AnswerText:
    """Feeds one request's engine outputs (``add``, in order) through the detokenizer and
    the stop strings. ``skip_first``: the first token is already with the client (a decode
    leg's, streamed by the proxy from the prefill node): context, never returned."""

    def __init__(
        self,
        detok: IncrementalDetokenizer,
        params: SamplingParams,
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_first: bool = False,
    ) -> None:
        self.detok = detok
        self.params = params
        self.keep_stop = include_stop_str_in_output
        self.matcher = StopStringMatcher(stop, include=include_stop_str_in_output)
        self.eos_token_id: int | None = getattr(detok.tokenizer, "eos_token_id", None)
        self.skip_first = skip_first
        self.num_tokens = 0  # the answer's tokens so far (a skipped first one included)
        self.last_id: int | None = None

    def add(self, out: RequestOutput) -> TextPiece:
        ids = list(out.new_token_ids)
        lps = out.new_logprobs
        self.num_tokens += len(ids)
        self.last_id = ids[-1] if ids else self.last_id
        # The engine stopped on a token (stop strings are found below, in the text). A
        # grammar ends an answer on EOS (vLLM's convention; min_tokens yielded to it), a
        # stop token as any EOS -- unless ``ignore_eos`` (EOS is text then) or the request
        # could not take EOS (its last token is the grammar's last text).
        stop_token = out.finished and out.finish_reason == "stop"
        if stop_token and out.ended_by_grammar:
            eos_ids = getattr(self.detok.tokenizer, "eos_token_ids", [self.eos_token_id])
            stop_token = self.last_id in eos_ids and not self.params.ignore_eos
        hidden = stop_token and bool(ids) and not self.keep_stop
        skipped = ""
        if self.skip_first and ids:
            self.skip_first = False
            if not (stop_token and len(ids) == 1 and not self.keep_stop):
                # Context for the text of later tokens, and for a stop string that begins
                # in it; the client has its text.
                skipped = self.detok.add(ids[:1])
                self.matcher.skip(skipped)
            ids = ids[1:]
            lps = None if lps is None else lps[1:]
        shown = ids[:-1] if stop_token and ids and not self.keep_stop else ids
        # Stop strings are looked for in each token's text, as vLLM's detokenizer does in
        # each step's (one token): an output may carry several ids, merged for a slow
        # reader, and the text must not depend on that -- when one token completes several,
        # the first listed wins (the matcher), so the text fed at once is one token's. And
        # only once the answer has more than min_tokens tokens (vLLM): a stop string must
        # end after those; it may start in them (the matcher holds back their text that
        # may begin one).
        before = self.num_tokens - len(ids)  # the answer's tokens before these
        min_tokens = self.params.min_tokens
        text, hit, kept = "", False, len(ids)
        for i, token in enumerate(shown):
            last = i == len(shown) - 1
            piece = self.detok.add([token])
            if last and out.finished:
                piece += self.detok.flush()  # text held back for an incomplete UTF-8 sequence
            piece, hit = self.matcher.feed(
                piece, final=last and out.finished, check=before + i + 1 > min_tokens
            )
            text += piece
            if hit:
                kept = i + 1
                break
        if not shown:
            # The held-back text (a broken UTF-8 sequence's U+FFFD) is the last shown
            # token's, in an earlier output (this one has none or a hidden stop token): a
            # stop string it completes ends the answer there, before the stop token, and
            # counts only past min_tokens by that token's place -- as in one output.
            rest = self.detok.flush() if out.finished else ""
            shown_tokens = self.num_tokens - len(ids)
            rest, hit = self.matcher.feed(rest, final=out.finished, check=shown_tokens > min_tokens)
            text += rest
            kept = 0 if hit else kept
        if hit:
            dropped = len(ids) - kept
            ids, lps = ids[:kept], None if lps is None else lps[:kept]
            matched = self.matcher.matched
            return TextPiece(
                text, ids, lps, True, matched, skipped, hidden and not dropped, dropped
            )
        why = None
        if stop_token and self.last_id is not None:
            why = stop_token_reason(self.last_id, self.params, self.eos_token_id)
        return TextPiece(text, ids, lps, False, why, skipped, hidden)
