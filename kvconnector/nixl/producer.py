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

Fencing: a reservation carries D's ``nonce``. A cancel acts only on the reservation with
its nonce: a delayed cancel of an older reservation of the same transfer id never drops a
newer one; for a nonce P never accepted, nothing was or will be written (``cancelled``).

Not thread-safe on its own: the scheduler-side connector calls it under its lock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvconnector.nixl import clock
from kvconnector.nixl.messages import Ack, CancelReply, Refusal

logger = logging.getLogger(__name__)


# Cancels of reservations P never held, remembered at most (each kind) for paired peers;
# senders P does not pair with have a budget of their own, 1/16 of it (``CancelMemory``).
MAX_CANCELLED = 65536
# Tombstones kept at most. A paired peer makes them at will (reserve, cancel, again); past
# the bound the oldest one no WRITE may land for goes: it only fenced late messages about a
# transfer that ended, and every wait they would start has its deadline.
MAX_TOMBSTONES = 65536


@dataclass
class Reservation:
    transfer_id: str
    nonce: str
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
    finished_at: float = field(default_factory=clock.monotonic)  # the prefill's end
    pipelined: bool = False  # started in the prefill's last step (before its end)


@dataclass
class ProducerOutcome:
    """What the producer decided since it was last asked."""

    free_blocks: set[str] = field(default_factory=set)  # P request ids
    # reservations to tell D about: the KV will not come (nothing was written)
    notify_failed: list[tuple[Reservation, str]] = field(default_factory=list)  # (res, why)
    # ... and sends that ended unreported: a WRITE may still land (D quarantines)
    notify_unsafe: list[tuple[Reservation, str]] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)  # sends given up on: drop their counts


@dataclass
class Tombstone:
    why: str
    expiry: float
    may_land: bool  # the send errored or timed out: part of a WRITE may still land
    nonce: str | None  # the reservation it was for, if any


class CancelMemory:
    """Keys (nonces, transfer ids) of cancels P remembers, each for ``lifetime`` seconds,
    bounded by ``MAX_CANCELLED`` (paired peers') plus 1/16 of it (strangers').

    Who sent a cancel decides what its entry may push out. The bound is shared, and
    senders may be strangers (a cancel needs no pairing: a D whose handshake was refused
    sends one) or peers pairing under keys of their own: a flood of either must not evict
    a real decode node's entries (its leg would wait to its timeout, its raced reservation
    be accepted). So entries of senders P does not pair with (``owner`` None) have a
    budget of their own and push out only each other; at the paired peers' bound, the
    peer holding the most entries gives up its oldest (the sender itself on a tie).

    In expiry order (one lifetime for all; a re-added key moves to the end): ``expire``
    reads only what expired. Not thread-safe: the connector's lock guards it.
    """

    def __init__(self, lifetime: float) -> None:
        self.lifetime = lifetime
        self._expiry: dict[str, tuple[str | None, float]] = {}  # key -> (owner, expiry)
        self._owned: dict[str | None, dict[str, None]] = {}  # owner -> its keys, oldest first
        self._sizes: dict[int, set[str]] = {}  # n -> paired owners holding n entries
        self._largest = 0  # the most entries a paired owner holds
        self._paired = 0  # entries of paired owners

    def __len__(self) -> int:
        return len(self._expiry)

    def __contains__(self, key: object) -> bool:
        return key in self._expiry

    def add(self, key: str, owner: str | None) -> None:
        """Remember ``key``, cancelled by ``owner`` (a paired peer's key; None: a sender P
        does not pair with), making room within the owner's share."""
        self.pop(key)  # (re)added last: the dict stays in expiry order
        if owner is None:
            strangers = self._owned.get(None, {})
            if len(strangers) >= max(1, MAX_CANCELLED // 16):
                self._remove(next(iter(strangers)))
        elif self._paired >= MAX_CANCELLED:
            biggest = self._sizes[self._largest]
            victim = owner if owner in biggest else next(iter(biggest))
            self._remove(next(iter(self._owned[victim])))
        self._expiry[key] = (owner, time.monotonic() + self.lifetime)
        self._owned.setdefault(owner, {})[key] = None
        if owner is not None:
            self._resize(owner, +1)

    def pop(self, key: str, default: float | None = None) -> float | None:
        """Forget ``key``; its expiry, or ``default`` when it is not remembered."""
        entry = self._expiry.get(key)
        if entry is None:
            return default
        self._remove(key)
        return entry[1]

    def expire(self, now: float) -> None:
        while self._expiry:
            key = next(iter(self._expiry))
            if self._expiry[key][1] > now:
                return
            self._remove(key)

    def _remove(self, key: str) -> None:
        owner, _ = self._expiry.pop(key)
        keys = self._owned[owner]
        del keys[key]
        if not keys:
            del self._owned[owner]
        if owner is not None:
            self._resize(owner, -1)

    def _resize(self, owner: str, step: int) -> None:
        """``owner`` now holds ``step`` more entries: keep the owners by size (O(1))."""
        new = len(self._owned.get(owner, ()))
        old = new - step
        self._paired += step
        if old:
            self._sizes[old].discard(owner)
            if not self._sizes[old]:
                del self._sizes[old]
        if new:
            self._sizes.setdefault(new, set()).add(owner)
        if new > self._largest:
            self._largest = new
        elif old == self._largest and old not in self._sizes:
            self._largest = new  # it held the most, alone; one less now (0: none left)


class Producer:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.pending: dict[str, PendingSend] = {}  # transfer id -> finished prefill
        self.in_flight: dict[str, PendingSend] = {}  # P request id -> started send
        self.early: dict[str, Reservation] = {}  # transfer id -> reservation w/o prefill
        self.tombstones: dict[str, Tombstone] = {}  # transfer id -> how it ended
        # nonces D cancelled before P held their reservation: a reservation that arrives
        # after its own cancel (the two raced) is refused, never written. Paired peers' only.
        self.cancelled = CancelMemory(4 * timeout)
        # transfer ids D gave up on before P prefilled (nor holds anything of it): a
        # prefill leg still waiting for its reservation ends at once (delay_admission).
        self.cancelled_legs = CancelMemory(2 * timeout)
        self.outcome = ProducerOutcome()
        self.sends_started = 0

    # -- from the engine thread -----------------------------------------------------------
    def start_pipelined(
        self, request_id: str, transfer_id: str, block_ids: list[int], peer_ready
    ) -> PendingSend | None:
        """The prefill of ``transfer_id`` runs its last step now: if D's reservation is
        already here (and its peer reachable), start the send now -- the workers post it
        a layer group at a time during that step. None: push after the prefill."""
        res = self.early.get(transfer_id)
        if res is None or not peer_ready(res.peer_key) or time.monotonic() >= res.expires:
            return None  # no reservation yet (or an expired one: expire() refuses it)
        if transfer_id in self.tombstones or self._started(transfer_id) is not None:
            return None
        del self.early[transfer_id]
        now = time.monotonic()
        send = PendingSend(
            request_id, transfer_id, list(block_ids), None, now + self.timeout, res, now
        )
        send.pipelined = True
        self.in_flight[request_id] = send
        self.sends_started += 1
        return send

    def prefill_finished(
        self, request_id: str, transfer_id: str, block_ids: list[int], first_token: int | None
    ) -> bool:
        """Hold the blocks for a push; False when the transfer id is already taken."""
        now = time.monotonic()
        piped = self.in_flight.get(request_id)
        if piped is not None and piped.pipelined and piped.transfer_id == transfer_id:
            piped.first_token, piped.finished_at = first_token, now
            return True  # already being sent: hold the blocks until it is done
        in_flight = any(s.transfer_id == transfer_id for s in self.in_flight.values())
        dead = self.tombstones.get(transfer_id)
        if dead is not None and not in_flight and transfer_id not in self.pending:
            # Ended before its prefill did (D gave up, its reservation expired, a cancel):
            # D was told or will recompute; nothing to push.
            logger.info("transfer %s ended before its prefill: %s; not pushing", transfer_id,
                        dead.why)  # fmt: skip
            return False
        if transfer_id in self.pending or in_flight:
            logger.error("transfer id %s is already in use; not pushing it twice", transfer_id)
            return False
        if transfer_id not in self.early and self.cancelled_legs.pop(transfer_id, None):
            logger.info("transfer %s: the decode node gave up during its prefill", transfer_id)
            return False  # nothing will reserve it: hold nothing
        send = PendingSend(
            request_id, transfer_id, list(block_ids), first_token, now + self.timeout
        )
        send.reservation = self.early.pop(transfer_id, None)
        self.pending[transfer_id] = send
        return True

    def prefill_failed(self, transfer_id: str, why: str) -> bool:
        """The P request ended without KV to send (aborted, error). True: a pipelined
        send of it is in flight -- the blocks stay held until the workers report it
        (they post no further piece if its step failed; D hears of it then)."""
        if self._started(transfer_id) is not None:
            return True
        res = self.early.pop(transfer_id, None)
        self._tombstone(transfer_id, why, res)
        if res is not None:
            self.outcome.notify_failed.append((res, why))
        return False

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
                self._tombstone(tid, "reservation expired before the push could start", res)
                self.outcome.free_blocks.add(send.request_id)
                self.outcome.notify_failed.append((res, "reservation expired on prefill"))
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
            self._tombstone(send.transfer_id, why, send.reservation, may_land=error is not None)
        return send

    def expire(self) -> None:
        now = time.monotonic()
        for rid, send in list(self.in_flight.items()):
            # Each rank's WRITE times out after T and is then reported: a send with no
            # all-ranks report after 2T was lost (a rank never posted or reported it).
            if send.started_at is not None and now - send.started_at >= 2 * self.timeout:
                logger.warning(
                    "transfer %s: no completion report within %.1fs; giving up on it",
                    send.transfer_id,
                    2 * self.timeout,
                )
                self.send_finished(rid, "no completion report from every rank")
                self.outcome.free_blocks.add(rid)
                self.outcome.ended.append(rid)
                if send.reservation is not None:
                    self.outcome.notify_unsafe.append((send.reservation, "push lost on prefill"))
        for tid, send in list(self.pending.items()):
            if now >= send.deadline:
                why = "no reservation" if send.reservation is None else "decode peer not ready"
                logger.warning(
                    "transfer %s: %s within %.1fs; freeing prefill blocks", tid, why, self.timeout
                )
                del self.pending[tid]
                self._tombstone(tid, f"prefill gave up: {why}", send.reservation)
                self.outcome.free_blocks.add(send.request_id)
                if send.reservation is not None:
                    self.outcome.notify_failed.append((send.reservation, why))
        for tid, res in list(self.early.items()):
            if now >= res.expires:
                del self.early[tid]
                self._tombstone(tid, "the prefill did not finish in time", res)
                self.outcome.notify_failed.append((res, "the prefill did not finish in time"))
        # In expiry order (one lifetime for all; a re-added one moves to the end): read
        # only what expired, every step.
        while self.tombstones:
            tid = next(iter(self.tombstones))
            if self.tombstones[tid].expiry > now:
                break
            del self.tombstones[tid]
        # Up to MAX_CANCELLED each, filled by peers and strangers: read only what expired.
        self.cancelled_legs.expire(now)
        self.cancelled.expire(now)

    def take_outcome(self) -> ProducerOutcome:
        out, self.outcome = self.outcome, ProducerOutcome()
        return out

    # -- from the side-channel thread ----------------------------------------------------
    def reserve(self, res: Reservation) -> Ack | Refusal:
        dead = self.tombstones.get(res.transfer_id)
        if dead is not None:
            return Refusal(f"transfer {res.transfer_id} ended on prefill: {dead.why}")
        if res.nonce in self.cancelled:
            return Refusal(f"transfer {res.transfer_id}: this reservation was cancelled")
        send = self.pending.get(res.transfer_id)
        held = send.reservation if send is not None else self.early.get(res.transfer_id)
        if held is None:
            started = self._started(res.transfer_id)
            held = started.reservation if started is not None else None
            if started is not None and held is None:  # cannot happen: a send needs one
                return Refusal(f"transfer {res.transfer_id} is already being sent")
        if held is not None:
            if held.nonce == res.nonce and held.peer_key == res.peer_key:
                return Ack()  # the same reservation again (a retry): nothing changes
            return Refusal(f"transfer {res.transfer_id} is already reserved")
        if send is not None:
            send.reservation = res
        else:
            self.early[res.transfer_id] = res
        return Ack()

    def _started(self, transfer_id: str) -> PendingSend | None:
        return next((s for s in self.in_flight.values() if s.transfer_id == transfer_id), None)

    def abort(self, transfer_id: str) -> None:
        """The P request's client went away: drop its send unless it already started."""
        send = self.pending.pop(transfer_id, None)
        if send is None:
            return
        self._tombstone(transfer_id, "aborted on prefill", send.reservation)
        self.outcome.free_blocks.add(send.request_id)
        if send.reservation is not None:
            self.outcome.notify_failed.append((send.reservation, "aborted on prefill"))

    def cancel(
        self, transfer_id: str, nonce: str, peer_key: str | None, sender: str | None = None
    ) -> CancelReply:
        """D gives up on its reservation ``nonce`` of a transfer. ``cancelled``: nothing
        was or will be written for that reservation; ``in_flight``: a WRITE may land.
        ``peer_key``: the paired decode peer it comes from, None from a sender P does not
        pair with (a D whose handshake failed, or one P restarted under): that only ends
        a hold no reservation came for (or a leg still waiting for one), and its nonce is
        remembered, within strangers' budget. ``sender``: the key the cancel names, paired or not (default
        ``peer_key``): a peer P dropped after a failed push still holds reservations here
        under it, and its cancel of one of them (its key and that reservation's nonce)
        drops it. (It was answered ``cancelled`` and kept: D freed the blocks, and P
        pushed into them once D paired again.)"""
        sender = peer_key if sender is None else sender
        started = self._started(transfer_id)
        if started is not None:
            res = started.reservation
            return CancelReply(
                "in_flight" if res is not None and res.nonce == nonce else "cancelled"
            )
        dead = self.tombstones.get(transfer_id)
        if dead is not None:
            # An errored or timed-out send: a WRITE UCX did not really abort may still land.
            return CancelReply(
                "in_flight" if dead.may_land and dead.nonce == nonce else "cancelled"
            )
        send = self.pending.get(transfer_id)
        held = send.reservation if send is not None else self.early.get(transfer_id)
        if held is None or held.nonce != nonce or held.peer_key != sender:
            # Not a reservation P holds (not arrived yet, or another one): nothing of it
            # was or will be written, and it is refused if it comes later.
            # Remembered also from a sender P does not pair with (within strangers' own
            # share): a D P restarted under cancels a reservation that got no answer;
            # should it arrive after all, once D paired again, it must be refused (D freed
            # the blocks on this answer).
            self.cancelled.add(nonce, peer_key)
            if held is None and send is not None:
                # D gave up before its reservation got here (e.g. the handshake was
                # refused): no reservation will come, drop the held prefill now.
                del self.pending[transfer_id]
                self.outcome.free_blocks.add(send.request_id)
                self._tombstone(transfer_id, "cancelled by decode", None)
            elif held is None:
                # ... before P prefilled: its leg, waiting for that reservation (or not
                # here yet), need not wait any more. Strangers may send it too (a D whose
                # handshake was refused): within their own small share.
                self.cancelled_legs.add(transfer_id, peer_key)
            # A reservation P holds under another nonce stays as it is: a delayed cancel
            # of an older reservation must not drop a newer one.
            return CancelReply("cancelled")
        if send is not None:
            del self.pending[transfer_id]
            self.outcome.free_blocks.add(send.request_id)
        self.early.pop(transfer_id, None)
        self._tombstone(transfer_id, "cancelled by decode", held)
        return CancelReply("cancelled")

    def _tombstone(
        self, transfer_id: str, why: str, res: Reservation | None, may_land: bool = False
    ) -> None:
        # 4T > D's quarantine (2T from its own give-up): outlives every cancel D may send.
        expiry = time.monotonic() + 4 * self.timeout
        nonce = res.nonce if res is not None else None
        self.tombstones.pop(transfer_id, None)  # (re)added last: the dict stays in expiry order
        if len(self.tombstones) >= MAX_TOMBSTONES:
            # Never one whose WRITE may land: its cancel must keep answering in_flight.
            old = next((t for t, s in self.tombstones.items() if not s.may_land), None)
            if old is not None:
                del self.tombstones[old]
        self.tombstones[transfer_id] = Tombstone(why, expiry, may_land, nonce)

    def early_blocks(self, peer_key: str, but: str) -> int:
        """Blocks (at least one each) of ``peer_key``'s reservations waiting for their
        prefill, but the one of transfer ``but`` (a retry of it is not more)."""
        return sum(
            max(1, len(r.block_ids))
            for tid, r in self.early.items()
            if r.peer_key == peer_key and tid != but
        )

    def evict_early(self, peer_key: str, why: str) -> None:
        """Give up ``peer_key``'s oldest reservation waiting for its prefill (D is told:
        nothing was written; a late prefill of it is not pushed)."""
        tid = next(t for t, r in self.early.items() if r.peer_key == peer_key)
        res = self.early.pop(tid)
        self._tombstone(tid, why, res)
        self.outcome.notify_failed.append((res, why))

    def drop_early(self, peer_key: str, why: str) -> None:
        """Forget every reservation of ``peer_key`` waiting for its prefill, telling no one
        (a claim P never trusted: its address did not confirm it)."""
        for tid, res in list(self.early.items()):
            if res.peer_key == peer_key:
                del self.early[tid]
                self._tombstone(tid, why, res)

    def peers_in_use(self) -> set[str]:
        """Decode peer keys a held reservation or a running send refers to."""
        held = [s.reservation for s in self.pending.values()]
        held += [s.reservation for s in self.in_flight.values()]
        held += list(self.early.values())
        return {r.peer_key for r in held if r is not None}

    def num_states(self) -> int:
        return len(self.pending) + len(self.in_flight) + len(self.early)
