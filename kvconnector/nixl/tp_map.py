"""Which P rank writes which KV heads into which D rank (heterogeneous TP).

A rank of a TP group of size ``tp`` over a model with ``H`` KV heads owns a contiguous
range of global KV heads: ``H / tp`` of them from ``rank * H / tp`` when ``tp <= H``;
when ``tp > H`` the heads are replicated and rank ``r`` owns head ``r // (tp / H)`` alone
(vLLM's rule; ``engine/model/config.py`` shards the weights the same way).

Each D rank needs every head it owns exactly once. P rank ``p`` writes into D rank ``d``
the intersection of their head ranges; when P replicates heads (``tp_p > H``), several
P ranks own the same head and only the replica ``d % (tp_p / H)`` writes it, which
spreads D ranks over P's replicas. Inside a block and layer the layout is head-major
(``[block, layer, kv, head, token, dim]``), so a contiguous head range is one byte range
per (block, layer, kv): a write is ``layers x 2`` descriptors per block, or whole blocks
when both sides hold exactly the same heads (homogeneous TP).

A D rank counts one notification per P rank that writes into it (``senders``).
"""

from __future__ import annotations

from dataclasses import dataclass


def head_range(rank: int, tp: int, num_heads: int) -> tuple[int, int]:
    """(first global KV head, count) that ``rank`` of a TP group of ``tp`` owns."""
    check_tp(tp, num_heads)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not in a TP group of {tp}")
    if tp <= num_heads:
        per = num_heads // tp
        return rank * per, per
    return rank // (tp // num_heads), 1


def check_tp(tp: int, num_heads: int) -> None:
    if tp < 1 or num_heads < 1:
        raise ValueError(f"TP size {tp} and KV heads {num_heads} must be >= 1")
    if num_heads % tp and tp % num_heads:
        raise ValueError(
            f"TP size {tp} neither divides nor is a multiple of the model's {num_heads} KV heads"
        )


def peer_tp_error(num_ranks: int, tp_size: object, num_heads: int) -> str | None:
    """Why a peer that sent ``num_ranks`` ranks for ``tp_size`` cannot be mapped onto a
    model of ``num_heads`` KV heads (None: it can)."""
    if num_ranks != tp_size:
        return f"the peer sent {num_ranks} ranks for tp_size {tp_size!r}"
    try:
        check_tp(num_ranks, num_heads)
    except ValueError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class HeadWrite:
    """P rank -> D rank: ``count`` heads starting at ``p_offset`` in P's rank-local heads,
    landing at ``d_offset`` in D's rank-local heads."""

    d_rank: int
    p_offset: int
    d_offset: int
    count: int
    whole_blocks: bool  # both ranks hold exactly these heads: write whole blocks


def writes_of(p_rank: int, tp_p: int, tp_d: int, num_heads: int) -> list[HeadWrite]:
    """What P rank ``p_rank`` writes, one entry per D rank it writes into."""
    p0, pn = head_range(p_rank, tp_p, num_heads)
    replicas = tp_p // num_heads if tp_p > num_heads else 1
    out = []
    for d in range(tp_d):
        d0, dn = head_range(d, tp_d, num_heads)
        lo, hi = max(p0, d0), min(p0 + pn, d0 + dn)
        if lo >= hi:
            continue
        if replicas > 1 and p_rank % replicas != d % replicas:
            continue  # another replica of these heads writes into this D rank
        out.append(HeadWrite(d, lo - p0, lo - d0, hi - lo, whole_blocks=(pn == dn == hi - lo)))
    return out


def senders(d_rank: int, tp_p: int, tp_d: int, num_heads: int) -> int:
    """How many P ranks write into D rank ``d_rank`` (its notifications per transfer)."""
    return sum(
        any(w.d_rank == d_rank for w in writes_of(p, tp_p, tp_d, num_heads)) for p in range(tp_p)
    )
