"""What the proxy knows about each prefill and decode node.

A ``Node`` is routable when it is healthy (its last health check passed and no request
failed on it since), its facts are known (model, context length and, for prefill nodes,
the KV side-channel address D nodes must reach) and it is still in the pool. Nodes join
and leave the pool at run time (``proxy/discovery.py``): a request in flight on a node
that left keeps its ``Node`` and ends as it would on a failed one. Only the event loop
touches these objects, so they need no locks.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]

# How long a load answer (429) is remembered when no answer from the node clears it.
OVERLOAD_MEMORY_S = 30.0

# Counters kept for URLs no longer in the pool (``NodePool.counters_for``): a node that
# joins again at one goes on from its counts; past this many, the longest gone are dropped.
MAX_REMEMBERED_URLS = 4096

# The KV roles (``/v1/kv_transfer_info`` "role", ``--kv-role``) that can serve each role.
KV_ROLES: dict[str, tuple[str, ...]] = {
    "prefill": ("producer", "both"),
    "decode": ("consumer", "both"),
}


@dataclass
class NodeCounters:
    """What the metrics count per role and URL, shared by every node at that URL (one that
    left and one that joined again): Prometheus counters never go down for a label set."""

    requests: int = 0
    failures: int = 0


@dataclass
class Node:
    url: str
    role: Role
    healthy: bool = False
    outstanding: int = 0
    requests_total: int = 0
    failures_total: int = 0
    last_error: str | None = None
    changed_at: float = field(default_factory=time.monotonic)
    # Facts from GET /v1/kv_transfer_info and GET /v1/models.
    engine_id: str | None = None
    incarnation: str | None = None
    side_channel: str | None = None
    kv_role: str | None = None  # "producer", "consumer", "both"; None: not advertised
    # Its --reasoning-parser (None: off, or not advertised): its chat answers are split
    # into reasoning and content, so their first token is not pre-streamed as content.
    reasoning_parser: str | None = None
    # A digest of the chat template it renders chats with (None: not advertised): a P and
    # a D that differ compute different prompts for one chat (warned about: ``HealthChecker``).
    chat_template: str | None = None
    # Its usage has ``prompt_tokens_details`` (``--enable-prompt-tokens-details``): a
    # decode node's then gets the prefill node's cached count (``proxy/cached_tokens.py``).
    prompt_tokens_details: bool = False
    model: str | None = None
    # Every name it serves (its /v1/models cards: --served-model-name's names), model first.
    names: tuple[str, ...] = ()
    roots: dict[str, str] = field(default_factory=dict)  # name -> its card's root (--model)
    max_model_len: int | None = None
    # When the node last answered a request with load (429 / 503 overloaded); cleared by
    # an answer it finished. See ``shedding``.
    overloaded_at: float | None = None
    # Called when what the node caches becomes unknown: it left rotation or restarted.
    on_reset: Callable[[Node], None] | None = field(default=None, repr=False, compare=False)
    # Why it is in the pool: "static" (--prefill/--decode), "registered", "dns:NAME:PORT".
    sources: set[str] = field(default_factory=lambda: {"static"})
    removed: bool = False  # left the pool (never routable again; a new Node may join)
    # It passed a health check once: only then is its next healthy check "healthy again".
    was_healthy: bool = False
    # Its last health check got no answer at all (refused, reset, timed out): requests
    # waiting on it give up. A node that answers "not ready" (503: draining, starting)
    # still finishes what it has, so waits on it go on.
    unreachable: bool = False
    # Health checks in a row that got no answer (0 once one is answered), and when the
    # first of them began: requests reading a decode node's answer give up on it after
    # ``--unreachable-checks`` of them with no bytes from it since (``Attempt.d_gone``).
    unreachable_checks: int = 0
    unreachable_since: float | None = None
    # The node that left the pool at this URL (same role) with requests still on it, when
    # this one joined after it (``NodePool.add``): its requests are this URL's too.
    previous: Node | None = field(default=None, repr=False, compare=False)
    # Its URL's counters (``NodePool.counters_for``); ``requests_total`` and
    # ``failures_total`` are this node's own.
    counters: NodeCounters = field(default_factory=NodeCounters, repr=False, compare=False)

    @property
    def in_flight(self) -> int:
        """Requests in flight through this proxy on this node's URL: its own, and those
        still running from before it left and joined again (``previous``). What least-load
        routing, ``/health`` and the metrics count: a node that rejoins with requests still
        running is not idle."""
        n, prev = self.outstanding, self.previous
        while prev is not None:
            n += prev.outstanding
            prev = prev.previous
        return n

    @property
    def ready(self) -> bool:
        if self.removed or not self.healthy or self.model is None:
            return False
        return self.role == "decode" or self.side_channel is not None

    def set_healthy(self, healthy: bool, reason: str | None = None) -> None:
        if healthy == self.healthy:
            if reason:
                self.last_error = reason
            return
        self.healthy = healthy
        self.changed_at = time.monotonic()
        if healthy:
            again = " again" if self.was_healthy else ""
            self.was_healthy = True
            logger.info("%s node %s is healthy%s", self.role, self.url, again)
            self.last_error = None
        else:
            self.last_error = reason
            logger.warning("%s node %s taken out of rotation: %s", self.role, self.url, reason)
            self._reset()

    def mark_unreachable(self, reason: str, since: float | None = None) -> None:
        """A health check (begun at ``since``, monotonic; default now) got no answer: out
        of rotation; requests waiting for its first token give up on it (see
        ``unreachable_checks`` for answers already flowing)."""
        if self.unreachable_checks == 0:
            self.unreachable_since = time.monotonic() if since is None else since
        self.unreachable = True
        self.unreachable_checks += 1
        self.set_healthy(False, reason)

    def mark_reachable(self) -> None:
        """A health check got an answer, whatever it said."""
        self.unreachable = False
        self.unreachable_checks = 0
        self.unreachable_since = None

    def mark_overloaded(self) -> None:
        self.overloaded_at = time.monotonic()

    def mark_answered(self) -> None:
        self.overloaded_at = None

    def shedding(self, window_s: float = OVERLOAD_MEMORY_S) -> bool:
        """The node refused a request for load within ``window_s`` and has not finished
        one since: a streamed request routed to it waits for its answer (a 429 is still
        a status the client can see) instead of pre-streaming P's first token."""
        at = self.overloaded_at
        return at is not None and time.monotonic() - at < window_s

    def mark_failed(self, reason: str) -> None:
        """A request failed on this node (connection error or 5xx): stop routing to it."""
        self.failures_total += 1
        self.counters.failures += 1
        self.set_healthy(False, reason)

    def update_info(self, kv_info: dict[str, Any] | None, models: dict[str, Any] | None) -> None:
        """Learn the node's facts from its ``/v1/kv_transfer_info`` and ``/v1/models``
        answers (either may be None); ``ValueError`` when ``/v1/models`` lists no model."""
        if kv_info is not None:
            incarnation = kv_info.get("incarnation")
            if self.incarnation is not None and incarnation != self.incarnation:
                logger.info(
                    "%s node %s restarted (incarnation %s -> %s)",
                    self.role, self.url, self.incarnation, incarnation,
                )  # fmt: skip
                self._reset()
            self.engine_id = kv_info.get("engine_id")
            self.incarnation = incarnation
            side = kv_info.get("side_channel")
            self.side_channel = side if isinstance(side, str) and side else None
            kv_role = kv_info.get("role")
            self.kv_role = kv_role if isinstance(kv_role, str) else None
            parser = kv_info.get("reasoning_parser")
            self.reasoning_parser = parser if isinstance(parser, str) and parser else None
            template = kv_info.get("chat_template")
            self.chat_template = template[:64] if isinstance(template, str) and template else None
            self.prompt_tokens_details = kv_info.get("prompt_tokens_details") is True
        if models is not None:
            cards = models.get("data")
            if not (isinstance(cards, list) and cards and isinstance(cards[0], dict)):
                raise ValueError("/v1/models lists no model")
            self.model = str(cards[0].get("id"))
            ids = (str(c.get("id")) for c in cards[1:64] if isinstance(c, dict) and c.get("id"))
            self.names = tuple(dict.fromkeys([self.model, *ids]))
            roots = ((c.get("id"), c.get("root")) for c in cards[:64] if isinstance(c, dict))
            self.roots = {
                str(i): r for i, r in roots if isinstance(r, str) and r and len(r) <= 1024
            }
            mml = cards[0].get("max_model_len")
            ok = isinstance(mml, int) and not isinstance(mml, bool) and mml >= 2
            self.max_model_len = mml if ok else None

    def role_mismatch(self) -> str | None:
        """Why the node cannot serve the role it is listed in (its advertised KV role is
        the other one: a decode node given as ``--prefill``, or registered so), or None."""
        if self.kv_role is None or self.kv_role in KV_ROLES[self.role]:
            return None
        other = "decode" if self.role == "prefill" else "prefill"
        return (
            f"it is a {other} node (KV role {self.kv_role!r:.20}) listed as a {self.role} "
            f"node: give it as --{other}, or register it with role {other!r}"
        )

    def _reset(self) -> None:
        if self.on_reset is not None:
            self.on_reset(self)

    def begin_request(self) -> None:
        """One more request on this node (its own count and its URL's); the caller ends
        it with ``outstanding -= 1``."""
        self.outstanding += 1
        self.requests_total += 1
        self.counters.requests += 1

    @contextmanager
    def lease(self) -> Iterator[Node]:
        """Count one outstanding request on this node for the duration of the block."""
        self.begin_request()
        try:
            yield self
        finally:
            self.outstanding -= 1


def not_ready_summary(pool: NodePool) -> str:
    """Each node not ready and why, for the start-up line ("" when all are ready)."""
    parts = []
    for n in pool.all():
        if n.ready:
            continue
        if n.healthy:
            why = "healthy, its model not learned yet"
        else:
            why = n.last_error or "not checked yet"
        parts.append(f"{n.role} node {n.url}: {why}")
    return "; ".join(parts)


class NodePool:
    def __init__(
        self, prefill: tuple[str, ...], decode: tuple[str, ...], prefill_fallback: bool = False
    ) -> None:
        # Per role and URL, the longest gone first (``counters_for``).
        self._counters: OrderedDict[tuple[Role, str], NodeCounters] = OrderedDict()
        self._departed: list[Node] = []  # removed, maybe still serving requests (``watched``)
        self.prefill: list[Node] = []
        self.decode: list[Node] = []
        self.prefill = [self._new("prefill", url.rstrip("/")) for url in prefill]
        self.decode = [self._new("decode", url.rstrip("/")) for url in decode]
        self.prefill_fallback = prefill_fallback  # decode nodes alone when no P is ready
        self._on_reset: Callable[[Node], None] | None = None
        self._on_removed: list[Callable[[Node], None]] = []  # ``add_on_removed``

    def set_on_reset(self, callback: Callable[[Node], None]) -> None:
        """``Node.on_reset`` of every node, present and future."""
        self._on_reset = callback
        for n in self.all():
            n.on_reset = callback

    def add_on_removed(self, callback: Callable[[Node], None]) -> None:
        """Call ``callback`` with each node that leaves the pool for good (``remove``):
        what is remembered by URL goes with it, so that nodes joining and leaving (DNS
        answers, registrations) leave nothing behind."""
        self._on_removed.append(callback)

    def get(self, url: str) -> Node | None:
        return next((n for n in self.all() if n.url == url), None)

    def add(self, role: Role, url: str, source: str) -> Node:
        """A new node (not yet health-checked, so not routable). When a node of that role
        left at this URL with requests still on it, the new one counts them too
        (``Node.in_flight``)."""
        node = self._new(role, url, sources={source}, on_reset=self._on_reset)
        node.previous = self._last_departed(role, url)
        self.nodes(role).append(node)
        logger.info("%s node %s joined (%s)", role, url, source)
        return node

    def remove(self, node: Node, reason: str) -> None:
        """Out of the pool for good; what the router remembers of it is dropped."""
        nodes = self.nodes(node.role)
        nodes[:] = [n for n in nodes if n is not node]  # by identity: Nodes compare by value
        node.removed = True
        node.healthy = False
        logger.info("%s node %s left: %s", node.role, node.url, reason)
        node._reset()
        for callback in self._on_removed:
            callback(node)
        self._departed.append(node)
        self._counters.move_to_end((node.role, node.url))
        self._trim_counters()

    def _new(self, role: Role, url: str, **kw: Any) -> Node:
        return Node(url, role, counters=self.counters_for(role, url), **kw)

    def counters_for(self, role: Role, url: str) -> NodeCounters:
        """The counters of ``url`` in ``role``: those of the nodes that were there before,
        if any. Kept for up to ``MAX_REMEMBERED_URLS`` URLs no node is at any more (DNS
        answers and registrations bring new ones for ever), the longest gone dropped."""
        key = (role, url)
        counters = self._counters.pop(key, None) or NodeCounters()
        self._counters[key] = counters
        self._trim_counters(key)
        return counters

    def _trim_counters(self, keep: tuple[Role, str] | None = None) -> None:
        serving = [n for n in self._departed if n.outstanding > 0]
        live = {(n.role, n.url) for n in [*self.all(), *serving]} | {keep}
        gone = [k for k in self._counters if k not in live]
        for old in gone[: max(len(gone) - MAX_REMEMBERED_URLS, 0)]:
            del self._counters[old]

    def watched(self) -> list[Node]:
        """The nodes to health-check: the pool's, and those that left it while requests
        were still on them (a node that hangs after leaving must still be found hung:
        ``Attempt.d_gone`` reads its checks), until their last request ends."""
        self._departed = [n for n in self._departed if n.outstanding > 0]
        for n in [*self.all(), *self._departed]:
            if n.previous is not None and n.previous.in_flight == 0:
                n.previous = None  # their requests ended: nothing to carry
        return [*self.all(), *self._departed]

    def _last_departed(self, role: Role, url: str) -> Node | None:
        """The latest node of ``role`` that left at ``url`` with requests still on it."""
        for n in reversed(self._departed):
            if n.role == role and n.url == url and n.in_flight > 0:
                return n
        return None

    def leaving(self) -> list[Node]:
        """Nodes that left the pool with requests still on them, one per role and URL (the
        latest, counting the earlier ones: ``Node.in_flight``), while no node of that role
        is in the pool at the URL (whose ``in_flight`` counts them then): shown in
        ``/health`` and the metrics until their last request ends."""
        present = {(n.role, n.url) for n in self.all()}
        out: dict[tuple[str, str], Node] = {}
        for n in reversed(self._departed):
            key = (n.role, n.url)
            if key not in present and key not in out and n.in_flight > 0:
                out[key] = n
        return list(reversed(out.values()))

    def all(self) -> list[Node]:
        return [*self.prefill, *self.decode]

    def nodes(self, role: Role) -> list[Node]:
        return self.prefill if role == "prefill" else self.decode

    def ready(self, role: Role) -> list[Node]:
        return [n for n in self.nodes(role) if n.ready]

    @property
    def serving(self) -> bool:
        """At least one prefill and one decode node can take requests (a decode node alone
        with ``--prefill-fallback``)."""
        p_ok = self.prefill_fallback or bool(self.ready("prefill"))
        return p_ok and bool(self.ready("decode"))

    def model_names(self) -> list[str]:
        """What the ready nodes serve, every name of each (a node not ready -- e.g. one
        that just registered, or failed its check -- says nothing to clients)."""
        names: list[str] = []
        for n in self.all():
            if not n.ready:
                continue
            for name in n.names or ([n.model] if n.model is not None else []):
                if name not in names:
                    names.append(name)
        return names

    def model_root(self, name: str) -> str | None:
        """A served name's ``root`` as a ready node's card gives it (vLLM's: its --model)."""
        for n in self.all():
            if n.ready and (root := n.roots.get(name)) is not None:
                return root
        return None

    def max_model_len(self) -> int | None:
        """The context a client's prompt and answer share: the ready decode nodes' least.
        A prefill node computes the prompt and one token, so its context bounds only the
        prompt (it refuses a longer one itself)."""
        lens = [
            n.max_model_len for n in self.nodes("decode") if n.ready and n.max_model_len is not None
        ]
        return min(lens) if lens else None
