"""The steps the scheduler sent and has not updated from yet (more than one only with
``--async-scheduling``): the requests each scheduled, and the blocks that go back at its
update.

A step's results go only to the requests it scheduled, as they were then: not to one
finished, preempted or replaced since. The blocks of a request that ends or is preempted
while such a step scheduled it are freed at that step's update: its forward may still
write them, and a block handed to a remote load must not take a late local write after
the remote one.
"""

from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request

# Per request a step scheduled: the request and its preemption count then (preempted
# since: the results are stale).
Scheduled = dict[str, tuple[Request, int]]


class StepsInFlight:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.scheduled: dict[int, Scheduled] = {}  # by step id
        # Blocks of requests that ended or were preempted while a step may still write
        # them: freed at that step's update.
        self.free_after: dict[int, list[list[int]]] = {}

    def sent(self, step_id: int, scheduled: Scheduled) -> None:
        """Step ``step_id`` goes to the workers with these requests."""
        self.scheduled[step_id] = scheduled

    def updated(self, step_id: int) -> Scheduled:
        """The step's forward is done: the requests it scheduled; the blocks that waited for
        it are free (no write is left)."""
        scheduled = self.scheduled.pop(step_id, {})
        for blocks in self.free_after.pop(step_id, ()):
            self.kv.pool.free(blocks)
        return scheduled

    def free_blocks(self, request_id: str) -> bool:
        """Free the request's blocks now (True), or -- when a step not updated yet scheduled
        it (async scheduling) -- at that step's update."""
        steps = [k for k, reqs in self.scheduled.items() if request_id in reqs]
        if not steps:
            self.kv.free(request_id)
            return True
        blocks = self.kv.detach(request_id)
        if blocks:
            self.free_after.setdefault(max(steps), []).append(blocks)
        return False

    def blocks_waiting(self) -> bool:
        """Blocks go back at a step's update."""
        return bool(self.free_after)

    def forget(self) -> None:
        """No step in flight will be updated or write anything (the workers are gone): the
        blocks waiting for those updates are free now."""
        for step in sorted(self.free_after):
            for blocks in self.free_after[step]:
                self.kv.pool.free(blocks)
        self.free_after.clear()
        self.scheduled.clear()
