"""Token sampling for the whole batch on the logits' device: greedy, temperature, top-k,
top-p, min-p, logit bias, allowed token ids, per-request seeds.

Sampling is an exponential race: the token is ``argmax(p_j / E_j)`` over the (top-k/top-p
filtered) probabilities ``p`` with ``E_j = -log(u_j)``, which draws ``j`` with probability
``p_j``. The uniforms ``u_j`` are a counter-based hash of ``(key, j)`` computed with integer
tensor ops, so they are the same on every device. A seeded request's key at position ``p``
is ``position_seed(seed, p)`` alone, so the same token comes out whichever node (prefill,
decode or a colocated one) samples that position; an unseeded row gets a random key.

One host read per step: the sampled ids (``sample``'s ``.tolist()``; ``sample_on_device``
leaves them on the device, for async scheduling). The per-row parameters go over in one
copy (through pinned staging when given one). Greedy-only batches skip the noise, and
batches without top-k/top-p skip the sort.

The order (vLLM's): every id outside a row's ``allowed_token_ids`` is masked (-inf),
``logit_bias`` is added to the logits (a masked id stays masked), ``min_tokens``'s
``banned`` ids are masked, the penalties apply (``engine/worker/penalties.py``; all four in
a copy, greedy rows too), the temperature divides, ``min_p`` drops the tokens less likely
than ``min_p`` times the most likely one, then top-k and top-p. A row whose allowed ids
are all banned (every one an EOS or stop id before ``min_tokens``) keeps them: the ban is
lifted for that row, so it still draws an allowed id (vLLM draws from a row of -inf
alone: token 0). A row ``bad_words`` leave without a token (they ban every allowed id)
draws token 0, as vLLM's, whatever else the step samples. ``compute_logprobs`` -- only called for rows that asked for log
probabilities, so the rest pay nothing -- is ``log_softmax`` of the model's logits, before
all of that (vLLM's default ``raw_logprobs``), read back in one more host read.

Structured outputs: the engine process computes the grammar masks of the rows that have
one (``engine/structured``) and sends them with the step as one int32 buffer (a bit per
token id, and the rows); ``grammar`` here applies it first, in one host->device copy,
before ``allowed_token_ids`` (a row's ``min_tokens`` ban is lifted as for that mask).
Steps without a grammar row pass None and pay nothing.

``allowed_token_ids`` costs nothing in a step without it. A request's ids become a
[vocab] mask row on the device in its first step and are kept while it samples in every
step (the ids go over once); a step's one host->device copy carries which rows have one
and the ids of the requests new to it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.structured.matcher import bitmask_words
from engine.worker.penalties import PenaltyHistory, PenaltyPool, apply_penalties
from engine.worker.staging import HostStaging

_MASK64 = (1 << 63) - 1
_M32 = 0xFFFFFFFF
_BELOW_ONE = 1.0 - 2.0**-24  # float32's largest value below 1


def position_seed(seed: int, position: int) -> int:
    # splitmix64-style mix of (seed, position); stable across processes and runs.
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (
        (1 << 64) - 1
    )
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK64


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def hashed_uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``u [S, vocab]`` in (0, 1), float32: a hash of ``(keys[s], j)``; ``keys`` [S] int64 >= 0."""
    lo = (keys & _M32)[:, None]  # [S, 1]
    hi = _fmix32(((keys >> 32) & _M32) ^ 0x27D4EB2F)[:, None]
    j = torch.arange(vocab, device=keys.device, dtype=torch.int64)[None, :]  # [1, V]
    h = _fmix32(((j * 0x9E3779B1) & _M32) ^ lo)
    h = _fmix32(h ^ hi)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # The largest hash's ``2**24 - 0.5`` rounds to 2**24 in float32: u = 1, whose
    # exponential -log(u) = 0 made ``p / E`` NaN for a masked id (p = 0), and argmax takes
    # NaN. float32's largest value below 1 instead (every other u is unchanged).
    return u.clamp_(max=_BELOW_ONE)


class Sampler:
    def __init__(self, device: torch.device | None = None, max_rows: int | None = None) -> None:
        """``max_rows``: the most requests at once (``max_num_seqs``), the penalties'
        pool's size, taken whole at its first use (None: it grows as needed)."""
        self._rng = random.SystemRandom()
        # The per-row parameters' and the min_tokens mask's copies: pinned, two slots each
        # (one use per step each: a copy never waits for the step in flight).
        cuda = device is not None and device.type == "cuda"
        self._staging = HostStaging(device, slots=2) if cuda else None
        self._mask_staging = HostStaging(device, slots=2) if cuda else None
        self._bad_staging = HostStaging(device, slots=2) if cuda else None
        self._bias_staging = HostStaging(device, slots=2) if cuda else None
        self._penalty_staging = HostStaging(device, slots=2) if cuda else None
        # The penalized requests' state, one slot each (``engine/worker/penalties.py``).
        self.penalty_pool = PenaltyPool(max_rows)
        self._allowed_staging = HostStaging(device, slots=2) if cuda else None
        self._grammar_staging = HostStaging(device, slots=2) if cuda else None
        # The allowed_token_ids masks of the last step with any, by request: id() of its
        # parameters -> (them, kept to check the id; a [vocab] bool row on the device, True
        # outside the allowed ids, or None: none of them is in the vocabulary, every id).
        self._allowed: dict[int, tuple[SamplingParams, torch.Tensor | None]] = {}

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        banned: list[tuple[int, ...]] | None = None,
        penalties: list[PenaltyHistory | None] | None = None,
        pending: tuple[list[int], list[int], torch.Tensor] | None = None,
        grammar: np.ndarray | None = None,
        bad: list[tuple[int, ...]] | None = None,
    ) -> list[int]:
        """``logits``: [S, vocab] float32 (any device); ``positions``: where each token will
        sit; ``banned``: per row, ids that may not be sampled (``min_tokens``);
        ``penalties``: per row, its tokens so far (None: no penalties), and ``pending``
        its output tokens not in them yet (``apply_penalties``); ``grammar``: the step's
        structured-output bitmasks (``SchedulerOutput.grammar_bitmask``); ``bad``: per row,
        ``bad_words``' ids (held where ``banned``'s yield). Returns the S sampled token ids."""
        return self.sample_on_device(
            logits, params, positions, banned, penalties, pending, grammar, bad
        ).tolist()

    def sample_on_device(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        banned: list[tuple[int, ...]] | None = None,
        penalties: list[PenaltyHistory | None] | None = None,
        pending: tuple[list[int], list[int], torch.Tensor] | None = None,
        grammar: np.ndarray | None = None,
        bad: list[tuple[int, ...]] | None = None,
    ) -> torch.Tensor:
        """``sample`` without the host read: the ids ``[S]`` int64 on the logits' device."""
        if grammar is not None:
            logits = self._apply_grammar(logits, grammar)
        allowed = any(sp.allowed_token_ids for sp in params)
        if allowed:
            logits = self._allow_only(logits, params)
        elif self._allowed:
            self._allowed = {}
        if any(sp.logit_bias for sp in params):
            logits = _add_bias(logits, params, lambda h, d: _copy(h, d, self._bias_staging))
        if bad is not None and any(bad):
            # bad_words' bans hold (a row they empty draws from -inf, as vLLM's)
            logits = _mask(logits, bad, lambda h, d: _copy(h, d, self._bad_staging))
        if banned is not None and any(banned):
            masked = _mask(logits, banned, lambda h, d: _copy(h, d, self._mask_staging))
            if (allowed or grammar is not None) and masked is not logits:
                # A row the ban left without a finite logit (its allowed ids all banned)
                # keeps them: min_tokens yields to allowed_token_ids and to a grammar (no
                # NaN, no other id).
                emptied = torch.isneginf(masked).all(dim=-1, keepdim=True)  # [S, 1]
                masked = torch.where(emptied, logits, masked)
            logits = masked
        if penalties is not None and any(h is not None for h in penalties):
            logits = apply_penalties(
                logits,
                params,
                penalties,
                pending,
                lambda h, d: _copy(h, d, self._penalty_staging),
                self.penalty_pool,
            )
        if all(sp.greedy for sp in params):
            return logits.argmax(dim=-1)
        dev = logits.device
        num, vocab = logits.shape
        temps = [sp.temperature if not sp.greedy else 1.0 for sp in params]
        keys = [
            position_seed(sp.seed, pos) if sp.seed is not None else self._rng.getrandbits(63)
            for sp, pos in zip(params, positions, strict=True)
        ]
        top_k = [sp.top_k if 0 < sp.top_k < vocab else vocab for sp in params]
        top_p = [sp.top_p for sp in params]
        min_p = [sp.min_p for sp in params]
        greedy = [sp.greedy for sp in params]
        # One host->device copy for the per-row parameters: [temps | top_p | min_p | keys |
        # top_k | greedy], the float rows as their bits in int64 (as float64).
        rows = torch.tensor([temps, top_p, min_p], dtype=torch.float64).view(torch.int64)
        ints = torch.tensor([keys, top_k, greedy], dtype=torch.int64)
        host = torch.cat([rows, ints]).reshape(-1)  # [6 * S]
        packed = _copy(host, dev, self._staging).view(6, num)
        temp_t, top_p_t, min_p_t = packed[:3].view(torch.float64).float()
        keys_t, top_k_t, greedy_t = packed[3], packed[4], packed[5].bool()

        x = logits.float() / temp_t[:, None]  # [S, V]
        if any(m > 0.0 for m in min_p):
            probs = torch.softmax(x, dim=-1)
            floor = min_p_t[:, None] * probs.amax(dim=-1, keepdim=True)  # [S, 1]
            x = x.masked_fill(probs < floor, float("-inf"))
        noise = -torch.log(hashed_uniform(keys_t, vocab))  # [S, V] Exp(1)
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_x, idx = torch.sort(x, dim=-1, descending=True)  # [S, V]
            rank = torch.arange(vocab, device=dev)[None, :]
            sorted_x = sorted_x.masked_fill(rank >= top_k_t[:, None], float("-inf"))
            probs = torch.softmax(sorted_x, dim=-1)
            cum = torch.cumsum(probs, dim=-1)
            drop = (cum - probs) >= top_p_t[:, None]  # keep the smallest set reaching top_p
            probs = probs.masked_fill(drop, 0.0)
            # Noise follows the token id, not its rank, so ties sort the same everywhere.
            pick = torch.argmax(probs / noise.gather(1, idx), dim=-1, keepdim=True)
            sampled = idx.gather(1, pick).squeeze(1)
            # A row left with no token (bans took every id it allows) draws token 0, as
            # below and as vLLM's: its first sorted place is wherever the sort left ties
            # of -inf, which depends on the batch.
            sampled = sampled.masked_fill(torch.isneginf(sorted_x[:, 0]), 0)
        else:
            probs = torch.softmax(x, dim=-1)
            sampled = torch.argmax(probs / noise, dim=-1)
            # A row left with no token has NaN probabilities; say token 0 outright rather
            # than lean on where a device's argmax finds the first NaN.
            sampled = sampled.masked_fill(torch.isneginf(x).all(dim=-1), 0)
        return torch.where(greedy_t, logits.argmax(dim=-1), sampled)

    def _apply_grammar(self, logits: torch.Tensor, buf: np.ndarray) -> torch.Tensor:
        """``logits`` with the ids each grammar row's mask does not allow at -inf (in a
        copy). ``buf``: ``k`` masks of ``ceil(vocab / 32)`` int32 words (bit ``j`` of word
        ``w``: id ``32 w + j`` allowed), then the ``k`` rows; one copy to the device."""
        num, vocab = logits.shape
        words = bitmask_words(vocab)
        k = len(buf) // (words + 1)
        if k * (words + 1) != len(buf):
            raise ValueError(
                f"a grammar bitmask of {len(buf)} words does not fit a vocabulary of {vocab}"
            )
        dev = _copy(torch.from_numpy(buf), logits.device, self._grammar_staging)
        masks = dev[: k * words].view(k, words)
        rows = dev[k * words :].long()
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((masks[:, :, None] >> shifts) & 1).view(k, words * 32)[:, :vocab].bool()
        out = logits.clone()
        out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        return out

    def _allow_only(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """``logits`` with every id outside each row's ``allowed_token_ids`` at -inf (in a
        copy; ids past the vocabulary are ignored, and a list of only such ids is every
        id). Mask rows are made for the requests new here and kept (``self._allowed``
        then holds this step's); one host->device copy of ``[rows | the new requests' id
        counts | their ids]``."""
        num, vocab = logits.shape
        kept: dict[int, tuple[SamplingParams, torch.Tensor | None]] = {}
        new: list[tuple[SamplingParams, list[int]]] = []
        for sp in params:
            key = id(sp)
            if not sp.allowed_token_ids or key in kept:
                continue
            entry = self._allowed.get(key)
            if entry is not None and entry[0] is sp:
                mask = entry[1]
                if mask is None or mask.shape[0] == vocab:
                    kept[key] = entry
                    continue
            ids = [t for t in sp.allowed_token_ids if 0 <= t < vocab]
            kept[key] = (sp, None)
            if ids:
                new.append((sp, ids))
        fresh_keys = {id(sp) for sp, _ in new}
        rows = [
            i
            for i, sp in enumerate(params)
            if sp.allowed_token_ids and (id(sp) in fresh_keys or kept[id(sp)][1] is not None)
        ]
        if not rows:
            self._allowed = kept
            return logits
        counts = [len(ids) for _, ids in new]
        host = torch.tensor(
            [*rows, *counts, *(t for _, ids in new for t in ids)], dtype=torch.int64
        )
        dev = _copy(host, logits.device, self._allowed_staging)
        r, k = len(rows), len(new)
        if new:
            ids_t = dev[r + k :]
            owner = torch.repeat_interleave(
                torch.arange(k, device=logits.device), dev[r : r + k], output_size=len(ids_t)
            )
            outside = torch.ones(k, vocab, dtype=torch.bool, device=logits.device)
            outside[owner, ids_t] = False
            for j, (sp, _) in enumerate(new):  # a row each: no view keeps the others alive
                kept[id(sp)] = (sp, outside[j].clone())
        self._allowed = kept
        drop = torch.zeros(num, vocab, dtype=torch.bool, device=logits.device)
        drop[dev[:r]] = torch.stack([kept[id(params[i])][1] for i in rows])  # type: ignore[misc]
        return logits.masked_fill(drop, float("-inf"))


def _copy(host: torch.Tensor, dev: torch.device, staging: HostStaging | None) -> torch.Tensor:
    """``host`` on ``dev``: through ``staging`` (pinned) on CUDA when there is one."""
    if staging is not None and dev.type == "cuda":
        return staging.to_device(host)
    return host.to(dev, non_blocking=True)


def _add_bias(
    logits: torch.Tensor,
    params: list[SamplingParams],
    to_device: Callable[[torch.Tensor, torch.device], torch.Tensor],
) -> torch.Tensor:
    """``logits`` plus each row's ``logit_bias`` (in a copy): one host->device copy of the
    [rows | ids | biases as float64 bits] triples."""
    vocab = logits.shape[1]
    entries = [
        (i, t, b) for i, sp in enumerate(params) for t, b in sp.logit_bias.items() if t < vocab
    ]
    if not entries:
        return logits
    rows, cols, vals = zip(*entries, strict=True)
    bits = torch.tensor(vals, dtype=torch.float64).view(torch.int64)
    host = torch.cat([torch.tensor([*rows, *cols], dtype=torch.int64), bits])
    dev = to_device(host, logits.device)
    n = len(rows)
    biased = logits.to(torch.float32, copy=True)  # [S, V]
    biased.index_put_(
        (dev[:n], dev[n : 2 * n]), dev[2 * n :].view(torch.float64).float(), accumulate=True
    )
    return biased


def _mask(
    logits: torch.Tensor,
    banned: list[tuple[int, ...]],
    to_device: Callable[[torch.Tensor, torch.device], torch.Tensor],
) -> torch.Tensor:
    vocab = logits.shape[1]
    rows = [i for i, ids in enumerate(banned) for t in ids if 0 <= t < vocab]
    cols = [t for ids in banned for t in ids if 0 <= t < vocab]
    if not rows:
        return logits
    masked = logits.clone()
    idx = to_device(torch.tensor(rows + cols, dtype=torch.int64), logits.device)
    n = len(rows)
    masked[idx[:n], idx[n:]] = float("-inf")
    return masked


def compute_logprobs(
    logits: torch.Tensor, token_ids: list[int], top_k: list[int]
) -> list[TokenLogprob]:
    """Per row of ``logits`` [S, vocab]: the log probability of ``token_ids[i]``, its rank,
    and those of the ``top_k[i]`` most likely tokens (most likely first), from
    ``log_softmax(logits)``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [S, V]
    ids = torch.tensor(token_ids, dtype=torch.int64).to(logits.device, non_blocking=True)
    chosen = logprobs.gather(1, ids[:, None])  # [S, 1]
    rank = (logprobs > chosen).sum(dim=1, keepdim=True) + 1  # [S, 1]
    parts = [chosen.double(), rank.double()]
    k = max(top_k, default=0)
    if k:
        values, indices = logprobs.topk(k, dim=-1)
        parts += [values.double(), indices.double()]  # ids < 2**53: exact in float64
    rows = torch.cat(parts, dim=1).tolist()  # one host read
    return [
        TokenLogprob(
            token_id=t,
            logprob=row[0],
            top_ids=tuple(int(x) for x in row[2 + k : 2 + k + n]),
            top_logprobs=tuple(row[2 : 2 + n]),
            rank=int(row[1]),
        )
        for t, n, row in zip(token_ids, top_k, rows, strict=True)
    ]
