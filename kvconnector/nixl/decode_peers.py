"""Prefill side: the decode peers this node pairs with, and when it trusts one.

A decode node's ``peer_key`` is a secret of its incarnation *and of the prefill address it
pairs with* (128 bits, ``PrefillLinks.pairing_key``), sent only in its handshake
to that address -- never in a ping reply, its ``/v1/kv_transfer_info`` or a log line
(those name it ``engine_id:incarnation``, ``DecodePeer.name``): a key a fake "prefill
node" learned (a client may name any allowed address) is worth nothing at a real one. P keys its table by it, and a reservation or cancel counts only
under a key P has paired with: knowing a decode node's public name is not enough to
reserve, cancel or squat in its name.

A handshake only *claims* an identity: an engine id, an incarnation, a side-channel
address and the ranks' transport metadata. Anyone who reaches P's side channel can send
one (anyone holding ``--kv-secret``, when it is set). So:

* **Nothing is pushed to a peer before its address answered as it.** A new peer is
  unconfirmed; P pings the address it claims (on a small pool of its own, not the peers'
  lanes) and trusts it only when the answer names the same engine id and incarnation and
  the same ranks (``ranks_digest``). A claim its address does not confirm is dropped. At
  most ``MAX_UNCONFIRMED`` claims wait at a time; more are refused.
* **A paired peer is replaced only by proof.** A handshake naming an engine id or an
  address P already pairs with does not drop the old peer on its word: the old one goes
  when a *new* one is confirmed at the *same* address (one address serves one process).
* **A key is not taken over.** A handshake under a confirmed peer's key with another
  address or other ranks is refused; the same handshake again (a retry) is idempotent.
* **The table is bounded** (``MAX_DECODE_PEERS``): a new peer evicts an unconfirmed one,
  else the least recently used one, that no reservation or send refers to; it is refused
  when every one is in use.

P's workers know a peer by its ``handle`` (``name#n``, unique in this process), never by
its key.

Not thread-safe on its own: the scheduler-side connector calls it under its lock.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

MAX_DECODE_PEERS = 256
MAX_UNCONFIRMED = 32  # claims waiting for their address to answer, at most
_handles = itertools.count(1)


@dataclass
class DecodePeer:
    engine_id: str
    incarnation: str
    address: str  # its side channel: where failure notices and verification pings go
    ranks: list[dict[str, Any]]  # each rank's transport metadata
    digest: str  # ``messages.ranks_digest(ranks)``: what its ping must name
    verified: bool = False
    last_used: float = field(default_factory=time.monotonic)
    handle: str = ""  # what P's workers call it (set when it enters the table)

    @property
    def name(self) -> str:
        """Its public name, for logs: ``engine_id:incarnation``."""
        return f"{self.engine_id}:{self.incarnation}"

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
        # Checks queued or running: every claim ``offer`` asked to verify, until
        # ``checked`` (a claim replaced while its check runs still counts until then).
        self.checking = 0

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
    ) -> tuple[bool, list[DecodePeer], str | None]:
        """A handshake claims ``peer`` under ``key``. Returns (needs verifying, peers
        evicted to make room, why refused or None)."""
        old = self.peers.get(key)
        if old is not None:
            if old.same_claim(peer):
                old.last_used = time.monotonic()
                return False, [], None  # a retry: nothing changes (its check is queued)
            if old.verified:
                return (
                    False,
                    [],
                    f"this peer key is already paired as {old.name} at another address or "
                    "with other ranks (a restarted node has a new key)",
                )
        if self.checking >= MAX_UNCONFIRMED:
            return False, [], f"{self.checking} decode peers wait to be confirmed; try again"
        evicted: list[DecodePeer] = []
        if old is None and len(self.peers) >= MAX_DECODE_PEERS:
            idle = [k for k in self.peers if k not in in_use]
            if not idle:
                return False, [], f"this prefill node pairs with {MAX_DECODE_PEERS} decode peers"
            # Unconfirmed claims go first: a flood of them cannot push out paired peers.
            lru = min(idle, key=lambda k: (self.peers[k].verified, self.peers[k].last_used))
            evicted.append(self.peers.pop(lru))
        if old is not None:
            evicted.append(old)  # an unconfirmed claim under this key, replaced
        peer.handle = f"{peer.name}#{next(_handles)}"
        self.peers[key] = peer
        self.checking += 1
        return True, evicted, None

    def checked(self) -> None:
        """A check ``offer`` asked for is over (whatever it found)."""
        self.checking -= 1

    def confirm(self, key: str, peer: DecodePeer) -> list[DecodePeer]:
        """``peer``'s address answered as it: trust it. Returns the peers it replaces
        (other incarnations claiming the same address, now gone)."""
        if self.peers.get(key) is not peer:
            return []  # replaced or dropped meanwhile
        peer.verified = True
        # Another incarnation at this address is gone (one address, one process); the same
        # incarnation under another key (its address spelt another way by D) stays.
        me = (peer.engine_id, peer.incarnation)
        gone = [
            k
            for k, p in self.peers.items()
            if k != key and p.address == peer.address and (p.engine_id, p.incarnation) != me
        ]
        return [self.peers.pop(k) for k in gone]

    def drop(self, key: str, peer: DecodePeer | None = None) -> DecodePeer | None:
        """Forget ``key`` (only if it is still ``peer``, when given); the peer dropped."""
        current = self.peers.get(key)
        if current is None or (peer is not None and current is not peer):
            return None
        return self.peers.pop(key)

    def touch(self, key: str) -> None:
        peer = self.peers.get(key)
        if peer is not None:
            peer.last_used = time.monotonic()
