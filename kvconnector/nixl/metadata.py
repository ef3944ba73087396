"""Per-step instructions from the NIXL scheduler-side connector to its workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvconnector.base import KVConnectorMetadata

# Why a pipelined send failed when P's own step raised (no fault of the decode peer).
STEP_FAILED = "the prefill step computing this KV failed"
# Why a rank posted nothing (more) of a send: it got to it after ``SendSpec.post_by`` (a
# stalled worker), when D may have given the blocks up. No fault of the decode peer.
TOO_LATE = "this rank got to the send after its reservation's deadline"


@dataclass
class SendSpec:
    """Push the local blocks of a finished prefill into a decode node's blocks."""

    request_id: str  # P's request id (reported back in finished_sending)
    peer_key: str  # D engine id + incarnation
    local_block_ids: list[int]
    remote_block_ids: list[int]
    notif: bytes
    # Pipelined: the prefill computing this KV runs in this very step; the workers post
    # it a layer group at a time as the forward writes it (``--kv-layer-group-size``).
    pipelined: bool = False
    # ``time.monotonic()`` (one clock for the processes of a host) after which a rank
    # posts nothing of it: the reservation's deadline. D gives up at its own deadline and
    # frees the blocks after a quarantine of 2 x --kv-transfer-timeout, so a rank that
    # stalled past this (SIGSTOP, swap, a hung GPU) must not write into them when it wakes.
    post_by: float = float("inf")


@dataclass
class PeerSpec:
    """A decode peer for the workers: every D rank's transport metadata (rank order) and
    the model's KV head count, from which each P rank works out which heads it writes
    into which D rank (``tp_map.writes_of``)."""

    ranks: list[dict[str, Any]]
    num_kv_heads: int


@dataclass
class NixlConnectorMetadata(KVConnectorMetadata):
    add_peers: dict[str, PeerSpec] = field(default_factory=dict)  # by peer key
    remove_peers: list[str] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    # Transfers that ended without completing on every rank -- D reservations (nonces)
    # failed, cancelled or past their deadline, P sends (request ids) lost: every rank
    # drops its partial count, the aggregator its partial all-ranks count.
    ended_keys: list[str] = field(default_factory=list)
    # Whether D's workers should watch for notifications between steps (and wake the
    # engine when KV lands); None: unchanged since the last step that said it.
    watch: bool | None = None
    # D's process (its incarnation, which every nonce it makes begins with), said in its
    # first step and whenever watching starts: a notification naming another process's
    # nonce (one made for a D process at this address before a restart) counts nowhere.
    incarnation: str | None = None
    # D: reservations made this step, nonce -> the D blocks P may write for it. A
    # transport that puts received data in place itself (UCXX) writes a message's data
    # only into blocks of the reservation its notification names (``ended_keys`` and the
    # rank's own completion end it); NIXL's WRITE is one-sided and cannot be gated.
    expect: dict[str, list[int]] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (
            self.add_peers
            or self.remove_peers
            or self.sends
            or self.ended_keys
            or self.watch is not None
            or self.incarnation is not None
            or bool(self.expect)
        )

    def ended_transfer_keys(self) -> list[str]:
        return self.ended_keys
