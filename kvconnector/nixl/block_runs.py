"""Coalescing of (source block, destination block) pairs into contiguous runs.

A KV block of one TP rank is one contiguous byte range of the rank's KV cache tensor
(see ``engine/kv_cache_layout.py``), so a run of consecutive block ids on *both* sides
of a copy is one contiguous range on each side and can move as a single descriptor.

Pure functions, no I/O. A plain loop: on the target CPUs it beats numpy below ~1k pairs
(~1 us for 4 pairs, ~70 us for 512 scattered pairs; numpy has a ~25 us floor).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# (src_start, dst_start, length)
BlockRun = tuple[int, int, int]


def block_runs(src_ids: Iterable[int], dst_ids: Iterable[int]) -> list[BlockRun]:
    """Coalesce paired block ids into ``(src_start, dst_start, length)`` runs.

    Pairs are taken in the given order; a pair extends the current run when both its
    source and its destination id are exactly one past the previous pair's. Nothing is
    sorted or deduplicated: the order of the pairs is the order of the runs, so the
    result mirrors what a transfer engine that merges adjacent descriptors produces.
    Accepts any iterables of ints, numpy arrays included.

    >>> block_runs([4, 5, 6, 9], [0, 1, 2, 3])
    [(4, 0, 3), (9, 3, 1)]

    Raises ``ValueError`` when the two sequences differ in length or hold a negative id.
    """
    src = _as_list(src_ids)
    dst = _as_list(dst_ids)
    if len(src) != len(dst):
        raise ValueError(f"block id lists differ in length: {len(src)} != {len(dst)}")
    if not src:
        return []
    runs: list[BlockRun] = []
    src_start, dst_start, length = src[0], dst[0], 1
    for s, d in zip(src[1:], dst[1:], strict=True):
        if s == src_start + length and d == dst_start + length:
            length += 1
        else:
            runs.append((src_start, dst_start, length))
            src_start, dst_start, length = s, d, 1
    runs.append((src_start, dst_start, length))
    # ids only grow inside a run, so a run's start is its smallest id
    if any(s < 0 or d < 0 for s, d, _ in runs):
        raise ValueError("negative block id")
    return runs


def _as_list(ids: Iterable[int]) -> list[int]:
    if isinstance(ids, list):
        return ids
    tolist = getattr(ids, "tolist", None)  # numpy arrays, torch tensors
    return tolist() if tolist is not None else [int(i) for i in ids]


def expand_runs(runs: Sequence[BlockRun]) -> tuple[list[int], list[int]]:
    """Inverse of :func:`block_runs`: the flat source and destination id lists."""
    src: list[int] = []
    dst: list[int] = []
    for src_start, dst_start, length in runs:
        if length <= 0:
            raise ValueError(f"run length must be positive, got {length}")
        src.extend(range(src_start, src_start + length))
        dst.extend(range(dst_start, dst_start + length))
    return src, dst
