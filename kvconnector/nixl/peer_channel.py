"""The scheduler-side connector's side channel: what peers send it, and its calls to them.

* Served (the side-channel server's thread): every request is decoded into its typed
  message and dispatched -- a handshake, reservation or cancel to the ``PrefillService``
  (P), a failure notice to the ``Consumer`` (D), a ping answered here; a malformed one,
  or one only the other role takes, is answered with a ``Refusal``.
* Sent: this node's calls to peers, each on the peer's lane (``lanes.PeerLanes``: a FIFO
  queue and a thread per peer), so that no network wait runs on the engine's step loop
  and a peer that does not answer delays only the calls to itself -- D's reservations
  and cancels (``PrefillLinks``' jobs) and P's failure notices.

It shares the connector's lock. Lines peers can provoke are logged at most once per
``PEER_LOG_S`` per kind, with a count of those held back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from engine.log_limit import LimitedLog
from kvconnector.nixl.consumer import Consumer
from kvconnector.nixl.lanes import LaneFull, PeerLanes
from kvconnector.nixl.messages import (
    Ack,
    Cancel,
    CancelReply,
    Handshake,
    HandshakeReply,
    MessageError,
    PingReply,
    Refusal,
    Reserve,
    TransferFailed,
    compat_mismatch,
    decode_request,
    ranks_digest,
)
from kvconnector.nixl.prefill_service import PrefillService
from kvconnector.nixl.producer import Reservation
from kvconnector.nixl.side_channel import SideChannelClient, SideChannelServer

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0  # the failure notices this node sends
# Lines others can provoke, each kind at most once per this many seconds (the next says
# how many were held back): calls refused at a lane bound, per peer class (a client names
# the peers), and refusals of messages a peer sent (malformed, for the other role; without
# --kv-secret anyone who reaches the port is read).
PEER_LOG_S = 10.0


class PeerChannel:
    """The side channel of one node's scheduler-side connector (P, D or both)."""

    def __init__(
        self,
        *,
        engine_id: str,
        incarnation: str,
        role: str,
        compat: dict[str, Any],
        service: PrefillService,
        consumer: Consumer,
        lock: threading.RLock,
        client: SideChannelClient,
        host: str,
        port: int,
        secret: bytes | None,
        wake: Callable[[], None],
    ) -> None:
        """Binds the side-channel server on ``host:port`` (``SideChannelError`` if it
        cannot): it serves from here on."""
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.role = role
        self.compat = compat
        self.service = service
        self.consumer = consumer
        self._lock = lock
        self.client = client
        self._wake = wake
        self.ranks_digest = ranks_digest([])  # what this node's pings name (its ranks')
        self.lanes = PeerLanes()
        # Keyed by ``proven``: strangers' refusals never hold back a proven peer's line.
        self._peer_log = LimitedLog(logger, PEER_LOG_S)
        self.server = SideChannelServer(host, port, self.handle, secret=secret)

    # -- served ----------------------------------------------------------------------------
    def handle(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Serve one side-channel request. Never raises: a message that does not decode
        is answered with a ``Refusal`` saying why."""
        try:
            msg = decode_request(raw)
        except MessageError as e:
            return self._refuse_malformed(raw, e).to_wire()
        reply: HandshakeReply | Ack | CancelReply | PingReply | Refusal
        if (wrong_role := self._wrong_role(msg)) is not None:
            return wrong_role.to_wire()
        if isinstance(msg, Handshake):
            reply = self.service.handshake(msg)
        elif isinstance(msg, Reserve):
            reply = self.service.reserve(msg)
        elif isinstance(msg, Cancel):
            reply = self.service.cancel(msg)
        elif isinstance(msg, TransferFailed):
            with self._lock:
                self.consumer.fail(msg.d_request_id, msg.reason, msg.safe, nonce=msg.nonce)
            reply = Ack()
        else:
            return PingReply(
                incarnation=self.incarnation,
                engine_id=self.engine_id,
                ranks_digest=self.ranks_digest,
            ).to_wire()
        self._wake()  # the next step may act on it (push, fail over, free blocks)
        return reply.to_wire()

    def _wrong_role(self, msg: Any) -> Refusal | None:
        """What only the other role takes: a decode node pairs with no one and holds no
        prefill (its handshake reply would hand out its KV memory's keys); a prefill node
        waits for no KV."""
        role = self.role
        if role == "consumer" and isinstance(msg, Handshake | Reserve | Cancel):
            why = f"this is a decode node: a {msg.KIND} goes to a prefill node"
        elif role == "producer" and isinstance(msg, TransferFailed):
            why = f"this is a prefill node: a {msg.KIND} goes to a decode node"
        else:
            return None
        self._peer_log.warning("wrong role", "side channel: refusing a %s: %s", msg.KIND, why)
        return Refusal(why, code=Refusal.WRONG_ROLE)

    def _refuse_malformed(self, raw: dict[str, Any], error: MessageError) -> Refusal:
        is_handshake = raw.get("kind") == Handshake.KIND
        if is_handshake and (mismatch := compat_mismatch(self.compat, raw)):
            # A peer of another version may speak another shape: name the version first.
            with self._lock:
                self.service.handshake_failures += 1
            return Refusal(f"incompatible peer: {mismatch}")
        self._peer_log.warning("malformed", "side channel: refusing a malformed message: %s", error)
        return Refusal(f"malformed message: {error}")

    # -- sent ------------------------------------------------------------------------------
    def notify_failed(self, res: Reservation, why: str, safe: bool) -> None:
        msg = TransferFailed(
            d_request_id=res.d_request_id,
            transfer_id=res.transfer_id,
            nonce=res.nonce,
            reason=why,
            safe=safe,
        )
        # Not sent: D's own deadline ends its wait.
        with self._lock:
            proven = self.service.ready(res.peer_key)
        self.submit(res.d_address, self._send_quietly, res.d_address, msg.to_wire(), proven=proven)

    def submit(self, peer: str, fn: Any, *args: Any, proven: bool) -> bool:
        """Queue a call on ``peer``'s lane; False (logged) when the lane is at its bound.
        ``proven``: the peer paired with this node (a prefill node that answered its
        handshake, a confirmed decode peer); peers a client named and that never did
        share a few lanes (``lanes.PeerLanes``). Refusals are logged at most once per
        ``PEER_LOG_S`` per class (proven or not), with a count of those held back."""
        try:
            self.lanes.submit(peer, fn, *args, proven=proven)
        except LaneFull as e:
            kind = "lane refused, proven" if proven else "lane refused, unproven"
            self._peer_log.warning(kind, "side channel: not calling %s: %s", peer, e)
            return False
        return True

    def _send_quietly(self, address: str, msg: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return self.client.request(address, msg, RPC_TIMEOUT_S)
        except Exception as e:
            logger.info("side-channel %s to %s failed: %s", msg.get("kind"), address, e)
            return None

    def shutdown(self) -> None:
        self.server.close()
        self.lanes.shutdown()
