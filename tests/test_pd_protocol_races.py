"""Deterministic races between the P and D scheduler-side connectors, each found by
``test_property_pd_protocol.py`` (same harness: ``pd_model.Pair``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pd_model import P_ADDRESS, TIMEOUT, Pair, check_no_block_free_while_writable, fake_clock

from kvconnector.nixl.messages import RESERVE_MAX_AGE_S
from kvconnector.nixl.prefill_links import RPC_TIMEOUT_S, PrefillLinks


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    p = Pair(fake_clock(monkeypatch))
    try:
        yield p
    finally:
        p.close()


def test_a_reservation_still_queued_when_its_request_ended_is_never_sent(pair: Pair) -> None:
    """D's request is aborted while its reservation still waits on P's lane; D keeps the
    blocks quarantined for 2T, then frees them. The reservation was sent when the lane got
    to it all the same -- after the blocks were free -- and P held a reservation into
    them: its push would have written into another request's KV."""
    pair.add_d("t0")
    pair.step_d()  # blocks reserved, the reservation queued on P's lane
    (reserve,) = pair.calls
    pair.d_sch.abort_request("d-t0")
    pair.step_d()  # quarantined (a WRITE may land), a cancel queued behind it
    pair.clock.now += 2 * TIMEOUT
    pair.step_d()  # the quarantine ended: the blocks are free
    assert pair.d_sch.kv.pool.num_free == pair.d_sch.kv.num_blocks
    pair.deliver(pair.calls.index(reserve))  # the lane gets to it only now
    assert not pair.p_conn.producer.early, "P holds a reservation into freed blocks"
    check_no_block_free_while_writable(pair)


def test_a_cancel_after_p_evicted_the_decode_peer_still_drops_its_reservation(pair: Pair) -> None:
    """P drops a decode peer after a failed push to it (``PrefillService.evict``); a
    reservation of that peer still waits at P for its prefill. D's request is aborted and
    its cancel reaches P: P answered ``cancelled`` -- it took the evicted peer's cancel
    for a stranger's -- but kept the reservation, so D freed the blocks while P could
    still push into them once D paired again (same key: one per P address)."""
    pair.add_d("t0")
    pair.step_d()
    while pair.calls:  # handshake, the claim's check, the reservation
        pair.deliver(0)
    prod = pair.p_conn.producer
    assert "t0" in prod.early
    key = pair.d_conn.links.pairing_key(P_ADDRESS)
    pair.p_conn.service.evict(key, "WRITE failed")  # as a failed push of another transfer
    pair.d_sch.abort_request("d-t0")
    pair.step_d()  # quarantined, the cancel queued
    while pair.calls:
        pair.deliver(0)
    pair.step_d()
    check_no_block_free_while_writable(pair)
    assert "t0" not in prod.early
    assert pair.d_sch.kv.pool.num_free == pair.d_sch.kv.num_blocks


def test_a_request_that_ends_while_its_reservation_handshakes_sends_none(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race one call later: the request ends while the lane pairs with P (a
    handshake may take its whole timeout, twice) -- the reservation is not sent after it."""
    pair.add_d("t0")
    pair.step_d()
    handshake = PrefillLinks.ensure_handshake

    def slow(links: PrefillLinks, address: str, force: bool = False) -> Any:
        peer = handshake(links, address, force)
        pair.d_sch.abort_request("d-t0")  # meanwhile, on the engine thread
        pair.step_d()
        return peer

    monkeypatch.setattr(PrefillLinks, "ensure_handshake", slow)
    pair.deliver(0)  # the reservation's call
    assert "t0" not in pair.p_conn.producer.early


def test_a_lost_reservation_arriving_after_its_cancel_from_an_unpaired_decode_is_refused(
    pair: Pair,
) -> None:
    """P restarted: D is not paired with the new process yet. D's reservation gets no
    answer (D quarantines and cancels); the cancel reaches P from a key it does not pair
    with, and is confirmed (P holds no such reservation), so D frees the blocks. Then D
    pairs again (another request), and the lost reservation arrives after all. P used
    to accept it (it remembered only paired peers' cancelled nonces) and held a
    reservation into blocks D had freed."""
    pair.add_d("t0")
    pair.step_d()
    while pair.calls:
        pair.deliver(0)  # D paired with P
    pair.restart_p()
    pair.add_d("t1")
    pair.step_d()
    reserve = next(i for i, c in enumerate(pair.calls) if c.fn.__name__ == "reserve_job")
    pair.deliver(reserve, "lost")
    lost = len(pair.router.sent) - 1
    pair.clock.now += 0.5  # (calls queued with the unanswered one are not sent)
    pair.step_d()  # quarantined, the cancel queued
    while pair.calls:
        pair.deliver(0)
    pair.step_d()
    assert "d-t1" not in pair.d_sch.quarantine  # P confirmed the cancel
    pair.add_d("t2")
    pair.step_d()
    while pair.calls:
        pair.deliver(0)  # D pairs with the new P
    assert "t2" in pair.p_conn.producer.early
    pair.router.replay(lost)  # the lost reservation arrives now
    check_no_block_free_while_writable(pair)
    assert "t1" not in pair.p_conn.producer.early


def test_a_reservation_queued_behind_an_unanswered_call_is_not_sent(pair: Pair) -> None:
    """Two reservations queued on P's lane; the first call gets no answer (P hung). The
    second was queued before that timeout: it is not sent (it would wait out a timeout of
    its own) and its leg fails safely. ``RemoteRecv.created`` took the real clock, not the
    connector's (bound at import), so the fake clock never compared with it."""
    pair.add_d("t0")
    pair.add_d("t1")
    pair.step_d()  # both reservations queued on P's lane
    assert [c.fn.__name__ for c in pair.calls] == ["reserve_job", "reserve_job"]
    pair.clock.now += 0.5
    pair.deliver(0, "lost")  # the handshake of the first goes unanswered
    sent = len(pair.router.sent)
    pair.deliver(0)
    assert len(pair.router.sent) == sent, "a call queued behind an unanswered one was sent"
    assert pair.d_conn.links.calls_skipped == 1
    assert "d-t1" not in pair.d_conn.consumer.recvs
    pair.step_d()
    assert "t1" not in pair.p_conn.producer.early


def test_a_reservation_replayed_to_a_prefill_node_that_restarted_since_is_refused(
    pair: Pair,
) -> None:
    """D's reservation reaches P; P restarts. D's leg times out and its blocks are
    quarantined, the cancel lost; after 2T they are free. D pairs with the new P (another
    request), and the old reservation, captured on the wire, is replayed there (within the
    signed envelope's 60 s; the new process's replay guard is empty). P accepted it -- it
    did not say which P incarnation it was made for -- and held a reservation into blocks
    D had freed."""
    pair.add_d("t0")
    pair.step_d()
    while pair.calls:
        pair.deliver(0)  # paired, the reservation held by P
    assert "t0" in pair.p_conn.producer.early
    old = next(i for i, (_, m, _) in enumerate(pair.router.sent) if m.get("kind") == "reserve")
    pair.restart_p()
    pair.clock.now += TIMEOUT
    pair.step_d()  # D's wait timed out: quarantined, a cancel queued
    cancel = next(i for i, c in enumerate(pair.calls) if c.fn.__name__ == "cancel_job")
    pair.deliver(cancel, "not_sent")
    pair.clock.now += 2 * TIMEOUT
    pair.step_d()
    assert "d-t0" not in pair.d_sch.quarantine
    pair.add_d("t1")
    pair.step_d()
    while pair.calls:
        pair.deliver(0)  # D pairs with the new P
    assert "t1" in pair.p_conn.producer.early
    pair.router.replay(old, restarted=True)
    check_no_block_free_while_writable(pair)
    assert "t0" not in pair.p_conn.producer.early


def test_a_reservation_refused_for_naming_an_old_prefill_incarnation_pairs_again(
    pair: Pair,
) -> None:
    """D paired with P, P restarted, and D's handshake (replayed, or a lost one arriving
    late) paired the new process with D's key while D still names the old one: D's next
    reservation is refused (``wrong_incarnation``); D pairs again and it is held."""
    pair.add_d("t0")
    pair.step_d()
    while pair.calls:
        pair.deliver(0)
    shake = next(i for i, (_, m, _) in enumerate(pair.router.sent) if m.get("kind") == "handshake")
    pair.restart_p()
    pair.router.replay(shake, restarted=True)  # the new P pairs with D's key
    pair.calls = [c for c in pair.calls if not c.peer.startswith("ping:")]
    pair.add_d("t1")
    pair.step_d()
    while pair.calls:
        if pair.calls[0].peer.startswith("ping:"):
            pair.calls.pop(0)  # no ping of D's tells it of the restart
        else:
            pair.deliver(0)  # the claim's check, t1's reservation
    reserves = [m for _, m, _ in pair.router.sent if m.get("transfer_id") == "t1"]
    incarnations = [m["p_incarnation"] for m in reserves]
    assert incarnations == [pair.dead[0].incarnation, pair.p_conn.incarnation]
    assert pair.p_conn.producer.early["t1"].nonce == reserves[-1]["nonce"]
    assert "d-t1" in pair.d_conn.consumer.recvs


def test_a_request_that_ends_during_its_reservation_call_keeps_its_blocks_while_p_may_write(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D's request ends while its reservation is on the wire (the call may take up to
    ``RPC_TIMEOUT_S``); P gets it just before that and pushes at the last moment its
    reservation allows. D's quarantine counted from the request's end, so it ended that
    much before P's WRITE could: D's blocks were free while the WRITE might land (the
    cancel lost, as any message may be)."""
    pair.add_d("t0")
    pair.step_d()
    request = pair.router.request

    def slow(address: str, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        if msg.get("kind") == "reserve":
            pair.d_sch.abort_request("d-t0")  # meanwhile, on the engine thread
            pair.step_d()  # quarantined from now, a cancel queued behind the call
            pair.clock.now += RPC_TIMEOUT_S - 0.1  # P gets it just before the timeout
        return request(address, msg, timeout)

    monkeypatch.setattr(pair.router, "request", slow)
    ended = pair.clock.now
    pair.deliver(0)  # the reservation's call (and its handshake)
    monkeypatch.setattr(pair.router, "request", request)
    assert "t0" in pair.p_conn.producer.early
    for call in list(pair.calls):
        lost = call.fn.__name__ == "cancel_job"
        pair.deliver(pair.calls.index(call), "not_sent" if lost else "ok")
    pair.clock.now = pair.p_conn.producer.early["t0"].expires - 0.5
    pair.add_p("t0")
    for _ in range(4):  # P prefills and pushes just before its reservation expires
        pair.step_p()
    assert pair.writes, "P did not push"
    pair.clock.now = ended + 2 * TIMEOUT
    pair.step_d()
    check_no_block_free_while_writable(pair)


def test_a_reservation_that_reaches_p_after_ds_quarantine_ended_is_refused(pair: Pair) -> None:
    """D's reservation call goes unanswered (the bytes sit in a socket buffer, a network
    partition retransmits them); D quarantines the blocks for 2T from the call's end, its
    cancel is not sent (no connection), then frees them. The reservation reaches P only
    now: P took it (its deadline is T from receipt, its push T more) and held a
    reservation into blocks D had freed -- its push would write another request's KV."""
    pair.add_d("t0")
    pair.step_d()
    while pair.calls:
        pair.deliver(0)  # D paired with P (t0's reservation went through)
    pair.add_d("t1")
    pair.step_d()
    reserve = next(i for i, c in enumerate(pair.calls) if c.fn.__name__ == "reserve_job")
    pair.deliver(reserve, "lost")  # t1's reservation: no answer, it may still arrive
    lost = len(pair.router.sent) - 1
    assert pair.router.sent[lost][1].get("d_request_id") == "d-t1"
    pair.clock.now += RPC_TIMEOUT_S  # the call's timeout
    pair.step_d()  # quarantined, its cancel queued
    pair.clock.now += 0.5
    while pair.calls:
        pair.deliver(0, "not_sent")  # the partition: no connection
    pair.clock.now = pair.d_conn.consumer.quarantine["d-t1"][0]
    pair.step_d()  # the quarantine ended: the blocks are free (t1 recomputes in others)
    assert "d-t1" not in pair.d_sch.quarantine
    pair.router.replay(lost)  # the partition heals: P reads the reservation
    check_no_block_free_while_writable(pair)
    assert "t1" not in pair.p_conn.producer.early


def _pushed(pair: Pair, tid: str) -> None:
    """D reserved for ``tid``, P prefilled it and every rank's WRITE is done; their
    notifications are on their way (``pair.notifs``), not landed."""
    pair.add_d(tid)
    pair.add_p(tid)
    for _ in range(4):
        pair.step_d()
        while pair.calls:
            pair.deliver(0)
        pair.step_p()
    assert pair.writes, "P did not push"
    while pair.writes:
        pair.report(pair.writes[0], ok=True, lands=True)
    assert pair.notifs


def test_a_notification_for_a_decode_process_that_restarted_since_completes_nothing(
    pair: Pair,
) -> None:
    """P's WRITEs for D's reservation of t0 finished; D restarts before their
    notifications land, and a new request of the same id waits on its own reservation.
    The old notifications reach the new process (a transport routing by address): they
    name the old process's nonce, so they complete nothing, and their counts go."""
    _pushed(pair, "t0")
    old = pair.d_conn.incarnation
    pair.restart_d()
    pair.add_d("t0")  # same request id, same transfer id, in the new process
    pair.step_d()
    assert pair.d_conn.consumer.recvs["d-t0"].nonce.split(".")[0] != old
    stray = len(pair.notifs)
    while pair.notifs:
        pair.land(0, stray=True)
    pair.step_d()
    pair.step_d()
    assert sum(w._notifs for w in pair.d_workers) == stray  # they reached the new ranks
    assert "d-t0" in pair.d_conn.consumer.recvs, "a notif for the old process ended the wait"
    assert not pair.accepted
    pair.clock.now += 4 * TIMEOUT + 1
    pair.step_d()
    for w in pair.d_workers:
        assert not w._parts, f"D rank {w.rank} kept the old process's counts {w._parts}"


def test_a_notification_from_a_prefill_process_that_restarted_since_completes_nothing(
    pair: Pair,
) -> None:
    """P's WRITEs for t0 finished, their notifications on the way; P restarts, and D
    learns it from a ping (the new incarnation: nothing of the old process can land, the
    blocks are free again, the request recomputes). The old process's notifications
    landing then complete nothing: D does not decode from blocks it gave back."""
    _pushed(pair, "t0")
    pair.restart_p()
    pair.clock.now += TIMEOUT / 4 + 0.1  # D's next ping of the prefill node it waits on
    pair.step_d()
    pings = [c for c in pair.calls if c.peer.startswith("ping:")]
    assert pings, "D pinged no one"
    while pair.calls:
        pair.deliver(0)
    pair.step_d()
    assert "d-t0" not in pair.d_conn.consumer.recvs  # ended: P restarted
    assert "d-t0" not in pair.d_sch.quarantine
    before = sum(w._notifs for w in pair.d_workers)
    late = len(pair.notifs)
    while pair.notifs:
        pair.land(0)
    pair.step_d()
    pair.step_d()
    assert sum(w._notifs for w in pair.d_workers) == before + late  # they reached D's ranks
    assert not pair.accepted, "D decoded from a transfer it had ended"


def test_a_notification_for_a_restarted_decode_process_on_one_rank_leaves_no_count(
    pair: Pair,
) -> None:
    """As above, but only one rank's notification reaches the new process (the other
    rank's lands nowhere). That rank completed the old nonce and reported it; the
    aggregator then waited for the other rank's report of it forever -- the new process
    never made that nonce, so nothing ever ended its count (found by the P/D property
    test once it delivered such notifications)."""
    _pushed(pair, "t0")
    pair.restart_d()
    rank0 = next(i for i, p in enumerate(pair.notifs) if p.d_rank == 0)
    pair.land(rank0, stray=True)
    pair.notifs.clear()  # the rest land nowhere
    for _ in range(3):
        pair.step_d()
    pair.clock.now += 4 * TIMEOUT + 1
    for _ in range(3):
        pair.step_d()
    assert not pair.d_agg.pending_ids, "the aggregator waits for the old process's nonce"
    for w in pair.d_workers:
        assert not w._parts


def test_a_lost_reservation_p_takes_at_its_age_limit_keeps_ds_blocks_until_its_push_ends(
    pair: Pair,
) -> None:
    """D's reservation call fails before its timeout (the model's lost call fails at once;
    a real one when its connection breaks after the bytes left), D quarantines the
    blocks, and its cancel finds no connection. The reservation reaches P
    ``RESERVE_MAX_AGE_S`` after its send -- still fresh: P takes it and pushes, a WRITE that
    may land until its deadline (T after P got it) plus T. Counted 2T from the failed call
    (not from the send + ``RESERVE_MAX_AGE_S`` + ``CLOCK_SLACK_S``), D's quarantine freed
    the blocks while that WRITE could still land in them (seen failing with
    ``Consumer._writable_until`` ignoring ``sent_at``; the property test does not reach
    it: it takes an arrival at the age limit, an unconfirmed cancel, P's push left
    unreported and D's quarantine end, in that order)."""
    pair.add_d("t0")
    pair.step_d()
    while pair.calls:
        pair.deliver(0)  # D paired with P (t0's reservation went through)
    pair.add_p("t1")
    pair.add_d("t1")
    pair.step_d()
    reserve = next(i for i, c in enumerate(pair.calls) if c.fn.__name__ == "reserve_job")
    pair.deliver(reserve, "reserve_lost")
    (lost, sent), *_ = pair.router.lost
    pair.step_d()  # quarantined, its cancel queued
    while pair.calls:
        pair.deliver(0, "not_sent")  # no connection
    pair.clock.now = sent + RESERVE_MAX_AGE_S
    reply = pair.router.replay(lost)  # P gets it at its age limit
    assert reply is not None and reply.get("ok"), reply
    pair.step_p()  # P prefills t1 (it waited for the reservation)
    pair.step_p()  # ... and pushes: its WRITEs posted
    assert pair.writes
    pair.clock.now = pair.d_conn.consumer.quarantine["d-t1"][0]
    pair.step_d()  # the quarantine ended
    check_no_block_free_while_writable(pair)
