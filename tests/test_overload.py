"""Overload with real processes (tiny model): a node admits at most ``--max-num-seqs`` +
``--max-queued-requests`` generation requests; the next get 429 with ``Retry-After`` at
once while the admitted ones finish with the right tokens; the proxy moves a request off
an overloaded node without taking the node out of rotation, and passes the 429 on when
every node is overloaded; a node's resident memory stays flat across rounds of overload."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from harness import (
    GREEDY,
    PD,
    Proc,
    Procs,
    descendants,
    kv_pool_full,
    metric,
    node_idle,
    sse_data,
    sse_events,
    stream_ids,
    wait_for,
    wait_healthy,
)

pytestmark = pytest.mark.slow

# Two running, one waiting: the fourth generation request in flight is refused.
BOUNDED = ("--max-num-seqs", "2", "--max-queued-requests", "1", "--num-blocks", "256")
LIMIT = 3
# The memory test's node: 240 requests a round against a limit of 8.
MEMORY_BOUNDS = ("--max-num-seqs", "4", "--max-queued-requests", "4", "--num-blocks", "256")
# Long enough to still run while the test sends a few short requests.
HOLD = {"prompt": "hold the line", "max_tokens": 800, "stream": True, **GREEDY}
# Runs until the test cuts it (closes the stream; the node aborts the request).
UNTIL_CUT = {**HOLD, "max_tokens": 3000}
SHORT = {"prompt": "The quick brown fox", "max_tokens": 8, **GREEDY}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **GREEDY}


class Held:
    """``n`` streams of ``body`` opened at once on ``url``, each read in a thread until
    it ends or ``cut`` closes it; ``join`` returns their SSE events."""

    def __init__(self, url: str, n: int, body: dict[str, Any] = HOLD) -> None:
        self.url = url
        self.results: list[Any] = [None] * n
        self._cut = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(i, body), daemon=True) for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def _run(self, i: int, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=600) as r:
                if r.status_code != 200:
                    self.results[i] = r.status_code
                    return
                lines = []
                for line in r.iter_lines():
                    if self._cut.is_set():
                        break
                    lines.append(line)
                self.results[i] = sse_data(lines)
        except Exception as e:  # reported by join
            self.results[i] = e

    def join(self, timeout: float = 600) -> list[list[Any]]:
        for t in self.threads:
            t.join(timeout)
        return self.results

    def cut(self) -> None:
        """Close the streams; wait until the node has let their requests go."""
        self._cut.set()
        self.join()
        wait_admitted(self.url, 0)


def admitted(url: str) -> float:
    return metric(url, "pdserve_num_requests_admitted")


def wait_admitted(url: str, n: int) -> None:
    wait_for(lambda: admitted(url) == n, 120, f"{n} requests admitted on {url}")


def check_finished(results: list[Any], want: list[int]) -> None:
    for events in results:
        assert isinstance(events, list), events
        assert events[-1] == "DONE", events[-3:]
        assert events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
        assert stream_ids(events) == want


def check_overloaded(resp: httpx.Response) -> None:
    assert resp.status_code == 429, resp.text
    assert int(resp.headers["retry-after"]) >= 1
    err = resp.json()["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "overloaded"), err


# One prefill and two decode nodes, bounded, shared by the module: the first test uses a
# decode node on its own (a request without transfer params is served there, colocated).


@pytest.fixture(scope="module")
def memory_node_started(module_procs: Procs) -> Proc:
    """The memory test's own node (other bounds), not yet healthy: ``pd`` starts it with
    its nodes (their start-ups overlap; idle, it costs next to nothing)."""
    return module_procs.node(*MEMORY_BOUNDS, name="memory", wait=False)


@pytest.fixture(scope="module")
def memory_node(memory_node_started: Proc) -> Proc:
    wait_healthy(memory_node_started)
    return memory_node_started


@pytest.fixture(scope="module")
def pd(module_procs: Procs, memory_node_started: Proc) -> PD:
    pd = module_procs.pd(1, 2, *BOUNDED)
    wait_healthy(memory_node_started)
    return pd


@pytest.fixture(scope="module")
def proxy_url(module_procs: Procs, pd: PD) -> str:
    return module_procs.proxy([pd.p.url], [d.url for d in pd.decode]).url


# -- one node --------------------------------------------------------------------------------


def test_a_node_past_its_bound_answers_429_while_admitted_requests_finish(pd: PD):
    node = pd.decode[1]
    assert metric(node.url, "pdserve_max_admitted_requests") == LIMIT
    refused_before = metric(node.url, "pdserve_http_requests_total", {"status": "429"})
    held = Held(node.url, LIMIT)
    wait_admitted(node.url, LIMIT)
    for path, body in (("/v1/completions", SHORT), ("/v1/chat/completions", CHAT)):
        resp = httpx.post(node.url + path, json=body, headers={"X-Request-Id": "over"}, timeout=10)
        check_overloaded(resp)
        assert resp.headers["x-request-id"] == "over"
    assert httpx.get(node.url + "/health", timeout=10).status_code == 200  # busy, not sick
    results = held.join()
    # Once they are done the node admits again; greedy, so this is every stream's answer.
    ref = httpx.post(node.url + "/v1/completions", json={**HOLD, "stream": False}, timeout=600)
    assert ref.status_code == 200, ref.text
    check_finished(results, ref.json()["choices"][0]["token_ids"])
    refused = metric(node.url, "pdserve_http_requests_total", {"status": "429"})
    assert refused - refused_before == 2


# -- through the proxy -----------------------------------------------------------------------


def _decode_health(proxy_url: str) -> dict[str, dict]:
    body = httpx.get(proxy_url + "/health", timeout=10).json()
    return {n["url"]: n for n in body["decode"]}


def test_the_proxy_moves_a_request_off_an_overloaded_node_and_keeps_it_in_rotation(
    pd: PD, proxy_url: str
):
    d1, d2 = pd.decode
    ref = httpx.post(proxy_url + "/v1/completions", json=SHORT, timeout=120)
    assert ref.status_code == 200, ref.text
    want = ref.json()["choices"][0]["token_ids"]
    held = Held(d1.url, LIMIT, UNTIL_CUT)  # straight to d1: the proxy does not know it is busy
    wait_admitted(d1.url, LIMIT)
    refused_before = metric(d1.url, "pdserve_http_requests_total", {"status": "429"})
    for i in range(6):  # the proxy's ties go round-robin: half of them try d1 first
        if i % 2:
            with httpx.stream(
                "POST", proxy_url + "/v1/completions", json={**SHORT, "stream": True}, timeout=120
            ) as resp:
                assert resp.status_code == 200, resp.read()
                assert stream_ids(sse_events(resp)) == want
        else:
            resp = httpx.post(proxy_url + "/v1/completions", json=SHORT, timeout=120)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["token_ids"] == want
    assert metric(d1.url, "pdserve_http_requests_total", {"status": "429"}) > refused_before
    health = _decode_health(proxy_url)
    assert health[d1.url]["healthy"] and health[d1.url]["error"] is None, health
    labels = {"role": "decode", "url": d1.url}
    assert metric(proxy_url, "pdproxy_node_failures_total", labels) == 0
    assert metric(proxy_url, "pdproxy_node_healthy", labels) == 1
    held.cut()


def test_when_every_node_is_overloaded_the_client_gets_the_429_and_retry_after(
    pd: PD, proxy_url: str
):
    helds = [Held(d.url, LIMIT, UNTIL_CUT) for d in pd.decode]
    for d in pd.decode:
        wait_admitted(d.url, LIMIT)
    check_overloaded(httpx.post(proxy_url + "/v1/completions", json=SHORT, timeout=120))
    resp = httpx.post(
        proxy_url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=120
    )
    check_overloaded(resp)
    health = httpx.get(proxy_url + "/health", timeout=10)
    assert health.status_code == 200, health.text
    assert all(n["healthy"] and n["error"] is None for n in health.json()["decode"])
    # The prefill legs of the refused requests were aborted: nothing is left on P.
    wait_for(lambda: kv_pool_full(pd.p.url), 60, "the prefill node's KV pool to be full")
    for h in helds:
        h.cut()
    ok = httpx.post(proxy_url + "/v1/completions", json=SHORT, timeout=120)
    assert ok.status_code == 200, ok.text


# -- memory ----------------------------------------------------------------------------------


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants (the TP workers), from /proc."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/status") as f:
                line = next(x for x in f if x.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        total += int(line.split()[1]) * 1024
    return total


CLIENTS, ATTEMPTS = 16, 15  # per round: 240 requests against a limit of 8


def _client(url: str, seed: int, counts: dict[int, int], lock: threading.Lock) -> None:
    """``ATTEMPTS`` requests, whatever their answers: plain and streamed completions, chat,
    and streams left after their first event (aborted by the node)."""
    with httpx.Client(base_url=url, timeout=120) as c:
        for i in range(ATTEMPTS):
            kind = (seed + i) % 4
            body = {"prompt": f"round {seed} {i}", "max_tokens": 24, **GREEDY}
            if kind == 0:
                status = c.post("/v1/completions", json=body).status_code
            elif kind == 1:
                chat = {**CHAT, "max_tokens": 24}
                status = c.post("/v1/chat/completions", json=chat).status_code
            else:
                with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    status = r.status_code
                    lines = (line for line in r.iter_lines() if line)
                    if status == 200 and kind == 2:
                        list(lines)
                    elif status == 200:
                        next(lines)  # and leave
            with lock:
                counts[status] = counts.get(status, 0) + 1
            if status == 429:
                time.sleep(0.05)


def _round(url: str, pid: int) -> tuple[dict[int, int], int]:
    """One round of overload; the answers' status counts and the tree's RSS once idle."""
    counts: dict[int, int] = {}
    lock = threading.Lock()
    threads = [
        threading.Thread(target=_client, args=(url, s, counts, lock), daemon=True)
        for s in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wait_for(lambda: admitted(url) == 0 and node_idle(url) and kv_pool_full(url), 120, "idle")
    return counts, tree_rss_bytes(pid)


def test_node_memory_stays_flat_across_two_rounds_of_overload(memory_node: Proc):
    node = memory_node
    _round(node.url, node.pid)  # warm-up: allocator pools, caches, lazily built objects
    counts1, rss1 = _round(node.url, node.pid)
    counts2, rss2 = _round(node.url, node.pid)
    for counts in (counts1, counts2):  # overloaded indeed, and still serving
        assert set(counts) == {200, 429} and counts[429] >= CLIENTS // 2, counts
    mib = 1024 * 1024
    allowed = max(64 * mib, rss1 // 10)
    assert rss2 - rss1 <= allowed, (
        f"RSS grew {(rss2 - rss1) / mib:.1f} MiB from round 1 ({rss1 / mib:.0f} MiB) to "
        f"round 2 ({rss2 / mib:.0f} MiB); allowed {allowed / mib:.0f} MiB"
    )
