"""PeerLiveness decisions, with a scripted side channel (unit-level fault injection)."""

from __future__ import annotations

from concurrent.futures import Future

from kvconnector.nixl.liveness import PeerLiveness


class Inline:
    """An executor that runs jobs at once, so each tick's ping completes inside tick()."""

    def submit(self, fn, *args):
        fut: Future = Future()
        fut.set_result(fn(*args))
        return fut


def make(replies: list):
    lost: list[tuple[str, str, bool]] = []

    def request(address, msg, timeout):
        assert msg == {"kind": "ping"}
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    live = PeerLiveness(0.001, request, Inline(), lambda a, i, w, s: lost.append((a, i, w, s)))
    live._last = -1.0
    return live, lost


def tick(live: PeerLiveness, watched: set[tuple[str, str]]) -> None:
    live._last = -1.0  # ignore the interval in the test
    live.tick(watched)


def test_same_incarnation_is_alive():
    live, lost = make([{"ok": True, "incarnation": "a"}] * 3)
    for _ in range(3):
        tick(live, {("tcp://p:1", "a")})
    assert lost == [] and live.peers_lost == 0


def test_new_incarnation_means_restarted_and_safe():
    live, lost = make([{"ok": True, "incarnation": "b"}])
    tick(live, {("tcp://p:1", "a")})
    assert lost == [("tcp://p:1", "a", "the prefill node restarted", True)]


def test_two_missed_pings_in_a_row_mean_silent_and_unsafe():
    live, lost = make(
        [TimeoutError(), {"ok": True, "incarnation": "a"}, TimeoutError(), TimeoutError()]
    )
    tick(live, {("tcp://p:1", "a")})  # miss 1
    tick(live, {("tcp://p:1", "a")})  # answered: the count starts over
    tick(live, {("tcp://p:1", "a")})  # miss 1
    assert lost == []
    tick(live, {("tcp://p:1", "a")})  # miss 2
    assert lost == [("tcp://p:1", None, "prefill tcp://p:1 stopped answering", False)]


def test_disabled_or_nothing_watched_sends_nothing():
    live, lost = make([])
    tick(live, set())
    live.interval = 0
    tick(live, {("tcp://p:1", "a")})
    assert lost == []
