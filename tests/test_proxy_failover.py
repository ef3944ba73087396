"""Node failures behind the proxy: a decode node SIGKILLed mid-stream and before its first token.

One prefill and two decode nodes (real processes, NIXL), and proxies in front of them:
``fast`` polls health every 0.5 s; ``slow_*`` poll once a minute, so they still believe a
killed node is healthy and route to it, which exercises the retry on another pair.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from harness import (
    GREEDY,
    PD,
    Proc,
    Procs,
    kv_pool_full,
    metric,
    procs_in,
    sse_data,
    sse_events,
    stream_ids,
    wait_for,
    wait_healthy,
)

pytestmark = pytest.mark.slow


class Setup:
    def __init__(self, procs: Procs) -> None:
        self.procs = procs
        pd = procs.pd(1, 2, "--num-blocks", "256")
        self.p, self.d = pd.p, pd.decode
        self.fast = self.proxy("fast")
        # The slow proxies check their nodes once, at start (a round later in the module
        # would see the nodes these tests kill or stop: an hour never comes here).
        self.slow_stream = self.proxy("slow-stream", "--health-interval", "3600")
        self.slow_plain = self.proxy("slow-plain", "--health-interval", "3600")
        wait_healthy(self.fast, self.slow_stream, self.slow_plain, timeout=60)
        self.killed: Proc | None = None

    def killed_node(self) -> Proc:
        """The decode node the first test killed; killed here (SIGKILL, once ``fast`` saw
        it down) when that test did not run in this process (xdist's default ``--dist
        load`` hands a module's tests to both workers, each with its own ``setup``; or the
        test was picked alone). The slow proxies still believe it healthy either way."""
        if self.killed is None:
            victim = self.killed = self.d[0]
            victim.kill9()
            wait_for(lambda: not _decode_health(self.fast)[victim.url]["healthy"], 10, "down")
        return self.killed

    def proxy(self, name: str, *extra: str) -> Proc:
        urls = [d.url for d in self.d]
        # The default --health-timeout: these tests time hang detection by it.
        args = ("--health-timeout", "2", *extra)
        return self.procs.proxy([self.p.url], urls, *args, name=name, wait=False)


@pytest.fixture(scope="module")
def setup(module_procs: Procs) -> Setup:
    return Setup(module_procs)


BODY = {"prompt": "The quick brown fox", "max_tokens": 8, **GREEDY}


def _decode_health(proxy: Proc) -> dict[str, dict]:
    return {n["url"]: n for n in httpx.get(proxy.url + "/health", timeout=5).json()["decode"]}


def _stream_broken_by(
    setup: Setup, fault: Callable[[Proc], None], after: Callable[[Proc], None] = lambda d: None
) -> tuple[Proc, list]:
    """A long stream through ``fast``: ``fault`` hits its decode node once tokens flow
    (``after`` runs once the stream ended); the stream must end with one error event and
    [DONE] after some tokens. Returns the node and the events before [DONE]."""
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True, **GREEDY}
    with httpx.stream("POST", setup.fast.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = [next(lines) for _ in range(6)]
        serving = [u for u, n in _decode_health(setup.fast).items() if n["outstanding"] == 1]
        assert len(serving) == 1, _decode_health(setup.fast)
        victim = next(d for d in setup.d if d.url == serving[0])
        fault(victim)
        try:
            rest = list(lines)  # a read timeout (60 s) fails the test
        finally:
            after(victim)
    events = sse_data(first + rest)
    assert events.pop() == "DONE"
    assert "error" in events[-1], events[-3:]
    assert all("error" not in e for e in events[:-1])
    assert stream_ids(events[:-1]), "some tokens arrived before the failure"
    return victim, events


def test_decode_killed_mid_stream_gets_error_event(setup: Setup) -> None:
    ref = httpx.post(setup.fast.url + "/v1/completions", json=BODY, timeout=60)
    assert ref.status_code == 200, ref.text
    victim, events = _stream_broken_by(setup, lambda d: d.kill9())
    setup.killed = victim
    assert not any(e.get("choices", [{}])[0].get("finish_reason") for e in events[:-1])
    # The dead node leaves the rotation once its health check fails ...
    wait_for(lambda: not _decode_health(setup.fast)[victim.url]["healthy"], 10, "health check")
    routed = metric(setup.fast.url, "pdproxy_node_requests_total", {"url": victim.url})
    # ... and the proxy keeps serving with the remaining nodes.
    for _ in range(4):
        out = httpx.post(setup.fast.url + "/v1/completions", json=BODY, timeout=60)
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["token_ids"] == ref.json()["choices"][0]["token_ids"]
    assert metric(setup.fast.url, "pdproxy_node_requests_total", {"url": victim.url}) == routed
    assert httpx.get(setup.fast.url + "/health").status_code == 200


def _retries(proxy: Proc) -> float:
    return metric(proxy.url, "pdproxy_request_retries_total", {"role": "decode"})


def test_dead_decode_before_first_token_is_retried(setup: Setup) -> None:
    victim = setup.killed_node()
    ref = httpx.post(setup.fast.url + "/v1/completions", json=BODY, timeout=60).json()
    ref_ids = ref["choices"][0]["token_ids"]
    # The slow proxies still route to the dead node (their last health check passed):
    # round-robin ties send one of the first two requests there; it is retried.
    for _ in range(3):
        with httpx.stream(
            "POST", setup.slow_stream.url + "/v1/completions",
            json={**BODY, "stream": True}, timeout=60,
        ) as resp:  # fmt: skip
            assert resp.status_code == 200
            events = sse_events(resp)
        assert events[-1] == "DONE" and all("error" not in e for e in events[:-1]), events
        assert stream_ids(events[:-1]) == ref_ids
        resp = httpx.post(setup.slow_plain.url + "/v1/completions", json=BODY, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == ref_ids
    for proxy in (setup.slow_stream, setup.slow_plain):
        assert _retries(proxy) >= 1
        assert metric(proxy.url, "pdproxy_node_failures_total", {"url": victim.url}) >= 1
        # Taken out at the first failure: nothing else went there.
        assert metric(proxy.url, "pdproxy_node_requests_total", {"url": victim.url}) == 1
        assert not _decode_health(proxy)[victim.url]["healthy"]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_stream_whose_prefill_node_hangs_is_answered_by_the_decode_node(setup: Setup) -> None:
    """P stops answering (SIGSTOP: its process hangs, its connections stay open). A
    pre-streamed request waited for P's first token until the request timeout (600 s),
    with the proxy at 100% CPU, although D recomputed the prompt within seconds and had
    the whole answer. Now the proxy streams D's answer: ``slow_stream`` (P still healthy
    to it) once D's first token comes before P's; ``fast`` once P's health check
    got no answer."""
    ref = httpx.post(setup.fast.url + "/v1/completions", json=BODY, timeout=60).json()
    ref_ids = ref["choices"][0]["token_ids"]
    proxies = (setup.slow_stream, setup.fast)
    results: dict[str, list] = {}

    def stream(proxy: Proc) -> None:
        body = {**BODY, "stream": True}
        with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=90) as r:
            results[proxy.name] = [r.status_code, sse_events(r)]

    os.kill(setup.p.pid, signal.SIGSTOP)
    try:
        cpu = {p.name: _cpu_s(p.pid) for p in proxies}
        wall = time.monotonic()
        threads = [threading.Thread(target=stream, args=(p,)) for p in proxies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        wall = time.monotonic() - wall
        used = {p.name: _cpu_s(p.pid) - cpu[p.name] for p in proxies}
    finally:
        os.kill(setup.p.pid, signal.SIGCONT)
    for proxy in proxies:
        status, events = results[proxy.name]
        assert status == 200 and events[-1] == "DONE", (proxy.name, events[-3:])
        assert all("error" not in e for e in events[:-1]), (proxy.name, events)
        assert stream_ids(events[:-1]) == ref_ids, proxy.name
        # Waiting is sleeping: a spinning proxy uses a whole core for the whole wait.
        assert used[proxy.name] < 0.25 * wall, (proxy.name, used, wall)
    assert "came before the prefill answer" in setup.slow_stream.logs(20000)
    assert "unreachable before its first token" in setup.fast.logs(20000)
    for d in setup.d:
        if d is not setup.killed:
            wait_for(lambda d=d: kv_pool_full(d.url), 30, "decode pool free")
    wait_healthy(setup.p, timeout=30)
    wait_for(lambda: kv_pool_full(setup.p.url), 60, "prefill pool free")
    # Back in ``fast``'s rotation too (its next health check): the next test streams there.
    wait_for(lambda: _prefill_ready(setup.fast), 30, "the prefill node back in rotation")


def _prefill_ready(proxy: Proc) -> bool:
    return all(n["healthy"] for n in httpx.get(proxy.url + "/health", timeout=5).json()["prefill"])


def test_a_decode_node_that_hangs_mid_stream_ends_the_stream_with_an_error(setup: Setup) -> None:
    """D stops answering mid-stream (SIGSTOP: its connections stay open, no bytes come).
    The stream used to wait for D's next bytes until the request timeout (600 s); now it
    ends with an error event once D's health checks got no answer three times in a row,
    and D, resumed, frees the request's blocks."""
    victim, events = _stream_broken_by(
        setup,
        lambda d: os.kill(d.pid, signal.SIGSTOP),
        after=lambda d: os.kill(d.pid, signal.SIGCONT),
    )
    assert "health checks in a row" in events[-1]["error"]["message"], events[-3:]
    wait_healthy(victim, timeout=30)
    wait_for(lambda: kv_pool_full(victim.url), 60, "decode pool free")
    wait_for(lambda: _decode_health(setup.fast)[victim.url]["healthy"], 30, "back in rotation")


def test_requests_whose_only_prefill_node_dies_are_answered_by_the_decode_node(
    setup: Setup,
) -> None:
    """P dies (SIGKILL) while requests wait for its answer, and no other P is ready. They
    used to get 503 (no pair left to retry on), while a hung P's requests were answered
    by D's recompute; now a dead P's are answered the same way, streamed or not. Last in
    the module: P stays dead."""
    ref = httpx.post(setup.slow_plain.url + "/v1/completions", json=BODY, timeout=60).json()
    ref_ids = ref["choices"][0]["token_ids"]
    results: dict[str, object] = {}

    def stream() -> None:
        body = {**BODY, "stream": True}
        with httpx.stream(
            "POST", setup.slow_stream.url + "/v1/completions", json=body, timeout=90
        ) as r:  # fmt: skip
            results["stream"] = (r.status_code, sse_events(r))

    def plain() -> None:
        r = httpx.post(setup.slow_plain.url + "/v1/completions", json=BODY, timeout=90)
        results["plain"] = (r.status_code, r.json())

    os.kill(setup.p.pid, signal.SIGSTOP)  # the legs reach P and wait there ...
    threads = [threading.Thread(target=f) for f in (stream, plain)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    setup.p.kill9()  # ... until it dies
    for t in threads:
        t.join(120)
    status, events = results["stream"]  # type: ignore[misc]
    assert status == 200 and events[-1] == "DONE", events[-3:]
    assert all("error" not in e for e in events[:-1]), events
    assert stream_ids(events[:-1]) == ref_ids
    status, body = results["plain"]  # type: ignore[misc]
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == ref_ids
    for proxy in (setup.slow_stream, setup.slow_plain):
        assert "no other prefill node is ready" in proxy.logs(20000), proxy.name


@pytest.fixture(scope="module")
def migration_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Procs, PD]]:
    """One prefill and three decode nodes for the migration tests (their own group: the
    module's ``setup`` loses nodes to its tests). Each test kills one decode node; its
    proxy is given two that are alive."""
    with procs_in(tmp_path_factory.mktemp("migration")) as procs:
        yield procs, procs.pd(1, 3, "--num-blocks", "256")


@pytest.mark.parametrize("route", ["pair", "decode-alone"])
def test_with_a_migration_limit_a_decode_node_killed_mid_stream_is_not_seen(
    migration_nodes: tuple[Procs, PD], route: str
) -> None:
    """``--migration-limit 1``: D is SIGKILLed after streaming some tokens; the stream
    moves to the other pair, which replays the answer (checked, not sent again), and the
    client gets every token once, equal to an answer nobody interrupted (seeded sampling).
    ``decode-alone``: the short prompt goes to a decode node alone
    (``--disagg-min-prompt-tokens``), D's stream is the whole answer; the request is
    unseeded, so the replay only agrees if the rerun samples with the failed transfer's
    seed (the node's ``transfer_seed``; else ``retry_diverged``)."""
    procs, pd = migration_nodes
    live = [d for d in pd.decode if d.proc.poll() is None][:2]
    assert len(live) == 2, [d.proc.poll() for d in pd.decode]
    urls = [d.url for d in live]
    alone = ("--disagg-min-prompt-tokens", "100000") if route == "decode-alone" else ()
    proxy = procs.proxy([pd.p.url], urls, "--migration-limit", "1", *alone, name=f"mig-{route}")
    transfers_before = metric(pd.p.url, "pdserve_engine_kv_transfers_started_total")
    body = {"prompt": "Once upon a time", "max_tokens": 160, "stream": True}
    body |= {"temperature": 0.9, "ignore_eos": True}
    if not alone:
        body["seed"] = 1234
        ref = httpx.post(proxy.url + "/v1/completions", json={**body, "stream": False}, timeout=120)
        assert ref.status_code == 200, ref.text
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = [next(lines) for _ in range(6)]
        serving = [u for u, n in _decode_health(proxy).items() if n["outstanding"] == 1]
        assert len(serving) == 1, _decode_health(proxy)
        victim = next(d for d in live if d.url == serving[0])
        victim.kill9()
        rest = list(lines)
    events = sse_data(first + rest)
    assert events.pop() == "DONE"
    assert all("error" not in e for e in events), events[-3:]
    assert len(stream_ids(events)) == 160
    if not alone:
        assert stream_ids(events) == ref.json()["choices"][0]["token_ids"]
    else:
        transfers = metric(pd.p.url, "pdserve_engine_kv_transfers_started_total")
        assert transfers == transfers_before  # D alone
    assert len(stream_ids(first_events := sse_data(first))) < 160, first_events  # cut mid-way
    assert metric(proxy.url, "pdproxy_stream_migrations_total", {"outcome": "resumed"}) == 1
