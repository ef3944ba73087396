"""Choosing the prefill and decode node of each request, and whether it needs a prefill
node at all.

``RoutingPolicy`` is the interface: given the routable nodes of one role (and the
request's ``PromptKey``), return one. ``--routing``:

* ``least_load`` (``LeastOutstanding``, the default): fewest requests in flight through
  this proxy, ties round-robin, so an idle cluster still spreads requests evenly.
* ``round_robin`` (``RoundRobin``): each role's nodes in turn, load ignored.
* ``prefix`` (``CacheAware``, SGLang's cache-aware rule): while the load is balanced, the
  node holding the longest prefix of the prompt (per the proxy's ``PrefixIndex``) when
  that prefix is at least ``--cache-threshold`` of the prompt, else the node with the
  least remembered (so that different prefixes spread); when the load is imbalanced
  (max - min outstanding > ``--balance-abs-threshold`` and max > min x
  ``--balance-rel-threshold``), the least loaded node. A request's ``prompt_cache_key``
  (OpenAI's) comes first: its node (``proxy/cache_keys.py``) counts as holding the whole
  prompt, so it gets the request while the load is balanced and it is a candidate; a key
  without a node takes the node this rule picks.

``Router.plan`` picks the decode node first, then decides the mode (Dynamo's conditional
disaggregation): when the prompt minus the prefix that decode node already holds is
shorter than ``--disagg-min-prompt-tokens`` (estimated, ``proxy/prefix.py``), the decode
node serves the request alone, no prefill leg; else a prefill node is picked too.
A routed prompt counts in the index as on its way to the nodes that got it (so that
requests sharing a prefix follow each other before the first is done) and is kept there
only for the nodes that served it (``finish``: P answered its leg, D finished the answer);
a refused pair, a request a node refused or failed, a client that left leave nothing. A prefill node
whose side channel the decode node refused (``refuse_pair``: not in D's
``--kv-allowed-peers``) is not paired with it; when D refuses every ready prefill node, D
serves the request alone (mode ``peer_refused``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.cache_keys import KeyOwners
from proxy.config import ProxyConfig
from proxy.nodes import Node, NodePool, Role
from proxy.prefix import CHAR_BLOCK, PrefixIndex, PromptKey, TokenEstimator

logger = logging.getLogger(__name__)


class NoHealthyNode(Exception):
    """No routable node of a role (after exclusions)."""

    def __init__(self, role: Role) -> None:
        super().__init__(f"no healthy {role} node is available")
        self.role = role


class PairRefused(NoHealthyNode):
    """Prefill nodes are ready, but the decode node(s) refuse every one of them."""

    def __init__(self, what: str = "the decode node refuses") -> None:
        Exception.__init__(
            self, f"{what} every ready prefill node (--kv-allowed-peers, or no KV connector)"
        )
        self.role = "prefill"


# How long a decode node's refusal of a prefill node's side channel is remembered (also
# forgotten when either node restarts: the key holds their incarnations).
REFUSAL_MEMORY_S = 600.0


class RoutingPolicy(Protocol):
    def choose(self, role: Role, candidates: Sequence[Node], key: PromptKey | None = None) -> Node:
        """Pick one of ``candidates`` (never empty); ``last_reason`` says why."""
        ...


class LeastOutstanding:
    """Fewest outstanding requests; ties go round-robin per role."""

    def __init__(self) -> None:
        self._turn: dict[str, int] = {}
        self.last_reason = "least_load"

    def choose(self, role: Role, candidates: Sequence[Node], key: PromptKey | None = None) -> Node:
        least = min(n.in_flight for n in candidates)
        tied = [n for n in candidates if n.in_flight == least]
        turn = self._turn.get(role, 0)
        self._turn[role] = turn + 1
        return tied[turn % len(tied)]


class RoundRobin:
    """Each role's candidates in turn, whatever their load."""

    def __init__(self) -> None:
        self._turn: dict[str, int] = {}
        self.last_reason = "round_robin"

    def choose(self, role: Role, candidates: Sequence[Node], key: PromptKey | None = None) -> Node:
        turn = self._turn.get(role, 0)
        self._turn[role] = turn + 1
        return candidates[turn % len(candidates)]


class CacheAware:
    """SGLang's cache-aware rule over the proxy's ``PrefixIndex`` (see the module doc).

    ``last_reason``: ``cache_key`` (the node of the request's ``prompt_cache_key``),
    ``prefix`` (longest cached prefix), ``spread`` (no node holds enough: the one with the
    least remembered), ``load`` (imbalanced, or nothing to match). ``owners``: the nodes
    of the keys (default: as many keys per role as ``index`` holds blocks per node)."""

    def __init__(
        self,
        index: PrefixIndex,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        owners: KeyOwners | None = None,
    ) -> None:
        self.index = index
        self.owners = owners or KeyOwners(index.max_blocks)
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold
        self._least = LeastOutstanding()
        self.last_reason = "load"

    def imbalanced(self, candidates: Sequence[Node]) -> bool:
        loads = [n.in_flight for n in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > lo * self.balance_rel

    def choose(self, role: Role, candidates: Sequence[Node], key: PromptKey | None = None) -> Node:
        near = key.affinity if key is not None else None
        if near is None:
            return self._by_prefix(role, candidates, key)
        # A ``prompt_cache_key``: its node counts as holding the whole prompt, so it wins
        # whatever the text matches, unless the load is imbalanced. A key without a node
        # (new, or its node left) takes the one the rule picks.
        url = self.owners.owner(role, near)
        if url is None:
            node = self._by_prefix(role, candidates, key)
            self.owners.assign(role, near, node.url)
            return node
        owner = next((n for n in candidates if n.url == url), None)
        if owner is None or self.imbalanced(candidates):
            # Avoided by this attempt (a retry), or too busy: the rule, this once; the
            # key stays with its node.
            return self._by_prefix(role, candidates, key)
        self.last_reason = "cache_key"
        return owner

    def _by_prefix(self, role: Role, candidates: Sequence[Node], key: PromptKey | None) -> Node:
        if key is None or not key.hashes or self.imbalanced(candidates):
            self.last_reason = "load"
            return self._least.choose(role, candidates)
        matched = [self.index.match(n.url, key) for n in candidates]
        best = max(matched)
        if best and best * key.block / key.length >= self.cache_threshold:
            self.last_reason = "prefix"
            tied = [n for n, m in zip(candidates, matched, strict=True) if m == best]
            return self._least.choose(role, tied)
        self.last_reason = "spread"
        sizes = [self.index.size(n.url) for n in candidates]
        small = min(sizes)
        tied = [n for n, s in zip(candidates, sizes, strict=True) if s == small]
        return self._least.choose(role, tied)


@dataclass
class Route:
    """Where one attempt of a request goes."""

    prefill: Node | None  # None: the decode node prefills the prompt itself
    decode: Node
    prompt_tokens: float | None = None  # the estimate the decision used
    decode_cached_tokens: float | None = None  # of them, held by the decode node
    # The prompt on its way to the nodes in the prefix index (``PrefixIndex.begin``'s
    # tickets, by URL) until ``Router.finish``.
    key: PromptKey | None = field(default=None, repr=False)
    tickets: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def decode_only(self) -> bool:
        return self.prefill is None


class Router:
    def __init__(
        self,
        pool: NodePool,
        policy: RoutingPolicy | None = None,
        *,
        index: PrefixIndex | None = None,
        estimator: TokenEstimator | None = None,
        disagg_min_prompt_tokens: int = 0,
    ) -> None:
        self.pool = pool
        self.policy: RoutingPolicy = policy or LeastOutstanding()
        self.index = index
        self.estimator = estimator
        self.disagg_min_prompt_tokens = disagg_min_prompt_tokens
        self.decisions: Counter[tuple[str, str]] = Counter()  # (role, reason) -> count
        # "disaggregated" / "decode_only" / "prefill_fallback" / "peer_refused" -> count
        self.modes: Counter[str] = Counter()
        self._falling_back = False  # the last route was a --prefill-fallback one
        # (P url, P incarnation, P side channel, D url, D incarnation) -> when D refused
        # P's side channel (``refuse_pair``): such a pair is not routed to.
        self._refused: dict[tuple[Any, ...], float] = {}
        self._parser_warned: set[tuple[Any, ...]] = set()  # pairs refused for their parsers
        if index is not None:
            pool.set_on_reset(self._node_reset)
        pool.add_on_removed(self._node_left)

    @classmethod
    def from_config(cls, pool: NodePool, cfg: ProxyConfig) -> Router:
        """The router ``--routing``, ``--disagg-min-prompt-tokens`` and their knobs ask for;
        an index is kept when either needs one."""
        index = None
        if cfg.routing == "prefix" or cfg.disagg_min_prompt_tokens > 0:
            index = PrefixIndex(max(1, cfg.prefix_max_chars // CHAR_BLOCK))
        policy: RoutingPolicy
        if cfg.routing == "prefix":
            assert index is not None
            policy = CacheAware(
                index, cfg.cache_threshold, cfg.balance_abs_threshold, cfg.balance_rel_threshold
            )
        elif cfg.routing == "round_robin":
            policy = RoundRobin()
        else:
            policy = LeastOutstanding()
        return cls(
            pool,
            policy,
            index=index,
            estimator=TokenEstimator(cfg.chars_per_token),
            disagg_min_prompt_tokens=cfg.disagg_min_prompt_tokens,
        )

    def _node_reset(self, node: Node) -> None:
        if self.index is not None and self.index.size(node.url):
            logger.info("%s node %s: forgetting its cached prefixes", node.role, node.url)
            self.index.drop(node.url)
        owners = getattr(self.policy, "owners", None)
        if isinstance(owners, KeyOwners) and (moved := owners.drop(node.role, node.url)):
            logger.info(
                "%s node %s: its %s prompt_cache_key(s) move with their next requests",
                node.role, node.url, moved,
            )  # fmt: skip

    def _node_left(self, node: Node) -> None:
        """``node`` left the pool: its pairs' parser warnings go (a node joining at its URL
        again is warned about afresh)."""
        at = 0 if node.role == "prefill" else 2  # (P url, P parser, D url, D parser)
        self._parser_warned = {k for k in self._parser_warned if k[at] != node.url}

    @staticmethod
    def pair_key(p: Node, d: Node) -> tuple[Any, ...]:
        """What a refusal is remembered under: both nodes as they are now (a restart
        changes an incarnation, so a restarted node is paired again)."""
        return (p.url, p.incarnation, p.side_channel, d.url, d.incarnation)

    def refuse_pair(self, p: Node, d: Node, why: str, key: tuple[Any, ...] | None = None) -> bool:
        """D refused P's side channel: stop pairing them (until either restarts, or for
        ``REFUSAL_MEMORY_S``); ``key``: the nodes as the refused attempt saw them
        (``pair_key`` when it started; default now). False when that was known already."""
        now = time.monotonic()
        self._refused = {k: t for k, t in self._refused.items() if now - t < REFUSAL_MEMORY_S}
        key = key or self.pair_key(p, d)
        known = key in self._refused
        self._refused[key] = now
        if not known:
            logger.warning(
                "decode node %s cannot pair with prefill node %s (side channel %s): %s; "
                "requests routed to that decode node go to another prefill node, or the "
                "decode node prefills them by itself", d.url, p.url, p.side_channel, why,
            )  # fmt: skip
        return not known

    def refuses(self, d: Node, p: Node) -> bool:
        """Whether D is not to be paired with P: D refused it, or their reasoning
        parsers differ (P's first token would be another answer's; warned once)."""
        if d.reasoning_parser != p.reasoning_parser:
            key = (p.url, p.reasoning_parser, d.url, d.reasoning_parser)
            if key not in self._parser_warned:
                self._parser_warned.add(key)
                logger.warning(
                    "decode node %s (--reasoning-parser %s) is not paired with prefill node "
                    "%s (%s): give P and D the same flag",
                    d.url, d.reasoning_parser, p.url, p.reasoning_parser,
                )  # fmt: skip
            return True
        at = self._refused.get(self.pair_key(p, d))
        return at is not None and time.monotonic() - at < REFUSAL_MEMORY_S

    def pick(
        self,
        role: Role,
        exclude: Collection[str] = (),
        key: PromptKey | None = None,
        paired_with: Node | None = None,
        needs_prefill: bool = False,
    ) -> Node:
        """A routable node of ``role``; excluded URLs are avoided unless nothing else is
        left; with ``paired_with`` (a decode node) only prefill nodes it accepts
        (``PairRefused`` when it refuses every ready one); a decode node ``needs_prefill``
        only among those accepting a ready prefill node (``PairRefused`` when none does)."""
        ready = self.pool.ready(role)
        if not ready:
            raise NoHealthyNode(role)
        if paired_with is not None:
            ready = [n for n in ready if not self.refuses(paired_with, n)]
            if not ready:
                raise PairRefused()
        elif role == "decode" and needs_prefill:
            # Only decode nodes that accept some ready prefill node (when there is one).
            ps = self.pool.ready("prefill")
            pairable = [d for d in ready if any(not self.refuses(d, p) for p in ps)]
            if ps and not pairable:
                raise PairRefused("every decode node refuses")
            ready = pairable or ready
        candidates = [n for n in ready if n.url not in exclude] or ready
        node = self.policy.choose(role, candidates, key)
        self.decisions[(role, getattr(self.policy, "last_reason", "least_load"))] += 1
        return node

    def has_other(self, role: Role, exclude: Collection[str]) -> bool:
        """Whether a routable node of ``role`` is left outside ``exclude``."""
        return any(n.url not in exclude for n in self.pool.ready(role))

    def pick_pair(self, exclude: Collection[str] = ()) -> tuple[Node, Node]:
        """A (prefill, decode) pair; excluded URLs are avoided unless nothing else is left."""
        return self.pick("prefill", exclude), self.pick("decode", exclude)

    def plan(
        self,
        key: PromptKey | None = None,
        exclude: Collection[str] = (),
        *,
        allow_decode_only: bool = True,
        decode_alone: bool = False,
    ) -> Route:
        """The decode node, then a prefill node unless the decode node should prefill the
        prompt itself (``--disagg-min-prompt-tokens``, or ``decode_alone``: no prefill
        node can serve it); raises ``NoHealthyNode``."""
        # A route that must have a prefill node takes a decode node that accepts one.
        d = self.pick("decode", exclude, key, needs_prefill=not allow_decode_only)
        route = Route(None, d)
        if key is not None and self.estimator is not None:
            route.prompt_tokens = self.estimator.tokens(key)
            held = self.index.match(d.url, key) * key.block if self.index is not None else 0
            route.decode_cached_tokens = self.estimator.tokens(key, held)
        n = self.disagg_min_prompt_tokens
        short = (
            n > 0
            and route.prompt_tokens is not None
            and route.prompt_tokens - (route.decode_cached_tokens or 0.0) < n
        )
        mode = "decode_only"
        if not (allow_decode_only and (short or decode_alone)):
            try:
                route.prefill = self.pick("prefill", exclude, key, paired_with=d)
                mode = "disaggregated"
            except PairRefused:
                if not allow_decode_only:
                    raise
                mode = "peer_refused"  # D refuses every ready P: it prefills by itself
            except NoHealthyNode:
                if not (allow_decode_only and self.pool.prefill_fallback):
                    raise
                mode = "prefill_fallback"  # no prefill node ready: D prefills by itself
        if (
            mode in ("disaggregated", "prefill_fallback")
            and (mode == "prefill_fallback") != self._falling_back
        ):
            self._falling_back = not self._falling_back
            if self._falling_back:
                logger.warning("no prefill node is ready: decode nodes prefill by themselves")
            else:
                logger.info("a prefill node is ready again: disaggregating")
        self.modes[mode] += 1
        if self.index is not None and key is not None:
            route.key = key
            for node in (d, route.prefill):
                if node is not None:
                    route.tickets[node.url] = self.index.begin(node.url, key)
        return route

    def finish(self, route: Route, prefill_served: bool, decode_served: bool) -> None:
        """The attempt ``route`` planned ended: each node that served it (P answered its
        leg, D finished the answer) now holds the prompt; the others are no longer said to
        be getting it. Once per route."""
        tickets, route.tickets = route.tickets, {}
        if self.index is None or route.key is None:
            return
        for node, ok in ((route.decode, decode_served), (route.prefill, prefill_served)):
            if node is not None and node.url in tickets:
                # Not for a node that left or failed meanwhile (its entries were dropped).
                ok = ok and not node.removed and node.healthy
                self.index.end(node.url, route.key, tickets[node.url], ok)

    def answered(self, route: Route, key: PromptKey | None, suffix: Any) -> None:
        """The decode node finished: it caches the prompt and the answer (``suffix``)."""
        if self.index is None or key is None or not route.decode.ready or not suffix:
            return
        self.index.insert(route.decode.url, key.extend(suffix))

    def observe_usage(self, key: PromptKey | None, body: Any) -> None:
        """Learn characters per token from a node's answer (its ``usage.prompt_tokens``)."""
        if key is None or self.estimator is None or not isinstance(body, dict):
            return
        usage = body.get("usage")
        if isinstance(usage, dict):
            self.estimator.observe(key, usage.get("prompt_tokens"))
