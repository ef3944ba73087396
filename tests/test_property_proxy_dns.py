"""Property test (hypothesis) of DNS discovery under requests: decode nodes found through a
name (stand-ins at ``127.0.0.2``-``127.0.0.4``, one port: ``tests/proxy_churn_nodes.py``)
whose answers change from one refresh to the next -- addresses added, removed, listed twice,
the same one back; the lookup failing (an OSError), timing out, or the name gone
(NXDOMAIN) -- while requests are in flight on the nodes (held until a drawn later step or
the end; some clients leave while held) and each node's ``/health`` answers, answers 503 or
hangs, per step. Each step: requests sent, the answer set, a refresh, the join-time checks
awaited, a health round, some held requests let go.

Asserted (docs/proxy.md, "Discovery" and "Failures"):

* the pool is what the last answer listed: a failed or timed-out lookup keeps the nodes,
  NXDOMAIN lists none;
* after each round a node is in rotation exactly when its check passed (a node whose
  ``/health`` hung is back at its next check that answers, while the hung call waits; with
  two calls hung, a check sends no third and the node stays out: two calls per node);
* a completion reaches a node only while that node is in rotation (a node that just
  joined gets none before its check passed);
* every request ends: 200, or 503 ``no_healthy_nodes`` when no node was in rotation --
  never a 5xx of the proxy's own; a client that left gets its held leg aborted on the node
  that held it (and on no other);
* once everything ended, every in-flight count (nodes watched, ``/health``, metrics) is 0.

Derandomized, fixed examples: ``CI_EXAMPLES`` in CI; ``PDSERVE_PROXY_EXAMPLES=N``
multiplies them (a hunt: ``PDSERVE_PROXY_EXAMPLES=20 pytest tests/test_property_proxy_dns.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fakes import example_scale, fixed_examples, hunt_timeout
from hypothesis import Phase, given, note, settings
from hypothesis import strategies as st

import proxy.dns
from proxy.config import ProxyConfig
from proxy.dns import DnsDiscovery
from proxy.health import MAX_CALLS_PER_NODE
from proxy.nodes import Node
from tests.proxy_churn_nodes import (
    BODY,
    HostStandIn,
    Resolver,
    Script,
    aborts,
    handler,
    in_flight_settled,
    metric,
    node_at,
    proxy_app,
    until,
)
from tests.standin_http import StandIn

SCALE = example_scale("PDSERVE_PROXY_EXAMPLES")
CI_EXAMPLES = 12
ADDRS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
FAILURES = ("error", "hang", "nxdomain")
pytestmark = hunt_timeout(SCALE, 60 + 5 * CI_EXAMPLES)  # (a hunt takes longer)


@dataclass(frozen=True)
class Req:
    hold: int  # steps it stays held on its node (0: answered at once; 9: until the end)
    leaves: bool  # its client leaves while it is held
    stream: bool


@dataclass(frozen=True)
class Step:
    answer: tuple[str, ...] | str  # addresses (in order, maybe twice), or a failure
    health: tuple[str, ...]  # each address's /health this step: "ok", "503", "hang"
    requests: tuple[Req, ...]


reqs = st.builds(Req, st.sampled_from([0, 1, 2, 9]), st.booleans(), st.booleans())
answers = st.one_of(
    st.lists(st.sampled_from(ADDRS), max_size=4).map(tuple),
    st.sampled_from(FAILURES),
)
healths = st.tuples(*[st.sampled_from(["ok", "ok", "503", "hang"]) for _ in ADDRS])
steps = st.lists(
    st.builds(Step, answers, healths, st.lists(reqs, max_size=2).map(tuple)),
    min_size=2,
    max_size=5,
)


@settings(fixed_examples(CI_EXAMPLES * SCALE), phases=[Phase.explicit, Phase.generate])
@given(steps)
def test_dns_answers_change_under_requests(drawn: list[Step]) -> None:
    note(repr(drawn))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(proxy.dns, "LOOKUP_TIMEOUT_S", 0.05)
        asyncio.run(run(drawn))


@dataclass
class Sent:
    rid: str
    req: Req
    step: int
    task: asyncio.Future[httpx.Response]
    ready_at_launch: bool
    left: bool = False  # its client left (its task cancelled)


async def run(drawn: list[Step]) -> None:
    resolver = Resolver()
    scripts = [Script() for _ in ADDRS]
    wrong: list[str] = []  # completions that reached a node out of rotation
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(StandIn(handler("producer", Script())))
        ds: list[HostStandIn] = []
        for addr, script in zip(ADDRS, scripts, strict=True):
            port = ds[0].port if ds else 0
            ds.append(await stack.enter_async_context(
                HostStandIn(handler("consumer", script), addr, port)))  # fmt: skip
        cfg = ProxyConfig(prefill=(p.url,), decode_dns=(f"svc:{ds[0].port}",),
                          health_interval=3600, discovery_interval=3600, health_timeout=0.3)  # fmt: skip
        app, client = await stack.enter_async_context(proxy_app(cfg, resolver))
        pool = app.state.pool
        dns: DnsDiscovery = app.state.discovery.jobs[0][0].__self__
        for d, script in zip(ds, scripts, strict=True):

            def arrived(tid: str, url: str = d.url) -> None:
                node = node_at(app, url)
                if node is None or not node.ready:
                    wrong.append(f"{tid} reached {url} out of rotation")

            script.arrived = arrived

        listed: set[str] = set()
        hung: dict[int, int] = {}  # id() of a Node -> its /health calls that hung
        nodes_seen: list[Node] = []  # (kept alive: their ids stay theirs)
        sent: list[Sent] = []
        for k, step in enumerate(drawn):
            for script, health in zip(scripts, step.health, strict=True):
                script.health = health
            for j, r in enumerate(step.requests):  # sent, then held or answered
                rid = f"rq{k}{j}"
                if r.hold:
                    for script in scripts:
                        script.hold_ids.add(rid)
                body = {**BODY, "stream": r.stream}
                task = asyncio.ensure_future(
                    client.post("/v1/completions", json=body, headers={"X-Request-Id": rid}))  # fmt: skip
                sent.append(Sent(rid, r, k, task, bool(pool.ready("decode"))))
            await until(lambda: all(s.task.done() or held_on(scripts, s.rid) is not None
                                    for s in sent if s.step == k), "requests held or done")  # noqa: B023  # fmt: skip

            resolver.answer = resolved(step.answer)
            await dns.refresh()
            if step.answer == "hang":
                resolver.release.set()
                await until(lambda: all(f.done() for f in dns._running.values()), "lookup")
                resolver.release = __import__("threading").Event()
            if isinstance(step.answer, tuple):
                listed = {d.url for d, a in zip(ds, ADDRS, strict=True) if a in step.answer}
            elif step.answer == "nxdomain":
                listed = set()
            assert {n.url for n in pool.decode} == listed, (k, step.answer)
            await asyncio.gather(*dns.members._checks.values(), return_exceptions=True)
            await app.state.health.check_all()
            for n in pool.decode:
                health = step.health[[d.url for d in ds].index(n.url)]
                joined = all(n is not seen for seen in nodes_seen)  # checked at join too
                nodes_seen.append(n)
                expect = False
                for _ in range(2 if joined else 1):
                    if hung.get(id(n), 0) >= MAX_CALLS_PER_NODE:
                        expect = False  # no call sent: a miss
                    elif health == "hang":
                        hung[id(n)] = hung.get(id(n), 0) + 1
                        expect = False
                    else:
                        expect = health == "ok"
                assert n.ready == expect, (k, n.url, health, n.last_error)

            for s in sent:  # clients leave; held requests let go
                where = held_on(scripts, s.rid)
                if where is None or s.task.done():
                    continue
                if s.req.leaves:
                    s.task.cancel()
                    s.left = True
                    tid = where[1]
                    d = ds[scripts.index(where[0])]
                    await until(lambda: tid in [a.get("transfer_id") for a in aborts(d)], "abort")  # noqa: B023
                    for other in ds:
                        if other is not d:
                            assert tid not in [a.get("transfer_id") for a in aborts(other)]
                elif s.req.hold <= k - s.step + 1:
                    where[0].gates[where[1]].set()
            await until(lambda: counted(app, ds, scripts, sent), "in-flight counts")

        for script in scripts:
            script.release_all()
        for s in sent:
            try:
                async with asyncio.timeout(10):
                    resp = await s.task
            except asyncio.CancelledError:
                assert s.left, s
                continue
            if s.left and resp.status_code == 499:  # the transport answered for the app
                continue
            assert resp.status_code in (200, 503), (s, resp.text)
            if resp.status_code == 503:
                assert "no_healthy_nodes" in resp.text and not s.ready_at_launch, resp.text
        assert wrong == []
        await until(lambda: all(n.outstanding == 0 for n in pool.watched()), "all ended")
        await app.state.health.check_all()
        in_flight_settled(app)
        text = (await client.get("/metrics")).text
        for d in ds:
            assert metric(text, "pdproxy_node_outstanding_requests", d.url) in (None, 0.0)
        assert '"outstanding":-' not in (await client.get("/health")).text.replace(" ", "")


def counted(app: Any, ds: list[HostStandIn], scripts: list[Script], sent: list[Sent]) -> bool:
    """Each address's in-flight count in the proxy (its node in the pool, else the one
    that left) is that of the requests held on it whose clients still wait, once the
    requests let go ended; never below 0."""
    if not all(s.task.done() for s in sent if held_on(scripts, s.rid) is None):
        return False
    by_url = {n.url: n.in_flight for n in [*app.state.pool.leaving(), *app.state.pool.decode]}
    for d, script in zip(ds, scripts, strict=True):
        held = [
            s
            for s in sent
            if not s.task.done() and (held_on(scripts, s.rid) or [None])[0] is script
        ]
        assert by_url.get(d.url, 0) >= 0, (d.url, by_url)
        if by_url.get(d.url, 0) != len(held):
            return False
    return True


def held_on(scripts: list[Script], rid: str) -> tuple[Script, str] | None:
    """The script holding request ``rid``'s completion now, and its transfer id."""
    for script in scripts:
        for tid, gate in script.gates.items():
            if tid.startswith(rid + "-") and not gate.is_set():
                return script, tid
    return None


def resolved(answer: tuple[str, ...] | str) -> Any:
    if isinstance(answer, tuple):
        return list(answer)
    if answer == "error":
        return OSError("no DNS server")
    if answer == "nxdomain":
        return proxy.dns.NameNotFound("svc: not found")
    return "hang"
