"""PeerLiveness decisions, with a scripted side channel (unit-level fault injection)."""

from __future__ import annotations

from concurrent.futures import Future

from kvconnector.nixl.liveness import PeerLiveness


class Inline:
    """Lanes that run calls at once, so each tick's ping completes inside tick()."""

    def submit(self, peer, fn, *args, proven=False):
        fut: Future = Future()
        fut.set_result(fn(*args))
        return fut


class ScriptedChannel:
    """The side channel as PeerLiveness sees it: records every request and answers from
    ``replies`` (an exception in the script is raised). PeerLiveness catches whatever its
    request raises (that is a missed ping), so nothing here asserts: the tests check
    ``sent`` and the leftover script themselves."""

    def __init__(self, replies: list) -> None:
        self.replies = list(replies)
        self.sent: list[tuple[str, dict]] = []

    def request(self, address: str, msg: dict, timeout: float) -> dict:
        self.sent.append((address, msg))
        if not self.replies:
            raise LookupError("a request the test did not script")
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def pings(self) -> list[str]:
        """The addresses pinged, in order; any request that is not a ping fails the test."""
        assert all(msg == {"kind": "ping"} for _, msg in self.sent), self.sent
        return [address for address, _ in self.sent]


def make(replies: list) -> tuple[PeerLiveness, list, ScriptedChannel]:
    lost: list[tuple[str, str | None, str, bool]] = []
    chan = ScriptedChannel(replies)
    live = PeerLiveness(0.001, chan.request, Inline(), lambda a, i, w, s: lost.append((a, i, w, s)))
    live._last = -1.0
    return live, lost, chan


def tick(live: PeerLiveness, watched: set[tuple[str, str]]) -> None:
    live._last = -1.0  # ignore the interval in the test
    live.tick(watched)


def test_same_incarnation_is_alive():
    live, lost, chan = make([{"ok": True, "incarnation": "a"}] * 3)
    for _ in range(3):
        tick(live, {("tcp://p:1", "a")})
    assert chan.pings() == ["tcp://p:1"] * 3 and chan.replies == []
    assert lost == [] and live.peers_lost == 0


def test_new_incarnation_means_restarted_and_safe():
    live, lost, chan = make([{"ok": True, "incarnation": "b"}])
    tick(live, {("tcp://p:1", "a")})
    assert chan.pings() == ["tcp://p:1"]
    assert lost == [("tcp://p:1", "a", "the prefill node restarted", True)]


def test_two_missed_pings_in_a_row_mean_silent_and_unsafe():
    live, lost, chan = make(
        [TimeoutError(), {"ok": True, "incarnation": "a"}, TimeoutError(), TimeoutError()]
    )
    tick(live, {("tcp://p:1", "a")})  # miss 1
    tick(live, {("tcp://p:1", "a")})  # answered: the count starts over
    tick(live, {("tcp://p:1", "a")})  # miss 1
    assert lost == []
    tick(live, {("tcp://p:1", "a")})  # miss 2
    assert chan.pings() == ["tcp://p:1"] * 4 and chan.replies == []
    assert lost == [("tcp://p:1", None, "prefill tcp://p:1 stopped answering", False)]


def test_disabled_or_nothing_watched_sends_nothing():
    live, lost, chan = make([])
    tick(live, set())
    live.interval = 0
    tick(live, {("tcp://p:1", "a")})
    assert chan.sent == [] and lost == []


def test_a_miss_is_forgotten_once_no_wait_is_on_its_address():
    """Prefill addresses come from clients (a decode leg names one): a miss was counted
    for good for every address that missed one ping before its waits ended, one entry
    per address ever named."""
    live, lost, chan = make([TimeoutError()] * 50)
    for i in range(50):
        tick(live, {(f"tcp://p:{i}", "a")})
    assert len(live._misses) <= 1 and lost == []
    tick(live, set())
    assert live._misses == {}
