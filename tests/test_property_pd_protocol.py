"""Model checking of the P/D transfer protocol: the real scheduler-side NIXL connectors of a
prefill node and a decode node (each with the real scheduler and block pool) talk through
a message queue the test controls (``pd_model.Pair``), under drawn interleavings: side-
channel calls delivered in any order, lost, their reply lost, sent twice, replayed late
(at a restarted process too), a reservation on the wire while its request ends; P's ranks
reporting their WRITEs one by one, ok or failed, notifications landing or not, in any
order; requests aborted on either side at any point; the clock moved past deadlines; P
restarted with a new incarnation.

After every action: no block of D is free, or another request's, while a WRITE may land
in it (a reservation P holds, a WRITE posted and not reported). At the end, once every
deadline passed and every queue is drained: nothing held on either side, no partial count
left, and every request reached a terminal outcome.

Fixed examples (derandomized, no database); ``PDSERVE_PD_PROTOCOL_EXAMPLES=N`` multiplies
them for a longer hunt.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from fakes import fixed_examples
from hypothesis import event, given
from hypothesis import strategies as st
from pd_model import (
    TIMEOUT,
    FakeTime,
    Pair,
    check_no_block_free_while_read,
    check_no_block_free_while_writable,
    fake_clock,
)

EXAMPLES = 60 * int(os.environ.get("PDSERVE_PD_PROTOCOL_EXAMPLES", "1"))
FAULTS = ("ok", "ok", "ok", "lost", "no_reply", "twice", "not_sent", "ended_meanwhile")
ACTIONS = (
    *("new_pair",) * 2,
    "new_d_only",
    "new_p_only",
    *("tick",) * 6,  # both nodes step and the oldest call is delivered: progress
    "step_d",
    "step_p",
    *("deliver",) * 4,
    *("report",) * 4,
    *("land",) * 3,
    "advance",
    "to_deadline",
    "abort_d",
    "abort_p",
    "restart_p",
    "restart_d",
    "replay",
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
        while pair.writes:
            for rank in sorted(pair.writes[0].ranks_left):
                pair.report(0, rank, ok=True, lands=True)
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
        if pair.calls:
            pair.deliver(0)
    elif action == "step_d":
        pair.step_d()
    elif action == "step_p":
        pair.step_p()
    elif action == "deliver" and pair.calls:
        # Mostly in order (a lane is FIFO), sometimes any queued call first.
        i = draw(st.integers(0, len(pair.calls) - 1)) if draw(st.booleans()) else 0
        fault = draw(st.sampled_from(FAULTS)) if pair.faults else "ok"
        pair.faulty |= fault != "ok"
        pair.deliver(i, fault)
    elif action == "report" and pair.writes:
        i = draw(st.integers(0, len(pair.writes) - 1))
        rank = draw(st.sampled_from(sorted(pair.writes[i].ranks_left)))
        ok = draw(st.booleans())
        lands = not ok or not pair.faults or draw(st.booleans())
        pair.faulty |= not (ok and lands)
        pair.report(i, rank, ok, lands)
    elif action == "land" and pair.notifs:
        pair.land(draw(st.integers(0, len(pair.notifs) - 1)))
    elif action == "advance":
        dt = draw(st.sampled_from((0.5, 2.0, TIMEOUT / 2, TIMEOUT, 2 * TIMEOUT)))
        pair.faulty |= dt >= TIMEOUT  # a deadline may end a leg (and P forget a cancel)
        pair.clock.now += dt
    elif action == "to_deadline" and (edges := deadlines(pair)):
        # Just before, or at, a deadline of either side: races at its edge.
        pair.faulty = True
        pair.clock.now = draw(st.sampled_from(edges)) - draw(st.sampled_from((0.5, 0.1, 0.0)))
    elif action == "abort_d" and pair.d_requests:
        pair.d_sch.abort_request(draw(st.sampled_from(sorted(pair.d_requests))))
    elif action == "abort_p" and pair.p_requests:
        pair.p_sch.abort_request(draw(st.sampled_from(sorted(pair.p_requests))))
    elif action == "restart_p" and pair.faults:
        pair.faulty = True
        pair.restart_p()
    elif action == "restart_d" and pair.faults:
        pair.faulty = True
        pair.restart_d()
    elif action == "replay" and pair.router.sent and pair.faults:
        pair.faulty = True
        i = draw(st.integers(0, len(pair.router.sent) - 1))
        pair.router.replay(i, restarted=draw(st.booleans()))  # even at a restarted process


@fixed_examples(EXAMPLES)
@given(data=st.data())
def test_pd_protocol_holds_under_drawn_interleavings(clock: FakeTime, data: Any) -> None:
    clock.now = 1000.0
    pair = Pair(clock)
    try:
        pair.faults = data.draw(st.booleans())  # False: only aborts, failed WRITEs, time
        steps = data.draw(st.integers(5, 60))
        for n in range(steps):
            action = data.draw(st.sampled_from(ACTIONS))
            run_action(pair, data, action, n)
            check_no_block_free_while_writable(pair)
            check_no_block_free_while_read(pair)
        settle(pair)
        if not pair.faulty:
            check_explicit_ends(pair)
        drain(pair)
        check_all_ended(pair)
        links = [c.links for c in (pair.d_conn, *pair.dead) if hasattr(c, "links")]
        if any(x.calls_skipped for x in links):  # reached since created took the fake clock
            event("a call queued behind an unanswered one was not sent")
    finally:
        pair.close()
        for conn in pair.dead:
            conn.shutdown()
