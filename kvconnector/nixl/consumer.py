"""Decode-side (consumer) transfer state of the NIXL connector.

A D request with ``do_remote_prefill`` gets blocks reserved for its prompt and waits in
``WAITING_FOR_REMOTE_KV``. Its reservation is sent to P off the engine thread; the KV is
in when every D rank has its notification (aggregated). Every state has a deadline:

* waiting for the KV: ``kv_transfer_timeout`` from the reservation; then the request
  fails over (recompute or error, by policy) and P is told to cancel.
* blocks a WRITE may still land in (after a timeout, an unconfirmed cancel, or an abort
  while waiting) are *quarantined*: freed when P confirms the cancel, when the KV lands
  anyway, or after 2 x ``kv_transfer_timeout`` (P starts no push later than that timeout
  after the reservation, and a WRITE lasts at most that long, so nothing lands after it),
  counted from when P got the reservation if ever: the call's answer, or -- unanswered --
  no earlier than its send + ``RESERVE_MAX_AGE_S`` + ``CLOCK_SLACK_S``, past which P
  refuses it.

Fencing: every reservation has its own ``nonce``. What arrives about a transfer -- the
all-ranks "landed", P's ``transfer_failed``, its cancel confirmation -- acts only when its
nonce is the one of the request's current reservation; anything else is stale or forged
and changes nothing. A reservation that ends without landing (failed safely, or released
from quarantine) is listed in ``ended`` so that every rank and the aggregator drop what
they counted for it.

Not thread-safe on its own: the scheduler-side connector calls it under its lock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvconnector.nixl import clock
from kvconnector.nixl.messages import CLOCK_SLACK_S, RESERVE_MAX_AGE_S

logger = logging.getLogger(__name__)


@dataclass
class RemoteRecv:
    request_id: str
    transfer_id: str
    p_address: str
    block_ids: list[int]  # D blocks P writes into
    skip_blocks: int  # leading prompt blocks D had in its prefix cache
    deadline: float
    nonce: str = ""  # this reservation's fence: notifs, replies and counts carry it
    created: float = field(default_factory=clock.monotonic)  # blocks reserved
    reserved: bool = False
    p_incarnation: str | None = None  # the P process that accepted the reservation
    # when its reservation was (last) sent, while P may still get it; None: never sent,
    # or P answered (it got the reservation by then)
    sent_at: float | None = None


@dataclass
class ConsumerOutcome:
    failed_loads: dict[str, str] = field(default_factory=dict)
    free_blocks: set[str] = field(default_factory=set)
    # (p_addr, transfer id, nonce, D request id) to cancel on P
    cancels: list[tuple[str, str, str, str]] = field(default_factory=list)
    # nonces of reservations that ended without landing: ranks drop their partial counts
    ended: list[str] = field(default_factory=list)


class Consumer:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.recvs: dict[str, RemoteRecv] = {}  # D request id -> waiting load
        # D request id -> (release deadline, nonce of the reservation a WRITE may land for)
        self.quarantine: dict[str, tuple[float, str]] = {}
        self.outcome = ConsumerOutcome()
        self.loads_failed = 0

    def expect(self, recv: RemoteRecv) -> None:
        self.recvs[recv.request_id] = recv

    def reserved(self, request_id: str, p_incarnation: str | None) -> None:
        recv = self.recvs.get(request_id)
        if recv is not None:
            recv.reserved = True
            recv.p_incarnation = p_incarnation

    def landed(self, request_id: str, nonce: str) -> bool:
        """All D ranks have the KV of reservation ``nonce`` (aggregated). True when that is
        the request's current reservation and it may go on decoding."""
        recv = self.recvs.get(request_id)
        if recv is not None and recv.nonce == nonce:
            del self.recvs[request_id]
            return True
        q = self.quarantine.get(request_id)
        if q is not None and q[1] == nonce:
            del self.quarantine[request_id]
            self.outcome.free_blocks.add(request_id)  # late KV: nothing more will land
        elif recv is None:
            logger.info("request %s: KV for an unknown reservation; ignored", request_id)
        else:
            logger.warning(
                "request %s: KV for another reservation than its own; ignored", request_id
            )
        return False

    def fail(self, request_id: str, why: str, safe: bool, nonce: str | None = None) -> None:
        """The KV will not come. ``safe``: P will not write into the blocks any more.
        ``nonce``: the reservation a peer's message is about (None: this node decided);
        a message about another reservation than the current one changes nothing."""
        recv = self.recvs.get(request_id)
        if recv is None or (nonce is not None and nonce != recv.nonce):
            q = self.quarantine.get(request_id)
            if safe and q is not None and nonce in (None, q[1]):
                del self.quarantine[request_id]
                self.outcome.free_blocks.add(request_id)
                self.outcome.ended.append(q[1])
            return
        del self.recvs[request_id]
        self.loads_failed += 1
        self.outcome.failed_loads[request_id] = why
        if safe:
            self.outcome.free_blocks.add(request_id)
            self.outcome.ended.append(recv.nonce)
            # Rejection is a message too: P drops what it holds for this transfer now
            # instead of at its own deadline.
            self.outcome.cancels.append((recv.p_address, recv.transfer_id, recv.nonce, request_id))
        else:
            self._quarantine(recv)

    def aborted(self, request_id: str) -> bool:
        """The request ended while waiting; True when its blocks must be held.

        Also True when its load already failed unsafely but the scheduler has not seen
        that event yet: the blocks are quarantined, not free. Once it has, the scheduler
        parked the reserved blocks itself and the request (recomputing) holds new ones
        that were never named to P: False, they are free when it ends."""
        recv = self.recvs.pop(request_id, None)
        if recv is None:
            return request_id in self.quarantine and request_id in self.outcome.failed_loads
        self._quarantine(recv)
        return True

    def cancel_confirmed(self, request_id: str, nonce: str) -> None:
        q = self.quarantine.get(request_id)
        if q is not None and q[1] == nonce:
            del self.quarantine[request_id]
            self.outcome.free_blocks.add(request_id)
            self.outcome.ended.append(nonce)

    def call_over(self, recv: RemoteRecv, answered: bool) -> None:
        """The reservation call of ``recv`` is over: ``answered`` (P got the reservation
        by now), or given up (P may still get it, up to ``RESERVE_MAX_AGE_S`` after it
        was sent). When the wait ended while that call was on the wire, its quarantine
        counted from the end -- before P may have got the reservation and started the
        clock of its own deadline: it counts from now (or that age) instead."""
        if answered:
            recv.sent_at = None
        q = self.quarantine.get(recv.request_id)
        if self.recvs.get(recv.request_id) is not recv and q is not None and q[1] == recv.nonce:
            self.quarantine[recv.request_id] = (max(q[0], self._writable_until(recv)), q[1])

    def _quarantine(self, recv: RemoteRecv) -> None:
        self.quarantine[recv.request_id] = (self._writable_until(recv), recv.nonce)
        self.outcome.cancels.append((recv.p_address, recv.transfer_id, recv.nonce, recv.request_id))

    def _writable_until(self, recv: RemoteRecv) -> float:
        """When nothing of ``recv``'s reservation can land any more. P starts a push at
        most T after it got the reservation and a WRITE lasts at most T; P got it by now
        if ever, or -- one still on the wire -- refuses it past ``RESERVE_MAX_AGE_S``
        after it was sent (by clocks ``CLOCK_SLACK_S`` apart at most): 2T from the later
        of the two."""
        got_by = time.monotonic()
        if recv.sent_at is not None:
            got_by = max(got_by, recv.sent_at + RESERVE_MAX_AGE_S + CLOCK_SLACK_S)
        return got_by + 2 * self.timeout

    def expire(self) -> None:
        now = time.monotonic()
        for rid, recv in list(self.recvs.items()):
            if now >= recv.deadline:
                logger.warning(
                    "request %s: no KV from %s within %.1fs", rid, recv.p_address, self.timeout
                )
                self.fail(rid, f"timed out after {self.timeout:.1f}s waiting for KV", safe=False)
        for rid, (deadline, nonce) in list(self.quarantine.items()):
            if now >= deadline:
                del self.quarantine[rid]
                self.outcome.free_blocks.add(rid)
                self.outcome.ended.append(nonce)

    def take_outcome(self) -> ConsumerOutcome:
        out, self.outcome = self.outcome, ConsumerOutcome()
        return out

    def num_states(self) -> int:
        return len(self.recvs) + len(self.quarantine)
