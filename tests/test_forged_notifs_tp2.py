"""A forged NIXL notification that reaches only one of D's two TP ranks, carrying D's
current incarnation and a live reservation's nonce (what only the prefill node holding
that reservation, or someone who saw it, can name).

The decode side is the real scheduler, the real scheduler-side connector, two real
worker-side connectors (TP=2) on real NIXL agents (UCX loopback, CPU memory) and the
real all-ranks aggregator, stepped the way the executor steps them. The prefill side is
two real NIXL agents writing real blocks, and the forger a third agent that loads D rank
0's metadata and sends it a notification. Only reservations are not sent anywhere: the
test plays P.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from harness import free_port
from pd_ranks import counts_left, d_rank_step

import kvconnector.nixl.scheduler as nixl_scheduler
from engine.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, ParallelConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.executor.aggregator import KVOutputAggregator
from engine.kv_cache_layout import KVCacheSpec
from engine.model.config import load_arch_config
from engine.sampling_params import SamplingParams
from kvconnector.nixl import checksum
from kvconnector.nixl.messages import Notif
from kvconnector.nixl.prefill_links import PrefillLinks
from kvconnector.nixl.transport import NIXL_AVAILABLE, NixlTransport
from kvconnector.nixl.worker import NixlConnectorWorker
from kvconnector.params import KVTransferParams

if not NIXL_AVAILABLE:
    pytest.skip("nixl is not installed", allow_module_level=True)

BLOCKS = 64
TIMEOUT = 30.0  # the clock is moved past deadlines; real waits are for NIXL only
_monotonic = time.monotonic  # the real one (the test moves the process's clock)


class Clock:
    """The connector's monotonic clock, moved by the test (real time plus ``skew``)."""

    def __init__(self) -> None:
        self.skew = 0.0

    def __call__(self) -> float:
        return _monotonic() + self.skew


class DecodeTP2:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, kv_checksum: str) -> None:
        monkeypatch.setattr(PrefillLinks, "reserve_job", lambda *a: None)
        monkeypatch.setattr(PrefillLinks, "cancel_job", lambda *a: None)
        self.clock = Clock()
        monkeypatch.setattr(nixl_scheduler.time, "monotonic", self.clock)
        monkeypatch.setattr("kvconnector.nixl.consumer.time.monotonic", self.clock)
        cfg = EngineConfig(
            model=ModelConfig(model="tiny", max_model_len=256, dtype="float32"),
            cache=CacheConfig(block_size=4, num_blocks=BLOCKS),
            parallel=ParallelConfig(tp=2),
            kv_transfer=KVTransferConfig(
                kv_connector="nixl", kv_role="consumer", kv_transfer_timeout=TIMEOUT,
                peer_ping_interval=0, kv_checksum=kv_checksum, kv_failure_policy="fail",
            ),
        )  # fmt: skip
        spec = KVCacheSpec.for_model(load_arch_config("tiny"), cfg)
        self.spec = dataclasses.replace(spec, num_blocks=BLOCKS)
        self.conn = nixl_scheduler.NixlConnectorScheduler(cfg, self.spec)
        self.sch = Scheduler(cfg, BLOCKS, 256, self.conn)
        self.agg = KVOutputAggregator(2)
        self.workers: list[NixlConnectorWorker] = []
        self.closers: list[Callable[[], None]] = [self.conn.shutdown]
        for rank in range(2):
            w = NixlConnectorWorker(cfg, rank, 2)
            w.register_kv_caches(self.cache(0.0), self.spec)
            self.workers.append(w)
            self.closers.append(w.shutdown)
        self.p_address = f"tcp://127.0.0.1:{free_port()}"
        self.ended: dict[str, str] = {}  # request id -> its error or finish reason

    def cache(self, fill: float) -> Any:
        import torch

        return torch.full(self.spec.shape, fill, dtype=self.spec.torch_dtype)

    def agent(self, name: str, fill: float, peer_rank: int) -> NixlTransport:
        """A NIXL agent (a P rank, or a forger) with a peer: D rank ``peer_rank``."""
        t = NixlTransport(f"{name}-{uuid.uuid4().hex[:6]}", self.cache(fill), self.spec.block_bytes)
        self.closers.append(t.close)
        t.add_peer("d", self.workers[peer_rank].handshake_info())
        return t

    def add(self, rid: str, tid: str) -> tuple[str, list[int]]:
        params = KVTransferParams(
            do_remote_prefill=True, transfer_id=tid, remote_side_channel=self.p_address
        )
        req = Request(rid, list(range(1, 30)), SamplingParams(max_tokens=4))
        req.kv_transfer_params = params
        self.sch.add_request(req)
        self.step()
        recv = self.conn.consumer.recvs[rid]
        return recv.nonce, list(recv.block_ids)

    def step(self) -> None:
        so = self.sch.schedule()
        self.agg.forget(so.kv_connector_metadata.ended_transfer_keys())
        sampled = {seq.request_id: 1 for seq in so.seqs if seq.samples}
        outs = [d_rank_step(w, so, sampled) for w in self.workers]
        for out in self.sch.update_from_output(so, self.agg.aggregate(outs)):
            if out.finished:
                self.ended[out.request_id] = out.error or str(out.finish_reason)

    def steps_until(self, cond: Callable[[], bool], limit: float = 10.0) -> bool:
        deadline = _monotonic() + limit
        while _monotonic() < deadline:
            self.step()
            if cond():
                return True
            time.sleep(0.01)
        return False

    def running(self, rid: str) -> bool:
        return any(r.request_id == rid for r in self.sch.running)

    def free(self, blocks: list[int]) -> set[int]:
        return set(blocks) & set(self.sch.kv.pool._free)

    def counts_left(self) -> dict[str, Any]:
        return counts_left(self.agg, self.workers)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


def _decode(monkeypatch: pytest.MonkeyPatch, kv_checksum: str) -> Iterator[DecodeTP2]:
    d = DecodeTP2(monkeypatch, kv_checksum)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def decode(monkeypatch: pytest.MonkeyPatch) -> Iterator[DecodeTP2]:
    yield from _decode(monkeypatch, "off")


@pytest.fixture
def decode_checked(monkeypatch: pytest.MonkeyPatch) -> Iterator[DecodeTP2]:
    yield from _decode(monkeypatch, "full")


def _push(
    d: DecodeTP2, p: NixlTransport, rid: str, tid: str, nonce: str, blocks: list[int]
) -> None:
    """P rank ``p`` writes ``blocks`` (same ids on both sides) with the notification its
    worker would build (sums of what it writes when D checks them)."""
    notif = Notif(r=rid, t=tid, k=nonce, n=1)
    if d.workers[0]._checksum != "off":
        picks = checksum.pick(len(blocks), d.workers[0]._checksum, nonce)
        sums = checksum.block_sums(p._kv_cache, [blocks[i] for i in picks], None)
        notif = Notif(
            r=rid, t=tid, k=nonce, n=1, c=tuple(zip([blocks[i] for i in picks], sums, strict=True))
        )
    handle = p.write_blocks("d", blocks, blocks, notif.pack())
    deadline = _monotonic() + 10
    while p.poll(handle) == "pending" and _monotonic() < deadline:
        for w in d.workers:  # D's ranks progress UCX between steps (no progress thread)
            w.progress()
        time.sleep(0.005)
    assert p.poll(handle) == "done", handle.error
    p.release(handle)


def test_a_forged_notification_on_one_rank_ends_at_the_deadline_and_touches_no_other_request(
    decode: DecodeTP2,
) -> None:
    """Rank 0 takes the forged notification for X's KV and reports it; rank 1 waits for
    one that never comes. X must not decode (one rank is not all ranks), must end by its
    deadline (an error to the client: --kv-failure-policy fail), its blocks must stay
    held for the quarantine (a WRITE of P's may still land) and then go back, with no
    count left on any rank or in the aggregator; Y, pushed for real meanwhile, decodes
    from exactly P's bytes."""
    d = decode
    x, x_blocks = d.add("X", "tX")
    y, y_blocks = d.add("Y", "tY")
    forger = d.agent("forger", 9.0, peer_rank=0)
    assert forger.send_notif("d", Notif(r="X", t="tX", k=x, n=1).pack())
    p = [d.agent(f"p{r}", 1.0 + r, peer_rank=r) for r in range(2)]
    for rank in range(2):
        _push(d, p[rank], "Y", "tY", y, y_blocks)
    assert d.steps_until(lambda: d.running("Y") and x in d.agg.pending_ids)
    assert not d.running("X") and "X" in d.conn.consumer.recvs  # rank 0 alone: not landed
    for rank, w in enumerate(d.workers):
        assert w._kv_cache is not None
        assert bool((w._kv_cache[y_blocks] == 1.0 + rank).all()), "Y's KV is not P's"
        assert bool((w._kv_cache[x_blocks] == 0.0).all()), "X's blocks were written"

    d.clock.skew = TIMEOUT + 1  # X's deadline passes
    d.step()
    d.step()
    assert "KV" in d.ended.get("X", ""), d.ended  # an error to the client
    assert "X" in d.conn.consumer.quarantine
    assert d.free(x_blocks) == set(), "X's blocks were freed while P may still write them"
    assert x in d.agg.pending_ids  # rank 0's report counts until the transfer ends

    d.clock.skew = 3 * TIMEOUT + 2  # the quarantine (2T) is over
    d.step()
    d.step()
    assert not d.conn.consumer.quarantine and not d.conn.consumer.recvs
    assert d.free(x_blocks) == set(x_blocks)
    assert d.counts_left() == {"aggregator": set(), "rank0": {}, "rank1": {}}
    assert d.running("Y") or d.ended.get("Y") == "length", d.ended  # Y decoded on


def test_a_forged_notification_on_one_rank_keeps_the_blocks_while_the_real_write_may_land(
    decode_checked: DecodeTP2,
) -> None:
    """With --kv-checksum, the forged notification (no sums) completes X on rank 0 with
    a KV error, and P rank 1's real WRITE completes it on rank 1: every rank reported, so
    the load fails -- but P rank 0's real WRITE has not landed yet (rank 0 took the forged
    notification for it). The blocks must stay quarantined until P confirms or 2T pass.
    Before: the load failed 'safely' (a checksum failure meant every WRITE had landed), X's
    blocks went back to the pool at once, and P rank 0's WRITE landed in blocks another
    request could hold by then."""
    d = decode_checked
    x, x_blocks = d.add("X", "tX")
    forger = d.agent("forger", 9.0, peer_rank=0)
    assert forger.send_notif("d", Notif(r="X", t="tX", k=x, n=1).pack())
    p = [d.agent(f"p{r}", 1.0 + r, peer_rank=r) for r in range(2)]
    _push(d, p[1], "X", "tX", x, x_blocks)  # rank 1's part lands; rank 0's is slow
    assert d.steps_until(lambda: "X" not in d.conn.consumer.recvs)
    assert not d.running("X")  # never decoded from
    assert "X" in d.conn.consumer.quarantine
    assert d.free(x_blocks) == set(), "X's blocks were freed while P rank 0 may write them"
    _push(d, p[0], "X", "tX", x, x_blocks)  # P rank 0's WRITE lands now: still X's blocks
    d.clock.skew = 3 * TIMEOUT + 2  # no confirmation from P here: the quarantine runs out
    d.step()
    d.step()
    assert not d.conn.consumer.quarantine
    assert d.free(x_blocks) == set(x_blocks)
    assert d.counts_left() == {"aggregator": set(), "rank0": {}, "rank1": {}}
