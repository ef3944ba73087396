"""Nodes joining and leaving, and nodes coming back, for the proxy's fault property test
(``tests/test_property_proxy_faults.py``): a node that is not static registers with the
proxy (``POST /v1/nodes/register``, ``proxy/registration.py``) at the start ("leaves":
it deregisters during a wave) or during a wave ("joins"); once the waves are over, health
rounds are run by hand, each node's ``/health`` failing for a drawn number of them first
(``HealthScript``), and every node must be in rotation exactly when its last check
passed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

logger = logging.getLogger(__name__)

KEY = "membership-key"  # --registration-key
STATIC, LEAVES, JOINS = "static", "leaves", "joins"


@dataclass(frozen=True)
class Member:
    """How a node is in the pool: ``how`` static, leaves or joins; when it leaves or
    joins: ``delay`` seconds after wave ``wave`` started."""

    how: str = STATIC
    wave: int = 0
    delay: float = 0.0

    def __repr__(self) -> str:
        return self.how if self.how == STATIC else f"{self.how}@w{self.wave}+{self.delay}s"


@dataclass(frozen=True)
class HealthScript:
    """A node's ``/health`` once the waves are over: ``fails`` rounds failing first, each
    by ``how`` ("503": it answers 503; "close": it closes the connection unanswered)."""

    fails: int = 0
    how: str = "503"


async def membership(client: httpx.AsyncClient, role: str, url: str, join: bool = True) -> None:
    """Register (``join``) or deregister the node at ``url`` with the proxy."""
    path = "/v1/nodes/register" if join else "/v1/nodes/deregister"
    resp = await client.post(path, json={"role": role, "url": url},
                             headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert resp.status_code == 200, (path, url, resp.text)


async def until(ready: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Wait for ``ready()`` (``what`` names it in the failure)."""
    async with asyncio.timeout(timeout):
        while not ready():
            await asyncio.sleep(0.005)
    assert ready(), what


def churn_at(
    client: httpx.AsyncClient, wave: int, members: dict[str, tuple[str, str, Member]]
) -> list[asyncio.Task[None]]:
    """The joins and leaves due once wave ``wave`` starts (``members``: by name, the
    node's role, URL and ``Member``), each a task."""

    async def later(role: str, url: str, m: Member) -> None:
        await asyncio.sleep(m.delay)
        await membership(client, role, url, join=m.how == JOINS)

    return [asyncio.ensure_future(later(role, url, m))
            for role, url, m in members.values()
            if m.how != STATIC and m.wave == wave]  # fmt: skip


async def health_rounds(
    check_all: Callable[[], Awaitable[None]], nodes: list[Any], fails: dict[str, int],
    names: dict[str, str], start_round: Callable[[int], None],
) -> None:  # fmt: skip
    """Run health rounds by hand until every node passed one; after each, a node is in
    rotation exactly when its check passed (``fails``: the rounds each node's ``/health``
    fails first, by name; ``start_round(k)`` tells the stand-ins round ``k`` begins: a
    client may ask again on a connection the node closed, within one round)."""
    for k in range(max(fails.values(), default=0) + 1):
        start_round(k)
        await check_all()
        for n in nodes:
            name = names[n.url]
            assert n.ready == (k >= fails[name]), (name, k, fails[name], n.last_error)
