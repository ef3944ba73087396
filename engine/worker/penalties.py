"""Presence, frequency and repetition penalties: what a worker keeps of each request's
tokens, and their application to a batch's logits (vLLM's ``apply_penalties``).

The scheduler sends a request's tokens once (``ScheduledSeq.penalty_token_ids``: all of
them with a new table, afterwards those added since). A worker keeps them per request
(``PenaltyHistory``) on the logits' device: a row of the output's counts and a row of
the prompt's ids, a slot of the sampler's ``PenaltyPool`` ([C, V] tensors), taken in the
first step that samples the request and updated in place. ``add`` only queues the new
ids on the host; a step's one host->device copy carries the rows' factors and slots and
every row's queued ids (one per row in a decode step; a whole prompt only in the first
step of a request or of a new table: a preempted request gets a new history), which one
kernel scatters into the pool, then one gathers the step's [S, V] state: the kernels a
step launches do not grow with the batch. So a step's host work grows with the batch and the new tokens,
not with the prompt's or the output's length. With async scheduling the last output is
a placeholder the scheduler does not know yet: the sampler adds it on the device, from
the previous step's samples, to that step's counts only (the scheduler sends the real
token in a later step), so no step waits for the host.

For the rows with penalties, on the logits (after ``logit_bias`` and the ``min_tokens``
mask, before the temperature; greedy rows too)::

    seen      = in the prompt or the output
    logit     = logit / r if logit > 0 else logit * r      (for seen tokens; r: repetition)
    logit    -= frequency * count_in_output + presence * (count_in_output > 0)
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from engine.sampling_params import SamplingParams


class PenaltyPool:
    """Every penalized request's state on the logits' device, in two tensors: ``counts``
    [C, V] float32 (a row's output counts) and ``in_prompt`` [C, V] bool (its prompt's
    ids), one slot (row) per live ``PenaltyHistory``. Slot 0 stays zeros: the rows of a
    step without penalties read it. Keeping them in one tensor is what lets a step
    scatter every row's new ids with one kernel and gather its [S, V] state with one
    (separate [V] tensors cost a launch per row). A history takes a slot in its first
    step (zeroed then) and gives it back when it is dropped (its request finished or was
    preempted); a later owner's zeroing is ordered after any step in flight that read
    the slot (one stream).

    ``max_slots`` (``max_num_seqs``: no more requests run at once): the tensors are made
    that size at their first use and do not grow (no transient copy; the memory
    profile's dummy step makes the same pool, so the KV cache is sized without it).
    None (CPU, tests): they start at one slot and double when every slot is taken.
    Either way they never shrink."""

    def __init__(self, max_slots: int | None = None) -> None:
        self.counts: torch.Tensor | None = None  # [C, V] float32
        self.in_prompt: torch.Tensor | None = None  # [C, V] bool
        self._free: list[int] = []
        self._first = 1 + (max_slots or 0)  # slot 0: zeros

    @property
    def capacity(self) -> int:
        return 0 if self.counts is None else self.counts.shape[0]

    def check(self, vocab: int, device: torch.device) -> None:
        """Made for ``vocab`` ids on ``device`` on the first call; the same after."""
        if self.counts is None:
            n = self._first
            self.counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)  # [C, V]
            self.in_prompt = torch.zeros(n, vocab, dtype=torch.bool, device=device)  # [C, V]
            self._free = list(range(n - 1, 0, -1))
        elif self.counts.shape[1] != vocab or self.counts.device != device:
            raise ValueError(
                f"penalty state of {self.counts.shape[1]} ids on {self.counts.device}, "
                f"logits of {vocab} on {device}"
            )

    def take(self, want: int) -> list[int]:
        """``want`` free slots (their rows zeroed by the caller), growing if needed."""
        assert self.counts is not None and self.in_prompt is not None
        short = want - len(self._free)
        if short > 0:  # (with max_slots: only if more requests than that ran at once)
            old = self.capacity
            new = max(old + short, 2 * old)
            vocab, device = self.counts.shape[1], self.counts.device
            grow = new - old
            self.counts = torch.cat(
                [self.counts, torch.zeros(grow, vocab, dtype=torch.float32, device=device)]
            )  # [C', V]
            self.in_prompt = torch.cat(
                [self.in_prompt, torch.zeros(grow, vocab, dtype=torch.bool, device=device)]
            )  # [C', V]
            self._free.extend(range(new - 1, old - 1, -1))
        return [self._free.pop() for _ in range(want)]

    def give_back(self, slot: int) -> None:
        self._free.append(slot)


class PenaltyHistory:
    """One request's tokens, as its penalties need them: on the logits' device its slot
    of a ``PenaltyPool`` (its output's counts and its prompt's ids), taken by the first
    ``apply_penalties`` that reads the history and given back when the history goes; on
    the host the ids added since the last step, which the next step moves into the slot
    (ids outside the vocabulary are dropped then)."""

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_seen = 0
        self.pool: PenaltyPool | None = None
        self.slot = 0
        self._new_prompt: list[int] = []
        self._new_output: list[int] = []

    def bind(self, pool: PenaltyPool, slot: int) -> None:
        """Keep the state in ``pool``'s ``slot`` (zeroed by the caller) until dropped."""
        self.pool, self.slot = pool, slot
        weakref.finalize(self, pool.give_back, slot).atexit = False

    @property
    def counts(self) -> torch.Tensor | None:
        """The output's counts, [V] float32 (a view of the pool's row), once bound."""
        return (
            None if self.pool is None or self.pool.counts is None else self.pool.counts[self.slot]
        )

    @property
    def in_prompt(self) -> torch.Tensor | None:
        """The prompt's ids, [V] bool (a view of the pool's row), once bound."""
        pool = self.pool
        return None if pool is None or pool.in_prompt is None else pool.in_prompt[self.slot]

    def add(self, token_ids: list[int]) -> None:
        """The request's next tokens (prompt first, then output): queued for the next step."""
        split = max(0, min(len(token_ids), self.num_prompt_tokens - self.num_seen))
        self._new_prompt.extend(token_ids[:split])
        self._new_output.extend(token_ids[split:])
        self.num_seen += len(token_ids)

    @property
    def prompt(self) -> set[int]:
        """The prompt's distinct ids (reads the device: for tests and inspection)."""
        ids = set(self._new_prompt)
        if self.in_prompt is not None:
            ids.update(self.in_prompt.nonzero().flatten().tolist())
        return ids

    @property
    def output(self) -> Counter[int]:
        """The output's counts by id (reads the device: for tests and inspection)."""
        counts = Counter(self._new_output)
        if self.counts is not None:
            ids = self.counts.nonzero().flatten()
            counts.update(dict(zip(ids.tolist(), self.counts[ids].long().tolist(), strict=True)))
        return counts

    def take_new(self, vocab: int) -> tuple[list[int], list[int]]:
        """The ids queued since the last step, those in ``[0, vocab)`` (an offline caller's
        prompt may hold any id): ``(prompt's, output's)``; the queue is emptied."""
        prompt, output = _in_vocab(self._new_prompt, vocab), _in_vocab(self._new_output, vocab)
        self._new_prompt, self._new_output = [], []
        return prompt, output


def _in_vocab(ids: list[int], vocab: int) -> list[int]:
    if not ids or (min(ids) >= 0 and max(ids) < vocab):
        return ids
    return [t for t in ids if 0 <= t < vocab]


def _bind_new(
    pool: PenaltyPool, histories: list[PenaltyHistory | None]
) -> tuple[list[PenaltyHistory], list[int]]:
    """The step's distinct histories (first-seen order; a history may sit in two rows),
    each bound to a slot of ``pool``; and the slots bound now (to be zeroed)."""
    distinct: dict[int, PenaltyHistory] = {}
    for h in histories:
        if h is not None:
            distinct.setdefault(id(h), h)
    unbound = [h for h in distinct.values() if h.pool is None]
    fresh = pool.take(len(unbound)) if unbound else []
    for h, slot in zip(unbound, fresh, strict=True):
        h.bind(pool, slot)
    for h in distinct.values():
        if h.pool is not pool:
            raise ValueError("a penalty history kept by another sampler's pool")
    return list(distinct.values()), fresh


def _new_ids(histories: list[PenaltyHistory], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Every history's queued ids as flat indices into the pool's [C * V] rows
    (``slot * V + id``): ``(prompt's, output's)``, int64."""
    prompt: list[np.ndarray] = []
    output: list[np.ndarray] = []
    for h in histories:
        p, o = h.take_new(vocab)
        base = h.slot * vocab
        if p:
            prompt.append(np.asarray(p, dtype=np.int64) + base)
        if o:
            output.append(np.asarray(o, dtype=np.int64) + base)
    empty = np.zeros(0, dtype=np.int64)
    return (
        np.concatenate(prompt) if prompt else empty,
        np.concatenate(output) if output else empty,
    )


def _gather(pool: torch.Tensor, slots: list[int], slots_dev: torch.Tensor) -> torch.Tensor:
    """``pool``'s rows ``slots``, [S, V] (a copy): one gather kernel on a GPU; on CPU a
    stack of the rows (memcpy: CPU ``index_select`` of float rows ran ~5x slower)."""
    if pool.device.type == "cpu":
        return torch.stack([pool[s] for s in slots])
    return pool.index_select(0, slots_dev)


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[PenaltyHistory | None],
    pending: tuple[list[int], list[int], torch.Tensor] | None,
    to_device: Callable[[torch.Tensor, torch.device], torch.Tensor],
    pool: PenaltyPool,
) -> torch.Tensor:
    """``logits`` [S, V] with each row's penalties applied (in a copy). ``histories[i]``:
    row ``i``'s tokens (None: no penalties), kept in ``pool``; their queued ids are moved
    into their slots on the device first. ``pending``: output tokens sampled but not in
    the histories yet (async scheduling; counted in this step only): ``(rows, src,
    samples)``, row ``rows[j]``'s is ``samples[src[j]]`` (``samples``: the previous
    step's ids, on the device). A fixed number of kernels whatever the batch: one copy,
    a zeroing of new slots, one scatter each for prompt and output ids, one gather each
    of the step's rows, then the [S, V] arithmetic."""
    num, vocab = logits.shape
    device = logits.device
    pool.check(vocab, device)
    distinct, fresh = _bind_new(pool, histories)
    new_prompt, new_output = _new_ids(distinct, vocab)
    on = [h is not None for h in histories]
    factors = np.array(
        [
            [sp.repetition_penalty if o else 1.0 for sp, o in zip(params, on, strict=True)],
            [sp.frequency_penalty if o else 0.0 for sp, o in zip(params, on, strict=True)],
            [sp.presence_penalty if o else 0.0 for sp, o in zip(params, on, strict=True)],
        ],
        dtype=np.float64,
    )  # [3, S]
    slots = [h.slot if h is not None else 0 for h in histories]  # slot 0: zeros
    pending_rows, pending_src = (pending[0], pending[1]) if pending is not None else ([], [])
    n_pending, n_fresh = len(pending_rows), len(fresh)
    # One host->device copy: [rep | freq | pres] as float64 bits, the rows' slots, the new
    # slots, the placeholders' rows and sources, then the new prompt and output ids.
    host = np.concatenate(
        [
            factors.reshape(-1).view(np.int64),
            np.asarray(slots + fresh + pending_rows + pending_src, dtype=np.int64),
            new_prompt,
            new_output,
        ]
    )  # [3 * S + S + fresh + 2 * pending + new ids]
    dev = to_device(torch.from_numpy(host), device)
    rep, freq, pres = dev[: 3 * num].view(torch.float64).float().view(3, num)
    at = 3 * num
    row_slots, at = dev[at : at + num], at + num
    fresh_slots, at = dev[at : at + n_fresh], at + n_fresh
    pending_idx, at = dev[at : at + 2 * n_pending], at + 2 * n_pending
    prompt_idx, at = dev[at : at + len(new_prompt)], at + len(new_prompt)
    output_idx = dev[at:]
    pool_counts, pool_prompt = pool.counts, pool.in_prompt
    assert pool_counts is not None and pool_prompt is not None
    if n_fresh:
        pool_counts.index_fill_(0, fresh_slots, 0.0)
        pool_prompt.index_fill_(0, fresh_slots, False)
    if len(new_prompt):
        pool_prompt.view(-1)[prompt_idx] = True  # [C * V]
    if len(new_output):  # index_add_: duplicates accumulate (one kernel on CUDA)
        ones = torch.ones(len(new_output), dtype=torch.float32, device=device)
        pool_counts.view(-1).index_add_(0, output_idx, ones)  # [C * V]
    counts = _gather(pool_counts, slots, row_slots)  # [S, V] (a copy)
    in_prompt = _gather(pool_prompt, slots, row_slots)  # [S, V]
    if n_pending:  # sampled ids: in the vocabulary
        rows = pending_idx[:n_pending]
        ids = pending[2].index_select(0, pending_idx[n_pending:]).to(torch.int64)  # type: ignore[index]
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    in_output = counts > 0  # [S, V]
    seen = in_prompt | in_output  # [S, V]
    x = logits.to(torch.float32, copy=True)  # [S, V]
    r = rep[:, None].expand_as(x)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x -= freq[:, None] * counts + pres[:, None] * in_output.float()
    return x
