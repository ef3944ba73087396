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
    """One request's tokens, as its penalties need them."""

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_seen = 0
        self.prompt: set[int] = set()
        self.output: Counter[int] = Counter()

    def add(self, token_ids: list[int]) -> None:
        """The request's next tokens (prompt first, then output)."""
        split = max(0, min(len(token_ids), self.num_prompt_tokens - self.num_seen))
        self.prompt.update(token_ids[:split])
        self.output.update(token_ids[split:])
        self.num_seen += len(token_ids)


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
    out_rows: list[int] = []
    out_ids: list[int] = []
    out_counts: list[int] = []
    seen_rows: list[int] = []
    seen_ids: list[int] = []
    for i, h in enumerate(histories):
        if h is None:
            continue
        for t, c in h.output.items():
            if 0 <= t < vocab:
                out_rows.append(i)
                out_ids.append(t)
                out_counts.append(c)
        for t in h.prompt:
            if 0 <= t < vocab:
                seen_rows.append(i)
                seen_ids.append(t)
    on = [h is not None for h in histories]
    factors = [
        [sp.repetition_penalty if o else 1.0 for sp, o in zip(params, on, strict=True)],
        [sp.frequency_penalty if o else 0.0 for sp, o in zip(params, on, strict=True)],
        [sp.presence_penalty if o else 0.0 for sp, o in zip(params, on, strict=True)],
    ]
    n_out, n_seen = len(out_ids), len(seen_ids)
    pending_rows, pending_src = (pending[0], pending[1]) if pending is not None else ([], [])
    # One host->device copy: [rep | freq | pres] as float64 bits, then the index lists.
    lists = out_rows + out_ids + out_counts + seen_rows + seen_ids + pending_rows + pending_src
    host = torch.cat(
        [
            torch.tensor(factors, dtype=torch.float64).view(torch.int64).reshape(-1),
            torch.tensor(lists, dtype=torch.int64),
        ]
    )
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
