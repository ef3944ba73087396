"""Per-peer lanes for side-channel calls: one FIFO queue and one thread per peer.

The scheduler-side connector never waits on the network on the engine thread; it hands
each call to the lane of the peer it goes to. One peer that does not answer (every call
to it waits out its RPC timeout) then delays only the calls to that peer -- never the
reservations, cancels, failure notices or liveness pings of healthy ones, as one shared
pool did. Within a lane calls run in order, so a cancel never overtakes the reservation
it cancels.

Bounds: a lane holds at most ``max_queued`` calls (``submit`` raises ``LaneFull`` past
that: the caller turns it into a terminal outcome at once); at most ``max_lanes`` lanes
exist (past that, calls to a new peer are refused the same way); a lane whose queue stays
empty for ``idle_s`` seconds ends its thread and is forgotten.

Proven and unproven peers: the caller says whether a peer has *proven* itself (a prefill
node that completed a handshake, a confirmed decode peer). Peers are named by clients (a
decode leg's prefill address is any address ``--kv-allowed-peers`` allows), so unproven
ones share at most ``max_unproven`` lanes: addresses that take the connection and never
answer then hold only those, and a proven peer always finds one of the other lanes. When
every lane is taken, an idle one (nothing queued or running; unproven first) is ended to
make room instead of refusing the call.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)

MAX_LANES = 256
# Lanes of peers that have not proven themselves, at most: a client may name any number.
MAX_UNPROVEN_LANES = 64

_STOP = object()


class LaneFull(RuntimeError):
    """The peer's lane (or the number of lanes) is at its bound."""


class _Lane:
    def __init__(self, owner: PeerLanes, peer: str, max_queued: int, proven: bool) -> None:
        self.peer = peer
        self.proven = proven
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=max_queued)
        self._owner = owner
        self.thread = threading.Thread(target=self._run, name=f"kv-lane-{peer}", daemon=True)

    def idle(self) -> bool:
        """Nothing queued and nothing running (each call is ``task_done`` once it ended).
        Stays true while the owner's lock is held: only ``submit`` queues calls."""
        return self.queue.unfinished_tasks == 0

    def _run(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=self._owner.idle_s)
            except queue.Empty:
                if self._owner._retire(self):
                    return
                continue
            try:
                if item is _STOP:
                    return
                self._call(*item)
            finally:
                self.queue.task_done()

    @staticmethod
    def _call(fut: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # the caller's future carries it
            fut.set_exception(e)


class PeerLanes:
    def __init__(
        self,
        max_queued: int = 1024,
        max_lanes: int = MAX_LANES,
        idle_s: float = 30.0,
        max_unproven: int = MAX_UNPROVEN_LANES,
    ):
        self.max_queued = max_queued
        self.max_lanes = max_lanes
        self.max_unproven = min(max_unproven, max_lanes)
        self.idle_s = idle_s
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.refused = 0  # calls refused at a bound

    def submit(
        self, peer: str, fn: Callable[..., Any], *args: Any, proven: bool = False
    ) -> Future[Any]:
        """Run ``fn(*args)`` on ``peer``'s lane, after the calls queued there before it.
        ``proven``: the peer proved itself (see the module docstring); the lanes of
        peers that did not are few."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise LaneFull("side-channel lanes are shut down")
            lane = self._lanes.get(peer)
            if lane is None:
                lane = self._new_lane(peer, proven)
            elif proven:
                lane.proven = True  # it has proven itself since: no longer in the small pool
            try:
                lane.queue.put_nowait((fut, fn, args))
            except queue.Full:
                self.refused += 1
                raise LaneFull(f"{self.max_queued} calls already queued for {peer}") from None
        return fut

    def _new_lane(self, peer: str, proven: bool) -> _Lane:
        """Start a lane for ``peer``, ending an idle one when a bound is reached; LaneFull
        when none is idle. Under the lock."""
        unproven = [lane for lane in self._lanes.values() if not lane.proven]
        if not proven and len(unproven) >= self.max_unproven:
            self._end_idle(unproven, f"{self.max_unproven} lanes of unproven peers in use", peer)
        if len(self._lanes) >= self.max_lanes:
            # Unproven peers' idle lanes go first, then the least recently started.
            lanes = sorted(self._lanes.values(), key=lambda lane: lane.proven)
            self._end_idle(lanes, f"{self.max_lanes} peer lanes in use", peer)
        lane = self._lanes[peer] = _Lane(self, peer, self.max_queued, proven)
        lane.thread.start()
        return lane

    def _end_idle(self, lanes: list[_Lane], full: str, peer: str) -> None:
        """End the first idle lane of ``lanes`` (its thread stops at once); LaneFull naming
        ``full`` when every one is busy. Under the lock."""
        lane = next((lane for lane in lanes if lane.idle()), None)
        if lane is None:
            self.refused += 1
            raise LaneFull(f"{full}; refusing {peer}")
        del self._lanes[lane.peer]
        lane.queue.put_nowait(_STOP)  # idle: its queue is empty

    def _retire(self, lane: _Lane) -> bool:
        """An idle lane asks to end: yes unless a call was queued meanwhile."""
        with self._lock:
            if not lane.queue.empty():
                return False
            if self._lanes.get(lane.peer) is lane:
                del self._lanes[lane.peer]
            return True

    def num_lanes(self, proven: bool | None = None) -> int:
        """Lanes alive (only the proven or the unproven peers' ones, when given)."""
        with self._lock:
            return sum(proven in (None, lane.proven) for lane in self._lanes.values())

    def shutdown(self) -> None:
        """Cancel queued calls and stop every lane (a call running now finishes)."""
        with self._lock:
            self._closed = True
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            while True:
                try:
                    item = lane.queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    item[0].cancel()
            with contextlib.suppress(queue.Full):  # just emptied: cannot be full
                lane.queue.put_nowait(_STOP)
