"""P's TP ranks for ``pd_model``: the real worker-side connectors (whole sends, layer-
pipelined pieces, heterogeneous-TP head slices, checksums) over a transport the test
controls, and the KV they read and D's ranks hold.

Each WRITE a P rank posts is a ``Piece`` (a send's blocks, or one layer group of them,
into one D rank); the test completes it when it likes (ok or failed), and its data and
notification land on D's rank then or later (a failed one: maybe, until its notification
does), possibly corrupted on the way. The KV is real tensors: P's "forward" writes into
each layer the values ``expected`` names for the prompt's tokens, a piece copies what it
read when posted (its layers, its head slice) into D's rank, and D's ranks checksum what
landed. So a send D accepts can be checked against what P computed, block by block.
``d_rank_step`` is a D rank's step (also ``test_transfer_fencing``'s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig
from engine.core.scheduler_output import SchedulerOutput, WorkerOutput
from kvconnector.nixl import tp_map
from kvconnector.nixl.transport_common import DONE, ERROR, PENDING, TransferHandle
from kvconnector.nixl.worker import NixlConnectorWorker

if TYPE_CHECKING:
    from collections.abc import Callable

LAYERS = 4  # tiny's
HEADS = 2  # tiny's KV heads (all ranks together)
DIM = 2  # of each head: small (the model checks values, not the model's math)


def kv_cache(blocks: int, block_size: int, tp: int) -> torch.Tensor:
    """One rank's KV: ``[block, layer, kv, head, token, dim]``."""
    return torch.zeros(blocks, LAYERS, 2, HEADS // tp, block_size, DIM)


def expected(token: int, layer: int, rank: int, tp: int) -> torch.Tensor:
    """What a token's KV holds in one layer on ``rank`` of a TP group of ``tp``: its
    value names the token, layer, K or V and global head (exact in float32)."""
    first, count = tp_map.head_range(rank, tp, HEADS)
    heads = torch.arange(first, first + count, dtype=torch.float32)
    kv = torch.tensor([0.0, 8.0])
    return (token * 64 + layer * 16 + kv[:, None] + heads[None, :])[..., None]  # [2, h, 1]


@dataclass
class Piece:
    """A WRITE one P rank posted into one D rank."""

    p_rank: int
    d_rank: int
    p_request_id: str
    notif: bytes
    p_blocks: list[int]
    d_blocks: list[int]
    layers: tuple[int, int]
    d_heads: tuple[int, int]  # (first local head on D, count)
    data: torch.Tensor  # what it read when posted
    post_by: float
    d_incarnation: int  # the D process it writes into (-1: none this model knows)
    handle: TransferHandle
    state: str = "posted"  # posted | ok | failed | gone (its process died first)
    landed: bool = False  # its data (and notification, if it is not lost) is in


@dataclass
class Hooks:
    """What a P rank's transport tells the model."""

    posted: Callable[[Piece], None]  # a WRITE was posted
    failed: Callable[[Piece], None]  # ... ended in error (its data may still land)
    about: Callable[[bytes], tuple[str, float, int]]  # a notif's (P request, post-by, D)


class ModelTransport:
    """A P rank's transport: WRITEs are ``Piece``s the test completes."""

    def __init__(self, rank: int, kv: torch.Tensor, hooks: Hooks) -> None:
        self.rank, self.kv, self.hooks = rank, kv, hooks
        self.peers: dict[str, tuple[int, int, int] | None] = {}  # sub -> head slice
        self.pieces: list[Piece] = []

    def add_peer(self, sub: str, meta: Any, heads: tuple[int, int, int] | None = None) -> None:
        self.peers[sub] = heads

    def remove_peer(self, sub: str) -> None:
        """Its pending WRITEs fail (UCX may not really abort them: they may still land)."""
        self.peers.pop(sub, None)
        for piece in self.pieces:
            if piece.handle.peer_key == sub and piece.state == "posted":
                self.fail(piece, "peer removed")

    def fail(self, piece: Piece, why: str) -> None:
        """The WRITE ends in error; part of it may still land (until its notification
        does: ``hooks.failed``)."""
        piece.state, piece.handle.state, piece.handle.error = "failed", ERROR, why
        self.hooks.failed(piece)

    def write_blocks(self, sub: str, local: list[int], remote: list[int], notif: bytes,
                     layers: tuple[int, int] | None = None) -> TransferHandle:  # fmt: skip
        if sub not in self.peers:
            raise KeyError(f"unknown peer {sub}")
        heads = self.peers[sub]
        p_off, d_off, count = heads if heads is not None else (0, 0, self.kv.shape[3])
        lo, hi = layers if layers is not None else (0, LAYERS)
        data = self.kv[local][:, lo:hi, :, p_off : p_off + count].clone()
        handle = TransferHandle(sub, len(local), len(local), 0, 0.0, None)
        rid, post_by, d_incarnation = self.hooks.about(notif)
        piece = Piece(self.rank, int(sub.rsplit("@", 1)[1]), rid, notif, list(local),
                      list(remote), (lo, hi), (d_off, count), data, post_by, d_incarnation,
                      handle)  # fmt: skip
        self.pieces.append(piece)
        self.hooks.posted(piece)
        return handle

    def poll(self, handle: TransferHandle) -> str:
        return handle.state

    def release(self, handle: TransferHandle) -> None:
        piece = next((p for p in self.pieces if p.handle is handle), None)
        if piece is not None and handle.state == PENDING:
            self.fail(piece, "released")
        if piece is not None:
            self.pieces.remove(piece)

    def get_notifs(self) -> list[bytes]:
        return []

    def close(self) -> None:
        pass


def p_workers(
    config: EngineConfig, tp: int, blocks: int, hooks: Hooks
) -> list[NixlConnectorWorker]:
    """P's ranks: real worker connectors over ``ModelTransport`` (``register_kv_caches``
    without NIXL)."""
    out = []
    group = config.kv_transfer.kv_layer_group_size
    for rank in range(tp):
        w = NixlConnectorWorker(config, rank, tp)
        w._kv_cache = kv_cache(blocks, config.cache.block_size, tp)
        w.transport = ModelTransport(rank, w._kv_cache, hooks)  # type: ignore[assignment]
        if group:
            w._groups = [(i, min(i + group, LAYERS)) for i in range(0, LAYERS, group)]
        out.append(w)
    return out


def p_rank_step(w: NixlConnectorWorker, so: SchedulerOutput, block_ids: Callable[[str], list[int]],
                sampled: dict[str, int], after_layer: Callable[[int, int], None]) -> WorkerOutput:  # fmt: skip
    """One P rank's step as ``engine/worker/worker.py`` runs it: the forward writes each
    layer's KV (a pipelined send posts a piece after each layer group), the last pieces
    and whole sends go after sampling, then the rank reports what finished.
    ``after_layer(rank, layer)``: the test's hook (a rank that stalls mid-forward)."""
    w.bind_connector_metadata(so.kv_connector_metadata)
    try:
        w.start_load_kv()
        if so.num_scheduled_tokens > 0:
            hook = w.wants_layer_hook()
            for layer in range(LAYERS):
                forward_layer(w, so, block_ids, layer)
                if hook:
                    w.save_kv_layer(layer)
                after_layer(w.rank, layer)
        mine = sampled if w.rank == 0 else {}
        w.wait_for_save(mine)
        sending, recving = w.get_finished(set())
        return WorkerOutput(
            rank=w.rank,
            sampled_token_ids=mine,
            finished_sending=sending,
            finished_recving=recving,
            kv_failed=w.take_failures(),
        )
    finally:
        w.clear_connector_metadata()


def d_rank_step(
    w: NixlConnectorWorker, so: SchedulerOutput, sampled: dict[str, int]
) -> WorkerOutput:
    """One D rank's connector calls in a step as ``engine/worker/worker.py`` makes them
    (its forward, if any, is the caller's): it reports the reservations whose KV landed;
    rank 0 samples ``sampled``."""
    w.bind_connector_metadata(so.kv_connector_metadata)
    try:
        sending, recving = w.get_finished(set())
        return WorkerOutput(
            rank=w.rank,
            finished_sending=sending,
            finished_recving=recving,
            kv_recv_info=w.take_recv_info(),
            sampled_token_ids=sampled if w.rank == 0 else {},
        )
    finally:
        w.clear_connector_metadata()


def forward_layer(w: NixlConnectorWorker, so: SchedulerOutput,
                  block_ids: Callable[[str], list[int]], layer: int) -> None:  # fmt: skip
    kv = w._kv_cache
    assert kv is not None
    size = kv.shape[4]
    for seq in so.seqs:
        table = block_ids(seq.request_id)
        for j, token in enumerate(seq.token_ids):
            pos = seq.start_pos + j
            value = expected(token, layer, w.rank, w.world_size)
            kv[table[pos // size], layer, :, :, pos % size] = value


def land(piece: Piece, d_kv: torch.Tensor, corrupt: bool) -> None:
    """The piece's data reaches D's rank (``corrupt``: a word flipped on the way)."""
    lo, hi = piece.layers
    first, count = piece.d_heads
    data = piece.data.clone()
    if corrupt:
        data.view(-1)[0] += 1.0
    d_kv[piece.d_blocks, lo:hi, :, first : first + count] = data
    piece.landed = True


def holds(
    d_kv: torch.Tensor, rank: int, tp: int, prompt: list[int], blocks: list[int]
) -> str | None:
    """Whether D's rank holds P's KV of ``prompt`` in ``blocks`` (the request's block
    table); None when it does, else what differs."""
    size = d_kv.shape[4]
    for pos, token in enumerate(prompt):
        block = blocks[pos // size]
        for layer in range(LAYERS):
            want = expected(token, layer, rank, tp)
            if not torch.equal(d_kv[block, layer, :, :, pos % size], want.expand(-1, -1, DIM)):
                return f"D rank {rank} block {block} layer {layer} token {pos}"
    return None


__all__ = ["DONE", "Hooks", "Piece", "holds", "kv_cache", "land", "p_rank_step", "p_workers"]


def counts_left(agg: Any, workers: list[NixlConnectorWorker]) -> dict[str, Any]:
    """The all-ranks counts a D still holds: the aggregator's ids, each rank's partial counts
    (``{"aggregator": set(), "rank0": {}, ...}`` when none is left open)."""
    return {"aggregator": agg.pending_ids} | {
        f"rank{i}": dict(w._parts)  # noqa: SLF001 - what the rank still counts
        for i, w in enumerate(workers)
    }
