"""Model checking of the P/D transfer protocol: the real scheduler-side NIXL connectors of a
prefill node and a decode node (each with the real scheduler and block pool) talk through
a message queue the test controls (``pd_model.Pair``), under drawn interleavings: side-
channel calls delivered in any order, lost, their reply lost, sent twice, replayed late
(at a restarted process too), a reservation on the wire while its request ends, a
reservation lost on the wire (now and then in the course of progress too); a lost message
arriving after all, once: at once, at the edge of a reservation's age limit, at a deadline
of either side, or much later (past every deadline and P's memory of cancels); P's ranks
(the real worker-side connectors, ``pd_ranks``) posting whole sends or a pipelined send's
layer-group pieces, head slices where P's and D's TP sizes differ (2->2, 1->2, 2->1), with
checksums or without; each WRITE reported on its own, ok or failed, its data and
notification landing or not, late (also from a P process that restarted since), or
corrupted, in any order, a notification for a D process that restarted since reaching
the new one; requests aborted on either
side at any point (a P prefill also mid-pipeline); a P rank stalling mid-forward; the
clock moved past deadlines; either node restarted with a new incarnation.

After every action: no block of D is free, or another request's, while a WRITE may land
in it (a reservation P holds, a WRITE posted and not reported, a failed one that may
still land), and no block of P is free while a WRITE reads it. Whenever D decodes from
pushed KV, its ranks' blocks hold exactly P's KV (every piece, every head, nothing
corrupted). At the end, once every deadline passed and every queue is drained: nothing
held on either side, no partial count left, and every request reached a terminal outcome.

Fixed examples (derandomized, no database); ``PDSERVE_PD_PROTOCOL_EXAMPLES=N`` multiplies
them for a longer hunt, and its pytest-timeout (300 s x N).
"""

from __future__ import annotations

from typing import Any

import pytest
from fakes import example_scale, fixed_examples, hunt_timeout
from hypothesis import event, given
from hypothesis import strategies as st
from pd_model import (
    TIMEOUT,
    FakeTime,
    Pair,
    Setup,
    check_no_block_free_while_read,
    check_no_block_free_while_writable,
    fake_clock,
)

from kvconnector.nixl.messages import RESERVE_MAX_AGE_S, Refusal
from kvconnector.nixl.metadata import TOO_LATE

SCALE = example_scale("PDSERVE_PD_PROTOCOL_EXAMPLES")
EXAMPLES = 250 * SCALE
FAULTS = (
    *("ok",) * 3,
    *("lost", "no_reply", "twice", "not_sent", "ended_meanwhile", "reserve_lost"),
)
ACTIONS = (
    *("new_pair",) * 2,
    "new_d_only",
    "new_p_only",
    *("tick",) * 6,  # both nodes step and the oldest call is delivered: progress
    *("flush",) * 2,  # every queued call delivered, both nodes step: to the push
    "step_d",
    "step_p",
    *("deliver",) * 4,
    *("report",) * 4,
    *("land",) * 3,
    *("report_all",) * 2,  # every posted WRITE (each piece) reported, in a drawn order
    "land_all",
    "advance",
    "to_deadline",
    "abort_d",
    "abort_p",
    "abort_p_mid_step",  # P's prefill aborted while its last step (a pipelined push) runs
    "stall_p_mid_step",  # a P rank will stall mid-forward: past a deadline between pieces
    "restart_p",
    "restart_d",
    "replay",
    *("late",) * 2,  # a lost message arrives after all
)
# When a lost message arrives after all (``late``): now; at the edge of a reservation's age
# limit (RESERVE_MAX_AGE_S after its send); at a deadline still ahead on either side; or
# much later, past all of them and every cancel P remembers now (the bytes sat in a
# socket buffer, a partition healed). The clock never goes back.
LATE = ("now", "age_limit", "deadline", *("much_later",) * 3)


# P TP2 -> D TP2 (whole blocks), P TP1 -> D TP2 and P TP2 -> D TP1 (head slices); whole
# sends or pipelined ones (4 pieces of a layer, or layers [0, 3) and [3, 4)); sums or not.
SETUPS = st.builds(
    Setup,
    tp_p=st.just(2),
    tp_d=st.just(2),
    group=st.sampled_from((0, 1, 3)),
    checksum=st.sampled_from(("off", "full")),
    policy=st.sampled_from(("recompute", "fail")),
).flatmap(
    lambda s: st.sampled_from(
        (s, Setup(1, 2, s.group, s.checksum, s.policy), Setup(2, 1, s.group, s.checksum, s.policy))
    )
)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    return fake_clock(monkeypatch)


def settle(pair: Pair) -> None:
    """Both nodes step, and every call, WRITE and notification goes through without a
    fault, until nothing new comes (the clock stands still)."""
    quiet = 0
    for _ in range(200):
        busy = bool(pair.calls or pair.writes or pair.notifs)
        while pair.calls:
            pair.deliver(0)
        while pair.writes:  # a piece at a time, D stepping in between
            pair.report(pair.writes[0], ok=True, lands=True)
            while pair.notifs:
                pair.land(0)
            pair.step_d()
        while pair.notifs:
            pair.land(0)
        pair.step_d()
        pair.step_p()
        quiet = 0 if busy else quiet + 1
        if quiet >= 3:
            return
    raise AssertionError("the nodes never settled")


def drain(pair: Pair) -> None:
    """Every queue delivered, every WRITE reported, every deadline passed."""
    for _ in range(12):
        settle(pair)
        pair.clock.now += TIMEOUT
    settle(pair)


def check_explicit_ends(pair: Pair) -> None:
    """Without faults, one side's end reaches the other as a message, before any
    deadline: once both settled, no leg waits for, or holds blocks for, a transfer whose
    other leg ended."""
    ended = {
        side: {o.request_id for o in outs if o.finished} for side, outs in pair.outputs.items()
    }
    prod = pair.p_conn.producer
    for d_rid in pair.d_requests & ended["D"]:
        tid = d_rid.removeprefix("d-")
        if f"p-{tid}" not in pair.p_requests:
            continue
        assert f"p-{tid}" in ended["P"], f"P's leg of {tid} outlived D's"
        assert tid not in prod.early and tid not in prod.pending, f"P still holds {tid}"
    for p_rid in pair.p_requests & ended["P"]:
        tid = p_rid.removeprefix("p-")
        if f"d-{tid}" in pair.d_requests:
            assert f"d-{tid}" not in pair.d_conn.consumer.recvs, f"D still waits for {tid}"


def check_all_ended(pair: Pair) -> None:
    for side, sch, conn in (("D", pair.d_sch, pair.d_conn), ("P", pair.p_sch, pair.p_conn)):
        assert not sch.requests, f"{side} still has requests {list(sch.requests)}"
        assert not sch.held and not sch.quarantine, f"{side} holds {sch.held} {sch.quarantine}"
        assert sch.kv.pool.num_free == sch.kv.num_blocks, f"{side} leaked blocks"
        assert not conn.has_pending_work(), f"{side} connector still has state"
    assert not pair.d_conn.consumer.quarantine
    for w in pair.d_workers:
        assert not w._parts, f"D rank {w.rank} kept partial counts {w._parts}"
    for w in pair.p_workers:
        assert not w._sending and not w._pipes, f"P rank {w.rank} kept sends {w._sending}"
    assert not pair.d_agg.pending_ids and not pair.p_agg.pending_ids
    ended = {
        side: {o.request_id for o in outs if o.finished} for side, outs in pair.outputs.items()
    }
    assert pair.d_requests <= ended["D"], f"no terminal outcome: {pair.d_requests - ended['D']}"
    assert pair.p_requests <= ended["P"], f"no terminal outcome: {pair.p_requests - ended['P']}"


def deadlines(pair: Pair) -> list[float]:
    """The deadlines still ahead: P's reservations, D's waits and quarantines."""
    prod, cons = pair.p_conn.producer, pair.d_conn.consumer
    times = [r.expires for r in prod.early.values()]
    times += [s.reservation.expires for s in prod.pending.values() if s.reservation]
    times += [r.deadline for r in cons.recvs.values()]
    times += [deadline for deadline, _ in cons.quarantine.values()]
    return sorted({t for t in times if t > pair.clock.now})


def corrupted(pair: Pair, data: Any) -> bool:
    """Whether the data of a WRITE is corrupted on its way (only where D checks sums:
    without them D cannot tell)."""
    if pair.setup.checksum == "off":
        return False
    bad = data.draw(st.integers(0, 4)) == 0
    pair.faulty |= bad
    if bad:
        event("a WRITE was corrupted on its way")
    return bad


def run_action(pair: Pair, data: Any, action: str, n: int) -> None:
    draw = data.draw
    if action in ("new_pair", "new_d_only", "new_p_only"):
        tid = f"t{n}"
        if action != "new_p_only":
            pair.add_d(tid)
        if action != "new_d_only":
            pair.add_p(tid)
    elif action == "tick":
        pair.step_d()
        pair.step_p()
        if pair.calls:  # a reservation is now and then lost on the wire (it may come late)
            lost = pair.faults and is_reserve(pair.calls[0]) and draw(st.integers(0, 3)) == 0
            pair.faulty |= lost
            pair.deliver(0, "reserve_lost" if lost else "ok")
    elif action == "flush":
        for _ in range(3):
            while pair.calls:
                pair.deliver(0)
            pair.step_d()
            pair.step_p()
    elif action == "step_d":
        pair.step_d()
    elif action == "step_p":
        pair.step_p()
    elif action == "deliver":
        deliver_one(pair, data)
    elif action == "report" and pair.writes:
        # Any posted WRITE: a rank's, a piece of a pipelined send, in any order.
        piece = draw(st.sampled_from(pair.writes))
        ok = draw(st.booleans())
        lands = not ok or not pair.faults or draw(st.booleans())
        pair.faulty |= not (ok and lands)
        pair.report(piece, ok, lands, corrupt=ok and corrupted(pair, data))
    elif action == "report_all":
        for piece in data.draw(st.permutations(pair.writes)):
            ok = draw(st.integers(0, 7)) > 0
            lands = not ok or not pair.faults or draw(st.integers(0, 7)) > 0
            pair.faulty |= not (ok and lands)
            pair.report(piece, ok, lands, corrupt=ok and corrupted(pair, data))
            if draw(st.booleans()):  # its notification lands before the next report
                while pair.notifs:
                    pair.land(0, corrupt=not pair.notifs[0].landed and corrupted(pair, data))
                pair.step_d()
    elif action == "land_all":
        while pair.notifs:
            pair.land(0, corrupt=not pair.notifs[0].landed and corrupted(pair, data))
    elif action == "land" and pair.notifs:
        i = draw(st.integers(0, len(pair.notifs) - 1))
        # A notif for a D process gone since may reach the one serving its address now.
        old_d = pair.notifs[i].d_incarnation != pair.incarnation("D")
        stray = old_d and pair.faults and draw(st.booleans())
        if stray:
            event("a notif for a restarted D process reached the new one")
        pair.land(i, corrupt=not pair.notifs[i].landed and corrupted(pair, data), stray=stray)
    elif action == "advance":
        dt = draw(st.sampled_from((0.5, 2.0, TIMEOUT / 2, TIMEOUT, 2 * TIMEOUT)))
        pair.faulty |= dt >= TIMEOUT  # a deadline may end a leg (and P forget a cancel)
        pair.clock.now += dt
    elif action == "to_deadline" and (edges := deadlines(pair)):
        # Just before, or at, a deadline of either side: races at its edge.
        pair.faulty = True
        pair.clock.now = draw(st.sampled_from(edges)) - draw(st.sampled_from((0.5, 0.1, 0.0)))
    elif action == "abort_d" and pair.d_requests:
        rid = draw(st.sampled_from(sorted(pair.d_requests)))
        if any(p.p_request_id == f"p-{rid[2:]}" for p in pair.writes):
            event("D's request ended while WRITEs into it were posted")
        pair.d_sch.abort_request(rid)
    elif action == "abort_p" and pair.p_requests:
        pair.p_sch.abort_request(draw(st.sampled_from(sorted(pair.p_requests))))
    elif action == "abort_p_mid_step":
        pair.step_p(abort=True)
        if any(s.pipelined for s in pair.p_conn.producer.in_flight.values()):
            event("P's prefill aborted mid-pipeline")
    elif action == "stall_p_mid_step":
        rank = draw(st.integers(0, pair.setup.tp_p - 1))
        layer = draw(st.integers(0, 3))
        dt = draw(st.sampled_from((0.5, TIMEOUT / 2, 1.5 * TIMEOUT)))
        pair.faulty |= dt >= TIMEOUT / 2
        pair.stall = (rank, layer, dt)  # in P's next step that computes
    elif action == "restart_p" and pair.faults:
        pair.faulty = True
        if any(p.landed for p in pair.pieces) and pair.writes:
            event("P restarted with a send part landed, part posted")
        pair.restart_p()
    elif action == "restart_d" and pair.faults:
        pair.faulty = True
        pair.restart_d()
    elif action == "replay" and pair.router.sent and pair.faults:
        pair.faulty = True
        i = draw(st.integers(0, len(pair.router.sent) - 1))
        reply = pair.router.replay(i, restarted=draw(st.booleans()))  # even at a restarted one
        if reply is not None and reply.get("code") == Refusal.STALE_RESERVATION:
            event("a reservation that came too late was refused")
    elif action == "late" and pair.router.lost and pair.faults:
        pair.faulty = True
        index, sent = pair.router.lost.pop(draw(st.integers(0, len(pair.router.lost) - 1)))
        arrive_at(pair, data, sent)
        reply = pair.router.replay(index, restarted=draw(st.booleans()))
        if pair.router.sent[index][1].get("kind") == "reserve" and reply is not None:
            taken = reply.get("ok", False)
            event(f"a lost reservation arrived late and was {'taken' if taken else 'refused'}")


def is_reserve(call: Any) -> bool:
    return bool(call.fn.__name__ == "reserve_job")


def deliver_one(pair: Pair, data: Any) -> None:
    """A queued call is delivered, mostly in order (a lane is FIFO), sometimes any queued
    call first. None queued: D steps first (it may queue one)."""
    if not pair.calls:
        pair.step_d()
    if pair.calls:
        i = data.draw(st.integers(0, len(pair.calls) - 1)) if data.draw(st.booleans()) else 0
        fault = data.draw(st.sampled_from(FAULTS)) if pair.faults else "ok"
        pair.faulty |= fault != "ok"
        pair.deliver(i, fault)


def arrive_at(pair: Pair, data: Any, sent: float) -> None:
    """The clock moves to when a message lost at ``sent`` arrives (``LATE``); both nodes
    step on the way (D may free what it quarantined, P forget a cancel)."""
    when = data.draw(st.sampled_from(LATE))
    at = pair.clock.now
    if when == "age_limit":
        at = sent + RESERVE_MAX_AGE_S + data.draw(st.sampled_from((-0.1, 0.0, 0.1)))
    elif when == "deadline" and (edges := deadlines(pair)):
        at = data.draw(st.sampled_from(edges)) - data.draw(st.sampled_from((0.1, 0.0)))
    elif when == "much_later":  # P's memory of cancels outlives every other deadline
        at = pair.clock.now + pair.p_conn.producer.cancelled.lifetime + 0.1
    if at > pair.clock.now:
        pair.clock.now = at
        pair.step_d()
        pair.step_p()


# A hunt's time limit grows with its count (hunt_timeout: FlakyStrategyDefinition at 8x
# on a loaded box was pytest-timeout's alarm inside an example).
@hunt_timeout(SCALE)
@fixed_examples(EXAMPLES)
@given(data=st.data())
def test_pd_protocol_holds_under_drawn_interleavings(clock: FakeTime, data: Any) -> None:
    clock.now = 1000.0
    pair = Pair(clock, data.draw(SETUPS))
    try:
        pair.faults = data.draw(st.booleans())  # False: only aborts, failed WRITEs, time
        steps = data.draw(st.integers(5, 60))
        for n in range(steps):
            action = data.draw(st.sampled_from(ACTIONS))
            run_action(pair, data, action, n)
            check_no_block_free_while_writable(pair)
            check_no_block_free_while_read(pair)
        while pair.router.lost and data.draw(st.integers(0, 3)) > 0:  # lost ones arrive, or never
            run_action(pair, data, "late", steps)
            check_no_block_free_while_writable(pair)
            check_no_block_free_while_read(pair)
        settle(pair)
        if not pair.faulty:
            check_explicit_ends(pair)
        drain(pair)
        check_all_ended(pair)
        links = [c.links for c in (pair.d_conn, *pair.dead) if hasattr(c, "links")]
        st_ = pair.setup
        event(f"P TP{st_.tp_p} -> D TP{st_.tp_d}, group {st_.group}, sums {st_.checksum}")
        conns = [pair.p_conn, pair.d_conn, *pair.dead]
        if any(getattr(c, "pipelined_sends", 0) for c in conns):
            event("a send was pipelined")
        if any(getattr(c, "checksum_failures", 0) for c in conns):
            event("D caught a corrupted transfer")
        if pair.accepted:
            event("D decoded from pushed KV")
        if TOO_LATE in pair.p_failures:
            event("a P rank got to a send (or its next piece) past its deadline")
        if any(x.calls_skipped for x in links):  # reached since created took the fake clock
            event("a call queued behind an unanswered one was not sent")
    finally:
        pair.close()
        for conn in pair.dead:
            conn.shutdown()
