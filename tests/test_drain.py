"""SIGTERM drains a node: /health says draining, new requests get 503 + Retry-After, requests
in flight finish, and streams still open at --shutdown-timeout end with an error event and
[DONE] (real nodes, tiny model)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from harness import Procs, descendants, sse_data, wait_for

pytestmark = pytest.mark.slow

NODE_ARGS = ("--model", "tiny", "--num-blocks", "512")
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _stream_in_thread(url: str, body: dict, out: dict) -> threading.Thread:
    """Reads the stream into ``out`` (``first``, then ``events``); a connection cut before
    its end leaves ``out["cut"]`` instead of ``events`` (a node killed at teardown)."""

    def run() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            out["status"] = resp.status_code
            assert resp.status_code == 200, resp.read()
            lines = resp.iter_lines()
            out["first"] = next(line for line in lines if line)  # streaming has begun
            try:
                out["events"] = sse_data(lines)
            except httpx.TransportError as e:
                out["cut"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_sigterm_refuses_new_work_and_lets_a_running_request_finish(procs: Procs):
    node = procs.node(*NODE_ARGS, "--shutdown-timeout", "60")
    out: dict = {}
    body = {"prompt": "finish me", "max_tokens": 200, "stream": True, **GREEDY}
    t = _stream_in_thread(node.url, body, out)
    wait_for(lambda: "first" in out, 60, "the stream to start")
    node.proc.send_signal(signal.SIGTERM)

    def draining() -> bool:
        return httpx.get(node.url + "/health", timeout=5).status_code == 503

    wait_for(draining, 10, "/health to say draining")
    assert httpx.get(node.url + "/health", timeout=5).json()["status"] == "draining"
    refused = httpx.post(
        node.url + "/v1/completions", json={"prompt": "new", "max_tokens": 2}, timeout=10
    )
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "draining"
    t.join(120)
    events = out["events"]
    assert events[-1] == "DONE"
    assert events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
    tokens = sum(len(e["choices"][0]["token_ids"]) for e in events[:-1] if e.get("choices"))
    # Every token came. The first event was read before; it may carry more than one token
    # (a node merges the outputs a reader has not taken yet).
    first = json.loads(out["first"].removeprefix("data:"))
    assert tokens + len(first["choices"][0]["token_ids"]) == 200
    assert node.proc.wait(60) == 0, node.logs()


def test_sigterm_to_the_whole_process_group_still_drains_a_running_request(procs: Procs):
    """systemd (KillMode=control-group) and ``kill -TERM -PGID`` signal the TP workers too.
    The workers leave their shutdown to the engine process, so the drain still finishes
    the request and the node exits cleanly, without an "executor dead" error."""
    node = procs.node(*NODE_ARGS, "--shutdown-timeout", "60")
    out: dict = {}
    body = {"prompt": "finish me too", "max_tokens": 200, "stream": True, **GREEDY}
    t = _stream_in_thread(node.url, body, out)
    wait_for(lambda: "first" in out, 60, "the stream to start")
    workers = descendants(node.pid)
    assert workers, "a node runs its TP rank in a worker process"
    for pid in (node.pid, *workers):
        os.kill(pid, signal.SIGTERM)
    t.join(120)
    events = out["events"]
    assert events[-1] == "DONE", events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
    first = json.loads(out["first"].removeprefix("data:"))
    tokens = sum(len(e["choices"][0]["token_ids"]) for e in events[:-1] if e.get("choices"))
    assert tokens + len(first["choices"][0]["token_ids"]) == 200
    assert node.proc.wait(60) == 0, node.logs()
    assert "executor dead" not in node.logs(100_000)


def test_answers_still_running_at_the_shutdown_timeout_end_as_draining(procs: Procs):
    """At the drain deadline a stream still open ends with an error event and [DONE]; a
    non-streamed request still running, whose answer had not started, gets 503 draining
    with Retry-After (a proxy retries it elsewhere). It used to get an empty 499, taken
    for the client's own doing."""
    node = procs.node(*NODE_ARGS, "--shutdown-timeout", "1")
    out: dict = {}
    body = {"prompt": "never finishes", "max_tokens": 4000, "stream": True, **GREEDY}
    t = _stream_in_thread(node.url, body, out)
    plain: dict = {}

    def run() -> None:
        resp = httpx.post(node.url + "/v1/completions", json={**body, "stream": False}, timeout=120)
        plain.update(status=resp.status_code, headers=resp.headers, body=resp.text)

    pt = threading.Thread(target=run, daemon=True)
    pt.start()
    wait_for(lambda: "first" in out, 60, "the stream to start")
    wait_for(lambda: node.metric("vllm:num_requests_running", {"model_name": "tiny"}) == 2,
             60, "both requests to run")  # fmt: skip
    start = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    t.join(60)
    pt.join(60)
    assert not t.is_alive() and not pt.is_alive()
    events = out["events"]
    assert events[-1] == "DONE", events[-3:]
    assert events[-2]["error"]["code"] == "draining", events[-3:]
    assert plain["status"] == 503, plain
    assert plain["headers"].get("retry-after") == "1"
    assert '"draining"' in plain["body"]
    assert node.proc.wait(60) == 0, node.logs()
    assert time.monotonic() - start < 30  # not the engine's generation time


def test_a_node_whose_tp_worker_died_says_so_on_health_at_once(procs: Procs):
    """No request needed: /health turns 503 as soon as a worker is gone (it stayed 200
    until a request failed on the dead engine, so probes kept the node in rotation)."""
    from harness import worker_pids

    node = procs.node(*NODE_ARGS, "--tp", "2")
    assert httpx.get(node.url + "/health", timeout=10).status_code == 200
    victim = worker_pids(node.pid)[-1]
    import os

    os.kill(victim, signal.SIGKILL)
    wait_for(
        lambda: httpx.get(node.url + "/health", timeout=10).status_code == 503,
        30,
        "/health to report the dead worker",
    )


def test_the_proxy_routes_around_a_draining_decode_node_and_drains_itself(procs: Procs):
    pd = procs.pd(1, 2, *NODE_ARGS[2:], "--shutdown-timeout", "60")
    d1, d2 = pd.decode
    proxy = procs.proxy([pd.p.url], [d1.url, d2.url], "--shutdown-timeout", "1")
    # Keep d1 draining: a long stream straight to it, then SIGTERM.
    out: dict = {}
    t = _stream_in_thread(d1.url, {"prompt": "hold", "max_tokens": 2000, "stream": True}, out)
    wait_for(lambda: "first" in out, 60, "the stream on d1 to start")
    d1.proc.send_signal(signal.SIGTERM)

    def d1_out_of_rotation() -> bool:
        nodes = httpx.get(proxy.url + "/health", timeout=5).json()["decode"]
        return not next(n for n in nodes if n["url"] == d1.url)["healthy"]

    wait_for(d1_out_of_rotation, 20, "the proxy to take the draining node out")
    for _ in range(4):  # every request lands on d2
        r = httpx.post(
            proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60
        )
        assert r.status_code == 200, r.text
    # The proxy itself drains: its open stream ends with an error event and [DONE].
    pout: dict = {}
    body = {"prompt": "long", "max_tokens": 1500, "stream": True, **GREEDY}
    pt = _stream_in_thread(proxy.url, body, pout)
    wait_for(lambda: "first" in pout, 60, "the stream through the proxy to start")
    proxy.proc.send_signal(signal.SIGTERM)
    pt.join(60)
    assert pout["events"][-1] == "DONE" and pout["events"][-2]["error"]["code"] == "draining"
    assert proxy.proc.wait(30) == 0, proxy.logs()
    t.join(0)
