"""A TP=2 node over HTTP: concurrent requests equal each alone and free every block; a
killed TP worker fails the in-flight request and the health check, and nothing is orphaned."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest
from harness import GREEDY, Proc, Procs, descendants, sse_data, wait_gone, worker_pids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2_node(module_procs: Procs) -> Proc:
    return module_procs.node("--tp", "2", "--num-blocks", "1024", "--max-num-seqs", "32")


def _completion(client: httpx.Client | httpx.AsyncClient, prompt: list[int], n: int):
    return client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": n, **GREEDY}, timeout=300
    )


def test_32_concurrent_requests_match_each_alone_and_free_all_blocks(tp2_node):
    rng = random.Random(0)
    prompts = [[rng.randint(0, 255) for _ in range(rng.randint(1, 300))] for _ in range(32)]
    lengths = [rng.randint(4, 24) for _ in range(32)]

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=tp2_node.url) as client:
            return await asyncio.gather(
                *(_completion(client, p, n) for p, n in zip(prompts, lengths, strict=True))
            )

    concurrent = asyncio.run(together())
    with httpx.Client(base_url=tp2_node.url) as client:
        alone = [_completion(client, p, n) for p, n in zip(prompts, lengths, strict=True)]
    for c, a, n in zip(concurrent, alone, lengths, strict=True):
        assert c.status_code == 200 and a.status_code == 200, (c.text, a.text)
        c_ids, a_ids = c.json()["choices"][0]["token_ids"], a.json()["choices"][0]["token_ids"]
        assert len(c_ids) == n
        assert c_ids == a_ids
    free = tp2_node.metric("pdserve_kv_blocks_free")
    used = tp2_node.metric("pdserve_kv_blocks_used")
    assert used == 0 and free == 1024


def test_the_engine_process_never_loads_torch_only_its_workers_do(tp2_node):
    """The engine process (HTTP server, scheduler, connector) plans without torch: it
    starts seconds sooner and stays ~200 MB smaller. Its workers load it."""
    assert _maps_torch(tp2_node.pid) is False
    workers = worker_pids(tp2_node.pid)
    assert len(workers) == 2 and all(_maps_torch(w) for w in workers)
    # Both forked from one fork server, which imported torch once for the node.
    parents = {_ppid(w) for w in workers}
    assert len(parents) == 1 and tp2_node.pid not in parents
    assert _ppid(server := parents.pop()) == tp2_node.pid and _maps_torch(server)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_killing_one_tp_worker_fails_requests_and_health(procs: Procs):
    node = procs.node("--tp", "2", "--num-blocks", "256")
    workers = worker_pids(node.pid)
    assert len(workers) == 2, workers
    body = {"prompt": "doomed", "max_tokens": 3000, "stream": True, **GREEDY}
    with httpx.stream("POST", node.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        killed_at = time.monotonic()
        os.kill(workers[1], signal.SIGKILL)  # one rank only
        events = sse_data(lines)
        ended_after = time.monotonic() - killed_at
    assert ended_after < 10, f"in-flight request took {ended_after:.1f}s to end"
    assert events[-1] == "DONE"
    err = events[-2]["error"]
    assert "worker" in err["message"].lower() or "engine" in err["message"].lower()
    health = httpx.get(node.url + "/health", timeout=10)
    assert health.status_code == 503
    assert "TP worker" in health.json()["reason"]
    # A new request is refused with an OpenAI error, not a hang.
    resp = httpx.post(
        node.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10
    )
    assert resp.status_code == 503 and resp.json()["error"]["message"]
    kids = descendants(node.pid)
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(60) == 0
    assert wait_gone(kids, 15) == [], "orphan processes left behind"
