"""Decode side of the side channel: a decode node's calls to the prefill nodes it pairs with.

For each request whose prompt a prefill node (P) computes, the decode node (D) reserves
blocks and tells P where to push (``reserve``), pairing with P first (``handshake``, once
per P incarnation); a wait that ends early is cancelled at P (``cancel``). Every call runs
on P's lane (``lanes.PeerLanes``), never on the engine's step loop, and its outcome goes
into the ``Consumer`` (the receives this node waits for) under the scheduler-side
connector's lock.

D pairs with each P address under its own secret key (``pairing_key``): what one P
learned -- e.g. a fake "prefill node" a client named -- is worth nothing at another
(``decode_peers``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from kvconnector.nixl import clock, tp_map
from kvconnector.nixl.consumer import Consumer, RemoteRecv
from kvconnector.nixl.messages import (
    Ack,
    Cancel,
    CancelReply,
    Handshake,
    HandshakeReply,
    MessageError,
    Ping,
    Refusal,
    Reserve,
    check_compat,
    compat_mismatch,
    decode_reply,
)
from kvconnector.nixl.side_channel import (
    SideChannelClient,
    SideChannelError,
    SideChannelNotSent,
    SideChannelTimeout,
)

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0
MAX_P_LOCKS = 1024  # per-prefill-address handshake locks kept beyond the paired peers
# Prefill addresses whose handshake is remembered: they come from clients (any address
# --kv-allowed-peers allows); past it the oldest is forgotten (its next call handshakes again).
MAX_PREFILL_PEERS = 1024


class HandshakeError(RuntimeError):
    pass


class PrefillLinks:
    def __init__(
        self,
        *,
        engine_id: str,
        incarnation: str,
        address: str,
        compat: dict[str, Any],
        model_kv_heads: int,
        consumer: Consumer,
        lock: threading.RLock,
        client: SideChannelClient,
        wake: Callable[[], None],
    ) -> None:
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.address = address
        self.compat = compat
        self.model_kv_heads = model_kv_heads
        self.consumer = consumer
        self._lock = lock
        self._client = client
        self._wake = wake
        # Secret: each prefill node this node pairs with learns its own pairing key.
        self._key_secret = secrets.token_bytes(32)
        self.ranks: list[dict[str, Any]] = []  # this node's ranks (set once they report)
        self.peers: dict[str, HandshakeReply] = {}  # handshake results by P address
        self._locks: dict[str, threading.Lock] = {}
        self.handshakes = 0
        self.handshake_failures = 0
        # P address -> when a call to it last went unanswered (cleared by an answer).
        # Calls queued behind that one on P's lane were not sent and are not: each would
        # wait out its own timeout, one after another (lane threads only).
        self._unanswered: dict[str, float] = {}
        self.calls_skipped = 0  # calls not sent: queued behind an unanswered one

    def pairing_key(self, p_address: str) -> str:
        """The secret this node pairs with the prefill node at ``p_address`` under (128
        bits, its own for every address and incarnation)."""
        mac = hmac.new(self._key_secret, p_address.encode(), hashlib.sha256)
        return mac.hexdigest()[:32]

    def paired(self, address: str) -> bool:
        """The prefill node at ``address`` completed a handshake with this node (and is
        remembered): it proved to be one, unlike any address a client may name."""
        with self._lock:
            return address in self.peers

    def forget(self, address: str, incarnation: str | None) -> None:
        """The prefill at ``address`` restarted: the next call handshakes with the new one.
        Under the lock."""
        peer = self.peers.get(address)
        if peer is not None and peer.incarnation == incarnation:
            del self.peers[address]

    # -- jobs on a prefill node's lane -----------------------------------------------------
    def reserve_job(self, recv: RemoteRecv) -> None:
        try:
            self._reserve(recv)
        finally:
            self._wake()

    def _behind_unanswered(self, address: str, queued_at: float) -> bool:
        """A call queued at ``queued_at`` waited behind one to ``address`` that went
        unanswered: it is not sent (P is hung or gone; its lane would hold every later
        call for a whole timeout each)."""
        at = self._unanswered.get(address)
        if at is None or at < queued_at:
            return False
        with self._lock:
            self.calls_skipped += 1
        return True

    def _answered(self, address: str, error: BaseException | None) -> None:
        if isinstance(error, SideChannelTimeout):
            if len(self._unanswered) >= MAX_P_LOCKS:
                self._unanswered.clear()  # addresses come from clients: bounded
            self._unanswered[address] = time.monotonic()
        elif error is None:
            self._unanswered.pop(address, None)

    def _ended(self, recv: RemoteRecv) -> bool:
        """The wait ``recv`` is for ended before its reservation left (aborted, timed out,
        failed while the call was queued or handshaking): its blocks are quarantined -- or
        free again -- for a deadline counted from that end, which a reservation P gets
        only now would outlive. It is not sent; the cancel queued behind it tells P, which
        confirms a nonce it never held."""
        with self._lock:
            ended = self.consumer.recvs.get(recv.request_id) is not recv
        if ended:
            logger.info("request %s ended before its reservation was sent", recv.request_id)
        return ended

    def _reserve(self, recv: RemoteRecv) -> None:
        if self._ended(recv):
            return
        if self._behind_unanswered(recv.p_address, recv.created):
            with self._lock:
                self.consumer.fail(
                    recv.request_id,
                    f"prefill unreachable: an earlier call to {recv.p_address} got no answer",
                    safe=True,  # not sent: P cannot hold it
                )
            return
        again = (Refusal.HANDSHAKE_REQUIRED, Refusal.WRONG_INCARNATION)
        try:
            for attempt in range(2):
                peer = self.ensure_handshake(recv.p_address, force=attempt > 0)
                if self._ended(recv):
                    return
                with self._lock:  # D's quarantine counts from its send (``sent_at``)
                    recv.sent_at = clock.monotonic()
                msg = self._reserve_msg(recv, peer.incarnation)
                answered = False
                try:
                    raw = self._client.request(recv.p_address, msg, RPC_TIMEOUT_S)
                    answered = True
                except SideChannelError as e:
                    self._answered(recv.p_address, e)
                    raise
                finally:
                    with self._lock:  # P got it by now, or may still (unanswered)
                        self.consumer.call_over(recv, answered)
                self._answered(recv.p_address, None)
                reply = decode_reply(raw, Ack)
                if isinstance(reply, Ack) or reply.code not in again:
                    break
        except (HandshakeError, SideChannelNotSent) as e:  # the reservation was not sent
            with self._lock:
                self.consumer.fail(recv.request_id, f"prefill unreachable: {e}", safe=True)
            return
        except MessageError as e:  # P answered, but not a reply we know: not safe
            with self._lock:
                self.consumer.fail(recv.request_id, f"bad reply from prefill: {e}", safe=False)
            return
        except Exception as e:  # unreachable P: it may have the reservation; not safe
            with self._lock:
                self.consumer.fail(recv.request_id, f"prefill unreachable: {e}", safe=False)
            return
        with self._lock:
            if isinstance(reply, Ack):
                self.consumer.reserved(recv.request_id, peer.incarnation)
            else:
                self.consumer.fail(recv.request_id, reply.error, safe=True)

    def _reserve_msg(self, recv: RemoteRecv, p_incarnation: str) -> dict[str, Any]:
        """The reservation for the P process this node paired with: another one at that
        address (P restarted) refuses it, even replayed from the wire."""
        return Reserve(
            transfer_id=recv.transfer_id,
            nonce=recv.nonce,
            d_request_id=recv.request_id,
            peer_key=self.pairing_key(recv.p_address),
            address=self.address,
            block_ids=tuple(recv.block_ids),
            skip_blocks=recv.skip_blocks,
            p_incarnation=p_incarnation,
            sent_at=clock.wall(),
        ).to_wire()

    def cancel_job(
        self, address: str, transfer_id: str, nonce: str, request_id: str, queued_at: float
    ) -> None:
        if self._behind_unanswered(address, queued_at):
            return  # the quarantine keeps the blocks to its deadline, as for a lost cancel
        msg = Cancel(transfer_id, nonce, self.pairing_key(address)).to_wire()
        try:
            try:
                raw = self._client.request(address, msg, RPC_TIMEOUT_S)
            except SideChannelError as e:
                self._answered(address, e)
                raise
            self._answered(address, None)
            reply = decode_reply(raw, CancelReply)
        except MessageError as e:
            logger.info("cancel of %s: bad reply from %s: %s", transfer_id, address, e)
            return
        except Exception as e:  # not sent: the quarantine keeps the blocks to its deadline
            logger.info("side-channel cancel to %s failed: %s", address, e)
            return
        if isinstance(reply, CancelReply) and reply.state == "cancelled":
            with self._lock:
                self.consumer.cancel_confirmed(request_id, nonce)
            self._wake()

    def ensure_handshake(self, address: str, force: bool = False) -> HandshakeReply:
        with self._lock:
            if address not in self._locks and len(self._locks) >= MAX_P_LOCKS:
                # Addresses come from clients (within --kv-allowed-peers): keep the locks
                # of paired peers and of handshakes running, forget the rest.
                for a, held in list(self._locks.items()):
                    if a not in self.peers and not held.locked():
                        del self._locks[a]
            lock = self._locks.setdefault(address, threading.Lock())
        with lock:  # one handshake per peer at a time; others wait here, off the loop
            peer = self.peers.get(address)
            if peer is not None and not force:
                return peer
            if self._client.signed:
                # The handshake hands out this node's rank metadata (the keys to write into
                # its KV memory), and a signed message is not a secret one: first the
                # address proves it holds --kv-secret (a signed ping reply).
                try:
                    self._client.request(address, Ping().to_wire(), RPC_TIMEOUT_S)
                except SideChannelError as e:
                    self._answered(address, e)
                    with self._lock:
                        self.handshake_failures += 1
                    raise HandshakeError(f"prefill {address} did not prove the secret: {e}") from e
            msg = Handshake(
                engine_id=self.engine_id,
                incarnation=self.incarnation,
                peer_key=self.pairing_key(address),
                compat=self.compat,
                ranks=tuple(self.ranks),
                address=self.address,
            ).to_wire()
            try:
                raw = self._client.request(address, msg, RPC_TIMEOUT_S)
            except SideChannelError as e:
                # No reservation went out yet: nothing can write into the blocks, so the
                # failure is safe (not a quarantine of 2 x the timeout).
                self._answered(address, e)
                with self._lock:
                    self.handshake_failures += 1
                raise HandshakeError(f"prefill {address} did not answer the handshake: {e}") from e
            self._answered(address, None)
            reply, error = self._check_handshake_reply(address, raw)
            with self._lock:
                self.handshakes += 1
                if reply is None:
                    self.handshake_failures += 1
                    raise HandshakeError(error)
                reply = self._remember(address, reply)
            logger.info("handshake with prefill %s (%s) done", reply.engine_id, address)
            return reply

    def _remember(self, address: str, reply: HandshakeReply) -> HandshakeReply:
        """Keep what this node uses of P's handshake reply (its names and incarnation), for
        at most ``MAX_PREFILL_PEERS`` addresses. P's rank, transport and compat maps are
        checked, not kept: the address is a client's choice, and whoever listens there may
        answer with a message's 64 MiB of them. Under the lock."""
        kept = dataclasses.replace(reply, compat={}, transport={}, ranks=())
        self.peers.pop(address, None)
        while len(self.peers) >= MAX_PREFILL_PEERS:
            del self.peers[next(iter(self.peers))]
        self.peers[address] = kept
        return kept

    def _check_handshake_reply(
        self, address: str, raw: dict[str, Any]
    ) -> tuple[HandshakeReply | None, str]:
        """(P's reply, "") when it can be paired with, else (None, why not)."""
        try:
            reply = decode_reply(raw, HandshakeReply)
        except MessageError as e:
            if mismatch := compat_mismatch(self.compat, raw):  # another version's shape
                return None, f"prefill {address} is incompatible: {mismatch}"
            return None, f"prefill {address} sent a malformed handshake reply: {e}"
        if isinstance(reply, Refusal):
            return None, f"prefill {address} refused the handshake: {reply.error}"
        mismatch = check_compat(self.compat, reply.compat) or tp_map.peer_tp_error(
            len(reply.ranks), reply.compat.get("tp_size"), self.model_kv_heads
        )
        if mismatch:
            return None, f"prefill {address} is incompatible: {mismatch}"
        return reply, ""
