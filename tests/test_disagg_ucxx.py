"""The P/D connector on the UCXX transport (``--kv-transport ucxx``): engines and nodes
whose ranks push KV with ``UcxxTransport`` answer what a colocated node answers, with
homogeneous and heterogeneous TP; a NIXL node and a UCXX node refuse to pair; the
worker's fencing holds with real UCXX notifications; a dead or killed peer ends every
wait.

These tests run in CI: ``ucxx`` is in the ``.[test]`` extra (for users it stays the
optional ``.[ucxx]`` extra). Without ``ucxx`` installed every test skips, saying so.
``PDSERVE_TEST_UCXX=0`` switches them off. Engines and nodes build their transports in
their own worker and node processes; the two fencing tests that build ``UcxxTransport``
objects in the test's process run in a child pytest process, one for both
(``@pytest.mark.isolated(batch=True)``, ``tests/isolated.py``), so a segfault in ``ucxx``
(seen once, closing an endpoint) fails that test, not the whole run.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from engine.engine_core import EngineCore
from engine.kv_cache_layout import KVCacheSpec
from engine.llm import LLM
from engine.model.config import load_arch_config
from engine.sampling_params import SamplingParams
from kvconnector.nixl.messages import Notif, TransferFailed
from kvconnector.nixl.transport_ucxx import ucxx_available

if os.environ.get("PDSERVE_TEST_UCXX", "").strip().lower() in ("0", "false", "no", "off"):
    pytest.skip("ucxx tests switched off (PDSERVE_TEST_UCXX=0)", allow_module_level=True)
if not ucxx_available():
    pytest.skip(
        "ucxx is not installed (pip install -e '.[test]' or '.[ucxx]')",
        allow_module_level=True,
    )

sys.path.insert(0, str(Path(__file__).parent))
from harness import GREEDY as HTTP_GREEDY  # noqa: E402
from harness import PD, Proc, Procs, descendants, wait_for, wait_gone  # noqa: E402
from hf_models import random_prompt  # noqa: E402
from pd_utils import assert_pools_full, disagg_generate, nixl_config  # noqa: E402

pytestmark = pytest.mark.slow  # engines with worker processes, nodes

BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, seed=1234)
LENGTHS = [1, BS - 1, BS, BS + 1, 5 * BS + 3, 300]


def ucxx_config(base: EngineConfig, role: str, **kv: object) -> EngineConfig:
    return nixl_config(base, role, kv_transport="ucxx", **kv)


def _assert_clean(*engines: EngineCore) -> None:
    for eng in engines:
        s = eng.stats()
        assert s["kv_blocks_free"] == s["kv_blocks_total"], s
        assert s["kv_transfers_in_flight"] == 0
        assert not eng.scheduler.requests and not eng.scheduler.held
        assert eng.executor.aggregator.pending_ids == set()


# ---------------------------------------------------------------- engines, in process


@pytest.mark.parametrize("tp", [1, 2])
def test_ucxx_disaggregated_output_matches_colocated(tp):
    base = EngineConfig(
        model=ModelConfig(model="tiny"),
        cache=CacheConfig(num_blocks=128, block_size=BS),
        parallel=ParallelConfig(tp=tp),
    )
    prompts = [random_prompt(n, 256, seed=n) for n in LENGTHS]
    with LLM(base) as llm:
        colocated = llm.generate_token_ids(prompts, GREEDY)
        seeded = llm.generate_token_ids(prompts, SEEDED)
    p = EngineCore(ucxx_config(base, "producer"))
    d = EngineCore(ucxx_config(base, "consumer"))
    try:
        res = disagg_generate(p, d, prompts, GREEDY)
        assert res["tokens"] == colocated
        assert all(f.finish_reason == "length" and f.error is None for f in res["final"])
        assert d.stats()["prompt_tokens_total"] == 0  # D decoded from the pushed KV
        ps = p.stats()
        blocks = sum(-(-len(x) // BS) for x in prompts)
        assert ps["kv_blocks_sent_total"] == blocks * tp
        assert ps["kv_bytes_sent_total"] == blocks * tp * p.block_bytes
        assert ps["kv_rank_transfers_done_total"] == len(prompts) * tp
        assert ps["kv_rank_transfers_failed_total"] == 0
        assert d.stats()["kv_notifs_received_total"] == len(prompts) * tp
        assert p.connector.transport_info()["library"] == "ucxx"

        assert disagg_generate(p, d, prompts, SEEDED, tag="s")["tokens"] == seeded
        _assert_clean(p, d)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "kv_checksum"),
    [(1, 2, "off"), (2, 1, "full")],
    ids=["P1-D2", "P2-D1"],
)
def test_ucxx_heterogeneous_tp_matches_colocated(tp_p, tp_d, kv_checksum):
    """Head slices over UCXX: D ranks of another TP size get exactly their heads."""
    base = EngineConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=96))

    def node(role: str, tp: int) -> EngineCore:
        cfg = base.replace(parallel=ParallelConfig(tp=tp))
        return EngineCore(ucxx_config(cfg, role, kv_checksum=kv_checksum))

    p, d = node("producer", tp_p), node("consumer", tp_d)
    try:
        prompts = [random_prompt(n, 256, seed=n) for n in (9, 40, 77)]
        res = disagg_generate(p, d, prompts, GREEDY, timeout=180)
        with LLM(base) as llm:
            assert res["tokens"] == llm.generate_token_ids(prompts, GREEDY)
        ds = d.stats()
        assert ds["prompt_tokens_total"] == 0 and ds["kv_checksum_failures_total"] == 0
        _assert_clean(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_ucxx_48_concurrent_requests_leave_no_state():
    base = EngineConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=512))
    p = EngineCore(ucxx_config(base, "producer"))
    d = EngineCore(ucxx_config(base, "consumer"))
    try:
        prompts = [random_prompt(1 + (i * 37) % 150, 256, seed=i) for i in range(48)]
        params = SamplingParams(max_tokens=6, temperature=0)
        res = disagg_generate(p, d, prompts, params)
        with LLM(base) as llm:
            assert res["tokens"] == llm.generate_token_ids(prompts, params)
        assert d.stats()["prompt_tokens_total"] == 0
        assert p.stats()["kv_rank_transfers_done_total"] == 48
        _assert_clean(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_nixl_node_and_a_ucxx_node_refuse_to_pair():
    """P on NIXL, D on UCXX: the handshake is refused naming kv_transport; D fails the
    load (policy fail here) and P, told by D's cancel, frees its blocks."""
    pytest.importorskip("nixl._api")
    base = EngineConfig(cache=CacheConfig(num_blocks=64))
    p = EngineCore(nixl_config(base, "producer", kv_transfer_timeout=600.0))
    d = EngineCore(ucxx_config(base, "consumer", kv_failure_policy="fail"))
    try:
        res = disagg_generate(p, d, [random_prompt(40, 256, seed=3)], GREEDY, timeout=60)
        final = res["final"][0]
        assert final.finish_reason == "error"
        assert "kv_transport mismatch" in final.error and "'nixl'" in final.error
        assert d.stats()["kv_handshake_failures_total"] >= 1
        assert p.stats()["kv_handshake_failures_total"] >= 1
        assert_pools_full(p, d)
    finally:
        p.shutdown()
        d.shutdown()


# ------------------------------------------------- fencing through the worker, real UCXX


class UcxxDecodeTP2:
    """D with TP=2 as ``tests/test_transfer_fencing.py`` wires it (real scheduler,
    scheduler-side connector, two worker-side connectors, the all-ranks aggregator), but
    each worker registers a real KV cache on a real ``UcxxTransport`` and the test plays
    two P ranks that write real blocks and real notifications to them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from test_transfer_fencing import DecodeTP2

        from kvconnector.nixl.transport_ucxx import UcxxTransport
        from kvconnector.nixl.worker import NixlConnectorWorker

        self.d = DecodeTP2(monkeypatch)
        kvt = dataclasses.replace(self.d.cfg.kv_transfer, kv_transport="ucxx")
        cfg = dataclasses.replace(self.d.cfg, kv_transfer=kvt)
        spec = KVCacheSpec.for_model(load_arch_config("tiny"), cfg, cfg.cache.num_blocks)
        self.d.workers = [NixlConnectorWorker(cfg, rank, 2) for rank in range(2)]
        self.p: list[Any] = []
        for rank, w in enumerate(self.d.workers):
            w.register_kv_caches(torch.zeros(spec.shape, dtype=spec.torch_dtype), spec)
            kv = torch.randn(spec.shape, generator=torch.Generator().manual_seed(rank))
            p = UcxxTransport(
                f"P-tp{rank}",
                kv.to(spec.torch_dtype),
                spec.block_bytes,
                num_layers=spec.num_layers,
                num_heads=spec.num_kv_heads,
            )
            p.add_peer("d", w.handshake_info())
            self.p.append(p)

    def deliver(
        self, rank: int, rid: str, transfer_id: str, nonce: str, stray: bool = False
    ) -> None:
        """P rank ``rank`` writes the request's blocks with its notification, and D steps
        until that rank's worker has taken the notification in -- or, ``stray`` (a nonce
        no reservation of D's waits for), until D's transport dropped the write: its data
        goes into no block and its notification reaches no worker."""
        blocks = (
            self.d.conn.consumer.recvs[rid].block_ids if rid in self.d.conn.consumer.recvs else [0]
        )
        notif = Notif(r=rid, t=transfer_id, k=nonce, n=1, ft=5).pack()
        worker = self.d.workers[rank]
        assert worker._kv_cache is not None
        before = worker._kv_cache[blocks].clone()
        handle = self.p[rank].write_blocks("d", blocks, blocks, notif)
        seen, dropped = worker._notifs, worker.transport.writes_dropped  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while worker._notifs == seen:
            assert time.monotonic() < deadline, "the notification never came"
            self.d.step()
            time.sleep(0.002)
            if stray and worker.transport.writes_dropped > dropped:  # type: ignore[union-attr]
                break
        assert self.p[rank].poll(handle) == "done"
        self.p[rank].release(handle)
        if stray:
            assert worker._notifs == seen, "a stray write's notification reached the worker"
            assert torch.equal(worker._kv_cache[blocks], before), "a stray write landed"

    def close(self) -> None:
        for p in self.p:
            p.close()
        for w in self.d.workers:
            w.shutdown()
        self.d.close()


@pytest.fixture
def ucxx_decode(monkeypatch) -> Iterator[UcxxDecodeTP2]:
    d = UcxxDecodeTP2(monkeypatch)
    try:
        yield d
    finally:
        d.close()


def _running(d: Any, rid: str) -> bool:
    return any(r.request_id == rid for r in d.sch.running)


@pytest.mark.isolated(batch=True)  # ucxx workers in the test's process
def test_ucxx_a_stale_notification_cannot_complete_a_newer_transfer(ucxx_decode):
    """An old transfer's notification from rank 0 and the new one's from rank 1 do not
    add up to "all ranks have it"; the new transfer's two do, and its blocks hold what
    both P ranks wrote."""
    u, d = ucxx_decode, ucxx_decode.d
    old = d.add("X", "t1")
    u.deliver(0, "X", "t1", old)
    d.conn.channel.handle(TransferFailed("X", "t1", old, "push failed", True).to_wire())
    for _ in range(8):
        d.step()
    d.sch.abort_request("X")
    d.step()
    new = d.add("X", "t2")
    assert new != old
    u.deliver(0, "X", "t1", old, stray=True)  # a replay of the old transfer's write
    u.deliver(1, "X", "t2", new)
    assert not _running(d, "X"), "KV counted as landed from two different transfers"
    blocks = d.conn.consumer.recvs["X"].block_ids
    u.deliver(0, "X", "t2", new)
    d.step()
    assert _running(d, "X")
    for rank, w in enumerate(d.workers):
        p_kv = u.p[rank]._kv_cache
        assert torch.equal(w._kv_cache[blocks], p_kv[blocks]), f"rank {rank}"


@pytest.mark.isolated(batch=True)  # ucxx workers in the test's process
def test_ucxx_a_notification_without_the_reservations_nonce_completes_nothing(ucxx_decode):
    u, d = ucxx_decode, ucxx_decode.d
    nonce = d.add("X", "t1")
    for rank in (0, 1):
        u.deliver(rank, "X", "t1", "guessed-nonce", stray=True)
    d.step()
    assert not _running(d, "X") and "X" in d.conn.consumer.recvs
    assert d.counts_left()["aggregator"] == set()
    for rank in (0, 1):
        u.deliver(rank, "X", "t1", nonce)
    d.step()
    assert _running(d, "X")


# ------------------------------------------------------------------ nodes, over HTTP

TIMEOUT_S = 6.0  # outlives the tests' own steps on a loaded box (tests/test_disagg_faults.py)
UCXX_ARGS = ("--kv-transport", "ucxx", "--kv-transfer-timeout", str(TIMEOUT_S))
NODE_ARGS = (*UCXX_ARGS, "--num-blocks", "128")


@pytest.fixture(scope="module")
def pd_node_args() -> tuple[str, ...]:
    return NODE_ARGS


def _side_channel(node: Proc) -> str:
    return httpx.get(node.url + "/v1/kv_transfer_info", timeout=5).json()["side_channel"]


def _p_body(prompt: list[int], tid: str) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": 1,
        **HTTP_GREEDY,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid},
    }


def _d_body(prompt: list[int], tid: str, p_addr: str, n: int = 12) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": n,
        **HTTP_GREEDY,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_side_channel": p_addr,
        },
    }


def _disagg(prefill: Proc, decode: Proc, prompt: list[int], tid: str) -> list[int]:
    with ThreadPoolExecutor(1) as pool:
        p_fut = pool.submit(
            httpx.post, prefill.url + "/v1/completions", json=_p_body(prompt, tid), timeout=60
        )
        d = httpx.post(
            decode.url + "/v1/completions",
            json=_d_body(prompt, tid, _side_channel(prefill)),
            timeout=60,
        )
        assert p_fut.result().status_code == 200
    assert d.status_code == 200, d.text
    return d.json()["choices"][0]["token_ids"]


def _colocated(node: Proc, prompt: list[int], n: int = 12) -> list[int]:
    body = {"prompt": prompt, "max_tokens": n, **HTTP_GREEDY}
    resp = httpx.post(node.url + "/v1/completions", json=body, timeout=60)
    return resp.json()["choices"][0]["token_ids"]


def _pools_full(node: Proc) -> bool:
    return node.metric("pdserve_kv_blocks_used") == 0


def test_ucxx_nodes_report_the_transport_and_match_colocated(pd_pair: PD):
    p, d = pd_pair.p, pd_pair.d
    for node in (p, d):
        info = httpx.get(node.url + "/v1/kv_transfer_info", timeout=5).json()
        assert info["transport"]["library"] == "ucxx"
        assert info["compat"]["kv_transport"] == "ucxx"
    prompt = [random.Random(7).randint(0, 255) for _ in range(70)]
    before = d.metric("pdserve_prompt_tokens_total")
    tokens = _disagg(p, d, prompt, "ucxx-node-1")
    assert d.metric("pdserve_prompt_tokens_total") == before  # the KV was pushed
    assert tokens == _colocated(d, prompt)


def test_ucxx_push_to_a_dead_decode_fails_cleanly_and_drops_the_peer(procs: Procs):
    """D reserved, then died before P's push: the write errors (no hang), P frees its
    blocks, counts the failure and forgets the dead peer. The push is 25 blocks (800 KiB):
    over same-host shared memory a push under UCX's rendezvous threshold goes out eagerly
    and completes into a dead peer's memory as if sent (harmless: D is gone), so only a
    larger one shows the failure path (here by the deadline: shared memory does not report
    a dead peer). Its own pair with a longer transfer timeout: D's early reservation must
    outlive killing D on a loaded box (the module's 3 s is not enough; the NIXL twin in
    tests/test_disagg_faults.py saw it expire first once), and the push fails by it."""
    timeout_s = 8
    slow = (
        "--kv-transport",
        "ucxx",
        "--kv-transfer-timeout",
        str(timeout_s),
        "--num-blocks",
        "128",
    )
    prefill = procs.node("--kv-connector", "nixl", *slow, module="prefill_node")
    dead = procs.node("--kv-connector", "nixl", *slow, module="decode_node")
    _disagg(prefill, dead, list(range(5, 30)), "ucxx-dead-0")  # the peer is known to P
    peers = prefill.metric("pdserve_engine_kv_decode_peers")
    failures = prefill.metric("pdserve_engine_kv_transfer_failures_total")
    prompt, tid = [5 + i % 200 for i in range(400)], "ucxx-dead-1"
    with ThreadPoolExecutor(1) as pool:
        fut: Future = pool.submit(
            httpx.post,
            dead.url + "/v1/completions",
            json=_d_body(prompt, tid, _side_channel(prefill)),
            timeout=30,
        )
        wait_for(
            lambda: prefill.metric("pdserve_engine_kv_reservations_waiting") == 1,
            10,
            "P to hold the reservation",
        )
        kids = descendants(dead.pid)
        dead.proc.kill()
        dead.proc.wait(10)
        wait_gone(kids, 10)
        fut.cancel()
    resp = httpx.post(prefill.url + "/v1/completions", json=_p_body(prompt, tid), timeout=30)
    assert resp.status_code == 200
    wait_for(lambda: _pools_full(prefill), 2 * timeout_s + 10, "P to free the failed push's blocks")
    assert prefill.metric("pdserve_engine_kv_transfer_failures_total") == failures + 1
    assert prefill.metric("pdserve_engine_kv_decode_peers") == peers - 1
    assert prefill.metric("pdserve_engine_kv_transfers_in_flight") == 0


def test_ucxx_prefill_killed_after_decode_reserved(pd_pair: PD, procs: Procs):
    """P dies holding D's reservation: D's wait ends (liveness or deadline), D recomputes
    the prompt itself and answers the colocated tokens; its blocks come back."""
    decode = pd_pair.d
    prefill = procs.node("--kv-connector", "nixl", *NODE_ARGS, module="prefill_node")
    prompt = [random.Random(1).randint(0, 255) for _ in range(40)]
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            httpx.post,
            decode.url + "/v1/completions",
            json=_d_body(prompt, "ucxx-killed-1", _side_channel(prefill)),
            timeout=60,
        )
        wait_for(
            lambda: prefill.metric("pdserve_engine_kv_reservations_waiting") == 1,
            10,
            "P to hold the reservation",
        )
        kids = descendants(prefill.proc.pid)
        prefill.proc.kill()
        prefill.proc.wait(10)
        killed = time.monotonic()
        resp = fut.result(timeout=60)
        took = time.monotonic() - killed
    assert resp.status_code == 200, resp.text
    assert took < TIMEOUT_S + 5, f"recompute took {took:.1f}s after P died"
    assert resp.json()["choices"][0]["token_ids"] == _colocated(decode, prompt)
    wait_for(lambda: _pools_full(decode), 2 * TIMEOUT_S + 5, "D's quarantined blocks to free")
    wait_gone(kids, 10)
