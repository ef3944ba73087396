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
from typing import Any

from engine.httpkit.drain import Drainer
from proxy.config import ProxyConfig
from proxy.discovery import Membership
from proxy.metrics import ProxyMetrics
from proxy.nodes import Node, NodePool
from proxy.router import LeastOutstanding, Router
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
