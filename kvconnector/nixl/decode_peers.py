"""Prefill side: the decode peers this node pairs with, and when it trusts one.

A handshake only *claims* an identity: an engine id, an incarnation, a side-channel
address and the ranks' transport metadata. Anyone who reaches P's side channel can send
one (anyone holding ``--kv-secret``, when it is set). So:

* **Nothing is pushed to a peer before its address answered as it.** A new peer is
  unverified; P pings the address it claims (off the engine loop, on that address's lane)
  and trusts it only when the answer names the same engine id and incarnation and the
  same ranks (``ranks_digest``). A claim whose address answers otherwise, or not at all,
  is dropped. Reservations from an unverified peer are accepted; their pushes wait.
* **A paired peer is replaced only by proof.** A handshake naming an engine id or an
  address P already pairs with no longer drops the old peer ("restarted") on its word:
  the old one is dropped when the *new* one is verified at the *same* address (one
  address serves one process, so the old incarnation is gone). A D restarted on another
  address leaves its old entry to the table's bound or to a failed push.
* **A key is not taken over.** A handshake under a verified peer's key with another
  address or other ranks is refused; the same handshake again (a retry) is idempotent.
* **The table is bounded** (``MAX_DECODE_PEERS``): a new peer evicts an unconfirmed one,
  else the least recently used one, that no reservation or send refers to; it is refused
  when every one is in use.

Not thread-safe on its own: the scheduler-side connector calls it under its lock.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

MAX_DECODE_PEERS = 256


@dataclass
class DecodePeer:
    engine_id: str
    incarnation: str
    address: str  # its side channel: where failure notices and verification pings go
    ranks: list[dict[str, Any]]  # each rank's transport metadata
    digest: str  # ``messages.ranks_digest(ranks)``: what its ping must name
    verified: bool = False
    last_used: float = field(default_factory=time.monotonic)

    @property
    def num_blocks(self) -> int:
        """The smallest rank's KV cache (checked at the handshake): the block-id bound."""
        return min(r["num_blocks"] for r in self.ranks)

    def same_claim(self, other: DecodePeer) -> bool:
        return (self.engine_id, self.address, self.digest) == (
            other.engine_id,
            other.address,
            other.digest,
        )


class DecodePeers:
    def __init__(self) -> None:
        self.peers: dict[str, DecodePeer] = {}

    def __len__(self) -> int:
        return len(self.peers)

    def __contains__(self, key: str) -> bool:
        return key in self.peers

    def get(self, key: str) -> DecodePeer | None:
        return self.peers.get(key)

    def ready(self, key: str) -> bool:
        """A push to ``key`` may start: known and verified."""
        peer = self.peers.get(key)
        return peer is not None and peer.verified

    def offer(
        self, key: str, peer: DecodePeer, in_use: Collection[str]
    ) -> tuple[bool, list[str], str | None]:
        """A handshake claims ``peer`` under ``key``. Returns (needs verifying, keys
        evicted to make room, why refused or None)."""
        old = self.peers.get(key)
        if old is not None:
            if old.same_claim(peer):
                old.last_used = time.monotonic()
                return not old.verified, [], None  # a retry: nothing changes
            if old.verified:
                return (
                    False,
                    [],
                    f"peer key {key!r:.80} is already paired with another address or other "
                    "ranks (a restarted node has a new incarnation, hence a new key)",
                )
        evicted: list[str] = []
        if old is None and len(self.peers) >= MAX_DECODE_PEERS:
            idle = [k for k in self.peers if k not in in_use]
            if not idle:
                return False, [], f"this prefill node pairs with {MAX_DECODE_PEERS} decode peers"
            # Unconfirmed claims go first: a flood of them cannot push out paired peers.
            lru = min(idle, key=lambda k: (self.peers[k].verified, self.peers[k].last_used))
            del self.peers[lru]
            evicted.append(lru)
        self.peers[key] = peer
        return True, evicted, None

    def confirm(self, key: str, peer: DecodePeer) -> list[str]:
        """``peer``'s address answered as it: trust it. Returns the keys of the peers it
        replaces (other incarnations claiming the same address, now gone)."""
        if self.peers.get(key) is not peer:
            return []  # replaced or dropped meanwhile
        peer.verified = True
        gone = [k for k, p in self.peers.items() if k != key and p.address == peer.address]
        for k in gone:
            del self.peers[k]
        return gone

    def drop(self, key: str, peer: DecodePeer | None = None) -> bool:
        """Forget ``key`` (only if it is still ``peer``, when given)."""
        current = self.peers.get(key)
        if current is None or (peer is not None and current is not peer):
            return False
        del self.peers[key]
        return True

    def touch(self, key: str) -> None:
        peer = self.peers.get(key)
        if peer is not None:
            peer.last_used = time.monotonic()
