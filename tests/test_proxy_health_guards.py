"""A node the proxy health-checks or discovers cannot hold the proxy up (found by a review
of discovery: a registered node, or any address a DNS name lists, is not trusted).

Real sockets: each misbehaving node is a small asyncio server on a loopback port.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from standin_http import StandIn, answer, node_facts

import proxy.dns as dns_module
from proxy.discovery import Membership
from proxy.dns import DnsDiscovery
from proxy.health import MAX_HEALTH_BODY_BYTES, HealthChecker
from proxy.node_client import NodeClient
from proxy.nodes import Node, NodePool

KV_INFO = {"engine_id": "e", "incarnation": "i", "side_channel": "tcp://127.0.0.1:1"}


@asynccontextmanager
async def trickling_node() -> AsyncIterator[tuple[str, list[int]]]:
    """Answers any request with a 1 MB body it sends one byte every 0.1 s; counts the
    connections still open."""
    open_conns = [0]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        open_conns[0] += 1
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
            while True:
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.1)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            open_conns[0] -= 1
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", open_conns
    finally:
        server.close()


def test_a_node_that_trickles_its_health_answer_cannot_hold_up_a_round():
    """Each read had a timeout, the check none: a node sending a byte every 0.1 s kept its
    check -- and with it the round, which gathers every node's -- running for ever."""

    async def main() -> None:
        async with trickling_node() as (url, _), NodeClient(timeout=0.5) as client:
            pool = NodePool((url,), ())
            checker = HealthChecker(pool, client, interval=1.0)
            await asyncio.wait_for(checker.check_all(), 10)  # hung before
            node = pool.prefill[0]
            assert not node.healthy and "no health answer within 0.5 s" in (node.last_error or "")

    asyncio.run(main())


def test_a_node_leaving_cancels_its_join_time_check():
    """The check started when a node joined ran on after the node left (and held one of the
    health client's connections while it did)."""

    async def main() -> None:
        started = asyncio.Event()

        async def stuck_check(node: Node) -> None:
            started.set()
            await asyncio.Event().wait()

        members = Membership(NodePool((), ()))
        members.checker = stuck_check
        members.add("decode", "http://127.0.0.1:9", "registered")
        await started.wait()
        (task,) = members._checks.values()
        assert members.drop("http://127.0.0.1:9", "registered")
        await asyncio.sleep(0)
        assert task.cancelled() and not members._checks

    asyncio.run(main())


def test_a_node_leaving_closes_its_idle_connections():
    """Idle keep-alive connections were dropped only when the same address was called
    again: every node that left (each pod of a rollout) kept its sockets for good."""

    async def main() -> None:
        async def ok(req):  # noqa: ANN001, ANN202
            return answer(200, {"ok": True})

        async with StandIn(ok) as node, NodeClient(timeout=5) as client:
            pool = NodePool((), ())
            members = Membership(pool)
            members.on_removed = lambda n: client.forget(n.url)
            members.add("decode", node.url, "registered")
            assert (await client.get(node.url + "/health")).status_code == 200
            assert sum(len(c) for c in client._idle.values()) == 1
            members.drop(node.url, "registered")
            assert not client._idle

    asyncio.run(main())


def test_node_facts_are_read_up_to_a_bound():
    """A node's /v1/models of any size was read whole (256 MiB) and parsed on the event
    loop, every round while the node was not ready."""

    async def main() -> None:
        big = {"data": [{"id": "m", "max_model_len": 64, "pad": "x" * (2 * MAX_HEALTH_BODY_BYTES)}]}

        async def handler(req):  # noqa: ANN001, ANN202
            if req.path == "/v1/models":
                return answer(200, big)
            return answer(200, KV_INFO if req.path == "/v1/kv_transfer_info" else {})

        async with (
            StandIn(handler) as node,
            NodeClient(timeout=5, max_body_bytes=MAX_HEALTH_BODY_BYTES) as client,
        ):
            pool = NodePool((node.url,), ())
            await HealthChecker(pool, client, interval=1.0).check_all()
            n = pool.prefill[0]
            assert not n.healthy and "facts unavailable" in (n.last_error or "")

    asyncio.run(main())


@pytest.mark.parametrize("bad", [True, 1, -5, "4096"])
def test_a_nodes_context_length_must_be_a_real_one(bad):
    """``max_model_len: true`` was taken as 1, and any node's -- even one not ready --
    became every client's limit (400 context_length_exceeded for every request)."""
    pool = NodePool(("http://127.0.0.1:1",), ("http://127.0.0.1:2",))
    p, d = pool.prefill[0], pool.decode[0]
    p.update_info(KV_INFO, {"data": [{"id": "m", "max_model_len": bad}]})
    assert p.max_model_len is None
    p.update_info(None, {"data": [{"id": "m", "max_model_len": 8}]})
    d.update_info(None, {"data": [{"id": "m", "max_model_len": 4096}]})
    assert pool.max_model_len() is None  # d is not ready: it sets no limit
    d.set_healthy(True)
    p.set_healthy(True)
    assert pool.max_model_len() == 4096  # a prefill node's context bounds the prompt only
    d.update_info(None, {"data": [{"id": "m", "max_model_len": 8}]})
    assert pool.max_model_len() == 8


def test_a_hung_dns_lookup_ends_at_its_deadline_and_is_not_started_twice(monkeypatch):
    monkeypatch.setattr(dns_module, "LOOKUP_TIMEOUT_S", 0.2)
    release = threading.Event()
    calls: list[str] = []

    def hung(name: str) -> list[str]:
        calls.append(name)
        release.wait(30)
        return ["10.0.0.1"]

    async def main() -> None:
        members = Membership(NodePool((), ()))
        dns = DnsDiscovery(members, [("decode", "svc", 8200)], hung)
        await asyncio.wait_for(dns.refresh(), 10)  # waited as long as the resolver did
        await asyncio.wait_for(dns.refresh(), 10)
        assert calls == ["svc"] and members.events["dns_error"] == 2
        release.set()
        for _ in range(100):  # once the first lookup's thread is done, a new one starts
            await dns.refresh()
            if len(calls) == 2:
                break
            await asyncio.sleep(0.1)
        assert calls == ["svc", "svc"]

    asyncio.run(main())


def test_a_dns_name_lists_a_bounded_number_of_nodes(monkeypatch):
    monkeypatch.setattr(dns_module, "MAX_NODES_PER_NAME", 3)
    pool = NodePool((), ())
    dns = DnsDiscovery(
        Membership(pool), [("decode", "svc", 8200)], lambda n: [f"10.0.0.{i}" for i in range(9)]
    )
    asyncio.run(dns.refresh())
    assert len(pool.decode) == 3


def test_models_are_what_ready_nodes_serve():
    pool = NodePool(("http://127.0.0.1:1",), ("http://127.0.0.1:2",))
    pool.prefill[0].update_info(None, {"data": [{"id": "other"}]})  # registered, not ready
    pool.decode[0].update_info(None, {"data": [{"id": "m"}]})
    pool.decode[0].set_healthy(True)
    assert pool.model_names() == ["m"]


def test_the_context_limit_clients_see_is_the_ready_decode_nodes():
    """A fault round: ``/v1/models``' ``max_model_len`` was the least of every decode node
    in the pool serving the name, ready or not -- a node registered in the wrong role (a
    prefill node with a shorter context), one that failed its checks, or any registered
    URL answering ``max_model_len: 2`` set the limit clients were told, while the proxy
    itself checked requests against the ready nodes' (``NodePool.max_model_len``)."""
    from starlette.testclient import TestClient

    from proxy.app import build_app
    from proxy.config import ProxyConfig

    ready, misfit = "http://127.0.0.1:2", "http://127.0.0.1:3"
    app = build_app(ProxyConfig(prefill=("http://127.0.0.1:1",), decode=(ready, misfit)))
    pool = app.state.pool
    for node, mml in zip(pool.decode, (4096, 2), strict=True):
        node.update_info({"role": "consumer"}, {"data": [{"id": "m", "max_model_len": mml}]})
    pool.decode[0].set_healthy(True)  # the other one failed its check: not ready
    (card,) = TestClient(app).get("/v1/models").json()["data"]
    assert (card["id"], card["max_model_len"]) == ("m", 4096) == ("m", pool.max_model_len())


def test_checks_without_an_answer_are_counted_in_a_row_and_a_late_answer_ends_the_row():
    """The proxy gives a hung decode node up after ``--unreachable-checks`` checks in a
    row without an answer (``Attempt.d_gone``). Each miss counts (with two calls still
    unanswered a check sends no third); an answer that comes after its check gave up
    still shows the node alive and ends the row (a load round saw two missed 0.05 s
    checks take healthy nodes for hung ones); any answer, even a 503, does."""
    calls = []

    async def node(req):
        calls.append(req.path)
        if len(calls) <= 2:
            await asyncio.sleep(0.6)  # past the check's 0.2 s: a late answer
        return answer(503, {"error": {"message": "draining"}})

    async def main() -> None:
        async with StandIn(node) as d, NodeClient(timeout=0.2) as client:
            pool = NodePool((), (d.url,))
            checker = HealthChecker(pool, client, interval=1.0)
            n = pool.decode[0]
            began = time.monotonic()
            for _ in range(3):  # the first two calls are still unanswered: no third
                await checker.check_node(n)
            assert n.unreachable and n.unreachable_checks == 3
            assert calls == ["/health", "/health"]
            assert began <= n.unreachable_since < began + 0.2  # when the first check began
            for _ in range(100):  # the late answer comes (after ~0.6 s)
                if not n.unreachable:
                    break
                await asyncio.sleep(0.1)
            assert not n.unreachable and n.unreachable_checks == 0
            assert n.unreachable_since is None
            await checker.check_node(n)  # answered 503: reachable, not ready
            assert not n.unreachable and n.unreachable_checks == 0 and not n.healthy
            await checker.stop()

    asyncio.run(main())


def test_a_node_that_never_answers_is_counted_missing_check_after_check():
    async def node(req):
        await asyncio.sleep(30)

    async def main() -> None:
        async with StandIn(node) as d, NodeClient(timeout=0.1) as client:
            pool = NodePool((), (d.url,))
            checker = HealthChecker(pool, client, interval=1.0)
            n = pool.decode[0]
            for _ in range(3):
                await checker.check_node(n)
            assert n.unreachable_checks == 3 and len(d.seen) == 2  # two calls at most
            await checker.stop()

    asyncio.run(main())


def test_a_node_that_answers_as_a_proxy_is_not_routed_to():
    """A registration (or a DNS name, or a flag) naming a proxy -- this proxy's own URL,
    say -- gave a "node" that passed every health round (a decode node need not have
    /v1/kv_transfer_info); each request routed to it was refused and took it out until
    the next round put it back (found by a hostile-input round)."""

    async def main() -> None:
        from proxy.health import PROXY_HEADER

        async def handler(req):  # noqa: ANN001, ANN202
            if req.path == "/health":
                return answer(200, {"status": "ok"}, {PROXY_HEADER: "1"})
            if req.path == "/v1/models":
                return answer(200, {"data": [{"id": "m", "max_model_len": 64}]})
            return answer(404, {"error": {"message": "no"}})

        async with StandIn(handler) as node, NodeClient(timeout=5) as client:
            pool = NodePool((), (node.url,))
            await HealthChecker(pool, client, interval=1.0).check_all()
            d = pool.decode[0]
            assert not d.healthy and "a pd-proxy" in (d.last_error or "")

    asyncio.run(main())


def test_nodes_that_left_do_not_keep_the_health_clients_connections():
    """A fault round: a registration key's holder registered URLs that accept a connection
    and never answer, deregistered them, and registered others. Each one's /health call
    ran on for ``LATE_ANSWER_S`` (30 s) after its node left, holding one of the health
    client's connections; three rounds of 249 used them all, and the real nodes' checks
    waited for a connection past their deadline: every node out of rotation, the proxy
    503 for half a minute. A node that leaves (with no request on it) has its call
    cancelled."""
    hung: list[str] = []

    async def never(req):  # noqa: ANN001, ANN202
        hung.append(req.path)
        await asyncio.sleep(60)

    async def node(req):  # noqa: ANN001, ANN202
        if req.path == "/v1/models":
            return answer(200, {"data": [{"id": "m"}]})
        return answer(200, {**KV_INFO, "role": "consumer"} if "kv" in req.path else {})

    async def main() -> None:
        async with (
            StandIn(never) as bad1,
            StandIn(never) as bad2,
            StandIn(node) as good,
            NodeClient(timeout=0.5, max_connections=2) as client,
        ):
            pool = NodePool((), (good.url,))
            checker = HealthChecker(pool, client, interval=1.0)
            members = Membership(pool)
            members.checker = checker.check_node
            members.on_removed = checker.forget
            for bad in (bad1, bad2):
                members.add("decode", bad.url, "registered")
            for _ in range(100):  # both calls sent, each on a connection of its own
                if len(hung) == 2:
                    break
                await asyncio.sleep(0.05)
            for bad in (bad1, bad2):
                assert members.drop(bad.url, "registered")
            await checker.check_node(pool.decode[0])
            assert pool.decode[0].ready, pool.decode[0].last_error
            assert client.in_flight == 0
            await checker.stop()

    asyncio.run(main())


def test_the_health_client_has_a_connection_for_every_node_dns_may_list():
    """Its connections were sized for the static and registered nodes only: two DNS names
    of 256 addresses each outnumbered them, and the checks of the nodes past the count
    waited for a connection past their deadline."""
    from proxy.app import health_client_connections
    from proxy.config import ProxyConfig

    cfg = ProxyConfig(prefill=("http://10.0.0.1:8100",), decode=(), decode_dns=("a:8200", "b:8200"))
    assert health_client_connections(cfg) >= 1 + 2 * dns_module.MAX_NODES_PER_NAME + (
        cfg.max_registered_nodes
    )


class Scripted:
    """A node whose ``/health`` answers (``mode`` "ok"), or is held (``hang``) until the
    test ends; ``delay``: seconds each answer takes."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.delay = 0.0
        self.held = 0  # /health calls held now
        self.arrived = asyncio.Event()  # a held call arrived
        self.gate = asyncio.Event()

    async def __call__(self, req):  # noqa: ANN001, ANN204
        if req.path == "/health" and self.mode == "hang":
            self.held += 1
            self.arrived.set()
            await self.gate.wait()
            self.held -= 1
        await asyncio.sleep(self.delay)
        return node_facts(req, "consumer")


def test_a_recovered_node_is_routed_to_on_its_next_good_check_while_a_hung_call_runs():
    """A node whose ``/health`` call hung (one stuck connection, a node paused for a while)
    and that answers again is back in rotation at its next check, while that call still
    hangs. Before, a check sent no call while the node's previous one was unanswered: the
    node stayed out until the hung call ended (``LATE_ANSWER_S``, 30 s, or the TCP call's
    end). Calls per node stay bounded: with two unanswered, a check counts a miss and sends
    none."""

    async def main() -> None:
        script = Scripted()
        async with StandIn(script) as d, NodeClient(timeout=1.0) as client:
            pool = NodePool((), (d.url,))
            checker = HealthChecker(pool, client, interval=1.0)
            n = pool.decode[0]
            await checker.check_node(n)
            assert n.ready, n.last_error
            script.mode = "hang"
            await checker.check_node(n)  # its call hangs: out at the check's deadline
            assert not n.ready and n.unreachable and script.held == 1
            script.mode = "ok"
            await checker.check_node(n)  # answers again: back, the hung call still held
            assert n.ready and not n.unreachable, n.last_error
            assert script.held == 1
            script.mode = "hang"
            for misses in (1, 2, 3):
                await checker.check_node(n)
                assert n.unreachable_checks == misses and not n.ready
            assert script.held == 2  # the third check sent no call: two were out
            script.gate.set()
            await checker.stop()

    asyncio.run(main())


def test_a_check_ends_at_the_health_timeout_facts_included():
    """A node's check, the facts it fetches after ``/health`` included, has one deadline:
    ``--health-timeout``. Before it was three timeouts (one per call): a node whose
    ``/health``, ``/v1/kv_transfer_info`` and ``/v1/models`` each took half the timeout
    passed its check, and a round lasted up to ~3x the timeout."""

    async def main() -> None:
        script = Scripted()
        script.delay = 1.0  # each of its three answers: within the timeout, not all three
        async with StandIn(script) as d, NodeClient(timeout=2.0) as client:
            pool = NodePool((), (d.url,))
            checker = HealthChecker(pool, client, interval=1.0)
            n = pool.decode[0]
            await checker.check_all()
            assert not n.ready
            assert "within 2 s" in (n.last_error or ""), n.last_error
            assert not n.unreachable  # it answered /health: not a hung node
            script.delay = 0.0
            await checker.check_all()
            assert n.ready, n.last_error
            await checker.stop()

    asyncio.run(main())


def test_a_hung_node_delays_no_other_nodes_checks():
    """Each node is checked every ``--health-interval`` on its own: while one node's check
    waits for its hung ``/health`` (up to the timeout), another node that stops answering
    200 is taken out of rotation at its next check. Before, the checks ran in rounds that
    waited for every node's check: the other node's next check came only after the hung
    one's ended (so with the default 1 s interval and 2 s timeout, every node was checked
    every 3 s while any node hung)."""

    async def main() -> None:
        hung = Scripted()
        answered_while_hung = [0]

        async def other(req):  # noqa: ANN001, ANN202
            if req.path == "/health" and hung.held:
                answered_while_hung[0] += 1
                if answered_while_hung[0] > 1:  # the first may be of a's round: 200
                    return answer(503, {"status": "draining"})
            return node_facts(req, "consumer")

        async with (
            StandIn(hung) as a,
            StandIn(other) as b,
            NodeClient(timeout=10.0) as client,
        ):
            pool = NodePool((), (a.url, b.url))
            node_a, node_b = pool.decode
            checker = HealthChecker(pool, client, interval=0.05)
            checker.start()
            await checker.wait_first_round(30)
            assert node_a.ready and node_b.ready
            hung.mode = "hang"
            async with asyncio.timeout(30):
                while node_b.ready:
                    await asyncio.sleep(0.005)
            # b went out while a's check still waited for its call (a 10 s deadline)
            assert hung.held == 1
            assert not node_a.unreachable and node_a.ready, node_a.last_error
            hung.gate.set()
            await checker.stop()

    asyncio.run(main())
