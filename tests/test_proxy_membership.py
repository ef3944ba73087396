"""Nodes leaving and joining again while requests are still on them, without processes:
least-load routing counts a URL's requests from before it left, and ``/health`` and the
per-node metrics show a node that left until its last request ends (then nothing of it
is left).

Found by a review of membership and routing: a node that left and joined again at its
URL started at 0 requests in flight while its old ones still ran (least-load routing
sent it more); a node that left with requests on it vanished from ``/health`` and
``/metrics`` while it still served them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import proxy.nodes
from engine.httpkit.drain import Drainer
from proxy.config import ProxyConfig
from proxy.discovery import Membership
from proxy.health import HealthChecker
from proxy.metrics import ProxyMetrics
from proxy.node_client import NodeClient
from proxy.nodes import Node, NodePool
from proxy.prefix import PrefixIndex, PromptKey
from proxy.router import CacheAware, LeastOutstanding, Route, Router
from proxy.serving import ProxyServing

D1, D2 = "http://10.0.0.2:8200", "http://10.0.0.3:8200"


def _ready(node: Node) -> Node:
    node.model, node.side_channel = "tiny", "tcp://x:1"
    node.set_healthy(True)
    return node


def _health(pool: NodePool) -> dict[str, Any]:
    cfg = ProxyConfig(prefill=(), decode=(), registration_key="k")
    serving = ProxyServing(cfg, pool, Router(pool), ProxyMetrics(pool), Drainer(frozenset()))
    return json.loads(serving.health().body)


def _gauge(pool: NodePool, url: str) -> str | None:
    """The ``pdproxy_node_outstanding_requests`` line of ``url``, or None."""
    text = ProxyMetrics(pool).render().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("pdproxy_node_outstanding")]
    return next((ln for ln in lines if f'url="{url}"' in ln), None)


# -- a URL's requests across leaving and joining again ------------------------------------------


def test_a_node_that_rejoins_counts_the_requests_still_running_from_before() -> None:
    pool = NodePool((), (D2,))
    members = Membership(pool)
    d1 = _ready(members.add("decode", D1, "registered"))
    d2 = _ready(pool.decode[0])
    with d1.lease(), d1.lease(), d2.lease():  # D1: 2 requests, D2: 1
        members.drop(D1, "registered")  # leaves (deregistered, expired) ...
        again = _ready(members.add("decode", D1, "registered"))  # ... and is back at once
        assert again is not d1 and again.outstanding == 0
        policy = LeastOutstanding()  # the URL's requests: still 2 against D2's 1
        assert [policy.choose("decode", [again, d2]).url for _ in range(3)] == [D2] * 3
        (entry,) = [n for n in _health(pool)["decode"] if n["url"] == D1]
        assert entry["outstanding"] == 2 and entry["state"] == "ready", entry
        assert again.in_flight == 2
        assert _gauge(pool, D1) == (
            f'pdproxy_node_outstanding_requests{{role="decode",url="{D1}"}} 2.0'
        )
    assert again.in_flight == 0
    pool.watched()  # a health round: the link to the node that left is dropped
    assert again.previous is None


def test_leaving_twice_with_requests_on_each_counts_them_all() -> None:
    pool = NodePool((), ())
    members = Membership(pool)
    first = _ready(members.add("decode", D1, "registered"))
    with first.lease():
        members.drop(D1, "registered")
        second = _ready(members.add("decode", D1, "registered"))
        with second.lease():
            members.drop(D1, "registered")
            third = members.add("decode", D1, "registered")
            assert third.in_flight == 2
        assert third.in_flight == 1
    assert third.in_flight == 0


# -- nodes that left, in /health and the metrics ---------------------------------------------


def test_a_node_that_left_with_requests_is_shown_leaving_until_they_end() -> None:
    pool = NodePool((), (D2,))
    members = Membership(pool)
    d1 = _ready(members.add("decode", D1, "registered"))
    _ready(pool.decode[0])
    with d1.lease():
        members.drop(D1, "registered")
        entries = {n["url"]: n for n in _health(pool)["decode"]}
        assert entries[D1] == {
            "url": D1, "healthy": False, "state": "leaving", "outstanding": 1,
            "error": None, "sources": [],
        }, entries[D1]  # fmt: skip
        assert entries[D2]["state"] == "ready"
        assert _gauge(pool, D1) == (
            f'pdproxy_node_outstanding_requests{{role="decode",url="{D1}"}} 1.0'
        )
        text = ProxyMetrics(pool).render().decode()
        assert f'pdproxy_node_healthy{{role="decode",url="{D1}"}} 0.0' in text
    # Its last request ended: nothing of it is left (no series kept at 0 for ever).
    assert [n["url"] for n in _health(pool)["decode"]] == [D2]
    assert _gauge(pool, D1) is None
    assert D1 not in ProxyMetrics(pool).render().decode()


def test_a_node_that_left_idle_is_gone_at_once() -> None:
    pool = NodePool((), ())
    members = Membership(pool)
    _ready(members.add("decode", D1, "registered"))
    members.drop(D1, "registered")
    assert _health(pool)["decode"] == [] and _gauge(pool, D1) is None


# -- what is remembered per URL goes with a node that leaves ---------------------------------
#
# Found by a review of membership: a warning's "once per pair" record and the prefix
# index's drop count were kept for every URL ever seen, so DNS answers or registrations
# that keep changing (pods of rollouts, autoscaling) grew them without bound.

CHURN = 200  # URLs that join and leave, one after another


def _churn(members: Membership, each: Callable[[Node], None]) -> None:
    """``CHURN`` decode nodes join, get ``each`` done to them, and leave."""
    for i in range(CHURN):
        url = f"http://10.1.{i // 250}.{i % 250}:8200"
        node = _ready(members.add("decode", url, "registered"))
        each(node)
        members.drop(url, "registered")


def test_parser_warnings_are_forgotten_with_the_node_that_left() -> None:
    pool = NodePool(("http://10.0.0.1:8100",), ())
    p = _ready(pool.prefill[0])
    router = Router(pool)
    members = Membership(pool)

    def differ(d: Node) -> None:
        d.reasoning_parser = "deepseek_r1"
        assert router.refuses(d, p)  # warned once for the pair

    _churn(members, differ)
    assert len(router._parser_warned) <= 1


def test_template_warnings_are_forgotten_with_the_node_that_left() -> None:
    pool = NodePool(("http://10.0.0.1:8100",), ())
    p = _ready(pool.prefill[0])
    p.chat_template = "aaaa"
    checker = HealthChecker(pool, NodeClient(timeout=1.0), interval=1.0)
    members = Membership(pool)
    members.on_removed = checker.forget  # as the app wires it

    def differ(d: Node) -> None:
        d.chat_template = "bbbb"
        checker._check_templates(d)  # warned once for the pair

    _churn(members, differ)
    assert len(checker._template_warned) <= 1


def test_the_prefix_index_keeps_nothing_of_nodes_that_left_with_prompts_on_their_way() -> None:
    pool = NodePool(("http://10.0.0.1:8100",), ())
    _ready(pool.prefill[0])
    index = PrefixIndex(1 << 12)
    router = Router(pool, CacheAware(index), index=index)
    members = Membership(pool)
    key = PromptKey.of("text", "x" * 1000)
    routes: list[Route] = []

    def route(d: Node) -> None:
        routes.append(router.plan(key))  # on its way to D when D leaves

    _churn(members, route)
    for r in routes:
        router.finish(r, True, False)
    assert len(index._epoch) <= 1
    assert index.total() <= len(key.hashes)  # what P served, no more


def test_a_ticket_from_before_a_drop_does_not_end_a_later_request() -> None:
    index = PrefixIndex(1 << 12)
    key = PromptKey.of("text", "y" * 1000)
    old = index.begin(D1, key)
    index.drop(D1)  # the node left (or restarted) with the request on it
    index.begin(D1, key)  # the node at that URL again, a new request on its way
    index.end(D1, key, old, served=False)  # the old request ends
    assert index.match(D1, key) == len(key.hashes)  # the new one still counts


def test_counters_of_urls_long_gone_are_kept_up_to_a_bound(monkeypatch: Any) -> None:
    """A URL's counters outlive its node (a node joining there again goes on from them),
    but not for ever: past ``MAX_REMEMBERED_URLS`` URLs with no node, the longest gone are
    dropped; those of nodes in the pool, or leaving with requests, are always kept."""
    monkeypatch.setattr(proxy.nodes, "MAX_REMEMBERED_URLS", 10)
    pool = NodePool((), (D2,))
    members = Membership(pool)
    with pool.decode[0].lease():
        _churn(members, lambda node: node.begin_request())  # each leaves with a request
        assert len(pool._counters) == CHURN + 1  # all still serving: none dropped
        for n in pool._departed:
            n.outstanding = 0
        pool.watched()
        _churn(members, _one_request)  # the same URLs again, idle when they leave
        assert len(pool._counters) == 10 + 1  # the bound, and D2's
        assert pool.counters_for("decode", D2).requests == 1
    first_kept = f"http://10.1.{(CHURN - 10) // 250}.{(CHURN - 10) % 250}:8200"
    node = members.add("decode", first_kept, "registered")
    assert node.counters.requests == 1  # one of the 10 last gone: its count goes on
    node = members.add("decode", "http://10.1.0.0:8200", "registered")
    assert node.counters.requests == 0  # gone longer: forgotten


def _one_request(node: Node) -> None:
    with node.lease():
        pass
