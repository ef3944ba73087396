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

_STOP = object()


class LaneFull(RuntimeError):
    """The peer's lane (or the number of lanes) is at its bound."""


class _Lane:
    def __init__(self, owner: PeerLanes, peer: str, max_queued: int) -> None:
        self.peer = peer
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=max_queued)
        self._owner = owner
        self.thread = threading.Thread(target=self._run, name=f"kv-lane-{peer}", daemon=True)

    def _run(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=self._owner.idle_s)
            except queue.Empty:
                if self._owner._retire(self):
                    return
                continue
            if item is _STOP:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # the caller's future carries it
                fut.set_exception(e)


class PeerLanes:
    def __init__(self, max_queued: int = 1024, max_lanes: int = 256, idle_s: float = 30.0):
        self.max_queued = max_queued
        self.max_lanes = max_lanes
        self.idle_s = idle_s
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.refused = 0  # calls refused at a bound

    def submit(self, peer: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on ``peer``'s lane, after the calls queued there before it."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise LaneFull("side-channel lanes are shut down")
            lane = self._lanes.get(peer)
            if lane is None:
                if len(self._lanes) >= self.max_lanes:
                    self.refused += 1
                    raise LaneFull(f"{self.max_lanes} peer lanes in use; refusing {peer}")
                lane = self._lanes[peer] = _Lane(self, peer, self.max_queued)
                lane.thread.start()
            try:
                lane.queue.put_nowait((fut, fn, args))
            except queue.Full:
                self.refused += 1
                raise LaneFull(f"{self.max_queued} calls already queued for {peer}") from None
        return fut

    def _retire(self, lane: _Lane) -> bool:
        """An idle lane asks to end: yes unless a call was queued meanwhile."""
        with self._lock:
            if not lane.queue.empty():
                return False
            if self._lanes.get(lane.peer) is lane:
                del self._lanes[lane.peer]
            return True

    def num_lanes(self) -> int:
        with self._lock:
            return len(self._lanes)

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
