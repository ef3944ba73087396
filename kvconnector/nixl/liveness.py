"""Decode-side liveness of the prefill peers a node is waiting on.

While a D request waits for KV from P (its reservation acknowledged), D pings P's side
channel every ``interval`` seconds, off the engine thread. Two outcomes end the wait
before its deadline:

* P answers with a new incarnation: the process that held the reservation is gone, so no
  WRITE of it can land -- the waits fail and their blocks are free at once;
* P does not answer ``misses`` pings in a row: the waits fail over, but their blocks stay
  quarantined (a silent peer may still be alive behind a broken side channel). An answer
  that is not a valid ping reply (a refusal, a malformed map) tells nothing about the
  incarnation and counts as a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvconnector.nixl.lanes import LaneFull, PeerLanes
from kvconnector.nixl.messages import Ping, PingReply, decode_reply

logger = logging.getLogger(__name__)


class PeerLiveness:
    def __init__(
        self,
        interval: float,
        request: Callable[[str, dict[str, Any], float], dict[str, Any]],
        lanes: PeerLanes,
        on_lost: Callable[[str, str | None, str, bool], None],
        misses: int = 2,
    ) -> None:
        self.interval = interval
        self._request = request
        self._lanes = lanes
        self._on_lost = on_lost  # (address, lost incarnation or None for all, why, safe)
        self._misses_allowed = misses
        self._misses: dict[str, int] = {}
        self._in_flight: set[str] = set()
        self._last = 0.0
        self._lock = threading.Lock()
        self.peers_lost = 0

    def tick(self, watched: set[tuple[str, str]]) -> None:
        """Ping, at most once per interval, each (address, incarnation) in ``watched``."""
        if self.interval <= 0:
            return
        if not watched:
            if self._misses:
                with self._lock:
                    self._misses.clear()
            return
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        self._last = now
        with self._lock:
            # Misses count in a row while a wait is on the address; then they are forgotten
            # (addresses come from clients: a count per address ever named grew for good).
            addresses = {address for address, _ in watched}
            for address in [a for a in self._misses if a not in addresses]:
                del self._misses[address]
            todo = [w for w in watched if w not in self._in_flight]
            self._in_flight.update(todo)
        for address, incarnation in todo:
            # Pings have their own lane per peer: never queued behind slow reservations.
            # Only peers that acknowledged a reservation are watched: proven ones.
            try:
                lane = f"ping:{address}"
                self._lanes.submit(lane, self._ping, address, incarnation, proven=True)
            except LaneFull:
                with self._lock:
                    self._in_flight.discard((address, incarnation))

    def _ping(self, address: str, incarnation: str) -> None:
        reply: PingReply | None = None
        try:
            raw = self._request(address, Ping().to_wire(), max(1.0, self.interval))
            decoded = decode_reply(raw, PingReply)
            if isinstance(decoded, PingReply):
                reply = decoded
            else:
                logger.info("prefill %s refused a ping: %s", address, decoded.error)
        except Exception as e:  # no answer, or not a ping reply (MessageError)
            logger.debug("ping of %s failed: %s", address, e)
        with self._lock:
            self._in_flight.discard((address, incarnation))
            if reply is not None:
                self._misses.pop(address, None)
            else:
                self._misses[address] = self._misses.get(address, 0) + 1
            silent = self._misses.get(address, 0) >= self._misses_allowed
            if silent:
                self._misses.pop(address, None)
        if reply is not None and reply.incarnation != incarnation:
            self.peers_lost += 1
            logger.warning("prefill %s restarted (incarnation %s)", address, reply.incarnation)
            self._on_lost(address, incarnation, "the prefill node restarted", True)
        elif silent:
            self.peers_lost += 1
            logger.warning("prefill %s stopped answering pings", address)
            self._on_lost(address, None, f"prefill {address} stopped answering", False)
