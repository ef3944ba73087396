"""Nodes coming and going while requests run on them (docs/proxy.md, "Discovery" and
"Failures"): DNS answers that change between refreshes (addresses added, removed, the same
one back; the lookup failing or timing out), health checks that never answer, and a node
that leaves and joins again at its URL while its old requests still run. The proxy runs in
process over stand-in nodes (``tests/proxy_churn_nodes.py``); DNS refreshes and health
rounds are run by hand."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import proxy.dns
from proxy.config import ProxyConfig
from proxy.discovery import DiscoveryLoop, Membership
from proxy.dns import DnsDiscovery
from proxy.nodes import Node, NodePool
from tests.proxy_churn_nodes import (
    BODY,
    KEY,
    HostStandIn,
    Resolver,
    Script,
    aborts,
    completions,
    handler,
    health_calls,
    in_flight_settled,
    metric,
    node_at,
    proxy_app,
    register,
    transfer_ids,
    until,
)
from tests.standin_http import SeenRequest, StandIn

pytestmark = pytest.mark.timeout(60)


def test_dns_answers_change_under_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DNS-listed decode node that leaves with a request on it finishes that request; a
    failed or timed-out lookup keeps the nodes; an address back in the answer joins again
    while its old request still runs, is routed to once its check passed, and the in-flight
    counts end at 0."""
    monkeypatch.setattr(proxy.dns, "LOOKUP_TIMEOUT_S", 0.05)
    asyncio.run(_dns_case())


async def _dns_case() -> None:
    sa, sb = Script(hold=True), Script(health="503")
    resolver = Resolver()
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(StandIn(handler("producer", Script())))
        a = await stack.enter_async_context(HostStandIn(handler("consumer", sa), "127.0.0.2"))
        b = await stack.enter_async_context(
            HostStandIn(handler("consumer", sb), "127.0.0.3", a.port)
        )
        resolver.answer = ["127.0.0.2"]
        cfg = ProxyConfig(
            prefill=(p.url,), decode_dns=(f"svc:{a.port}",), health_interval=3600,
            discovery_interval=3600, health_timeout=0.5,
        )  # fmt: skip
        app, client = await stack.enter_async_context(proxy_app(cfg, resolver))
        refresh = app.state.discovery.run_once
        node_a = node_at(app, a.url)
        assert node_a is not None
        await until(lambda: node_a.ready, "a ready after its first check")
        old = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        await until(lambda: sa.held == 1, "a request held on a")

        resolver.answer = ["127.0.0.3"]  # a leaves, b joins
        await refresh()
        assert node_at(app, a.url) is None and node_a.removed
        node_b = node_at(app, b.url)
        assert node_b is not None
        await until(lambda: node_b.last_error is not None, "b's first check (503)")
        resp = await client.post("/v1/completions", json=BODY)  # b not in rotation yet
        assert resp.status_code == 503 and completions(b) == 0, resp.text
        sb.health = "ok"
        await app.state.health.check_all()
        assert node_b.ready
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert completions(b) == 1 and completions(a) == 1

        for failure in (OSError("no DNS server"), "hang"):  # the rotation is kept
            resolver.answer = failure
            await refresh()
            assert node_at(app, b.url) is node_b and node_b.ready, failure
        resolver.release.set()

        resolver.answer = ["127.0.0.3", "127.0.0.2", "127.0.0.2"]  # a back, listed twice
        while node_at(app, a.url) is None:  # (once the hung lookup's thread ended)
            await refresh()
            await asyncio.sleep(0.01)
        await until(lambda: (n := node_at(app, a.url)) is not None and n.ready, "a back")
        new_a = node_at(app, a.url)
        assert new_a is not None and new_a is not node_a
        assert new_a.in_flight == 1  # its old request still runs
        assert not old.done()
        sa.release(0)
        resp = await old
        assert resp.status_code == 200, resp.text
        await refresh()
        in_flight_settled(app)


@pytest.mark.parametrize("old_ends", ["client_leaves", "fails", "answers"])
def test_rejoin_at_its_url_while_old_requests_run(old_ends: str) -> None:
    """A decode node deregisters with a request on it and registers again at its URL: the
    new node counts the old request in flight (``/health``, metrics) until it ends; the
    old request's end -- its client leaving (the abort goes to the URL, naming its leg),
    a failure (counted on the node that left: the new one stays in rotation), an answer --
    touches the old node's bookkeeping only; every count ends at 0."""
    asyncio.run(_rejoin_case(old_ends))


async def _rejoin_case(old_ends: str) -> None:
    sd = Script(hold=True)
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(StandIn(handler("producer", Script())))
        d = await stack.enter_async_context(StandIn(handler("consumer", sd)))
        cfg = ProxyConfig(prefill=(p.url,), registration_key=KEY, health_interval=3600,
                          health_timeout=0.5, max_retries=0)  # fmt: skip
        app, client = await stack.enter_async_context(proxy_app(cfg))
        await register(client, d.url)
        first = node_at(app, d.url)
        assert first is not None
        await until(lambda: first.ready, "registered node ready")
        old = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        await until(lambda: sd.held == 1, "old request held")
        await register(client, d.url, join=False)
        assert node_at(app, d.url) is None and first.outstanding == 1
        await register(client, d.url)
        second = node_at(app, d.url)
        assert second is not None and second is not first
        await until(lambda: second.ready, "node ready again")
        new = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        await until(lambda: sd.held == 2, "new request held")
        assert (second.outstanding, second.in_flight) == (1, 2)
        text = (await client.get("/metrics")).text
        assert metric(text, "pdproxy_node_outstanding_requests", d.url) == 2.0

        old_tid = transfer_ids(d)[0]
        if old_ends == "client_leaves":
            old.cancel()
            await until(lambda: any(a.get("transfer_id") == old_tid for a in aborts(d)), "abort")
            assert [a["transfer_id"] for a in aborts(d)] == [old_tid]
            await until(lambda: first.outstanding == 0, "old request ended")
        else:
            sd.fail = old_ends == "fails"
            sd.release(0)
            resp = await old
            assert resp.status_code == (502 if sd.fail else 200), resp.text
            sd.fail = False
        assert (second.outstanding, second.in_flight) == (1, 1)
        assert second.ready, second.last_error  # the old node's failure is not the new one's
        assert second.failures_total == 0
        text = (await client.get("/metrics")).text
        assert metric(text, "pdproxy_node_outstanding_requests", d.url) == 1.0
        assert metric(text, "pdproxy_node_healthy", d.url) == 1.0
        sd.release(1)
        assert (await new).status_code == 200
        await app.state.health.check_all()
        in_flight_settled(app)
        assert second.ready


def test_a_hung_health_check_holds_up_no_other_check() -> None:
    """A node whose ``/health`` never answers leaves the rotation as a failing one does;
    the others' checks are made while its call still waits (not after it), the round
    ends, and the background loop's next rounds check the others again and again."""
    asyncio.run(_hung_case())


async def _hung_case() -> None:
    hung = Script(health="ok")
    seen_while_waiting: list[bool] = []
    hung_node: list[Node] = []

    def good_handler() -> Callable[[SeenRequest], Any]:
        inner = handler("consumer", Script())

        async def handle(req: SeenRequest) -> Any:
            if req.path == "/health" and hung.health == "hang":
                # its check still waits for the hung node's answer
                seen_while_waiting.append(not hung_node[0].unreachable)
            return await inner(req)

        return handle

    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(StandIn(handler("producer", Script())))
        h = await stack.enter_async_context(StandIn(handler("consumer", hung)))
        goods = [await stack.enter_async_context(StandIn(good_handler())) for _ in range(2)]
        cfg = ProxyConfig(prefill=(p.url,), decode=(h.url, *(g.url for g in goods)),
                          health_interval=3600, health_timeout=0.3)  # fmt: skip
        app, client = await stack.enter_async_context(proxy_app(cfg))
        pool = app.state.pool
        hung_node.append(pool.decode[0])
        assert all(n.ready for n in pool.all())
        hung.health = "hang"
        async with asyncio.timeout(10):  # the round ends (within its deadline)
            await app.state.health.check_all()
        assert not hung_node[0].ready and hung_node[0].unreachable
        assert all(n.ready for n in pool.decode[1:])
        assert seen_while_waiting == [True, True]
        for _ in range(3):  # its call still hangs: the next rounds end too
            async with asyncio.timeout(10):
                await app.state.health.check_all()
            assert not hung_node[0].ready and all(n.ready for n in pool.decode[1:])
        assert health_calls(h) == 3  # the first round's and two hung ones: no pile-up
        for _ in range(4):
            resp = await client.post("/v1/completions", json=BODY)
            assert resp.status_code == 200
        assert completions(h) == 0


def test_a_timed_out_lookup_that_fails_later_logs_no_stray_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A lookup past its deadline runs on in its thread; when it then fails (a DNS server
    down: ``getaddrinfo`` gives up after its own timeouts), its error is the refresh's
    failed lookup already, not an asyncio "Task exception was never retrieved" error with
    a traceback logged for every such lookup."""
    monkeypatch.setattr(proxy.dns, "LOOKUP_TIMEOUT_S", 0.05)
    resolver = Resolver()
    resolver.answer = "hang"

    async def main() -> None:
        members = Membership(NodePool((), ()))
        dns = DnsDiscovery(members, [("decode", "svc", 8200)], resolver)
        await dns.refresh()  # past its deadline: a failed lookup
        resolver.release.set()  # then the lookup fails
        await until(lambda: all(f.done() for f in dns._running.values()), "lookup ended")
        resolver.answer = ["10.0.0.1"]
        await dns.refresh()  # the next lookup takes its place
        assert [n.url for n in members.pool.decode] == ["http://10.0.0.1:8200"]
        assert members.events["dns_error"] == 1

    asyncio.run(main())
    gc.collect()
    assert "never retrieved" not in caplog.text


@pytest.mark.parametrize("how", ["registration", "dns"])
def test_a_node_that_rejoins_keeps_its_counters(how: str) -> None:
    """A decode node that leaves and joins again at its URL (deregistered and registered,
    or gone from a DNS answer and back) keeps its per-node counters: Prometheus counters
    (``pdproxy_node_requests_total``, ``pdproxy_node_failures_total``) never go down for a
    label set. A request still on the node that left, failing after the rejoin, counts for
    the URL's failures (the new node stays in rotation); in-flight counts end at 0."""
    asyncio.run(_counters_case(how))


async def _counters_case(how: str) -> None:
    sd = Script()
    resolver = Resolver()
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(StandIn(handler("producer", Script())))
        d = await stack.enter_async_context(HostStandIn(handler("consumer", sd), "127.0.0.4"))
        resolver.answer = ["127.0.0.4"] if how == "dns" else []
        cfg = ProxyConfig(prefill=(p.url,), registration_key=KEY, health_interval=3600,
                          health_timeout=0.5, max_retries=0, discovery_interval=3600,
                          decode_dns=(f"svc:{d.port}",))  # fmt: skip
        app, client = await stack.enter_async_context(proxy_app(cfg, resolver))

        async def leave() -> None:
            if how == "dns":
                resolver.answer = []
                await app.state.discovery.run_once()
            else:
                await register(client, d.url, join=False)

        async def join() -> Node:
            if how == "dns":
                resolver.answer = ["127.0.0.4"]
                await app.state.discovery.run_once()
            else:
                await register(client, d.url)
            node = node_at(app, d.url)
            assert node is not None
            await until(lambda: node.ready, "node ready")
            return node

        async def counters() -> tuple[float | None, float | None]:
            text = (await client.get("/metrics")).text
            return (metric(text, "pdproxy_node_requests_total", d.url),
                    metric(text, "pdproxy_node_failures_total", d.url))  # fmt: skip

        if how == "registration":
            await join()
        first = node_at(app, d.url)
        assert first is not None
        await until(lambda: first.ready, "node ready")
        for _ in range(2):
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        sd.hold = True
        old = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        await until(lambda: sd.held == 1, "a request held on the first node")
        assert await counters() == (3.0, 0.0)

        await leave()
        assert node_at(app, d.url) is None
        assert await counters() == (3.0, 0.0)  # shown leaving, its request still on it
        second = await join()
        assert second is not first
        assert await counters() == (3.0, 0.0)  # not back to 0: the same label set
        sd.fail = True
        sd.release(0)
        assert (await old).status_code == 502
        sd.release_all()
        sd.fail = False
        assert await counters() == (3.0, 1.0)  # the old request's failure is the URL's
        assert second.ready, second.last_error  # ... not the new node's
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert await counters() == (4.0, 1.0)

        await leave()  # idle: its series go ...
        assert await counters() == (None, None)
        await join()  # ... and come back where they were
        assert await counters() == (4.0, 1.0)
        await app.state.health.check_all()
        in_flight_settled(app)


def test_a_slow_resolver_still_updates_the_nodes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A resolver that answers, but always after the lookup's deadline: each refresh that
    waited past the deadline counts a ``dns_error`` (logged once) and keeps the nodes; the
    lookup runs on (one at a time per name, never a second beside it) and its answer, when
    it comes, is the name's answer: the pool follows the resolver, late. (Before, a late
    answer was thrown away and the next refresh started a lookup just as slow: the pool
    never changed.)"""
    monkeypatch.setattr(proxy.dns, "LOOKUP_TIMEOUT_S", 0.1)
    caplog.set_level(logging.INFO, logger="proxy.dns")
    running, most = [0], [0]
    answer = [["10.0.0.1"]]

    def slow(name: str) -> list[str]:
        running[0] += 1
        most[0] = max(most[0], running[0])
        time.sleep(0.4)  # each lookup: four times its deadline
        running[0] -= 1
        return list(answer[0])

    async def main() -> None:
        members = Membership(NodePool((), ()))
        dns = DnsDiscovery(members, [("decode", "svc", 8200)], slow)
        loop = DiscoveryLoop([(dns.refresh, 0.05)])
        loop.start()
        urls = lambda: [n.url for n in members.pool.decode]  # noqa: E731
        try:
            await until(lambda: urls() == ["http://10.0.0.1:8200"], "the first answer", 30)
            assert members.events["dns_error"] >= 1
            answer[0] = ["10.0.0.2", "10.0.0.3"]
            await until(lambda: len(urls()) == 2 and "http://10.0.0.1:8200" not in urls(),
                        "the next answer", 30)  # fmt: skip
        finally:
            await loop.stop()
        assert sorted(urls()) == ["http://10.0.0.2:8200", "http://10.0.0.3:8200"]
        assert most[0] == 1  # never two lookups of the name at once

    asyncio.run(main())
    warnings = [r for r in caplog.records if "lookup failed" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert any("answered late" in r.getMessage() for r in caplog.records)


def test_a_late_answer_after_the_proxy_stopped_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup past its deadline whose answer comes once the proxy is shutting down
    (``Membership.close``) adds no node: no check is started for a pool going away."""
    monkeypatch.setattr(proxy.dns, "LOOKUP_TIMEOUT_S", 0.05)
    release = threading.Event()

    def late(name: str) -> list[str]:
        release.wait(30)
        return ["10.0.0.1"]

    async def main() -> None:
        members = Membership(NodePool((), ()))
        dns = DnsDiscovery(members, [("decode", "svc", 8200)], late)
        await dns.refresh()  # past its deadline
        await members.close()
        release.set()
        await until(lambda: all(f.done() for f in dns._running.values()), "lookup ended")
        await asyncio.sleep(0.05)  # (its done callbacks run)
        assert members.pool.decode == [] and members.events["added"] == 0

    asyncio.run(main())


def test_timed_out_and_late_lookups_have_their_own_counters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``dns_error`` counted every lookup that gave no answer, so a slow resolver (its
    answers taken late) looked like a broken one (no answer at all): lookups past their
    deadline are ``dns_timeout`` too (and still ``dns_error``), and a late answer taken
    is ``dns_late``."""
    monkeypatch.setattr(proxy.dns, "LOOKUP_TIMEOUT_S", 0.05)
    asyncio.run(_late_counters_case())


async def _late_counters_case() -> None:
    release = threading.Event()
    answer: list[list[str] | Exception] = [["127.0.0.9"]]

    def slow(name: str) -> list[str]:
        release.wait(30)
        out = answer[0]
        if isinstance(out, Exception):
            raise out
        return list(out)

    cfg = ProxyConfig(
        prefill=("http://127.0.0.1:1",), decode_dns=("svc:1",), health_interval=3600,
        discovery_interval=3600, health_timeout=0.5,
    )  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(release.set)  # a failed test leaves no thread waiting
        app, client = await stack.enter_async_context(proxy_app(cfg, slow))

        async def events() -> dict[str, float]:
            text = (await client.get("/metrics")).text
            prefix = 'pdproxy_discovery_events_total{event="'
            return {
                line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(prefix)
            }

        # Start-up's lookup passed its deadline; the next refresh finds it still running.
        await app.state.discovery.run_once()
        seen = await events()
        assert (seen["dns_error"], seen["dns_timeout"], seen["dns_late"]) == (2, 2, 0), seen
        release.set()  # the lookup answers, late: its answer is taken
        await until(lambda: node_at(app, "http://127.0.0.9:1") is not None, "the late answer")
        seen = await events()
        assert (seen["dns_error"], seen["dns_timeout"], seen["dns_late"]) == (2, 2, 1), seen
        answer[0] = OSError("Temporary failure in name resolution")  # fails in time
        await app.state.discovery.run_once()
        seen = await events()
        assert (seen["dns_error"], seen["dns_timeout"], seen["dns_late"]) == (3, 2, 1), seen
