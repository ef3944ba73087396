"""Prefill-side (producer) transfer state of the NIXL connector.

A P request with ``do_remote_decode`` finishes after sampling its first token; its blocks
are then *held* until they have been pushed to the decode node that reserved blocks for
it. Reservations may arrive before or after the prefill finishes. Every state has a
deadline: a finished prefill waits at most ``kv_transfer_timeout`` for its reservation,
an early reservation waits as long for its prefill. A transfer id that ended without a
send is tombstoned so that a late reservation for it is refused (and D recomputes); so is
every finished send, with its outcome, for 4 x ``kv_transfer_timeout`` (longer than D's
quarantine): a cancel of a send that errored or timed out is answered ``in_flight`` (part
of a WRITE UCX did not really abort may still land), so D keeps its blocks quarantined.

Not thread-safe on its own: the scheduler-side connector calls it under its lock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvconnector.nixl.messages import Ack, CancelReply, Refusal

logger = logging.getLogger(__name__)


@dataclass
class Reservation:
    transfer_id: str
    d_request_id: str
    peer_key: str
    d_address: str
    block_ids: list[int]
    skip_blocks: int
    expires: float


@dataclass
class PendingSend:
    request_id: str
    transfer_id: str
    block_ids: list[int]
    first_token: int | None
    deadline: float
    reservation: Reservation | None = None
    started_at: float | None = None


@dataclass
class ProducerOutcome:
    """What the producer decided since it was last asked."""

    free_blocks: set[str] = field(default_factory=set)  # P request ids
    notify_failed: list[tuple[str, str, str]] = field(default_factory=list)  # addr, d_req, why


class Producer:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.pending: dict[str, PendingSend] = {}  # transfer id -> finished prefill
        self.in_flight: dict[str, PendingSend] = {}  # P request id -> started send
        self.early: dict[str, Reservation] = {}  # transfer id -> reservation w/o prefill
        # transfer id -> (why, expiry, a WRITE may still land in D's blocks)
        self.tombstones: dict[str, tuple[str, float, bool]] = {}
        self.outcome = ProducerOutcome()
        self.sends_started = 0

    # -- from the engine thread -----------------------------------------------------------
    def prefill_finished(
        self, request_id: str, transfer_id: str, block_ids: list[int], first_token: int | None
    ) -> bool:
        """Hold the blocks for a push; False when the transfer id is already taken."""
        now = time.monotonic()
        in_flight = any(s.transfer_id == transfer_id for s in self.in_flight.values())
        if transfer_id in self.pending or transfer_id in self.tombstones or in_flight:
            logger.error("transfer id %s is already in use; not pushing it twice", transfer_id)
            return False
        send = PendingSend(
            request_id, transfer_id, list(block_ids), first_token, now + self.timeout
        )
        send.reservation = self.early.pop(transfer_id, None)
        self.pending[transfer_id] = send
        return True

    def prefill_failed(self, transfer_id: str, why: str) -> None:
        """The P request ended without KV to send (aborted, error)."""
        self._tombstone(transfer_id, why)
        res = self.early.pop(transfer_id, None)
        if res is not None:
            self.outcome.notify_failed.append((res.d_address, res.d_request_id, why))

    def ready_sends(self, peer_ready) -> list[PendingSend]:
        """Pending sends whose reservation is known and whose peer the workers can reach."""
        out = []
        now = time.monotonic()
        for tid, send in list(self.pending.items()):
            res = send.reservation
            if res is not None and now >= res.expires:
                # D has given up on this reservation (its deadline is the same length):
                # never push into blocks it may already have reused.
                del self.pending[tid]
                self._tombstone(tid, "reservation expired before the push could start")
                self.outcome.free_blocks.add(send.request_id)
                self.outcome.notify_failed.append(
                    (res.d_address, res.d_request_id, "reservation expired on prefill")
                )
                continue
            if res is None or not peer_ready(res.peer_key):
                continue
            del self.pending[tid]
            send.started_at = time.monotonic()
            self.in_flight[send.request_id] = send
            self.sends_started += 1
            out.append(send)
        return out

    def send_finished(self, request_id: str, error: str | None = None) -> PendingSend | None:
        """A send ended on every rank: done, or ``error`` (failed or timed out)."""
        send = self.in_flight.pop(request_id, None)
        if send is not None:
            why = f"push failed: {error}" if error is not None else "send finished"
            self._tombstone(send.transfer_id, why, may_land=error is not None)
        return send

    def expire(self) -> None:
        now = time.monotonic()
        for tid, send in list(self.pending.items()):
            if now >= send.deadline:
                why = "no reservation" if send.reservation is None else "decode peer not ready"
                logger.warning(
                    "transfer %s: %s within %.1fs; freeing prefill blocks", tid, why, self.timeout
                )
                del self.pending[tid]
                self._tombstone(tid, f"prefill gave up: {why}")
                self.outcome.free_blocks.add(send.request_id)
                if send.reservation is not None:
                    r = send.reservation
                    self.outcome.notify_failed.append((r.d_address, r.d_request_id, why))
        for tid, res in list(self.early.items()):
            if now >= res.expires:
                del self.early[tid]
                self._tombstone(tid, "the prefill did not finish in time")
                self.outcome.notify_failed.append(
                    (res.d_address, res.d_request_id, "the prefill did not finish in time")
                )
        for tid, (_, expiry, _) in list(self.tombstones.items()):
            if now >= expiry:
                del self.tombstones[tid]

    def take_outcome(self) -> ProducerOutcome:
        out, self.outcome = self.outcome, ProducerOutcome()
        return out

    # -- from the side-channel thread ----------------------------------------------------
    def reserve(self, res: Reservation) -> Ack | Refusal:
        dead = self.tombstones.get(res.transfer_id)
        if dead is not None:
            return Refusal(f"transfer {res.transfer_id} ended on prefill: {dead[0]}")
        send = self.pending.get(res.transfer_id)
        if send is not None:
            if send.reservation is not None:
                return Refusal(f"transfer {res.transfer_id} is already reserved")
            send.reservation = res
        elif res.transfer_id in self.early:
            return Refusal(f"transfer {res.transfer_id} is already reserved")
        else:
            self.early[res.transfer_id] = res
        return Ack()

    def abort(self, transfer_id: str) -> None:
        """The P request's client went away: drop its send unless it already started."""
        send = self.pending.pop(transfer_id, None)
        if send is None:
            return
        self._tombstone(transfer_id, "aborted on prefill")
        self.outcome.free_blocks.add(send.request_id)
        if send.reservation is not None:
            r = send.reservation
            self.outcome.notify_failed.append((r.d_address, r.d_request_id, "aborted on prefill"))

    def cancel(self, transfer_id: str) -> CancelReply:
        """D gives up on a transfer. ``cancelled``: nothing was or will be written."""
        if any(s.transfer_id == transfer_id for s in self.in_flight.values()):
            return CancelReply("in_flight")
        dead = self.tombstones.get(transfer_id)
        if dead is not None and dead[2]:
            # The send errored or timed out: a WRITE UCX did not really abort may still land.
            return CancelReply("in_flight")
        send = self.pending.pop(transfer_id, None)
        if send is not None:
            self.outcome.free_blocks.add(send.request_id)
        self.early.pop(transfer_id, None)
        self._tombstone(transfer_id, "cancelled by decode")
        return CancelReply("cancelled")

    def _tombstone(self, transfer_id: str, why: str, may_land: bool = False) -> None:
        # 4T > D's quarantine (2T from its own give-up): outlives every cancel D may send.
        self.tombstones[transfer_id] = (why, time.monotonic() + 4 * self.timeout, may_land)

    def num_states(self) -> int:
        return len(self.pending) + len(self.in_flight) + len(self.early)
