"""Two "hosts" on one box: P and D in two network namespaces, KV over TCP across a veth.

P runs in network namespace A and D in namespace B, joined only by a veth pair, with
``UCX_TLS=tcp`` so NIXL's UCX backend moves the KV over TCP across the veth. D's greedy
tokens must equal those of a colocated node (no connector, root namespace, 127.0.0.1).

Why ``UCX_TLS=tcp`` is needed: network namespaces do not separate processes for UCX's
shared-memory transports (same PID/IPC/mount namespaces), so with the default transports
UCX copies the KV with ``cma``/shm and only a few KB of wire-up cross the veth. The test
checks the veth's byte counters to make sure the KV really went over it.

Skips where namespaces can't be made (no ``ip``, not root / no CAP_SYS_ADMIN, a
restricted container).
"""

from __future__ import annotations

import json
import random
import time

import httpx
import netns_utils as nu
import pytest
from harness import Proc, parse_metric, spawn_node, stop, wait_healthy

pytest.importorskip("nixl._api")
pytestmark = pytest.mark.slow

BS = 16
LENGTHS = [1, BS - 1, BS, BS + 1, 6 * BS + 4]
MAX_TOKENS = 12
STARTUP_TIMEOUT_S = 150.0
UCX_ENV = {"UCX_TLS": "tcp"}  # UCX_NET_DEVICES not needed: each namespace has only lo + veth


def _prompt(n: int) -> list[int]:
    rng = random.Random(1000 + n)
    return [rng.randrange(256) for _ in range(n)]


@pytest.fixture
def netns_pair():
    nu.remove_stale_namespaces()
    try:
        pair = nu.create_pair()
    except nu.NetnsUnavailable as e:
        pytest.skip(f"cannot create network namespaces: {e}")
    try:
        yield pair
    finally:
        errors = nu.delete_pair(pair)
        assert not errors, f"namespace cleanup failed: {errors}"


def _wait_healthy_in_ns(pair: nu.NetnsPair, nodes: list[Proc]) -> None:
    """Poll /health from inside namespace B (P over the veth, D locally)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    last: dict = {}
    while time.monotonic() < deadline:
        for node in nodes:
            if node.proc.poll() is not None:
                raise RuntimeError(
                    f"{node.url} exited with {node.proc.returncode} during startup:\n{node.logs()}"
                )
        last = nu.ns_run(pair, pair.b, "health", *(n.url for n in nodes), "--timeout", "5")
        if last["ok"]:
            return
    logs = "\n".join(f"--- {n.url}\n{n.logs()}" for n in nodes)
    raise RuntimeError(f"nodes not healthy after {STARTUP_TIMEOUT_S}s: {last}\n{logs}")


def _colocated(url: str, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with httpx.Client(timeout=60) as client:
        for prompt in prompts:
            body = {
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            resp = client.post(f"{url}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            out.append(resp.json()["choices"][0]["token_ids"])
    return out


def test_prefill_and_decode_in_two_namespaces_match_colocated(netns_pair, tmp_path):
    pair = netns_pair
    common = ["--model", "tiny", "--num-blocks", "256"]
    nodes: list[Proc] = []
    try:
        # Start all three at once; the startups overlap.
        p = spawn_node(
            tmp_path,
            *common,
            "--kv-connector", "nixl",
            "--side-channel-host", pair.addr_a,
            "--kv-allowed-peers", pair.addr_b,
            module="prefill_node",
            host=pair.addr_a,
            prefix=pair.prefix(pair.a),
            env=UCX_ENV,
        )  # fmt: skip
        nodes.append(p)
        d = spawn_node(
            tmp_path,
            *common,
            "--kv-connector", "nixl",
            "--side-channel-host", pair.addr_b,
            "--kv-allowed-peers", pair.addr_a,
            module="decode_node",
            host=pair.addr_b,
            prefix=pair.prefix(pair.b),
            env=UCX_ENV,
        )  # fmt: skip
        nodes.append(d)
        ref = spawn_node(tmp_path, *common, "--kv-connector", "none", module="decode_node")
        nodes.append(ref)

        _wait_healthy_in_ns(pair, [p, d])
        wait_healthy(ref, timeout=STARTUP_TIMEOUT_S)

        prompts = [_prompt(n) for n in LENGTHS]
        expected = _colocated(ref.url, prompts)
        assert all(len(t) == MAX_TOKENS for t in expected)

        veth_before = pair.link_stats(pair.a, pair.dev_a)
        res = nu.ns_run(
            pair,
            pair.b,
            "disagg",
            "--prefill", p.url,
            "--decode", d.url,
            "--prompts", json.dumps(prompts),
            "--max-tokens", str(MAX_TOKENS),
            timeout=120,
        )  # fmt: skip
        veth_after = pair.link_stats(pair.a, pair.dev_a)

        assert res["side_channel"].startswith(f"tcp://{pair.addr_a}:"), res["side_channel"]
        assert res["tokens"] == expected

        # The KV really moved, via NIXL, over the veth (P writes into D's blocks: A's
        # veth end transmits at least the KV bytes) -- not via shared memory.
        sent = parse_metric(res["p_metrics"], "pdserve_engine_kv_bytes_sent_total")
        blocks = sum(-(-n // BS) for n in LENGTHS)
        assert sent > 0
        assert parse_metric(res["p_metrics"], "pdserve_engine_kv_blocks_sent_total") == blocks
        tx = veth_after["tx_bytes"] - veth_before["tx_bytes"]
        assert tx >= sent, f"only {tx} bytes left A's veth for {sent} KV bytes"
        # D never computed a prompt: it only decoded.
        assert parse_metric(res["d_metrics"], "pdserve_prompt_tokens_total") == 0
        assert parse_metric(res["d_metrics"], "pdserve_generation_tokens_total") == (
            len(LENGTHS) * MAX_TOKENS
        )
    except BaseException:
        for n in nodes:
            print(f"--- {n.url} stderr (tail)\n{n.logs()}")
        raise
    finally:
        stop(*nodes)
