"""A running request's grammar state, and a step's token bitmask.

The engine process keeps one ``GrammarState`` per structured request (``Request.grammar``)
and advances it with every output token the request gets -- sampled here, or sampled by
a prefill node and received with the KV -- in ``Scheduler._append``. Each step the
scheduler fills one bitmask for the rows that sample under a grammar (``fill_bitmask``)
and sends it with the step; rank 0's sampler applies it.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class GrammarState:
    """One request's ``llguidance.LLMatcher``, advanced token by token."""

    __slots__ = ("_allowed", "matcher")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self._allowed: np.ndarray | None = None

    def allowed_ids(self, ids: list[int], vocab_size: int) -> np.ndarray:
        """The request's ``allowed_token_ids`` as ``allows_any`` takes them (made once)."""
        if self._allowed is None:
            self._allowed = allowed_ids_array(ids, vocab_size)
        return self._allowed

    def accept(self, token: int) -> bool:
        """Advance with the request's next output token; False (and the matcher in its
        error state, ``error``) when the grammar does not allow it."""
        return bool(self.matcher.consume_token(token))

    @property
    def finished(self) -> bool:
        """The grammar is complete: no token but EOS may follow."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())


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
        state.matcher.unsafe_compute_mask_ptr(masks[j].ctypes.data, words * 4)
        buf[k * words + j] = row
    return buf


def allows_any(mask: np.ndarray, ids: np.ndarray) -> bool:
    """Whether one row's mask (``bitmask_words`` int32 words) allows any of ``ids`` (an
    int64 array of ids below the vocabulary size)."""
    words = mask.view(np.uint32)[ids >> 5]
    return bool(((words >> (ids & 31).astype(np.uint32)) & 1).any())


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
