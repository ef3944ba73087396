"""Token sampling: greedy, temperature, top-k, top-p, per-request seed.

A seeded request draws the token at position ``p`` from a generator seeded with
``(seed, p)`` alone, so the same token comes out whichever node (prefill, decode or a
colocated one) samples that position.
"""

from __future__ import annotations

import os

import torch

from engine.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    # splitmix64-style mix of (seed, position); stable across processes and runs.
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (
        (1 << 64) - 1
    )
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK64


class Sampler:
    def __init__(self) -> None:
        self._rng = torch.Generator()
        self._rng.manual_seed(int.from_bytes(os.urandom(8), "little") & _MASK64)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
    ) -> list[int]:
        """``logits``: [num_seqs, vocab] float32; ``positions``: where each token will sit."""
        out: list[int] = []
        for row, sp, pos in zip(logits, params, positions, strict=True):
            out.append(self._sample_one(row, sp, pos))
        return out

    def _sample_one(self, row: torch.Tensor, sp: SamplingParams, position: int) -> int:
        if sp.greedy:
            return int(torch.argmax(row).item())
        x = row.float() / sp.temperature
        if sp.top_k > 0 and sp.top_k < x.numel():
            kth = torch.topk(x, sp.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = (cum - sorted_p) >= sp.top_p  # keep the smallest set reaching top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        if sp.seed is not None:
            gen = torch.Generator()
            gen.manual_seed(position_seed(sp.seed, position))
        else:
            gen = self._rng
        return int(torch.multinomial(probs, 1, generator=gen).item())
