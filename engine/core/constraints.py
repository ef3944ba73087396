"""What a step's sampling rows are constrained to: grammar masks and ``bad_words``' bans.

A sampling row whose request has a structured output gets the grammar's mask of the ids
its next token may be (none while its answer reasons); a row whose request has
``bad_words`` gets their ban (``engine/bad_words.py``). Both follow the output's last
token: where that token is still being sampled by the step in flight (async scheduling;
for bad words, only words of two or more ids), the step goes out with
``sampling_deferred`` and its masks and bans are made once the step before is updated
(``deferred``: a ``DeferredSampling``). A request left with no token it may take is stuck,
and said so with why; the scheduler ends it (``Scheduler._end_stuck``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.bad_words import banned_by_bad_words
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import DeferredSampling, ScheduledSeq, SchedulerOutput
from engine.structured.matcher import allows_any, allows_any_but, bitmask_words, fill_bitmask

if TYPE_CHECKING:
    import numpy as np

    from engine.structured.compiler import GrammarCompiler

# A sampling row (its index among the step's sampling sequences) and its request.
Row = tuple[int, Request]
# A request that cannot go on, and why (the error its client gets).
Stuck = tuple[Request, str]


def _bad_words_ban(req: Request) -> tuple[int, ...]:
    """The ids ``bad_words`` ban for ``req``'s next sample, after its output so far."""
    sp = req.sampling_params
    return tuple(
        sorted(
            banned_by_bad_words(sp.bad_words_token_ids, req.all_token_ids, req.num_prompt_tokens)
        )
    )


class SamplingConstraints:
    """The scheduler's constrained sampling: per step, the rows that sample under a grammar
    or bad words (``add_row``), then their masks and bans (``end_step``, or ``deferred``
    for a step sent with ``sampling_deferred``). Reads requests, never changes them."""

    def __init__(self, grammars: GrammarCompiler | None) -> None:
        self.grammars = grammars  # the compiler of the structured outputs' grammars
        # This step's sampling rows so far, and the ones among them with a grammar.
        self._num_sampling = 0
        self._grammar_rows: list[Row] = []
        # Async scheduling: whether a row of this step samples after a token still in
        # flight with a grammar or bad words (its mask or ban waits for that token's
        # update: ``deferred``); this step's rows with bad words that follow the last
        # tokens; and the grammar and bad-word rows of the steps sent whose masks and bans
        # are made later.
        self._sampling_waits = False
        self._bad_rows: list[Row] = []
        self._deferred_rows: dict[int, tuple[list[Row], list[Row]]] = {}

    def begin_step(self) -> None:
        """A step is being scheduled: no sampling row yet."""
        self._num_sampling = 0
        self._grammar_rows, self._bad_rows = [], []
        self._sampling_waits = False

    def add_row(self, req: Request, seq: ScheduledSeq) -> None:
        """``seq`` samples for ``req`` in this step's next sampling row (before the step
        counts its sample as a placeholder): sets its bad words' ban, or notes the row's
        ban and grammar mask to make later."""
        row = self._num_sampling
        self._num_sampling += 1
        sp = req.sampling_params
        if sp.bad_words_token_ids:
            if req.num_output_placeholders and sp.bans_after_tokens:
                # The ban follows the token in flight: made after its update.
                self._bad_rows.append((row, req))
                self._sampling_waits = True
            else:
                seq.bad_token_ids = _bad_words_ban(req)
        if req.grammar is not None:
            # Its mask is this step's sampling row so far (none while it reasons: made
            # with the others, once the token in flight, if any, is known).
            self._grammar_rows.append((row, req))
            self._sampling_waits |= req.num_output_placeholders > 0

    def end_step(self, out: SchedulerOutput) -> list[Stuck]:
        """The step is scheduled: its masks into ``out.grammar_bitmask``, or -- a row waits
        for the token in flight -- ``out.sampling_deferred`` (the workers sample once the
        engine sends masks and bans). Returns the requests that cannot go on."""
        stuck: list[Stuck] = []
        if self._sampling_waits:
            out.sampling_deferred = True
            self._deferred_rows[out.step_id] = (self._grammar_rows, self._bad_rows)
        elif self._grammar_rows:
            out.grammar_bitmask, stuck = self._bitmask(self._grammar_rows)
        self._grammar_rows, self._bad_rows = [], []
        return stuck

    def deferred(self, step_id: int) -> tuple[DeferredSampling, list[Stuck]]:
        """The masks and bans of a step sent with ``sampling_deferred``, once the step
        before it was updated (the tokens its rows follow are known now), and the requests
        that cannot go on. Requests that ended since get none (they sample in vain)."""
        grammar_rows, bad_rows = self._deferred_rows.pop(step_id, ([], []))
        bad = {
            row: _bad_words_ban(req) for row, req in bad_rows if req.status == RequestStatus.RUNNING
        }
        bitmask, stuck = self._bitmask(grammar_rows)
        return DeferredSampling(step_id, bitmask, bad), stuck

    def forget_steps_in_flight(self) -> None:
        """The workers are gone: no step sent will sample."""
        self._deferred_rows.clear()

    def _bitmask(self, rows: list[Row]) -> tuple[np.ndarray | None, list[Stuck]]:
        """The masks of the rows whose grammar constrains the next token (not while an
        answer reasons), or None; and the requests that cannot go on."""
        rows = [
            (row, req)
            for row, req in rows
            if req.status == RequestStatus.RUNNING
            and req.grammar is not None
            and req.grammar.constrains
        ]
        if not rows:
            return None, []
        assert self.grammars is not None  # a request has a grammar only where it compiles
        states = [(row, req.grammar) for row, req in rows if req.grammar is not None]
        bitmask = fill_bitmask(states, self.grammars.vocab_size)
        return bitmask, self._stuck(bitmask, [req for _, req in rows])

    def _stuck(self, bitmask: np.ndarray, reqs: list[Request]) -> list[Stuck]:
        """Each request whose grammar allows no next token it may take (with why): its
        matcher is in its error state (a step past its lexer fuel, a schema that cannot go
        on), none of its ``allowed_token_ids`` is allowed, or its ``bad_words`` ban every id
        left (they hold where ``min_tokens`` yields). A call of its matcher that failed
        (``GrammarState.is_error``) is its error state. Its row of this step samples in vain
        (token 0 of a row of -inf; the grammar refused it: an "internal error")."""
        vocab = self.grammars.vocab_size  # type: ignore[union-attr]
        words = bitmask_words(vocab)
        stuck: list[Stuck] = []
        for j, req in enumerate(reqs):
            grammar = req.grammar
            assert grammar is not None
            mask = bitmask[j * words : (j + 1) * words]
            allowed = grammar.allowed_ids(vocab)  # the request's allowed_token_ids
            if grammar.is_error():
                why = f"the structured output cannot go on: {grammar.error}"
            elif allowed is not None and not allows_any(mask, allowed):
                why = (
                    f"none of 'allowed_token_ids' is allowed by the structured output after "
                    f"{req.num_output_tokens} tokens: the answer cannot go on"
                )
            elif req.sampling_params.bad_words_token_ids and not allows_any_but(
                mask, _bad_words_ban(req), allowed
            ):
                # The bans are the step's (made from the same tokens as its mask).
                why = (
                    f"'bad_words' ban every token the structured output allows after "
                    f"{req.num_output_tokens} tokens: the answer cannot go on"
                )
            else:
                continue
            stuck.append((req, why))
        return stuck
