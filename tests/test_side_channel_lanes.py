"""Per-peer side-channel lanes (issue 9, hole 7): a peer that does not answer delays only
the calls to itself; calls to one peer run in order; every lane is bounded."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq
from harness import free_port, wait_for

import kvconnector.nixl.peer_channel as peer_channel
import kvconnector.nixl.prefill_links as prefill_links
import kvconnector.nixl.scheduler as nixl_scheduler
from engine.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.kv_cache_layout import KVCacheSpec
from engine.log_limit import LogLimit, held_back
from engine.model.config import load_arch_config
from engine.sampling_params import SamplingParams
from kvconnector.nixl.lanes import LaneFull, PeerLanes
from kvconnector.nixl.messages import Ack, HandshakeReply, decode_request
from kvconnector.nixl.side_channel import SideChannelServer
from kvconnector.params import KVTransferParams


def test_a_blocked_peer_does_not_hold_up_another_peers_calls():
    lanes = PeerLanes()
    release = threading.Event()
    try:
        stuck = [lanes.submit("tcp://dead:1", release.wait) for _ in range(20)]
        healthy = lanes.submit("tcp://alive:1", lambda: "answered")
        assert healthy.result(timeout=30) == "answered"
        assert not any(f.done() for f in stuck)
    finally:
        release.set()
        lanes.shutdown()


def test_calls_to_one_peer_run_in_the_order_they_were_queued():
    lanes = PeerLanes()
    seen: list[int] = []
    try:
        futures = [lanes.submit("p", seen.append, i) for i in range(200)]
        for f in futures:
            f.result(timeout=30)
        assert seen == list(range(200))
    finally:
        lanes.shutdown()


def test_lanes_are_bounded_per_peer_and_in_number():
    lanes = PeerLanes(max_queued=3, max_lanes=2)
    release = threading.Event()
    try:
        lanes.submit("a", release.wait)  # running: the queue is empty again
        wait_for(lambda: lanes._lanes["a"].queue.empty(), 10, "lane a to start its call")
        for _ in range(3):
            lanes.submit("a", release.wait)
        with pytest.raises(LaneFull, match="3 calls already queued"):
            lanes.submit("a", release.wait)
        lanes.submit("b", release.wait, proven=True)
        with pytest.raises(LaneFull, match="2 peer lanes"):
            lanes.submit("c", lambda: None, proven=True)
        assert lanes.refused == 2
    finally:
        release.set()
        lanes.shutdown()


def test_unproven_peers_share_a_few_lanes_and_idle_lanes_make_room():
    """Peers that never proved themselves (addresses clients name) take at most
    ``max_unproven`` lanes, so a proven peer still gets one; at a bound an idle lane is
    ended rather than a call refused (it used to live on for ``idle_s``, 30 s)."""
    lanes = PeerLanes(max_lanes=4, max_unproven=2)
    release = threading.Event()
    try:
        lanes.submit("u1", release.wait)
        lanes.submit("u2", release.wait)
        with pytest.raises(LaneFull, match="2 lanes of unproven peers"):
            lanes.submit("u3", release.wait)
        assert lanes.submit("p1", lambda: "ok", proven=True).result(timeout=10) == "ok"
        wait_for(lambda: lanes._lanes["p1"].idle(), 10, "p1's call to end")
        lanes.submit("p2", release.wait, proven=True)
        lanes.submit("p3", release.wait, proven=True)  # ends idle p1's lane: four in all
        assert sorted(lanes._lanes) == ["p2", "p3", "u1", "u2"]
        with pytest.raises(LaneFull, match="4 peer lanes"):
            lanes.submit("p4", release.wait, proven=True)
        # A peer that proves itself later leaves the unproven pool.
        lanes.submit("u1", lambda: None, proven=True)
        assert lanes.num_lanes(proven=False) == 1
    finally:
        release.set()
        lanes.shutdown()


def test_an_idle_lane_ends_its_thread():
    lanes = PeerLanes(idle_s=0.05)
    try:
        lanes.submit("p", lambda: None).result(timeout=10)
        thread = lanes._lanes["p"].thread
        wait_for(lambda: lanes.num_lanes() == 0, 10, "the idle lane to retire")
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert lanes.submit("p", lambda: 7).result(timeout=10) == 7  # a new lane
    finally:
        lanes.shutdown()


# -- the decode connector with one silent and one healthy prefill peer ------------------


class HealthyPrefill:
    """A prefill side channel that pairs with anyone and acknowledges every reservation."""

    def __init__(self, compat: dict) -> None:
        self.compat = compat
        self.server = SideChannelServer("127.0.0.1", 0, self._handle)
        self.address = self.server.address

    def _handle(self, raw: dict) -> dict:
        msg = decode_request(raw)
        if msg.KIND == "handshake":
            return HandshakeReply(
                engine_id="p",
                incarnation="p1",
                side_channel=self.address,
                role="producer",
                compat=self.compat,
                transport={},
                ranks=({"num_blocks": 256},),  # one rank, as compat's tp_size says
            ).to_wire()
        return Ack().to_wire()


def _add_remote(sch: Scheduler, rid: str, address: str, prompt: list[int]) -> None:
    """A decode leg whose prompt's KV the prefill node at ``address`` is to push."""
    params = KVTransferParams(do_remote_prefill=True, transfer_id=rid, remote_side_channel=address)
    sch.add_request(Request(rid, prompt, SamplingParams(max_tokens=2), kv_transfer_params=params))


def _decode_connector(
    num_blocks: int, timeout: float = 60, max_num_seqs: int = 64
) -> tuple[EngineConfig, nixl_scheduler.NixlConnectorScheduler]:
    """A decode node's scheduler-side connector (tiny model, no liveness pings)."""
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=256, dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        kv_transfer=KVTransferConfig(
            kv_connector="nixl",
            kv_role="consumer",
            kv_transfer_timeout=timeout,
            peer_ping_interval=0,
        ),
    )
    spec = KVCacheSpec.for_model(load_arch_config("tiny"), cfg)
    return cfg, nixl_scheduler.NixlConnectorScheduler(cfg, spec)


def test_a_silent_prefill_peer_does_not_delay_reservations_to_a_healthy_one(monkeypatch):
    """Twelve reservations to a prefill node that never answers, then one to a healthy
    node: the healthy one is acknowledged while the silent ones still wait. With one
    shared 8-thread pool it waited until the silent node's calls timed out."""
    monkeypatch.setattr(prefill_links, "RPC_TIMEOUT_S", 20.0)
    cfg, conn = _decode_connector(256)
    conn.set_worker_info([{"num_blocks": 256}])
    sch = Scheduler(cfg, 256, 256, conn)
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    silent_address = f"tcp://127.0.0.1:{free_port()}"
    silent.bind(silent_address)
    healthy = HealthyPrefill(conn.compat)
    try:
        for i in range(12):
            _add_remote(sch, f"s{i}", silent_address, [1, 2, 3, 4, 5])
        _add_remote(sch, "h", healthy.address, [1, 2, 3, 4, 5])
        sch.schedule()
        wait_for(lambda: conn.consumer.recvs["h"].reserved, 30, "the healthy reservation")
        assert all(f"s{i}" in conn.consumer.recvs for i in range(12))
        assert not any(conn.consumer.recvs[f"s{i}"].reserved for i in range(12))
    finally:
        conn.shutdown()
        healthy.server.close()
        silent.close(linger=0)
        ctx.term()
        time.sleep(0)


def test_silent_prefill_addresses_a_client_names_leave_lanes_for_a_paired_prefill_node(
    monkeypatch,
):
    """A client may name any allowed address as a decode leg's prefill node. 256 of them
    that take the connection and never answer held every one of D's 256 lanes (each call
    for its RPC timeout, then idle for 30 s): a reservation to the prefill node D is
    paired with was refused at once (LaneFull; D recomputed). Addresses that never
    completed a handshake now share a small pool of lanes; a paired one still gets a lane."""
    monkeypatch.setattr(prefill_links, "RPC_TIMEOUT_S", 60.0)  # the silent calls stay stuck
    # Room to start every request at once: those refused a lane recompute.
    cfg, conn = _decode_connector(2048, timeout=120, max_num_seqs=512)
    conn.set_worker_info([{"num_blocks": 2048}])
    conn.channel.lanes.idle_s = 0.1  # the paired node's lane ends soon after its call (30 s live)
    sch = Scheduler(cfg, 2048, 2048, conn)
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # takes connections on every port, never answers
    silent_addresses = [
        f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}" for _ in range(256)
    ]
    healthy = HealthyPrefill(conn.compat)
    try:
        _add_remote(sch, "paired", healthy.address, [1, 2, 3, 4])
        sch.schedule()
        wait_for(lambda: conn.consumer.recvs["paired"].reserved, 30, "the first reservation")
        wait_for(
            lambda: conn.channel.lanes.num_lanes() == 0, 30, "the paired node's lane to idle out"
        )

        for i, address in enumerate(silent_addresses):
            _add_remote(sch, f"s{i}", address, [1, 2, 3, 4])
        sch.schedule()
        waiting = [f"s{i}" for i in range(256) if f"s{i}" in conn.consumer.recvs]
        assert waiting, "no call to a silent address was made at all"

        _add_remote(sch, "again", healthy.address, [1, 2, 3, 4])
        sch.schedule()
        assert "again" in conn.consumer.recvs, "the paired prefill node got no lane"
        wait_for(lambda: conn.consumer.recvs["again"].reserved, 30, "the paired reservation")
        assert not any(conn.consumer.recvs[rid].reserved for rid in waiting)
    finally:
        conn.shutdown()
        healthy.server.close()
        silent.close(linger=0)
        ctx.term()


def test_a_flood_of_lane_refusals_logs_a_few_lines_the_first_one_and_what_it_held_back(
    monkeypatch, caplog
):
    """Every call refused at a lane bound was logged at WARNING, one line each: a client
    naming addresses that take the connection and never answer (a decode leg's prefill
    node is any allowed address) filled D's log with a line per request. Now at most one
    line per peer class (proven, unproven) per ``PEER_LOG_S``: the first refusal is
    logged at once, a proven peer's refusal is not held back behind the strangers' line,
    and the next line says how many were held back (every refusal is accounted for)."""
    monkeypatch.setattr(peer_channel, "PEER_LOG_S", 0.5)
    cfg, conn = _decode_connector(64)
    conn.channel.lanes.shutdown()
    conn.channel.lanes = PeerLanes(max_lanes=2, max_unproven=1)  # one lane each, both kept busy
    busy = threading.Event()
    caplog.set_level(logging.WARNING, logger=peer_channel.__name__)

    def lines(part: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if f"not calling {part}" in r.getMessage()]

    try:
        assert conn.channel.submit("tcp://127.0.0.1:1", busy.wait, proven=False)
        assert conn.channel.submit("tcp://127.0.0.1:2", busy.wait, proven=True)
        n = 500
        start = time.monotonic()
        for i in range(n):
            assert not conn.channel.submit(
                f"tcp://10.0.{i // 250}.{i % 250}:9", busy.wait, proven=False
            )
        assert not conn.channel.submit("tcp://127.0.0.1:3", busy.wait, proven=True)
        took = time.monotonic() - start
        strangers = lines("tcp://10.")
        assert strangers[0].startswith("side channel: not calling tcp://10.0.0.0:9: "), strangers
        assert "lanes of unproven peers in use" in strangers[0] and not held_back(strangers[0])
        assert len(strangers) <= 2 + took / 0.5, (len(strangers), took)  # was one per call
        assert len(lines("tcp://127.0.0.1:3")) == 1  # the proven class has its own line
        time.sleep(0.6)  # past the period: the next refusal is logged, with the count
        assert not conn.channel.submit("tcp://10.1.0.0:9", busy.wait, proven=False)
        strangers = lines("tcp://10.")
        assert strangers[-1].startswith("side channel: not calling tcp://10.1.0.0:9")
        assert len(strangers) + sum(held_back(line) for line in strangers) == n + 1, strangers
        # Every refusal counted (/metrics: pdserve_engine_kv_side_channel_calls_refused_total).
        assert conn.stats()["kv_side_channel_calls_refused_total"] == n + 2
    finally:
        busy.set()
        conn.shutdown()


def test_a_log_limit_writes_the_first_line_and_counts_the_ones_it_held_back():
    now = [100.0]
    limit = LogLimit(10.0, clock=lambda: now[0])
    assert limit.take() == 0  # the first line: written, nothing held back
    assert [limit.take() for _ in range(5)] == [None] * 5
    now[0] += 9.9
    assert limit.take() is None
    now[0] += 0.1  # a period after the last line written
    assert limit.take() == 6
    assert limit.take() is None
