"""Which nodes are in the pool, and why: nodes joining and leaving at run time.

A node is in the pool while at least one *source* lists it: ``static`` (``--prefill`` /
``--decode``: never leaves), ``registered`` (``proxy/registration.py``: until it
deregisters or its registration expires) or ``dns:NAME:PORT`` (``proxy/dns.py``: while the
name resolves to its address). ``Membership`` adds a node when its first source appears
and removes it when its last one goes; a URL is one role. A node that joins is
health-checked at once (the checker the app sets) and routed to once ready, like a static
one. A node that leaves is never routed to again; a request already on it keeps its
``Node`` and finishes, or fails as on a failed node; the prefix router forgets it.

``DiscoveryLoop`` runs the periodic jobs (expiring registrations, resolving DNS names) in
the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

from proxy.nodes import Node, NodePool, Role

logger = logging.getLogger(__name__)

STATIC = "static"


class RoleConflict(Exception):
    """The URL is already in the pool under the other role."""


class Membership:
    def __init__(self, pool: NodePool) -> None:
        self.pool = pool
        # Events: added, removed (its last source went), expired, refused (a registration
        # answered 4xx), dns_error (a lookup failed; what it listed was kept), dns_timeout
        # (of those, no answer within the deadline), dns_late (an answer taken past it).
        self.events: Counter[str] = Counter()
        self.checker: Callable[[Node], Awaitable[None]] | None = None
        self.on_removed: Callable[[Node], None] | None = None  # e.g. close its connections
        self._checks: dict[str, asyncio.Task[None]] = {}  # URL -> its join-time check
        self.closed = False  # the proxy stops: no node joins or leaves any more

    def add(self, role: Role, url: str, source: str) -> Node:
        """``url`` is listed by ``source``: the node, added to the pool if new."""
        node = self.pool.get(url)
        if node is not None and node.role != role:
            raise RoleConflict(f"{url} is a {node.role} node of this proxy, not a {role} node")
        if node is not None:
            node.sources.add(source)
            return node
        node = self.pool.add(role, url, source)
        self.events["added"] += 1
        if self.checker is not None:  # routable after one health check, not one interval
            task = asyncio.get_running_loop().create_task(self.checker(node))
            self._checks[url] = task

            def done(finished: asyncio.Task[None]) -> None:
                if self._checks.get(url) is finished:  # not a later check of the URL
                    del self._checks[url]

            task.add_done_callback(done)
        return node

    def drop(self, url: str, source: str) -> bool:
        """``source`` no longer lists ``url``; True when the node left the pool."""
        node = self.pool.get(url)
        if node is None or source not in node.sources:
            return False
        node.sources.discard(source)
        if node.sources:
            return False
        self.pool.remove(node, f"no longer listed ({source})")
        self.events["removed"] += 1
        check = self._checks.pop(url, None)
        if check is not None:
            check.cancel()  # a node that left is not waited on
        if self.on_removed is not None:
            self.on_removed(node)
        return True

    def listed_by(self, source: str) -> set[str]:
        return {n.url for n in self.pool.all() if source in n.sources}

    async def close(self) -> None:
        self.closed = True
        for task in list(self._checks.values()):
            task.cancel()
        for task in list(self._checks.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task


Job = Callable[[], Awaitable[None]]


class DiscoveryLoop:
    """Runs each ``(job, period)`` every ``period`` seconds, each in its own task (a slow
    DNS lookup does not hold up expiry); a job that raises is logged and run again."""

    def __init__(self, jobs: Sequence[tuple[Job, float]]) -> None:
        self.jobs = list(jobs)
        self._tasks: list[asyncio.Task[None]] = []

    async def run_once(self) -> None:
        for job, _ in self.jobs:
            await self._safe(job)

    async def _safe(self, job: Job) -> None:
        try:
            await job()
        except Exception:  # the loop must outlive any one failure
            logger.exception("node discovery job failed")

    async def _every(self, job: Job, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            await self._safe(job)

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._every(job, period), name="pdproxy-discovery")
                for job, period in self.jobs
            ]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
