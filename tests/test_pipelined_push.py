"""Layer-pipelined push: P writes a prefill's KV a layer group at a time while the forward
runs (``--kv-layer-group-size``). Transport pieces with real NIXL agents here; the
engine paths (token identity, TP 1 and 2, a P killed mid-pipeline) further down."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

nixl_transport = pytest.importorskip("kvconnector.nixl.transport")
if not nixl_transport.NIXL_AVAILABLE:
    pytest.skip("nixl not installed", allow_module_level=True)
NixlTransport = nixl_transport.NixlTransport


def _wait_done(t, handle, limit: float = 30.0) -> str:
    deadline = time.monotonic() + limit
    while t.poll(handle) == "pending" and time.monotonic() < deadline:
        time.sleep(0.001)
    return t.poll(handle)


def _pair(layers: int, heads_p: int, heads_d: int, blocks: int = 8):
    bs, dim = 4, 8
    p_kv = torch.randn(blocks, layers, 2, heads_p, bs, dim)  # [block, layer, kv, head, tok, dim]
    d_kv = torch.zeros(blocks, layers, 2, heads_d, bs, dim)
    p = NixlTransport(f"P-{uuid.uuid4().hex[:6]}", p_kv, p_kv[0].numel() * 4,
                      num_layers=layers, num_heads=heads_p, layer_ranges=True)  # fmt: skip
    d = NixlTransport(f"D-{uuid.uuid4().hex[:6]}", d_kv, d_kv[0].numel() * 4,
                      num_layers=layers, num_heads=heads_d)  # fmt: skip
    return p, d, p_kv, d_kv


def test_layer_range_writes_move_exactly_those_layers_of_whole_blocks():
    layers = 5
    p, d, p_kv, d_kv = _pair(layers, 2, 2)
    try:
        p.add_peer("d", d.metadata())
        src, dst = [1, 2, 3, 6], [4, 5, 6, 0]
        h = p.write_blocks("d", src, dst, b"a", layers=(0, 2))
        assert _wait_done(p, h) == "done"
        assert h.num_descriptors == len(src)  # one per block: its layers are adjacent
        assert h.num_bytes == len(src) * 2 * p_kv[0, 0].numel() * 4
        for s, t in zip(src, dst, strict=True):
            assert torch.equal(d_kv[t, :2], p_kv[s, :2])
            assert not d_kv[t, 2:].any()  # later layers not written yet
        h = p.write_blocks("d", src, dst, b"b", layers=(2, layers))
        assert _wait_done(p, h) == "done"
        for s, t in zip(src, dst, strict=True):
            assert torch.equal(d_kv[t], p_kv[s])
        untouched = [b for b in range(8) if b not in dst]
        assert not d_kv[untouched].any()
        deadline = time.monotonic() + 10
        notifs: list[bytes] = []
        while len(notifs) < 2 and time.monotonic() < deadline:
            notifs += d.get_notifs()
        assert sorted(notifs) == [b"a", b"b"]
        with pytest.raises(ValueError, match="out of"):
            p.write_blocks("d", [0], [0], layers=(3, 6))
    finally:
        p.close()
        d.close()


def test_layer_range_writes_of_a_head_slice():
    """Heterogeneous TP: P's one head goes into head 1 of D's two, a layer range at a time."""
    layers = 3
    p, d, p_kv, d_kv = _pair(layers, 1, 2)
    try:
        p.add_peer("d", d.metadata(), heads=(0, 1, 1))
        h = p.write_blocks("d", [1, 2], [4, 0], layers=(1, 2))
        assert _wait_done(p, h) == "done"
        assert h.num_descriptors == 2 * 2  # (block, kv) units of the one layer
        assert torch.equal(d_kv[4, 1, :, 1], p_kv[1, 1, :, 0])
        assert torch.equal(d_kv[0, 1, :, 1], p_kv[2, 1, :, 0])
        d_kv[4, 1, :, 1] = 0
        d_kv[0, 1, :, 1] = 0
        assert not d_kv.any()  # nothing else was written
    finally:
        p.close()
        d.close()


# -- engines: real worker processes, NIXL over UCX -------------------------------------

import sys  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

from engine.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine.core.request import Request  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kvconnector.params import KVTransferParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from hf_models import random_prompt  # noqa: E402
from pd_utils import disagg_generate, nixl_config, run_until  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, temperature=0)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=7)
GROUP = 1  # tiny has 4 layers: 4 pieces per send


def _engines(
    tp: int, group: int = GROUP, tp_d: int | None = None, **kv: object
) -> tuple[EngineCore, EngineCore]:
    base = EngineConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=160))
    p_base = base.replace(parallel=ParallelConfig(tp=tp))
    d_base = base.replace(parallel=ParallelConfig(tp=tp if tp_d is None else tp_d))
    p = EngineCore(nixl_config(p_base, "producer", kv_layer_group_size=group, **kv))
    d = EngineCore(nixl_config(d_base, "consumer", **kv))
    return p, d


def _pd(p, d, prompts, params, reserve_first: bool = True, timeout: float = 180.0) -> dict:
    """P/D with D's reservations at P before P's prefill (so that it pipelines)."""
    return disagg_generate(p, d, prompts, params, tag="t", timeout=timeout,
                           reserve_first=reserve_first)  # fmt: skip


def _all_free(*engines: EngineCore) -> None:
    for eng in engines:
        s = eng.stats()
        assert s["kv_blocks_free"] == s["kv_blocks_total"]
        assert eng.executor.aggregator.pending_ids == set()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "tp_d", "kv_checksum"),
    [(1, 1, "off"), (2, 2, "full"), (2, 1, "full")],
    ids=["tp1", "tp2", "P2-D1-head-slices"],
)
def test_pipelined_push_is_token_identical_to_colocated_and_unpipelined(tp, tp_d, kv_checksum):
    """Prompts shorter than a block, an exact multiple of the block size, and 990 tokens;
    greedy and seeded: pipelined P/D == colocated, D computes no prompt token, and every
    send went out in pieces (4 per P rank: one per layer group; with P2 -> D1 both P
    ranks write their heads into D's one rank); with checksums, the sums of the last
    pieces verify every block once all pieces landed."""
    prompts = [random_prompt(n, 256, seed=n) for n in (5, 32, 990)]
    p, d = _engines(tp, tp_d=tp_d, kv_checksum=kv_checksum)
    try:
        base = EngineConfig(
            model=ModelConfig(model="tiny"),
            cache=CacheConfig(num_blocks=160),
            scheduler=SchedulerConfig(async_scheduling=False),  # P and D: the default, async
        )
        with LLM(base) as llm:
            want = [llm.generate_token_ids(prompts, sp) for sp in (GREEDY, SEEDED)]
        for sp, tokens in zip((GREEDY, SEEDED), want, strict=True):
            res = _pd(p, d, prompts, sp)
            assert res["tokens"] == tokens, sp
            assert all(f.error is None for f in res["final"])
        ps, ds = p.stats(), d.stats()
        assert ps["kv_pipelined_transfers_total"] == 2 * len(prompts)
        assert ds["prompt_tokens_total"] == 0  # every prompt decoded from pushed KV
        assert ds["kv_notifs_received_total"] == 2 * len(prompts) * 4 * tp  # pieces x P ranks
        assert ds["kv_checksum_failures_total"] == 0
        # What each push added after its prefill, one observation per push.
        assert p.connector.histograms["kv_push_exposed_seconds"].count == 2 * len(prompts)
        # The same P unpipelined (P's prefill before D's reservation): same tokens.
        res = _pd(p, d, prompts, GREEDY, reserve_first=False)
        assert res["tokens"] == want[0]
        _all_free(p, d)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 4], ids=["four-pieces", "one-piece"])
def test_async_scheduling_pipelined_push_carries_the_first_token(group, monkeypatch):
    """P and D with async scheduling and the sampled ids read back late (as on CUDA): the
    last piece still carries P's first token -- also with one layer group, where the
    forward has no layer hook -- so D computes no prompt token and the tokens are the
    colocated ones."""
    from engine.worker.model_runner import DEFER_READBACK_ENV

    monkeypatch.setenv(DEFER_READBACK_ENV, "1")
    prompts = [random_prompt(n, 256, seed=n) for n in (5, 32, 90)]
    base = EngineConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=160))
    with LLM(base.replace(scheduler=SchedulerConfig(async_scheduling=False))) as llm:
        want = llm.generate_token_ids(prompts, SEEDED)  # a synchronous colocated engine
    base = base.replace(scheduler=SchedulerConfig(async_scheduling=True))
    p = EngineCore(nixl_config(base, "producer", kv_layer_group_size=group))
    d = EngineCore(nixl_config(base, "consumer"))
    try:
        res = _pd(p, d, prompts, SEEDED)
        assert res["tokens"] == want
        assert p.stats()["kv_pipelined_transfers_total"] == len(prompts)
        assert d.stats()["prompt_tokens_total"] == 0  # the first token came with the KV
        _all_free(p, d)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.slow
def test_a_prefill_killed_mid_pipeline_leaves_decode_recomputing_the_right_tokens(monkeypatch):
    """P's worker dies after posting the first layer group: D never counts the send
    complete, gives up after its deadline, keeps the blocks a late WRITE could reach
    quarantined (P says the send is in flight), recomputes the prompt itself -- the right
    tokens -- and in the end holds no block."""
    prompts = [random_prompt(70, 256, seed=70)]
    base = EngineConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=160))
    with LLM(base) as llm:
        want = llm.generate_token_ids(prompts, GREEDY)
    timeout = 2.0
    monkeypatch.setenv("PDSERVE_FAULT_DIE_MID_PIPELINE", "1")
    p = EngineCore(nixl_config(base, "producer", kv_layer_group_size=GROUP,
                               kv_transfer_timeout=timeout))  # fmt: skip
    monkeypatch.delenv("PDSERVE_FAULT_DIE_MID_PIPELINE")
    d = EngineCore(nixl_config(base, "consumer", kv_transfer_timeout=timeout))
    try:
        tid = f"kill-{time.monotonic_ns()}"
        kv = KVTransferParams(
            do_remote_prefill=True, transfer_id=tid, remote_side_channel=p.connector.address
        )
        d.add_request(Request("d-0", prompts[0], GREEDY, kv_transfer_params=kv))
        run_until([d], lambda: len(p.connector.producer.early) == 1, lambda e, o: None, 60)
        p.add_request(
            Request("p-0", prompts[0], replace(GREEDY, max_tokens=1),
                    kv_transfer_params=KVTransferParams(do_remote_decode=True, transfer_id=tid))
        )  # fmt: skip
        with pytest.raises(Exception):  # noqa: B017 - the worker died mid-step
            for _ in range(3):  # async scheduling: it shows when that step is waited for
                p.step()
        assert p.connector.producer.in_flight  # the send had started: pieces were posted
        tokens: list[int] = []
        quarantined = []
        done = []

        def on_output(eng, out) -> None:
            tokens.extend(out.new_token_ids)
            if out.finished:
                done.append(out)

        def finished() -> bool:
            quarantined.append(d.stats()["kv_quarantined_requests"])
            return bool(done)

        run_until([d], finished, on_output, 60)
        assert tokens == want[0] and done[0].error is None
        ds = d.stats()
        assert ds["kv_loads_failed_total"] == 1
        assert ds["prompt_tokens_total"] == len(prompts[0])  # recomputed on D
        assert max(quarantined) == 1  # the blocks P may still write stayed out of use
        run_until([d], lambda: not d.has_work(), lambda e, o: None, 60)
        _all_free(d)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.slow
def test_a_decode_prefix_hit_shrinks_a_pipelined_push():
    """D already holds the first blocks of the prompt: it reserves only the rest, and P
    pipelines just those blocks into them; tokens still match colocated."""
    first = random_prompt(64, 256, seed=64)  # 4 full blocks
    longer = first + random_prompt(30, 256, seed=30)
    base = EngineConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=160))
    with LLM(base) as llm:
        want = llm.generate_token_ids([first, longer], GREEDY)
    p, d = _engines(1)
    try:
        assert _pd(p, d, [first], GREEDY)["tokens"] == want[:1]
        sent = p.stats()["kv_blocks_sent_total"]
        assert _pd(p, d, [longer], GREEDY)["tokens"] == want[1:]
        ps = p.stats()
        assert ps["kv_pipelined_transfers_total"] == 2
        # 4 layer pieces of the 2 blocks D did not hold (of the 6 the prompt fills).
        assert ps["kv_blocks_sent_total"] - sent == 4 * 2
        assert d.stats()["prompt_tokens_total"] == 0
        _all_free(p, d)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.slow
def test_a_prefill_leg_waits_briefly_for_its_reservation_so_that_it_can_pipeline():
    """P gets its leg before D reserved (as when the proxy sends both at once and P is
    idle): it holds the leg up to --kv-pipeline-wait-ms for the reservation, then
    pipelines; a leg whose reservation never comes runs after the wait, unpipelined."""
    prompts = [random_prompt(40, 256, seed=41)]
    p, d = _engines(1, kv_pipeline_wait_ms=10_000)  # long: the order, not the clock, decides
    try:
        base = EngineConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=160))
        with LLM(base) as llm:
            want = llm.generate_token_ids(prompts, GREEDY)
        res = _pd(p, d, prompts, GREEDY, reserve_first=False)
        assert res["tokens"] == want
        assert p.stats()["kv_pipelined_transfers_total"] == 1
        _all_free(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_delay_admission_holds_only_prefill_legs_without_a_reservation_and_only_so_long():
    from engine.config import KVTransferConfig
    from engine.kv_cache_layout import KVCacheSpec
    from kvconnector.nixl.decode_peers import DecodePeer
    from kvconnector.nixl.producer import Reservation
    from kvconnector.nixl.scheduler import NixlConnectorScheduler

    cfg = EngineConfig(model=ModelConfig(model="tiny"), kv_transfer=KVTransferConfig(
        kv_connector="nixl", kv_role="producer", kv_layer_group_size=1, kv_pipeline_wait_ms=50,
        kv_reserve_first=False))  # fmt: skip
    spec = KVCacheSpec(num_blocks=8, num_layers=4, num_kv_heads=2, block_size=16, head_dim=32,
                       dtype=torch.float32)  # fmt: skip
    conn = NixlConnectorScheduler(cfg, spec)
    try:
        leg = KVTransferParams(do_remote_decode=True, transfer_id="t1")
        p_req = Request("p", [1, 2, 3], replace(GREEDY, max_tokens=1), kv_transfer_params=leg)
        plain = Request("c", [1, 2, 3], GREEDY)
        assert conn.delay_admission(p_req) and not conn.delay_admission(plain)
        # An idle engine loop waits no longer than the delay (then admits it anyway).
        assert conn.admission_retry_at() == pytest.approx(p_req.arrival_time + 0.05)
        assert conn.admission_retry_at() is None  # taken once per step
        conn.producer.early["t1"] = Reservation("t1", "n", "d", "k", "a", [0], 0, 1e18)
        assert conn.delay_admission(p_req)  # its reservation is here, its peer unconfirmed
        ranks = [{"num_blocks": 8}]
        conn.service.peers.peers["k"] = DecodePeer("d", "i", "a", ranks, "x", verified=True)
        assert not conn.delay_admission(p_req)  # ... and now confirmed
        del conn.producer.early["t1"]
        p_req.arrival_time -= 0.05
        assert not conn.delay_admission(p_req)  # waited long enough
    finally:
        conn.shutdown()


def test_a_rank_that_samples_nothing_waits_for_the_gpu_before_the_last_piece(monkeypatch):
    """Unit level (a recording transport, a stand-in CUDA cache): every piece of a
    pipelined send is posted only after the GPU finished writing its KV. The middle pieces
    wait in ``save_kv_layer``; the last goes from ``wait_for_save``, where only rank 0's
    sampling has waited for the GPU -- a rank that samples nothing (TP > 1 on NCCL) must
    wait itself, or D receives the last layers' KV from before they were written."""
    from types import SimpleNamespace

    from engine.config import KVTransferConfig
    from kvconnector.nixl.messages import Notif
    from kvconnector.nixl.metadata import NixlConnectorMetadata, SendSpec
    from kvconnector.nixl.worker import NixlConnectorWorker

    log: list[tuple] = []

    class Transport:
        def write_blocks(self, sub, local, remote, notif, layers=None):
            log.append(("write", layers))
            return object()

    cfg = EngineConfig(kv_transfer=KVTransferConfig(kv_connector="nixl", kv_role="producer"))
    w = NixlConnectorWorker(cfg, 1, 2)
    w.transport = Transport()  # type: ignore[assignment]
    w._kv_cache = SimpleNamespace(is_cuda=True, device="cuda:1")  # type: ignore[assignment]
    stream = SimpleNamespace(synchronize=lambda: log.append(("sync",)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    w._groups = [(0, 2), (2, 4)]
    w._targets = {"peer": [("sub", None, 1)]}  # type: ignore[dict-item]
    send = SendSpec("r", "peer", [1], [2], Notif(r="r", t="t", k="n1").pack(), pipelined=True)
    w.bind_connector_metadata(NixlConnectorMetadata(sends=[send]))
    w.start_load_kv()
    assert w.wants_layer_hook()
    w.save_kv_layer(1)  # layers 0-1 written: the first piece
    w.wait_for_save({})  # this rank sampled nothing
    assert log == [("sync",), ("write", (0, 2)), ("sync",), ("write", (2, 4))]
    w.clear_connector_metadata()
