"""Choosing the prefill and decode node of each request.

``RoutingPolicy`` is the whole interface: given the routable nodes of one role, return
one. ``LeastOutstanding`` picks the node with the fewest requests in flight through this
proxy and breaks ties round-robin, so an idle cluster still spreads requests evenly.
``Router`` applies a policy to both roles and honours exclusions (for retries).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Protocol

from proxy.nodes import Node, NodePool, Role

logger = logging.getLogger(__name__)


class NoHealthyNode(Exception):
    """No routable node of a role (after exclusions)."""

    def __init__(self, role: Role) -> None:
        super().__init__(f"no healthy {role} node is available")
        self.role = role


class RoutingPolicy(Protocol):
    def choose(self, role: Role, candidates: Sequence[Node]) -> Node:
        """Pick one of ``candidates`` (never empty)."""
        ...


class LeastOutstanding:
    """Fewest outstanding requests; ties go round-robin per role."""

    def __init__(self) -> None:
        self._turn: dict[str, int] = {}

    def choose(self, role: Role, candidates: Sequence[Node]) -> Node:
        least = min(n.outstanding for n in candidates)
        tied = [n for n in candidates if n.outstanding == least]
        turn = self._turn.get(role, 0)
        self._turn[role] = turn + 1
        return tied[turn % len(tied)]


class Router:
    def __init__(self, pool: NodePool, policy: RoutingPolicy | None = None) -> None:
        self.pool = pool
        self.policy: RoutingPolicy = policy or LeastOutstanding()

    def pick(self, role: Role, exclude: Collection[str] = ()) -> Node:
        ready = self.pool.ready(role)
        if not ready:
            raise NoHealthyNode(role)
        candidates = [n for n in ready if n.url not in exclude] or ready
        return self.policy.choose(role, candidates)

    def has_other(self, role: Role, exclude: Collection[str]) -> bool:
        """Whether a routable node of ``role`` is left outside ``exclude``."""
        return any(n.url not in exclude for n in self.pool.ready(role))

    def pick_pair(self, exclude: Collection[str] = ()) -> tuple[Node, Node]:
        """A (prefill, decode) pair; excluded URLs are avoided unless nothing else is left."""
        return self.pick("prefill", exclude), self.pick("decode", exclude)
