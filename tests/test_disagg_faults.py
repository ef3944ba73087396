"""Transfer faults with real P and D nodes: every waiting state ends, no block is reused early."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from harness import (
    GREEDY,
    Proc,
    Procs,
    descendants,
    free_port,
    wait_for,
    wait_gone,
    wait_healthy,
)

pytest.importorskip("nixl._api")
pytestmark = pytest.mark.slow

# The module's transfer deadline: the holds and waits these tests check must outlive the
# tests' own steps (a request, a few metric scrapes, a kill) on a loaded 2-core box, where
# 3 s was seen to expire first once.
TIMEOUT_S = 6.0
NODE_ARGS = ("--kv-transfer-timeout", str(TIMEOUT_S), "--num-blocks", "128")
NIXL_ARGS = ("--kv-connector", "nixl", *NODE_ARGS)


# Each of these tests starts its own nodes (with other flags, or to kill them): all are
# started with the module's shared nodes, at once (their start-ups overlap; idle, a node
# costs next to nothing), and each is used by its one test alone.
LIVENESS_ARGS = ("--kv-connector", "nixl", "--kv-transfer-timeout", "120", "--num-blocks", "64")
PUSH_ARGS = ("--kv-connector", "nixl", "--kv-transfer-timeout", "60", "--num-blocks", "128")


@pytest.fixture(scope="module")
def restart_port() -> int:
    """The side-channel port of the restarted decode node's two incarnations."""
    return free_port()


@pytest.fixture(scope="module")
def module_nodes(module_procs: Procs, restart_port: int) -> dict[str, Proc]:
    """Every node the module starts before its tests, started at once. Shared, never
    killed: a P/D pair; a prefill node that computes a leg before any reservation
    (--no-kv-reserve-first), so that it holds the blocks for a decode node (the waits of
    that hold); a node without a connector. The others belong to one test each."""

    def spawn(key: str, *args: str, module: str = "decode_node") -> tuple[str, Proc]:
        return key, module_procs.node(*args, module=module, name=key, wait=False)

    restart = ("--side-channel-port", str(restart_port))
    nodes = dict([
        spawn("prefill", *NIXL_ARGS, module="prefill_node"),
        spawn("decode", *NIXL_ARGS),
        spawn("eager_prefill", *NIXL_ARGS, "--no-kv-reserve-first", module="prefill_node"),
        spawn("plain", "--num-blocks", "64"),
        spawn("killed_prefill", *NIXL_ARGS, module="prefill_node"),
        spawn("liveness_prefill", *LIVENESS_ARGS, module="prefill_node"),
        spawn("liveness_decode", *LIVENESS_ARGS),
        spawn("push_prefill", *PUSH_ARGS, module="prefill_node"),
        spawn("push_decode", *PUSH_ARGS),
        spawn("restart_decode", *NIXL_ARGS, *restart),
    ])  # fmt: skip
    wait_healthy(*nodes.values())
    return nodes


@pytest.fixture(scope="module")
def decode(module_nodes: dict[str, Proc]) -> Proc:
    return module_nodes["decode"]


@pytest.fixture(scope="module")
def prefill(module_nodes: dict[str, Proc]) -> Proc:
    return module_nodes["prefill"]


@pytest.fixture(scope="module")
def eager_prefill(module_nodes: dict[str, Proc]) -> Proc:
    return module_nodes["eager_prefill"]


def test_kv_transfer_info_reports_the_transport(prefill: Proc):
    info = httpx.get(prefill.url + "/v1/kv_transfer_info", timeout=5).json()
    assert info["role"] == "producer" and info["side_channel"].startswith("tcp://127.0.0.1:")
    assert info["transport"]["backend"] == "UCX" and info["transport"]["mem_type"] == "DRAM"
    assert info["compat"]["block_size"] == 16 and info["incarnation"]


def side_channel(node: Proc) -> str:
    return httpx.get(node.url + "/v1/kv_transfer_info", timeout=5).json()["side_channel"]


def d_body(prompt: list[int], tid: str, p_addr: str, n: int = 12) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": n,
        **GREEDY,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_side_channel": p_addr,
        },
    }


def p_body(prompt: list[int], tid: str) -> dict:
    """The prefill leg: compute the prompt, sample the first token, push to D."""
    return {
        "prompt": prompt,
        "max_tokens": 1,
        **GREEDY,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid},
    }


@contextlib.contextmanager
def decode_leg_waiting(
    prefill: Proc, decode: Proc, prompt: list[int], tid: str, timeout: float = 60
) -> Iterator[Future]:
    """Send only D's leg (no prefill): yields the future of D's response once P holds
    D's reservation, i.e. D reserved blocks and waits for KV that P never computes."""
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            httpx.post,
            decode.url + "/v1/completions",
            json=d_body(prompt, tid, side_channel(prefill)),
            headers={"X-Request-Id": tid},
            timeout=timeout,
        )
        wait_for(
            lambda: prefill.metric("pdserve_engine_kv_reservations_waiting") == 1,
            10,
            "P to hold the reservation",
        )
        yield fut


def pools_full(node: Proc) -> bool:
    return node.metric("pdserve_kv_blocks_used") == 0


def test_prefill_killed_after_decode_reserved(decode: Proc, module_nodes: dict[str, Proc]):
    """P dies holding D's reservation: D quarantines the reserved blocks (a late WRITE may
    land there) and recomputes the prompt into new blocks. Once the answer is out, only the
    quarantined blocks stay out of use: the new ones were never named to P. They used to be
    held, with the finished request, until the quarantine ended (2 x the timeout). P's
    engine worker, orphaned by the SIGKILL of P alone, exits on its own."""
    prefill = module_nodes["killed_prefill"]
    prompt = [random.Random(1).randint(0, 255) for _ in range(40)]  # 3 blocks
    before_prompt = decode.metric("pdserve_prompt_tokens_total")
    with decode_leg_waiting(prefill, decode, prompt, "killed-1") as fut:
        assert decode.metric("pdserve_engine_num_waiting_for_remote_kv") == 1
        kids = descendants(prefill.proc.pid)
        prefill.proc.kill()
        prefill.proc.wait(10)
        killed = time.monotonic()
        resp = fut.result(timeout=60)
        took = time.monotonic() - killed
    assert resp.status_code == 200, resp.text
    assert took < TIMEOUT_S + 5, f"recompute took {took:.1f}s after P died"
    tokens = resp.json()["choices"][0]["token_ids"]
    # Recomputed locally, with the same result as a plain colocated request.
    assert decode.metric("pdserve_prompt_tokens_total") - before_prompt >= 40
    assert decode.metric("pdserve_engine_kv_loads_failed_total") >= 1
    # The reserved blocks are not reused right away: they stay quarantined while a
    # late WRITE could still land, and come back after the deadline.
    assert decode.metric("pdserve_engine_num_quarantined_blocks") == 3
    assert decode.metric("pdserve_engine_kv_quarantined_requests") == 1
    # The recompute's new blocks are free once the answer is out; the quarantined stay.
    wait_for(lambda: decode.metric("pdserve_kv_blocks_used") == 3, 3, "D to free the new blocks")
    assert decode.metric("pdserve_engine_num_quarantined_blocks") == 3  # still quarantined
    assert decode.metric("pdserve_engine_num_held") == 0
    wait_for(lambda: pools_full(decode), 2 * TIMEOUT_S + 5, "D's quarantined blocks to free")
    assert decode.metric("pdserve_engine_num_quarantined_blocks") == 0
    ref = httpx.post(
        decode.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 12, **GREEDY},
        timeout=60,
    ).json()["choices"][0]["token_ids"]
    assert tokens == ref
    wait_gone(kids, 10)


def test_liveness_ends_the_wait_long_before_the_deadline(module_nodes: dict[str, Proc]):
    """With a 120 s transfer deadline, D notices the dead P by its missed pings and
    recomputes within seconds; the reserved blocks stay quarantined (P went silent)."""
    prefill, decode = module_nodes["liveness_prefill"], module_nodes["liveness_decode"]
    prompt = list(range(7, 47))
    with decode_leg_waiting(prefill, decode, prompt, "liveness-1", timeout=120) as fut:
        prefill.proc.kill()
        prefill.proc.wait(10)
        killed = time.monotonic()
        resp = fut.result(timeout=120)
        took = time.monotonic() - killed
    assert resp.status_code == 200, resp.text
    assert took < 20, f"recovered after {took:.1f}s; the liveness pings should end it sooner"
    assert decode.metric("pdserve_engine_kv_prefill_peers_lost_total") == 1
    assert decode.metric("pdserve_engine_num_quarantined_blocks") == 3


def test_decode_abort_while_waiting_cancels_on_prefill(decode: Proc, prefill: Proc):
    prompt = list(range(1, 30))
    rid = "abort-waiting-1"
    with decode_leg_waiting(prefill, decode, prompt, rid) as fut:
        httpx.post(decode.url + "/v1/abort", json={"request_id": rid}, timeout=10)
        resp = fut.result(timeout=30)
    # The aborted request ends like any abort: a 200 with finish reason "abort".
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    assert choice["finish_reason"] == "abort" and choice["token_ids"] == [], choice
    # P confirms the cancel (nothing was written), so D frees the blocks at once; without
    # that confirmation they would stay quarantined for 2 x TIMEOUT_S after the abort.
    took = wait_for(lambda: pools_full(decode), TIMEOUT_S, "D to free the aborted blocks")
    assert took < TIMEOUT_S / 2
    wait_for(  # P's gauges are read between its engine's (idle) loop turns
        lambda: prefill.metric("pdserve_engine_kv_reservations_waiting") == 0,
        5,
        "P to drop the cancelled reservation",
    )
    # A late prefill leg for the cancelled transfer computes nothing: it fails at once.
    p = httpx.post(
        prefill.url + "/v1/completions",
        json=p_body(prompt, rid),
        timeout=30,
    )
    assert p.status_code == 409, p.text  # the client's (or proxy's) leg names a dead transfer
    err = p.json()["error"]
    assert err["code"] == "kv_transfer_not_reserved" and "ended before" in err["message"]
    wait_for(lambda: pools_full(prefill), TIMEOUT_S + 5, "P's pool to be whole")


def test_prefill_frees_blocks_when_no_reservation_comes(eager_prefill: Proc):
    sent_before = eager_prefill.metric("pdserve_engine_kv_transfers_started_total")
    resp = httpx.post(
        eager_prefill.url + "/v1/completions",
        json=p_body(list(range(1, 50)), "nobody-wants-it"),
        timeout=30,
    )
    assert resp.status_code == 200
    params = resp.json()["kv_transfer_params"]
    assert params["first_token"] == resp.json()["choices"][0]["token_ids"][0]
    answered = time.monotonic()  # the hold's deadline runs from about here
    assert eager_prefill.metric("pdserve_engine_kv_held_for_send") == 1
    assert eager_prefill.metric("pdserve_kv_blocks_used") == 4  # held for the decode node
    wait_for(lambda: pools_full(eager_prefill), TIMEOUT_S + 5, "P's held blocks to free")
    held = time.monotonic() - answered
    assert held > TIMEOUT_S / 2, held  # held until the deadline, not dropped at once
    assert eager_prefill.metric("pdserve_engine_kv_held_for_send") == 0
    assert eager_prefill.metric("pdserve_engine_kv_transfers_started_total") == sent_before


def test_abort_on_prefill_frees_blocks_held_for_send(eager_prefill: Proc):
    """The proxy aborts P when D died before reserving: P frees at once, not at the deadline."""
    rid = "abort-held-1"
    resp = httpx.post(
        eager_prefill.url + "/v1/completions",
        json=p_body(list(range(1, 40)), rid),
        headers={"X-Request-Id": rid},
        timeout=30,
    )
    assert resp.status_code == 200
    assert eager_prefill.metric("pdserve_engine_kv_held_for_send") == 1
    httpx.post(eager_prefill.url + "/v1/abort", json={"request_id": rid}, timeout=10)
    took = wait_for(lambda: pools_full(eager_prefill), TIMEOUT_S, "P to free the aborted hold")
    assert took < TIMEOUT_S / 2
    assert eager_prefill.metric("pdserve_engine_kv_held_for_send") == 0


def _disagg(prefill: Proc, decode: Proc, prompt: list[int], tid: str) -> list[int]:
    with ThreadPoolExecutor(1) as pool:
        p_fut = pool.submit(
            httpx.post,
            prefill.url + "/v1/completions",
            json=p_body(prompt, tid),
            timeout=60,
        )
        d = httpx.post(
            decode.url + "/v1/completions",
            json=d_body(prompt, tid, side_channel(prefill)),
            timeout=60,
        )
        assert p_fut.result().status_code == 200
    assert d.status_code == 200, d.text
    return d.json()["choices"][0]["token_ids"]


def test_restarted_decode_replaces_its_old_incarnation(
    prefill: Proc, procs: Procs, module_nodes: dict[str, Proc], restart_port: int
):
    """A D restarted behind the same side-channel address is a new peer; the old one is
    dropped on P (its NIXL agents and descriptor lists), and pushes go to the new one."""
    args = (*NIXL_ARGS, "--side-channel-port", str(restart_port))
    prompt = list(range(3, 40))
    first = module_nodes["restart_decode"]
    tokens = _disagg(prefill, first, prompt, "restart-1")
    peers = prefill.metric("pdserve_engine_kv_decode_peers")
    first.stop()
    before = prefill.metric("pdserve_engine_kv_handshakes_total")
    second = procs.node(*args, module="decode_node")
    assert _disagg(prefill, second, prompt, "restart-2") == tokens
    assert prefill.metric("pdserve_engine_kv_handshakes_total") == before + 1
    assert prefill.metric("pdserve_engine_kv_decode_peers") == peers  # replaced, not added
    assert second.metric("pdserve_prompt_tokens_total") == 0  # the KV was pushed


def test_push_to_a_dead_decode_fails_cleanly_and_drops_the_peer(module_nodes: dict[str, Proc]):
    """D reserved, then died before P's push: the WRITE errors (no hang), P frees its
    blocks, counts the failure and forgets the dead peer's agents. Its own pair with a
    long transfer timeout: D's early reservation must outlive killing D on a loaded box
    (with the module's 3 s it expired first once, and P then had nothing to push)."""
    prefill, dead = module_nodes["push_prefill"], module_nodes["push_decode"]
    _disagg(prefill, dead, list(range(5, 30)), "dead-0")  # the peer is known to P
    peers = prefill.metric("pdserve_engine_kv_decode_peers")
    failures = prefill.metric("pdserve_engine_kv_transfer_failures_total")
    prompt, tid = list(range(5, 40)), "dead-1"
    with decode_leg_waiting(prefill, dead, prompt, tid, timeout=30):
        kids = descendants(dead.pid)
        dead.proc.kill()
        dead.proc.wait(10)
        wait_gone(kids, 10)
    resp = httpx.post(prefill.url + "/v1/completions", json=p_body(prompt, tid), timeout=30)
    assert resp.status_code == 200
    wait_for(lambda: pools_full(prefill), 15, "P to free the failed push's blocks")
    assert prefill.metric("pdserve_engine_kv_transfer_failures_total") == failures + 1
    assert prefill.metric("pdserve_engine_kv_decode_peers") == peers - 1
    assert prefill.metric("pdserve_engine_kv_transfers_in_flight") == 0


def test_transfer_params_without_connector_are_refused(module_nodes: dict[str, Proc]):
    resp = httpx.post(
        module_nodes["plain"].url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=30,
    )
    assert resp.status_code == 400
    assert "--kv-connector" in resp.json()["error"]["message"]


def test_a_second_prefill_leg_with_a_transfer_id_in_use_is_refused(eager_prefill: Proc):
    """The proxy makes one transfer id per request and attempt; a client calling P with an
    id P still holds blocks for gets a 400 naming it, not a second prefill that is then
    computed for nothing (and an ERROR in P's log)."""
    log_before = len(eager_prefill.logs(10**7))
    first = httpx.post(
        eager_prefill.url + "/v1/completions", json=p_body([5, 6, 7], "dup-1"), timeout=60
    )
    assert first.status_code == 200  # P holds its blocks for a decode node
    second = httpx.post(
        eager_prefill.url + "/v1/completions", json=p_body([5, 6, 7], "dup-1"), timeout=60
    )
    assert second.status_code == 400, second.text
    err = second.json()["error"]
    assert err["param"] == "kv_transfer_params" and "dup-1" in err["message"]
    assert " ERROR " not in eager_prefill.logs(10**7)[log_before:]
    wait_for(lambda: pools_full(eager_prefill), TIMEOUT_S + 5, "P to free the held blocks")
