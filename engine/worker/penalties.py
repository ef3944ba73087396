"""Presence, frequency and repetition penalties: what a worker keeps of each request's
tokens, and their application to a batch's logits (vLLM's ``apply_penalties``).

The scheduler sends a request's tokens once (``ScheduledSeq.penalty_token_ids``: all of
them with a new table, afterwards those added since), so a worker holds the prompt's ids
and the output's counts (``PenaltyHistory``). With async scheduling the last output is a
placeholder the scheduler does not know yet: the sampler adds it on the device, from the
previous step's samples, so no step waits for the host.

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
    """One request's tokens, as its penalties need them. The index tensors a step reads
    are cached between changes (a long prompt's ids are gathered once, not per step)."""

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_seen = 0
        self.prompt: set[int] = set()
        self.output: Counter[int] = Counter()
        self._prompt_ids: torch.Tensor | None = None
        self._output: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, token_ids: list[int]) -> None:
        """The request's next tokens (prompt first, then output)."""
        split = max(0, min(len(token_ids), self.num_prompt_tokens - self.num_seen))
        if split:
            self.prompt.update(token_ids[:split])
            self._prompt_ids = None
        if split < len(token_ids):
            self.output.update(token_ids[split:])
            self._output = None
        self.num_seen += len(token_ids)

    def prompt_ids(self) -> torch.Tensor:
        """The prompt's distinct ids, int64 (host)."""
        if self._prompt_ids is None:
            self._prompt_ids = torch.tensor(sorted(self.prompt), dtype=torch.int64)
        return self._prompt_ids

    def output_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The output's distinct ids and their counts, int64 (host)."""
        if self._output is None:
            ids = torch.tensor(list(self.output), dtype=torch.int64)
            counts = torch.tensor(list(self.output.values()), dtype=torch.int64)
            self._output = (ids, counts)
        return self._output


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[PenaltyHistory | None],
    pending: tuple[list[int], list[int], torch.Tensor] | None,
    to_device: Callable[[torch.Tensor, torch.device], torch.Tensor],
) -> torch.Tensor:
    """``logits`` [S, V] with each row's penalties applied (in a copy). ``histories[i]``:
    row ``i``'s tokens (None: no penalties); ``pending``: output tokens sampled but not in
    the histories yet (async scheduling): ``(rows, src, samples)``, row ``rows[j]``'s is
    ``samples[src[j]]`` (``samples``: the previous step's ids, on the device)."""
    num, vocab = logits.shape
    empty = torch.empty(0, dtype=torch.int64)
    out_rows, out_ids, out_counts, seen_rows, seen_ids = [], [], [], [], []
    for i, h in enumerate(histories):
        if h is None:
            continue
        ids, counts = h.output_counts()
        out_rows.append(torch.full_like(ids, i))
        out_ids.append(ids)
        out_counts.append(counts)
        prompt = h.prompt_ids()
        seen_rows.append(torch.full_like(prompt, i))
        seen_ids.append(prompt)
    o_rows, o_ids, o_counts = (
        torch.cat(x) if x else empty for x in (out_rows, out_ids, out_counts)
    )
    s_rows, s_ids = (torch.cat(x) if x else empty for x in (seen_rows, seen_ids))
    keep = (o_ids >= 0) & (o_ids < vocab)  # an offline caller's prompt may hold any id
    o_rows, o_ids, o_counts = o_rows[keep], o_ids[keep], o_counts[keep]
    keep = (s_ids >= 0) & (s_ids < vocab)
    s_rows, s_ids = s_rows[keep], s_ids[keep]
    on = [h is not None for h in histories]
    factors = [
        [sp.repetition_penalty if o else 1.0 for sp, o in zip(params, on, strict=True)],
        [sp.frequency_penalty if o else 0.0 for sp, o in zip(params, on, strict=True)],
        [sp.presence_penalty if o else 0.0 for sp, o in zip(params, on, strict=True)],
    ]
    n_out, n_seen = len(o_ids), len(s_ids)
    pending_rows, pending_src = (pending[0], pending[1]) if pending is not None else ([], [])
    # One host->device copy: [rep | freq | pres] as float64 bits, then the index lists.
    host = torch.cat(
        [
            torch.tensor(factors, dtype=torch.float64).view(torch.int64).reshape(-1),
            o_rows, o_ids, o_counts, s_rows, s_ids,
            torch.tensor(pending_rows + pending_src, dtype=torch.int64),
        ]
    )  # fmt: skip
    dev = to_device(host, logits.device)
    rep, freq, pres = dev[: 3 * num].view(torch.float64).float().view(3, num)
    idx = dev[3 * num :]
    counts = torch.zeros(num, vocab, dtype=torch.float32, device=logits.device)  # [S, V]
    counts.index_put_(
        (idx[:n_out], idx[n_out : 2 * n_out]), idx[2 * n_out : 3 * n_out].float(), accumulate=True
    )
    s0 = 3 * n_out
    if pending is not None and pending_rows:  # sampled ids: in the vocabulary
        p0, n_pending = s0 + 2 * n_seen, len(pending_rows)
        rows = idx[p0 : p0 + n_pending]
        ids = pending[2].index_select(0, idx[p0 + n_pending :]).to(torch.int64)
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    seen = counts > 0  # [S, V]
    seen[idx[s0 : s0 + n_seen], idx[s0 + n_seen : s0 + 2 * n_seen]] = True
    x = logits.to(torch.float32, copy=True)  # [S, V]
    r = rep[:, None].expand_as(x)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x -= freq[:, None] * counts + pres[:, None] * (counts > 0).float()
    return x
