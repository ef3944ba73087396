"""A running request's grammar state, and a step's token bitmask.

The engine process keeps one ``GrammarState`` per structured request (``Request.grammar``)
and advances it with every output token the request gets -- sampled here, or sampled by
a prefill node and received with the KV -- in ``Scheduler._append``
(``engine/core/output_tokens.py``). Each step the
scheduler's ``SamplingConstraints`` (``engine/core/constraints.py``) fills one bitmask for
the rows that sample under a grammar (``fill_bitmask``), which goes with the step; rank
0's sampler applies it.

An answer with reasoning (``SamplingParams.reasoning_tags``) is constrained only once its
reasoning ended: until then its rows sample freely and the matcher is not advanced
(``engine/structured/reasoning.py``).

An llguidance call that fails -- raises, or panics in Rust: regex derivatives are computed
lazily, so a grammar that validated may still panic in a mask or a token's consumption --
fails its request alone: ``GrammarState`` keeps the failure as the matcher's error state
(``is_error``, ``error``), and the scheduler ends the request as it ends a matcher in its
error state. The engine thread goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.structured.reasoning import Phase, ReasoningGate, ReasoningTags

logger = logging.getLogger(__name__)


def is_rust_panic(e: BaseException) -> bool:
    """Whether ``e`` is a Rust panic raised through pyo3 (``PanicException``: a
    ``BaseException``, its class not importable by name)."""
    return type(e).__name__ == "PanicException"


def is_llguidance_failure(e: BaseException) -> bool:
    """Whether ``e``, raised by an llguidance call, is that call failing: an ``Exception``,
    or a Rust panic (``is_rust_panic``). ``KeyboardInterrupt``, ``SystemExit`` and the like
    are not."""
    return isinstance(e, Exception) or is_rust_panic(e)


class GrammarState:
    """One request's ``llguidance.LLMatcher``, advanced token by token (the content's
    tokens only, when the answer reasons: ``reasoning``); ``allowed_token_ids``: the
    request's (None: any id), which ``finished`` asks whether EOS is among."""

    __slots__ = (
        "_allowed", "_ended", "_failure", "_ids", "_mask", "_matched", "matcher", "reasoning"
    )  # fmt: skip

    def __init__(
        self,
        matcher: Any,
        reasoning: ReasoningTags | None = None,
        allowed_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.matcher = matcher
        self._ids = list(allowed_token_ids) if allowed_token_ids else None
        self._allowed: np.ndarray | None = None
        self.reasoning = None if reasoning is None else ReasoningGate(reasoning)
        # The matcher took every output token so far. False only while a qwen3 answer is
        # a prefix of its start tag that the grammar does not allow: it can only go on
        # to open its reasoning (a token the grammar refuses is never consumed: llguidance
        # keeps its error state).
        self._matched = True
        # The last mask made (``fill_mask``): whether a token the matcher refused was one
        # it had allowed (its own limits stopped it) or not (sampled outside the mask).
        self._mask: np.ndarray | None = None
        # The matcher took EOS: the answer is over (``finished``).
        self._ended = False
        # Why an llguidance call failed (``_failed``): the matcher is not called again.
        self._failure: str | None = None

    def _failed(self, e: BaseException) -> None:
        """An llguidance call raised ``e``: kept as the matcher's error state (the caller
        goes on as with a matcher in its error state), or raised again when ``e`` is no
        llguidance failure. Each caller catches in a plain ``try`` (free unless raised:
        these run per request and step on the engine thread)."""
        if not is_llguidance_failure(e):
            raise e
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        self._failure = f"llguidance failed ({why})"
        logger.warning("structured output: llguidance failed", exc_info=e)

    def is_error(self) -> bool:
        """The matcher is in its error state, or a call of it failed (``error``: why)."""
        try:
            return self._failure is not None or bool(self.matcher.is_error())
        except BaseException as e:
            self._failed(e)
            return True

    @property
    def constrains(self) -> bool:
        """The next token is sampled under the grammar's mask (not while reasoning)."""
        return self.reasoning is None or self.reasoning.phase is not Phase.REASONING

    def allowed_ids(self, vocab_size: int) -> np.ndarray | None:
        """The request's ``allowed_token_ids`` as ``allows_any`` takes them (made once;
        None: any id)."""
        if self._allowed is None and self._ids is not None:
            self._allowed = allowed_ids_array(self._ids, vocab_size)
        return self._allowed

    def allows(self, token: int) -> bool:
        """Whether ``accept(token)`` would take it (nothing advances): a token from
        outside (a prefill node's first) is checked before it is taken."""
        try:
            return self._failure is None and self._allows(token)
        except BaseException as e:
            self._failed(e)
            return False

    def _allows(self, token: int) -> bool:
        gate = self.reasoning
        if gate is None or gate.phase is Phase.CONTENT:
            return self._validates(token)
        if gate.phase is Phase.REASONING or token == gate.next_start_token:
            return True
        return self._matched and self._validates(token)  # off the tag

    def _validates(self, token: int) -> bool:
        if self.matcher.is_stopped():  # complete: EOS alone, which validate_tokens refuses
            mask = self.matcher.compute_bitmask()
            return 0 <= token < len(mask) * 8 and bool(mask[token >> 3] >> (token & 7) & 1)
        return bool(self.matcher.validate_tokens([token]) == 1)

    def accept(self, token: int) -> bool:
        """Advance with the request's next output token; False (and the matcher in its
        error state, ``error``) when the grammar does not allow it. A reasoning token
        (the end tag's included) is not the grammar's: the matcher stays as it is."""
        try:
            return self._failure is None and self._accept(token)
        except BaseException as e:
            self._failed(e)
            return False

    def _accept(self, token: int) -> bool:
        gate = self.reasoning
        if gate is None or gate.phase is Phase.CONTENT:
            return self._consume(token)
        if gate.phase is Phase.REASONING:
            gate.feed(token)
            return True
        # OPENING: the token may go on with the start tag, or be the content's.
        phase = gate.feed(token)
        if phase is Phase.CONTENT:  # off the tag: the tokens so far are all content
            return self._matched and self._consume(token)
        if self._matched and self.matcher.validate_tokens([token]) == 1:
            self.matcher.consume_token(token)  # the content may still be this prefix
        else:
            self._matched = False
        if phase is Phase.REASONING:  # the tag is complete: no content so far
            self.matcher.reset()
            self._matched, self._ended = True, False
        return True

    def _consume(self, token: int) -> bool:
        """A content token into the matcher. Once the grammar is complete it takes only
        EOS; a token that completes it, EOS or not, leaves it stopped (llguidance)."""
        complete = bool(self.matcher.is_stopped())
        took = bool(self.matcher.consume_token(token))
        if took and (complete or self.matcher.stop_reason() == "EndOfSentence"):
            self._ended = True
        return took

    def fill_mask(self, mask: np.ndarray) -> None:
        """The ids the next token may be, one bit each, into ``mask`` (``bitmask_words``
        int32 words): the grammar's; while opening, the start tag's next token too. None
        once a call of the matcher failed."""
        if self._matched and self._failure is None:
            try:
                self.matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            except BaseException as e:
                self._failed(e)
        if not self._matched or self._failure is not None:
            mask[:] = 0  # none (a call that failed may have written part of it)
        gate = self.reasoning
        if gate is not None and gate.phase is Phase.OPENING:
            t = gate.next_start_token
            if t < mask.size * 32:
                mask.view(np.uint32)[t >> 5] |= np.uint32(1 << (t & 31))
        self._mask = mask

    def masked_out(self, token: int) -> bool:
        """Whether the last mask made did not allow ``token`` (False when none was made: a
        prefill node's first token, checked with ``allows`` when it came; or a call of the
        matcher failed: the matcher refused it, not the mask)."""
        mask = self._mask
        if mask is None or self._failure is not None:
            return False
        return not allows_any(mask, np.asarray([token], dtype=np.int64))

    @property
    def finished(self) -> bool:
        """The answer is over: the grammar took EOS -- vLLM's convention: a complete
        grammar allows only EOS, sampled as any EOS (in the answer's ids, counted, its
        text left out) -- or it is complete and the request cannot take EOS (none of its
        ``allowed_token_ids`` is one: the grammar's last token ends it). No mask need
        have been made: a prefill node's first token may complete it."""
        try:
            return self._failure is None and self._finished()
        except BaseException as e:
            self._failed(e)
            return False

    def _finished(self) -> bool:
        if not (self.constrains and self._matched):
            return False
        if self._ended:
            return True
        if self._ids is None or not self.matcher.is_stopped():
            return False
        # The complete grammar's mask: its EOS ids (one bit per id, in 32-bit words).
        mask = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
        return not allows_any(mask, allowed_ids_array(self._ids, mask.size * 32))

    @property
    def error(self) -> str:
        """The matcher's error, on one line (it goes to clients and to log lines)."""
        if self._failure is None:
            try:
                return " ".join(str(self.matcher.get_error()).split())[:500]
            except BaseException as e:
                self._failed(e)
        return self._failure or ""  # set by _failed


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row: one bit per token id, set where the id is allowed."""
    return (vocab_size + 31) // 32


def fill_bitmask(rows: list[tuple[int, GrammarState]], vocab_size: int) -> np.ndarray:
    """One int32 buffer for a step: ``k`` masks of ``bitmask_words`` words each (the
    grammar's allowed ids after the tokens each request has), then the ``k`` rows they
    belong to (a row is the index among the step's sampling sequences). One buffer, so
    the workers copy it to the device in one transfer (``Sampler._apply_grammar``)."""
    words = bitmask_words(vocab_size)
    k = len(rows)
    buf = np.empty(k * words + k, dtype=np.int32)
    masks = buf[: k * words].reshape(k, words)
    for j, (row, state) in enumerate(rows):
        state.fill_mask(masks[j])
        buf[k * words + j] = row
    return buf


def allows_any(mask: np.ndarray, ids: np.ndarray) -> bool:
    """Whether one row's mask (``bitmask_words`` int32 words) allows any of ``ids`` (an
    int64 array of ids below the vocabulary size)."""
    words = mask.view(np.uint32)[ids >> 5]
    return bool(((words >> (ids & 31).astype(np.uint32)) & 1).any())


def allows_any_but(mask: np.ndarray, banned: Sequence[int], ids: np.ndarray | None) -> bool:
    """Whether one row's mask allows an id not in ``banned`` (and, unless None, in ``ids``,
    as ``allows_any`` takes them)."""
    row = mask.view(np.uint32).copy()
    out = np.asarray(banned, dtype=np.int64)
    out = out[(out >= 0) & (out < row.size * 32)]
    np.bitwise_and.at(row, out >> 5, ~(np.uint32(1) << (out & 31).astype(np.uint32)))
    return bool(row.any()) if ids is None else allows_any(row, ids)


def allowed_ids_array(ids: list[int], vocab_size: int) -> np.ndarray:
    """``allowed_token_ids`` as ``allows_any`` takes them (ids past the vocabulary out)."""
    arr = np.asarray(ids, dtype=np.int64)
    return arr[(arr >= 0) & (arr < vocab_size)]


def start_allows_any(template: Any, ids: list[int], vocab_size: int) -> bool:
    """Whether a compiled grammar (a shared template: a copy is asked) allows one of
    ``ids`` as the first token."""
    matcher = template.deep_copy()
    mask = np.empty(bitmask_words(vocab_size), dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    return allows_any(mask, allowed_ids_array(ids, vocab_size))
