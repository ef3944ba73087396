"""Prefill side of the side channel: what a prefill node answers its decode peers.

A decode node pairs with this node by a handshake -- a *claim* that is trusted only once
the claimed address answers a ping as that peer (``decode_peers``) -- and then reserves
blocks for each prefill leg the proxy routes here, and may cancel them. This class holds
the decode peers, checks every handshake and reservation before it costs anything, and
tells the workers (through the step metadata) which peers to add and drop.

Runs in the engine process, on the side-channel server's thread and on a small pool of
its own for the claim checks; it shares the scheduler-side connector's lock and its
``Producer`` (the transfers this node holds), and wakes the engine loop when what it
changed may be acted on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.log_limit import LimitedLog
from kvconnector.nixl import clock, tp_map
from kvconnector.nixl.decode_peers import DecodePeer, DecodePeers
from kvconnector.nixl.messages import (
    CLOCK_SLACK_S,
    RESERVE_MAX_AGE_S,
    Ack,
    Cancel,
    CancelReply,
    Handshake,
    HandshakeReply,
    Ping,
    PingReply,
    Refusal,
    Reserve,
    check_compat,
    decode_reply,
    public_rank_info,
    rank_info_error,
    ranks_digest,
)
from kvconnector.nixl.metadata import PeerSpec
from kvconnector.nixl.peers import PeerAllowlist
from kvconnector.nixl.producer import Producer, Reservation
from kvconnector.nixl.side_channel import SideChannelClient

logger = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 2.0  # the ping of a new decode peer's claimed address


class PrefillService:
    def __init__(
        self,
        *,
        engine_id: str,
        incarnation: str,
        address: str,
        role: str,
        compat: dict[str, Any],
        model_kv_heads: int,
        timeout: float,
        max_blocks_per_seq: int,
        max_early: int,
        producer: Producer,
        lock: threading.RLock,
        client: SideChannelClient,
        allowed_peers: PeerAllowlist,
        transport_info: Callable[[], dict[str, Any]],
        wake: Callable[[], None],
    ) -> None:
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.address = address
        self.role = role
        self.compat = compat
        self.model_kv_heads = model_kv_heads
        self.timeout = timeout
        # A reservation names at most one prompt's blocks; so many wait at most.
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_early = max_early
        self.producer = producer
        self._lock = lock
        self._client = client
        self.allowed_peers = allowed_peers
        self._transport_info = transport_info
        self._wake = wake
        self.ranks: list[dict[str, Any]] = []  # this node's ranks (set once they report)
        self.peers = DecodePeers()  # by key
        self._workers_have: set[str] = set()  # handles of the peers the workers added
        self._remove: list[str] = []  # handles the workers drop in the next step
        # Pings of new decode peers' addresses (DecodePeers bounds how many wait). Its own
        # pool: claims must not take the lanes of paired peers' calls.
        self._verifier = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-verify")
        self._closed = False
        self.handshakes = 0
        self.handshake_failures = 0
        # Handshake refusals: any address that reaches the side channel can ask for one
        # (without --kv-secret): one line per kind per 10 s, the next counting the rest.
        self._peer_log = LimitedLog(logger)

    # -- messages (the side-channel server's thread) --------------------------------------
    def handshake(self, msg: Handshake) -> HandshakeReply | Refusal:
        if not self.allowed_peers.allows(msg.address):
            with self._lock:
                self.handshake_failures += 1
            self._peer_log.warning(
                "allowlist", "refusing a handshake from %s: not in --kv-allowed-peers", msg.address
            )
            return Refusal(
                f"{msg.address} is not an allowed peer of this node (--kv-allowed-peers)"
            )
        mismatch = (
            check_compat(self.compat, msg.compat)
            or tp_map.peer_tp_error(len(msg.ranks), msg.compat.get("tp_size"), self.model_kv_heads)
            or next(
                (e for i, r in enumerate(msg.ranks) if (e := rank_info_error(r, f"ranks[{i}]"))),
                None,
            )
        )
        if mismatch:
            with self._lock:
                self.handshake_failures += 1
            self._peer_log.warning(
                "mismatch", "refusing handshake from %s: %s", msg.address, mismatch
            )
            return Refusal(f"incompatible peer: {mismatch}")
        key = msg.peer_key
        claim = DecodePeer(
            engine_id=msg.engine_id,
            incarnation=msg.incarnation,
            address=msg.address,
            ranks=list(msg.ranks),
            digest=ranks_digest(msg.ranks),
        )
        with self._lock:
            verify, evicted, refused = self.peers.offer(key, claim, self.producer.peers_in_use())
            if refused is not None:
                self.handshake_failures += 1
                self._peer_log.warning(
                    "refused", "refusing handshake from %s: %s", msg.address, refused
                )
                return Refusal(refused)
            for old in evicted:
                self._forget_workers_peer(old)
                logger.info("decode peer %s dropped for %s", old.name, claim.name)
            self.handshakes += 1
        if verify:
            self._verifier.submit(self._verify_job, key, claim)
        return HandshakeReply(
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            side_channel=self.address,
            role=self.role,
            compat=self.compat,
            transport=self._transport_info(),
            ranks=tuple(public_rank_info(r) for r in self.ranks),
        )

    def reserve(self, msg: Reserve) -> Ack | Refusal:
        # A forged or confused reservation is refused here, not by a failed WRITE.
        if len(msg.block_ids) > self.max_blocks_per_seq:  # before anything costs
            return Refusal(
                f"reserve.block_ids: {len(msg.block_ids)} blocks, more than a prompt of "
                f"this node's max_model_len fills ({self.max_blocks_per_seq})"
            )
        if len(set(msg.block_ids)) != len(msg.block_ids):
            return Refusal("reserve.block_ids: a block is named twice")
        with self._lock:
            peer = self.peers.get(msg.peer_key)
            if peer is None:
                return Refusal("handshake first", code=Refusal.HANDSHAKE_REQUIRED)
            if msg.p_incarnation != self.incarnation:  # made for a process gone from here
                return Refusal(
                    f"reserve.p_incarnation: made for prefill incarnation {msg.p_incarnation!r:.40}, "
                    f"this is {self.incarnation!r} (restarted since): handshake again",
                    code=Refusal.WRONG_INCARNATION,
                )
            if stale := self._stale(msg):
                return stale
            peer.last_used = time.monotonic()
            limit = peer.num_blocks
            if any(b >= limit for b in msg.block_ids):
                return Refusal(
                    f"reserve.block_ids: block {max(msg.block_ids)} is out of range "
                    f"(the decode peer has {limit} blocks)"
                )
            if msg.transfer_id not in self.producer.pending and (
                refused := self._early_full(msg, limit)
            ):
                return refused
            res = Reservation(
                transfer_id=msg.transfer_id,
                nonce=msg.nonce,
                d_request_id=msg.d_request_id,
                peer_key=msg.peer_key,
                d_address=peer.address,  # the handshaken one, not what this message says
                block_ids=list(msg.block_ids),
                skip_blocks=msg.skip_blocks,
                expires=time.monotonic() + self.timeout,
            )
            return self.producer.reserve(res)

    def _stale(self, msg: Reserve) -> Refusal | None:
        """A reservation that got here later than D's quarantine covers (a socket buffer,
        a network partition: D gave up on the call and may have freed the blocks since),
        or dated ahead of this node's clock by more than the hosts may differ (a skew
        that would let a late one look fresh), is refused (docs/reliability.md)."""
        age = clock.wall() - msg.sent_at
        if -CLOCK_SLACK_S <= age <= RESERVE_MAX_AGE_S:
            return None
        why = (
            f"sent {age:.1f}s ago, more than {RESERVE_MAX_AGE_S:.0f}s"
            if age > 0
            else f"dated {-age:.1f}s ahead of this node's clock (more than "
            f"{CLOCK_SLACK_S:.0f}s: are the hosts' clocks synchronised?)"
        )
        self._peer_log.warning(
            "stale", "refusing reservation of %s from %s: %s", msg.transfer_id, msg.address, why
        )
        return Refusal(f"reserve.sent_at: {why}", code=Refusal.STALE_RESERVATION)

    def cancel(self, msg: Cancel) -> CancelReply:
        with self._lock:
            key = msg.peer_key if msg.peer_key in self.peers else None
            return self.producer.cancel(msg.transfer_id, msg.nonce, key, sender=msg.peer_key)

    def _early_full(self, msg: Reserve, limit: int) -> Refusal | None:
        """Reservations waiting for their prefill are the part of P's state a peer grows
        at will: no more of them, in blocks, than the peer's cache holds, and no more in
        all than this node could be asked to prefill (running + queued, twice over)."""
        if msg.transfer_id in self.producer.early:
            return None  # a retry, or refused as already reserved
        waiting = self.producer.early_blocks(msg.peer_key, but=msg.transfer_id)
        if waiting + max(1, len(msg.block_ids)) > limit:
            return Refusal(
                f"the decode peer has {waiting} blocks reserved here waiting for their "
                f"prefill, and {limit} in all"
            )
        if len(self.producer.early) >= self.max_early:
            # Full: the peer holding the most gives up its oldest -- unless that is the
            # sender itself. One peer (or a stranger's many) cannot starve the others.
            counts = Counter(r.peer_key for r in self.producer.early.values())
            biggest, held = counts.most_common(1)[0]
            if biggest == msg.peer_key or held <= counts[msg.peer_key] + 1:
                return Refusal(f"{self.max_early} reservations wait here for their prefill")
            self.producer.evict_early(biggest, "too many reservations wait on prefill")
        return None

    def _verify_job(self, key: str, claim: DecodePeer) -> None:
        """Ask the address a handshake claimed whether it is that peer (decode_peers)."""
        try:
            raw = self._client.request(claim.address, Ping().to_wire(), VERIFY_TIMEOUT_S)
            reply = decode_reply(raw, PingReply)
        except Exception as e:  # unreachable, or not a reply we know
            reply, why = None, f"no answer from {claim.address}: {e}"
        else:
            why = f"{claim.address} answered {reply!r:.200}"
        if self._closed:
            return  # the node is stopping: no verdict, no log line after its last
        with self._lock:
            self.peers.checked()
            if (
                isinstance(reply, PingReply)
                and (reply.engine_id, reply.incarnation) == (claim.engine_id, claim.incarnation)
                and reply.ranks_digest == claim.digest
            ):
                for old in self.peers.confirm(key, claim):
                    logger.info(
                        "decode at %s restarted; %s replaces %s",
                        claim.address,
                        claim.name,
                        old.name,
                    )
                    self._forget_workers_peer(old)
            elif self.peers.drop(key, claim) is not None:
                self.handshake_failures += 1
                logger.warning("decode peer %s not confirmed by its address: %s", claim.name, why)
                # Never pushed: its reservations waiting for their prefill go now.
                self.producer.drop_early(key, "the decode peer was not confirmed")
        self._wake()

    # -- the engine loop (under the scheduler-side connector's lock) ----------------------
    def ready(self, key: str) -> bool:
        """Whether sends to the peer under ``key`` may go (paired and confirmed)."""
        return self.peers.ready(key)

    def worker_peer(self, key: str) -> tuple[str, PeerSpec | None]:
        """The handle the workers know a ready peer by, and its spec when they have not
        added it yet (they add it in the step that carries it)."""
        peer = self.peers.get(key)
        assert peer is not None  # ready() said so, under the same lock
        if peer.handle in self._workers_have:
            return peer.handle, None
        self._workers_have.add(peer.handle)
        return peer.handle, PeerSpec(peer.ranks, self.model_kv_heads)

    def take_removed(self) -> list[str]:
        """Handles of the peers the workers drop in the next step."""
        removed, self._remove = self._remove, []
        return removed

    def evict(self, key: str, why: str) -> None:
        """A push to this decode peer failed: forget it (agents, descriptor lists). A live
        peer's next reservation is answered ``handshake_required`` and it handshakes anew."""
        peer = self.peers.drop(key)
        if peer is None:
            return
        logger.warning("dropping decode peer %s after a failed push: %s", peer.name, why)
        self._forget_workers_peer(peer)

    def _forget_workers_peer(self, peer: DecodePeer) -> None:
        """The workers drop ``peer``'s agents and descriptor lists in the next step."""
        if peer.handle in self._workers_have:
            self._workers_have.discard(peer.handle)
            self._remove.append(peer.handle)

    def shutdown(self) -> None:
        self._closed = True  # a ping still running ends within VERIFY_TIMEOUT_S, silently
        self._verifier.shutdown(wait=False, cancel_futures=True)
