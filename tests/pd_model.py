"""A prefill node and a decode node, each the real scheduler with the real scheduler-side
NIXL connector and block pool, talking through an in-process message queue a test
controls (for ``test_property_pd_protocol.py`` and ``test_pd_protocol_races.py``).

Only the transport is a stand-in: side-channel calls (D's reservations, cancels and
liveness pings, P's failure notices and checks of a new peer's claim) are queued instead
of run on a peer's lane, and delivered when the test says (in any order, lost, their
reply lost, sent twice, not sent; a message replayed late, even at a process that
restarted since; a reservation on the wire while its request ends); P's TP ranks post and report
WRITEs when the test says (each rank on its own, ok or failed); D's ranks are the real
worker-side connectors, their notifications handed in by the test; a fake clock drives
every deadline, and ids are counted (an example replays the same). Either node may
restart: a new incarnation at the same address."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from fakes import NotifsOnly

import engine.core.request as core_request
import engine.core.scheduler as core_scheduler
import kvconnector.nixl.consumer as consumer_mod
import kvconnector.nixl.decode_peers as decode_peers_mod
import kvconnector.nixl.liveness as liveness_mod
import kvconnector.nixl.peer_channel as peer_channel_mod
import kvconnector.nixl.prefill_links as prefill_links_mod
import kvconnector.nixl.prefill_service as prefill_service_mod
import kvconnector.nixl.producer as producer_mod
import kvconnector.nixl.scheduler as nixl_scheduler
import kvconnector.nixl.worker as nixl_worker
from engine.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, ParallelConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import WorkerOutput
from engine.executor.aggregator import KVOutputAggregator
from engine.kv_cache_layout import KVCacheSpec
from engine.model.config import load_arch_config
from engine.sampling_params import SamplingParams
from kvconnector.nixl.messages import Notif
from kvconnector.nixl.side_channel import SideChannelNotSent, SideChannelTimeout
from kvconnector.nixl.worker import NixlConnectorWorker
from kvconnector.params import KVTransferParams

logger = logging.getLogger(__name__)

BLOCKS = 48
TIMEOUT = 10.0
TP = 2
P_ADDRESS = "tcp://127.0.0.1:9"  # P's side channel as D's legs name it (routed here)
PROMPT = list(range(1, 14))  # 4 blocks of 4 tokens
CLOCKED = (
    core_request,
    core_scheduler,
    consumer_mod,
    decode_peers_mod,
    liveness_mod,
    prefill_links_mod,
    prefill_service_mod,
    producer_mod,
    nixl_scheduler,
    nixl_worker,
)


class FakeIds:
    """``secrets`` and ``uuid`` for the modules under test: ids counted from each
    ``Pair``'s start, so that an example runs the same every time (sets of nonces are
    iterated in their hashes' order)."""

    def __init__(self) -> None:
        self.counter = itertools.count()

    def token_hex(self, n: int = 16) -> str:
        return f"{next(self.counter):012x}".ljust(2 * n, "0")  # unique in 12 digits

    def token_bytes(self, n: int = 32) -> bytes:
        return next(self.counter).to_bytes(n, "little")

    def uuid4(self) -> Any:
        return SimpleNamespace(hex=self.token_hex(16))


IDS = FakeIds()


class FakeTime:
    """``time`` for the modules under test: ``monotonic`` is the test's clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@dataclass
class Call:
    """A side-channel call one node queued on a peer's lane."""

    sender: str  # "P" or "D"
    peer: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    incarnation: int  # the sender's (a restart drops the calls its old process queued)


@dataclass
class Write:
    """A send P's scheduler handed its ranks: each rank posts its WRITE and reports it."""

    p_request_id: str
    notif: bytes
    d_blocks: list[int]
    p_blocks: list[int]  # what it reads
    posted_at: float
    d_incarnation: int  # the D process it writes into
    post_by: float
    ranks_left: set[int] = field(default_factory=lambda: set(range(TP)))
    failed: bool = False
    # Ranks that reported it failed, whose WRITE may still land (until its notification
    # does: NIXL delivers it after the data).
    may_land: set[int] = field(default_factory=set)


class Router:
    """The side-channel client of both nodes: a request reaches the node serving the
    address at once, or is lost (``fault``) as the test decides."""

    def __init__(self) -> None:
        self.nodes: dict[str, Any] = {}  # address -> connector
        self.fault = "ok"  # ok | lost | no_reply | twice | not_sent | ended_meanwhile
        # ended_meanwhile: the call's reservation is on the wire while its request ends
        # and the clock runs (``Pair.ended_meanwhile``); the call's handshake goes first.
        self.meanwhile: Callable[[dict[str, Any]], None] = lambda msg: None
        self.sent: list[tuple[str, dict[str, Any], Any]] = []  # (address, message, node)
        self.signed = False

    def request(self, address: str, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.fault == "ended_meanwhile" and msg.get("kind") != "reserve":
            return self._to(address, msg)  # the reservation's handshake
        fault, self.fault = self.fault, "ok"
        if fault == "ended_meanwhile":
            self.meanwhile(msg)
        return self._to(address, msg, fault)

    def _to(self, address: str, msg: dict[str, Any], fault: str = "ok") -> dict[str, Any]:
        node = self.nodes.get(address)
        if fault == "not_sent":
            raise SideChannelNotSent(f"{address}: not sent")
        if node is None:
            raise SideChannelTimeout(f"{address}: no reply")
        if fault == "lost":  # ... for now: it may still arrive (``replay``)
            self.sent.append((address, msg, node))
            raise SideChannelTimeout(f"{address}: no reply")
        self.sent.append((address, msg, node))
        reply = node.channel.handle(msg)
        if fault == "twice":
            reply = node.channel.handle(msg)
        if fault == "no_reply":
            raise SideChannelTimeout(f"{address}: reply lost")
        return reply

    def replay(self, index: int, restarted: bool = False) -> None:
        """A message sent earlier arrives (again), late, at the process it was sent to: a
        lost one delayed, or a duplicate (the unsigned side channel has no replay guard);
        its reply goes nowhere. ``restarted``: at the process serving its address now,
        even one that restarted since (a signed envelope captured on the wire and replayed
        within its 60 s: a new process's replay guard is empty)."""
        address, msg, node = self.sent[index]
        now = self.nodes.get(address)
        if now is node or (restarted and now is not None):
            now.channel.handle(msg)


class FakeServer:
    """Stands in for the side-channel server: nothing is bound, ``Router`` calls the
    channel's ``handle`` directly."""

    count = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        FakeServer.count += 1
        self.address = f"tcp://127.0.0.1:{10000 + FakeServer.count}"
        self.refused = 0

    def close(self) -> None:
        pass


class _Pings:
    """Stands in for D's ping lanes: each ping is a call the test delivers."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair

    def submit(self, lane: str, fn: Callable[..., Any], *args: Any, proven: bool) -> None:
        self.pair.calls.append(Call("D", lane, fn, args, self.pair.incarnation("D")))


class _Queued:
    """Stands in for the verifier pool: its jobs are calls the test delivers."""

    def __init__(self, pair: Pair, sender: str) -> None:
        self.pair, self.sender = pair, sender

    def submit(self, fn: Callable[..., Any], *args: Any, proven: bool = True) -> None:
        self.pair.calls.append(Call(self.sender, "verify", fn, args, self.pair.incarnation("P")))

    def shutdown(self, **_: Any) -> None:
        pass


def _config(role: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=256, dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=BLOCKS),
        parallel=ParallelConfig(tp=TP),
        kv_transfer=KVTransferConfig(
            kv_connector="nixl",
            kv_role=role,
            kv_transfer_timeout=TIMEOUT,
            peer_ping_interval=TIMEOUT / 4,
        ),
    )


class Pair:
    """P and D, wired through ``calls`` (side channel), ``writes`` (P's ranks) and
    ``notifs`` (what lands on D's ranks)."""

    def __init__(self, clock: FakeTime) -> None:
        self.clock = clock
        IDS.counter = itertools.count()
        self.router = Router()
        self.calls: list[Call] = []
        self.writes: list[Write] = []
        self.failed_writes: list[Write] = []  # reported failed: part of it may still land
        # (D rank, notification, its WRITE) not landed yet
        self.notifs: list[tuple[int, bytes, Write]] = []
        self.outputs: dict[str, list[Any]] = {"P": [], "D": []}
        self.incarnations = {"P": 0, "D": 0}
        self.d_sch, self.d_conn = self._node("consumer")
        self.d_agg = KVOutputAggregator(TP)
        self._d_workers()
        self.p_sch, self.p_conn = self._node("producer")
        self.p_agg = KVOutputAggregator(TP)
        self.router.nodes[self.d_conn.address] = self.d_conn
        self.router.nodes[P_ADDRESS] = self.p_conn
        self.p_requests: set[str] = set()
        self.d_requests: set[str] = set()
        self.faults = True  # the test may inject faults (losses, restarts, replays)
        self.faulty = False  # ... and did, or a deadline may end a leg: ends need no message
        self.dead: list[Any] = []  # connectors of processes that restarted
        self.router.meanwhile = self.ended_meanwhile

    def ended_meanwhile(self, msg: dict[str, Any]) -> None:
        """While D's reservation ``msg`` is on the wire, its request ends (the engine
        thread aborts it and steps) and the call takes nearly its whole timeout."""
        rid = msg.get("d_request_id")
        if rid in self.d_sch.requests:
            self.d_sch.abort_request(rid)
        self.step_d()
        self.clock.now += prefill_links_mod.RPC_TIMEOUT_S - 0.1

    def incarnation(self, sender: str) -> int:
        return self.incarnations[sender]

    def _d_workers(self) -> None:
        self.d_workers = []
        for rank in range(TP):
            w = NixlConnectorWorker(self.d_sch.config, rank, TP)
            w.transport = NotifsOnly()  # type: ignore[assignment]
            self.d_workers.append(w)

    def _node(self, role: str) -> tuple[Scheduler, nixl_scheduler.NixlConnectorScheduler]:
        cfg = _config(role)
        spec = KVCacheSpec.for_model(load_arch_config("tiny"), cfg)
        conn = nixl_scheduler.NixlConnectorScheduler(cfg, spec)
        sender = "P" if role == "producer" else "D"
        incarnation = self.incarnation(sender)

        def submit(peer: str, fn: Callable[..., Any], *args: Any, proven: bool) -> bool:
            self.calls.append(Call(sender, peer, fn, args, incarnation))
            return True

        conn.channel.submit = submit  # type: ignore[method-assign]
        conn.channel.client = conn.links._client = conn.service._client = self.router  # type: ignore[assignment]
        conn.service._verifier = _Queued(self, sender)  # type: ignore[assignment]
        # D's liveness pings of the prefill nodes it waits on: queued calls too.
        conn.liveness._request = self.router.request
        conn.liveness._lanes = _Pings(self)  # type: ignore[assignment]
        conn.set_worker_info([{"num_blocks": BLOCKS} for _ in range(TP)])
        return Scheduler(cfg, BLOCKS, 256, conn), conn

    # -- requests ------------------------------------------------------------------------
    def add_p(self, tid: str) -> None:
        params = KVTransferParams(do_remote_decode=True, transfer_id=tid)
        rid = f"p-{tid}"
        self.p_sch.add_request(
            Request(rid, PROMPT, SamplingParams(max_tokens=1), kv_transfer_params=params)
        )
        self.p_requests.add(rid)

    def add_d(self, tid: str) -> None:
        params = KVTransferParams(
            do_remote_prefill=True, transfer_id=tid, remote_side_channel=P_ADDRESS
        )
        rid = f"d-{tid}"
        self.d_sch.add_request(
            Request(rid, PROMPT, SamplingParams(max_tokens=2), kv_transfer_params=params)
        )
        self.d_requests.add(rid)

    # -- the side channel ----------------------------------------------------------------
    def deliver(self, index: int, fault: str = "ok") -> None:
        call = self.calls.pop(index)
        if call.incarnation != self.incarnation(call.sender):
            return  # that process is gone: its lanes went with it
        self.router.fault = fault
        try:
            call.fn(*call.args)
        finally:
            self.router.fault = "ok"

    # -- steps ---------------------------------------------------------------------------
    def step_d(self) -> None:
        so = self.d_sch.schedule()
        md = so.kv_connector_metadata
        self.d_agg.forget(md.ended_transfer_keys())
        outs = []
        for w in self.d_workers:
            w.bind_connector_metadata(md)
            sending, recving = w.get_finished(set())
            sampled = {s.request_id: 7 for s in so.seqs if s.samples} if w.rank == 0 else {}
            outs.append(
                WorkerOutput(
                    rank=w.rank,
                    finished_sending=sending,
                    finished_recving=recving,
                    kv_recv_info=w.take_recv_info(),
                    sampled_token_ids=sampled,
                )
            )
            w.clear_connector_metadata()
        self.outputs["D"] += self.d_sch.update_from_output(so, self.d_agg.aggregate(outs))

    def step_p(self, reports: dict[int, dict[str, str | None]] | None = None) -> None:
        """One P step; ``reports``: rank -> {P request id: error or None} its ranks report."""
        so = self.p_sch.schedule()
        md = so.kv_connector_metadata
        self.p_agg.forget(md.ended_transfer_keys())
        for send in md.sends:
            self.writes.append(
                Write(
                    send.request_id,
                    send.notif,
                    list(send.remote_block_ids),
                    list(send.local_block_ids),
                    self.clock.now,
                    # The D process its reservation came from (a nonce names its maker).
                    self.incarnation("D")
                    if Notif.unpack(send.notif).k.startswith(f"{self.d_conn.incarnation}.")
                    else -1,
                    send.post_by,
                )
            )
        reports = reports or {}
        outs = []
        for rank in range(TP):
            done = reports.get(rank, {})
            failed = {rid: why for rid, why in done.items() if why is not None}
            sampled = {s.request_id: 7 for s in so.seqs if s.samples} if rank == 0 else {}
            outs.append(
                WorkerOutput(
                    rank=rank,
                    finished_sending=set(done),
                    finished_recving=set(),
                    kv_failed=failed,
                    sampled_token_ids=sampled,
                )
            )
        self.outputs["P"] += self.p_sch.update_from_output(so, self.p_agg.aggregate(outs))

    def report(self, index: int, rank: int, ok: bool, lands: bool) -> None:
        """Rank ``rank`` of P finishes its WRITE of ``writes[index]`` (the report reaches
        P's scheduler with a step); ``lands``: its notification reaches D's rank."""
        w = self.writes[index]
        if rank not in w.ranks_left:
            return
        w.ranks_left.discard(rank)
        if lands:
            self.notifs.append((rank, w.notif, w))
        if not ok:
            w.failed = True
            w.may_land.add(rank)
        if not w.ranks_left:
            self.writes.pop(index)
            if w.may_land:
                self.failed_writes.append(w)
        self.step_p({rank: {w.p_request_id: None if ok else "WRITE failed"}})

    def land(self, index: int) -> None:
        rank, raw, w = self.notifs.pop(index)
        w.may_land.discard(rank)  # its data is in: nothing more of it lands
        if w.d_incarnation != self.incarnation("D"):
            return  # written into a D process that is gone
        self.d_workers[rank].transport.inbox.append(raw)  # type: ignore[union-attr]

    def restart_p(self) -> None:
        """P's process dies and a new one serves the same address: its state, blocks and
        queued calls are gone; WRITEs it posted are torn down with it."""
        old = self.p_conn
        self.dead.append(old)
        self.incarnations["P"] += 1
        self.writes.clear()
        self.failed_writes.clear()
        # What its failed WRITEs had not landed never will.
        self.notifs = [(r, raw, w) for r, raw, w in self.notifs if r not in w.may_land]
        self.p_sch, self.p_conn = self._node("producer")
        self.p_agg = KVOutputAggregator(TP)
        self.router.nodes[P_ADDRESS] = self.p_conn
        self.p_requests.clear()
        old.shutdown()

    def restart_d(self) -> None:
        """D's process dies and a new one serves the same address: its requests, blocks,
        waits and queued calls are gone (a WRITE into the old process lands nowhere)."""
        old = self.d_conn
        self.dead.append(old)
        self.incarnations["D"] += 1
        self.notifs.clear()
        self.d_sch, self.d_conn = self._node("consumer")
        conn = self.d_conn
        conn.address = conn.service.address = conn.links.address = old.address
        self.d_agg = KVOutputAggregator(TP)
        self._d_workers()
        self.router.nodes[old.address] = conn
        self.d_requests.clear()
        old.shutdown()

    def close(self) -> None:
        for conn in (self.d_conn, self.p_conn):
            conn.shutdown()


def fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    """The fake clock in every module under test, and no side-channel server bound."""
    fake = FakeTime()
    monkeypatch.setattr(peer_channel_mod, "SideChannelServer", FakeServer)
    for module in CLOCKED:
        monkeypatch.setattr(module, "time", fake)
    monkeypatch.setattr(nixl_scheduler, "secrets", IDS)
    monkeypatch.setattr(nixl_scheduler, "uuid", IDS)
    monkeypatch.setattr(prefill_links_mod, "secrets", IDS)
    return fake


def writable(pair: Pair) -> list[tuple[str, list[int], str]]:
    """(D request id, D blocks, why) a WRITE of P may land in now or later."""
    out: list[tuple[str, list[int], str]] = []
    now = pair.clock.now
    live = [w for w in pair.writes + pair.failed_writes if w.d_incarnation == pair.incarnation("D")]
    for w in live:
        # A rank posts it by ``post_by`` at the latest and its WRITE times out after T (a
        # rank stuck inside a WRITE past that is an open hole, docs/reliability.md).
        if (w.ranks_left or w.may_land) and now < w.post_by + TIMEOUT:
            out.append((Notif.unpack(w.notif).r, w.d_blocks, f"posted WRITE of {w.p_request_id}"))
    prod = pair.p_conn.producer
    held = list(prod.early.values())
    held += [s.reservation for s in prod.pending.values() if s.reservation is not None]
    d_key = pair.d_conn.links.pairing_key(P_ADDRESS)  # reservations of this D process
    for res in held:
        if res.peer_key == d_key and now < res.expires:  # P may still start a push into it
            out.append((res.d_request_id, res.block_ids, f"reservation {res.nonce} held by P"))
    return out


def check_no_block_free_while_writable(pair: Pair) -> None:
    sch = pair.d_sch
    for rid, blocks, why in writable(pair):
        owned = set(sch.kv.block_ids(rid)) | set(sch.quarantine.get(rid, ()))
        for b in blocks:
            assert sch.kv.pool.ref_cnt[b] > 0, f"D block {b} is free, but {why} may write it"
            assert b in owned, f"D block {b} is no longer {rid}'s, but {why} may write it"


def check_no_block_free_while_read(pair: Pair) -> None:
    """P's blocks stay held while a rank's WRITE may still read them: a send is over only
    when every rank reported it (or 2T after it started: every WRITE timed out by then)."""
    sch = pair.p_sch
    for w in pair.writes:
        if not w.ranks_left or pair.clock.now >= w.post_by + TIMEOUT:
            continue
        owned = set(sch.kv.block_ids(w.p_request_id))
        for b in w.p_blocks:
            assert sch.kv.pool.ref_cnt[b] > 0, f"P block {b} is free, ranks {w.ranks_left} read it"
            assert b in owned, f"P block {b} is no longer {w.p_request_id}'s, a WRITE reads it"
