"""KV integrity checks for the push (``--kv-checksum off|sampled|full``).

P checksums the blocks it pushes and sends the sums in the notification (``Notif.c``:
``[[D block id, sum], ...]``, one rank's shard); D recomputes them over the blocks the
WRITE filled before it counts the notification. A mismatch fails the transfer -- D
recomputes or fails the request by ``--kv-failure-policy`` -- so corrupted KV is never
decoded from.

``full`` checks every pushed block; ``sampled`` at most ``SAMPLED_BLOCKS`` of them (the
first, the last and others picked by the reservation's nonce): a cheap canary for
systematic faults (a wrong layout, offsets, a stale or half-written block), not a proof
that every byte arrived.

The sum: the block's bytes read as int32 words ``x_i``, ``sum(x_i * w_i) mod 2**64`` with
odd weights ``w_i`` fixed by position. Integer addition wraps the same in any order, so
CPU and GPU give the same value; any change of one word changes it (an odd weight times
a non-zero change of under 2**32 is never 0 mod 2**64), and moved words change it too.
It catches corruption, not an attacker (the side channel's ``--kv-secret`` guards who
may write).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

MODES = ("off", "sampled", "full")
SAMPLED_BLOCKS = 4
_CHUNK = 32  # blocks summed at once (bounds the int64 temporary)

_weights: dict[tuple[int, torch.device], torch.Tensor] = {}


def _weights_for(words: int, device: torch.device) -> torch.Tensor:
    key = (words, device)
    w = _weights.get(key)
    if w is None:
        i = torch.arange(words, dtype=torch.int64, device=device)
        w = ((i * 2654435761 + 97) % (1 << 31)) | 1  # odd, < 2**31
        _weights[key] = w
    return w


def block_sums(
    kv_cache: torch.Tensor, block_ids: Sequence[int], heads: tuple[int, int] | None = None
) -> list[int]:
    """One sum per block of ``kv_cache`` (``[num_blocks, layers, 2, heads, tokens, dim]``);
    ``heads=(first, count)`` sums only that head range of each block (a head slice, as
    heterogeneous TP writes it)."""
    out: list[int] = []
    if not block_ids:
        return out
    if heads is not None:
        kv_cache = kv_cache[:, :, :, heads[0] : heads[0] + heads[1]]
    block_bytes = kv_cache[0].numel() * kv_cache.element_size()
    if block_bytes % 4:
        raise ValueError(f"a KV block of {block_bytes} bytes is not a whole number of words")
    words = block_bytes // 4
    w = _weights_for(words, kv_cache.device)
    for start in range(0, len(block_ids), _CHUNK):
        ids = torch.tensor(block_ids[start : start + _CHUNK], device=kv_cache.device)
        blocks = kv_cache.index_select(0, ids).contiguous()
        # [n, words]: each block's bytes as int32 words, widened so products do not clip
        x = blocks.view(torch.uint8).reshape(len(ids), block_bytes).view(torch.int32).long()
        out.extend(int(s) & ((1 << 64) - 1) for s in (x * w).sum(dim=1).tolist())
    return out


def pick(num_blocks: int, mode: str, nonce: str) -> list[int]:
    """Positions (into a send's block list) to checksum under ``mode``."""
    if mode == "off" or num_blocks == 0:
        return []
    if mode == "full" or num_blocks <= SAMPLED_BLOCKS:
        return list(range(num_blocks))
    chosen = {0, num_blocks - 1}
    seed = hashlib.sha256(nonce.encode()).digest()
    i = 0
    while len(chosen) < SAMPLED_BLOCKS:
        chosen.add(int.from_bytes(seed[i : i + 4], "little") % num_blocks)
        i = (i + 4) % 28
        seed = hashlib.sha256(seed).digest() if i == 0 else seed
    return sorted(chosen)


def verify(
    kv_cache: torch.Tensor,
    expected: Sequence[Sequence[int]],
    heads: tuple[int, int] | None = None,
) -> str | None:
    """None when every ``[block id, sum]`` matches, else what did not."""
    ids = [int(b) for b, _ in expected]
    if any(b < 0 or b >= kv_cache.shape[0] for b in ids):
        return "a checksum names a block outside the KV cache"
    if heads is not None and heads[0] + heads[1] > kv_cache.shape[3]:
        return "a checksum names heads outside the KV cache"
    got = block_sums(kv_cache, ids, heads)
    for (block, want), have in zip(expected, got, strict=True):
        if int(want) != have:
            return f"KV block {block} failed its checksum"
    return None


def corrupt_first(
    kv_cache: torch.Tensor, expected: Sequence[Sequence[int]], heads: tuple[int, int] | None
) -> None:
    """Test-only fault hook (``PDSERVE_FAULT_CORRUPT_KV=1`` on D): flip bits of the first
    checked block (its first checked head), as a corruption in flight would."""
    if expected:
        first = heads[0] if heads is not None else 0
        unit = kv_cache[int(expected[0][0]), 0, 0, first]  # [tokens, dim], contiguous
        flat = unit.view(torch.uint8).reshape(-1)
        flat[: min(64, flat.numel())] ^= 0x5A
