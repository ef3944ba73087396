"""Presence, frequency and repetition penalties: what a worker keeps of each request's
tokens, and their application to a batch's logits (vLLM's ``apply_penalties``).

The scheduler sends a request's tokens once (``ScheduledSeq.penalty_token_ids``: all of
them with a new table, afterwards those added since). A worker keeps them per request
(``PenaltyHistory``) on the logits' device: a [V] row of the output's counts and a [V]
row of the prompt's ids, made in the first step that samples the request and updated in
place. ``add`` only queues the new ids on the host; a step's one host->device copy
carries the rows' factors and every row's queued ids (one per row in a decode step; a
whole prompt only in the first step of a request or of a new table: a preempted request
gets a new history), which are scattered into those rows, then the rows are stacked into
the step's [S, V] state. So a step's host work grows with the batch and the new tokens,
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

from collections import Counter
from collections.abc import Callable

import torch

from engine.sampling_params import SamplingParams


class PenaltyHistory:
    """One request's tokens, as its penalties need them: on the logits' device a [V]
    float32 row of the output's counts (``counts``) and a [V] bool row of the prompt's
    ids (``in_prompt``), both made by the first ``apply_penalties`` that reads the
    history; on the host the ids added since the last step, which the next step moves
    into them (ids outside the vocabulary are dropped then)."""

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_seen = 0
        self.counts: torch.Tensor | None = None  # [V] float32
        self.in_prompt: torch.Tensor | None = None  # [V] bool
        self._new_prompt: list[int] = []
        self._new_output: list[int] = []

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

    def rows(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(counts, in_prompt)``, each [V] on ``device``: made (zeros) on the first call."""
        if self.counts is None or self.in_prompt is None:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)  # [V]
            self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)  # [V]
        elif self.counts.shape[0] != vocab or self.counts.device != device:
            raise ValueError(
                f"penalty state of {self.counts.shape[0]} ids on {self.counts.device}, "
                f"logits of {vocab} on {device}"
            )
        return self.counts, self.in_prompt

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


# A history's ids in this step's copy: (it, how many prompt ids, how many output ids).
_NewIds = tuple[PenaltyHistory, int, int]


def _take_new(
    histories: list[PenaltyHistory | None], vocab: int, device: torch.device
) -> tuple[list[int], list[_NewIds]]:
    """Every history's queued ids in one list (per history: its prompt's, its output's)
    and where each history's are; each history's rows are made if they were not."""
    flat: list[int] = []
    new: list[_NewIds] = []
    for h in histories:
        if h is None:
            continue
        h.rows(vocab, device)
        prompt, output = h.take_new(vocab)  # a history in two rows: its ids come once
        if prompt or output:
            flat += prompt
            flat += output
            new.append((h, len(prompt), len(output)))
    return flat, new


def _scatter_new(new: list[_NewIds], ids: torch.Tensor) -> None:
    """Add the histories' new ids (``ids``: on the device, laid out as ``_take_new``'s
    list) to their rows, in place."""
    most = max((n_out for _, _, n_out in new), default=0)
    ones = torch.ones(most, dtype=torch.float32, device=ids.device)  # [most]
    at = 0
    for h, n_prompt, n_out in new:
        counts, in_prompt = h.counts, h.in_prompt
        assert counts is not None and in_prompt is not None
        if n_prompt:
            in_prompt[ids[at : at + n_prompt]] = True
        at += n_prompt
        if n_out:  # index_add_: one kernel on CUDA (an accumulating index_put_ sorts first)
            counts.index_add_(0, ids[at : at + n_out], ones[:n_out])
        at += n_out


def _stack_rows(
    histories: list[PenaltyHistory | None], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's ``(counts [S, V] float32, in_prompt [S, V] bool)``: each row its
    history's (a copy), zeros for the rows without penalties."""
    counts, in_prompt = [], []
    zeros: tuple[torch.Tensor, torch.Tensor] | None = None
    for h in histories:
        if h is not None:
            c, p = h.rows(vocab, device)
        else:
            if zeros is None:
                zeros = (
                    torch.zeros(vocab, dtype=torch.float32, device=device),  # [V]
                    torch.zeros(vocab, dtype=torch.bool, device=device),  # [V]
                )
            c, p = zeros
        counts.append(c)
        in_prompt.append(p)
    return torch.stack(counts), torch.stack(in_prompt)  # [S, V] each


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[PenaltyHistory | None],
    pending: tuple[list[int], list[int], torch.Tensor] | None,
    to_device: Callable[[torch.Tensor, torch.device], torch.Tensor],
) -> torch.Tensor:
    """``logits`` [S, V] with each row's penalties applied (in a copy). ``histories[i]``:
    row ``i``'s tokens (None: no penalties); their queued ids are moved into their rows
    on the device first. ``pending``: output tokens sampled but not in the histories yet
    (async scheduling; counted in this step only): ``(rows, src, samples)``, row
    ``rows[j]``'s is ``samples[src[j]]`` (``samples``: the previous step's ids, on the
    device)."""
    num, vocab = logits.shape
    device = logits.device
    flat, new = _take_new(histories, vocab, device)
    on = [h is not None for h in histories]
    factors = [
        [sp.repetition_penalty if o else 1.0 for sp, o in zip(params, on, strict=True)],
        [sp.frequency_penalty if o else 0.0 for sp, o in zip(params, on, strict=True)],
        [sp.presence_penalty if o else 0.0 for sp, o in zip(params, on, strict=True)],
    ]
    pending_rows, pending_src = (pending[0], pending[1]) if pending is not None else ([], [])
    n_pending = len(pending_rows)
    # One host->device copy: [rep | freq | pres] as float64 bits, the placeholders' rows
    # and sources, then the histories' new ids.
    host = torch.cat(
        [
            torch.tensor(factors, dtype=torch.float64).view(torch.int64).reshape(-1),
            torch.tensor(pending_rows + pending_src + flat, dtype=torch.int64),
        ]
    )  # [3 * S + 2 * pending + new ids]
    dev = to_device(host, device)
    rep, freq, pres = dev[: 3 * num].view(torch.float64).float().view(3, num)
    idx = dev[3 * num :]
    if new:
        _scatter_new(new, idx[2 * n_pending :])
    counts, in_prompt = _stack_rows(histories, vocab, device)  # [S, V] each
    if pending is not None and n_pending:  # sampled ids: in the vocabulary
        rows = idx[:n_pending]
        ids = pending[2].index_select(0, idx[n_pending : 2 * n_pending]).to(torch.int64)
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    in_output = counts > 0  # [S, V]
    seen = in_prompt | in_output  # [S, V]
    x = logits.to(torch.float32, copy=True)  # [S, V]
    r = rep[:, None].expand_as(x)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x -= freq[:, None] * counts + pres[:, None] * in_output.float()
    return x
