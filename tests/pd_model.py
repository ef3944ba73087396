"""A prefill node and a decode node, each the real scheduler with the real scheduler-side
NIXL connector and block pool, talking through an in-process message queue a test
controls (for ``test_property_pd_protocol.py`` and ``test_pd_protocol_races.py``).

Only the transport is a stand-in: side-channel calls (D's reservations, cancels and
liveness pings, P's failure notices and checks of a new peer's claim) are queued instead
of run on a peer's lane, and delivered when the test says (in any order, lost, their
reply lost, sent twice, not sent; a message replayed late, even at a process that
restarted since; a reservation on the wire while its request ends, or lost there; a lost
message arriving once after all, ``Router.lost``). Both nodes' TP ranks
are the real worker-side connectors (``pd_ranks``): P's post their WRITEs -- whole sends,
or a pipelined send's layer-group pieces, head slices when P's and D's TP sizes differ --
into a transport whose WRITEs the test completes (each piece on its own, ok or failed)
and lands on D's ranks (then, later, corrupted, or never; a notification for a D process
gone since, nowhere or at the new process at its address); the KV is real tensors, which
D's ranks checksum. A fake clock drives every deadline, and ids are counted (an example
replays the same). Either node may restart: a new incarnation at the same address."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fakes import NotifsOnly
from pd_ranks import (
    DONE,
    LAYERS,
    Hooks,
    Piece,
    d_rank_step,
    forward_layer,
    holds,
    kv_cache,
    land,
    p_rank_step,
    p_workers,
)

import engine.core.request as core_request
import engine.core.scheduler as core_scheduler
import kvconnector.nixl.clock as clock_mod
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
    clock_mod,
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
    """``time`` for the modules under test: ``monotonic`` is the test's clock, and the
    wall clock (``time``: the hosts' shared clock, a reservation's ``sent_at``) moves
    with it."""

    EPOCH = 1.7e9  # the wall clock when ``now`` is 0

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.EPOCH + self.now

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


class Router:
    """The side-channel client of both nodes: a request reaches the node serving the
    address at once, or is lost (``fault``) as the test decides."""

    def __init__(self, clock: FakeTime) -> None:
        self.clock = clock
        self.nodes: dict[str, Any] = {}  # address -> connector
        # ok | lost | no_reply | twice | not_sent | ended_meanwhile | reserve_lost
        self.fault = "ok"
        # ended_meanwhile: the call's reservation is on the wire while its request ends
        # and the clock runs (``Pair.ended_meanwhile``); reserve_lost: the call's
        # reservation is lost (it may arrive later); for both, the handshake goes first.
        self.meanwhile: Callable[[dict[str, Any]], None] = lambda msg: None
        self.sent: list[tuple[str, dict[str, Any], Any]] = []  # (address, message, node)
        # Lost messages that have not arrived yet: (index in ``sent``, when sent). Each
        # may still arrive once, late (``late``), as bytes held in a socket buffer or a
        # partition do.
        self.lost: list[tuple[int, float]] = []
        self.signed = False

    def request(self, address: str, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.fault in ("ended_meanwhile", "reserve_lost") and msg.get("kind") != "reserve":
            return self._to(address, msg)  # the reservation's handshake
        fault, self.fault = self.fault, "ok"
        if fault == "ended_meanwhile":
            self.meanwhile(msg)
        return self._to(address, msg, "lost" if fault == "reserve_lost" else fault)

    def _to(self, address: str, msg: dict[str, Any], fault: str = "ok") -> dict[str, Any]:
        node = self.nodes.get(address)
        if fault == "not_sent":
            raise SideChannelNotSent(f"{address}: not sent")
        if node is None:
            raise SideChannelTimeout(f"{address}: no reply")
        if fault == "lost":  # ... for now: it may still arrive (``late``, ``replay``)
            self.lost.append((len(self.sent), self.clock.now))
            self.sent.append((address, msg, node))
            raise SideChannelTimeout(f"{address}: no reply")
        self.sent.append((address, msg, node))
        reply = node.channel.handle(msg)
        if fault == "twice":
            reply = node.channel.handle(msg)
        if fault == "no_reply":
            raise SideChannelTimeout(f"{address}: reply lost")
        return reply

    def replay(self, index: int, restarted: bool = False) -> dict[str, Any] | None:
        """A message sent earlier arrives (again), late, at the process it was sent to: a
        lost one delayed, or a duplicate (the unsigned side channel has no replay guard);
        its reply goes nowhere (returned for the test to look at). ``restarted``: at the
        process serving its address now, even one that restarted since (a signed envelope
        captured on the wire and replayed within its 60 s: a new process's replay guard is
        empty)."""
        address, msg, node = self.sent[index]
        now = self.nodes.get(address)
        if now is node or (restarted and now is not None):
            return now.channel.handle(msg)
        return None


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


@dataclass(frozen=True)
class Setup:
    """What an example's nodes run: TP sizes (P's and D's may differ), the pipelined
    push's layer group (0: whole sends), ``--kv-checksum`` and D's failure policy."""

    tp_p: int = TP
    tp_d: int = TP
    group: int = 0
    checksum: str = "off"
    policy: str = "recompute"


def _config(role: str, setup: Setup) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=256, dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=BLOCKS),
        parallel=ParallelConfig(tp=setup.tp_p if role == "producer" else setup.tp_d),
        kv_transfer=KVTransferConfig(
            kv_connector="nixl",
            kv_role=role,
            kv_transfer_timeout=TIMEOUT,
            peer_ping_interval=TIMEOUT / 4,
            kv_layer_group_size=setup.group if role == "producer" else 0,
            kv_checksum=setup.checksum,  # type: ignore[arg-type]
            kv_failure_policy=setup.policy,  # type: ignore[arg-type]
        ),
    )


class Pair:
    """P and D, wired through ``calls`` (side channel), ``pieces`` (the WRITEs P's ranks
    posted) and ``notifs`` (pieces whose notification may still land on D's rank)."""

    def __init__(self, clock: FakeTime, setup: Setup = Setup()) -> None:
        self.clock, self.setup = clock, setup
        IDS.counter = itertools.count()
        self.router = Router(clock)
        self.calls: list[Call] = []
        self.pieces: list[Piece] = []
        self.notifs: list[Piece] = []  # not landed yet (a failed piece's: maybe never)
        self.outputs: dict[str, list[Any]] = {"P": [], "D": []}
        self.incarnations = {"P": 0, "D": 0}
        self.accepted: list[str] = []  # D request ids D decoded from pushed KV
        self.p_failures: list[str] = []  # why P's ranks reported sends failed
        self.stall: tuple[int, int, float] | None = None  # see ``step_p``
        self.d_sch, self.d_conn = self._node("consumer")
        self._d_workers()
        self.p_sch, self.p_conn = self._node("producer")
        self._p_workers()
        self.router.nodes[self.d_conn.address] = self.d_conn
        self.router.nodes[P_ADDRESS] = self.p_conn
        self.p_requests: set[str] = set()
        self.d_requests: set[str] = set()
        self.faults = True  # the test may inject faults (losses, restarts, replays)
        self.faulty = False  # ... and did, or a deadline may end a leg: ends need no message
        self.dead: list[Any] = []  # connectors of processes that restarted
        self.router.meanwhile = self.ended_meanwhile

    @property
    def writes(self) -> list[Piece]:
        """The WRITEs posted and not reported yet."""
        return [p for p in self.pieces if p.state == "posted"]

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
        tp = self.setup.tp_d
        self.d_agg = KVOutputAggregator(tp)
        self.d_workers = []
        self.zeroed: set[str] = set()  # nonces whose blocks were cleared when reserved
        for rank in range(tp):
            w = NixlConnectorWorker(self.d_sch.config, rank, tp)
            w.transport = NotifsOnly()  # type: ignore[assignment]
            w._kv_cache = kv_cache(BLOCKS, 4, tp)
            self.d_workers.append(w)
        conn, accept = self.d_conn, self.d_conn.update_connector_output

        def checked(output: Any) -> dict[str, dict[str, Any]]:
            waiting = dict(conn.consumer.recvs)
            landed = accept(output)
            for rid in landed:  # D decodes from these blocks now: they hold P's KV
                recv = waiting[rid]
                table = self.d_sch.kv.block_ids(rid)  # its prefix-cache hits too
                assert table[recv.skip_blocks :] == recv.block_ids
                for w in self.d_workers:
                    assert w._kv_cache is not None
                    wrong = holds(w._kv_cache, w.rank, tp, PROMPT, table)
                    assert wrong is None, f"D decodes {rid} from KV P did not send: {wrong}"
                self.accepted.append(rid)
            return landed

        conn.update_connector_output = checked  # type: ignore[method-assign]

    def _p_workers(self) -> None:
        self.p_agg = KVOutputAggregator(self.setup.tp_p)
        self._sends: dict[str, Any] = {}  # nonce -> this step's send of it
        hooks = Hooks(self.pieces.append, self.notifs.append, self._about)
        self.p_workers = p_workers(self.p_sch.config, self.setup.tp_p, BLOCKS, hooks)

    def _about(self, notif: bytes) -> tuple[str, float, int]:
        """(P request id, post-by time, D incarnation) of the send a WRITE is part of."""
        nonce = Notif.unpack(notif).k
        send = self._sends[nonce]
        # The D process its reservation came from (a nonce names its maker).
        mine = nonce.startswith(f"{self.d_conn.incarnation}.")
        return send.request_id, send.post_by, self.incarnation("D") if mine else -1

    def _node(self, role: str) -> tuple[Scheduler, nixl_scheduler.NixlConnectorScheduler]:
        cfg = _config(role, self.setup)
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
        conn.set_worker_info([{"num_blocks": BLOCKS} for _ in range(cfg.parallel.tp)])
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
        for recv in self.d_conn.consumer.recvs.values():
            if recv.nonce not in self.zeroed:  # fresh blocks: whatever they held is gone
                self.zeroed.add(recv.nonce)
                for w in self.d_workers:
                    assert w._kv_cache is not None
                    w._kv_cache[recv.block_ids] = 0.0
        md = so.kv_connector_metadata
        self.d_agg.forget(md.ended_transfer_keys())
        sampled = {s.request_id: 7 for s in so.seqs if s.samples}
        outs = []
        for w in self.d_workers:
            for layer in range(LAYERS):  # D's forward: the KV of what it computes
                forward_layer(w, so, self.d_sch.kv.block_ids, layer)
            outs.append(d_rank_step(w, so, sampled))
        self.outputs["D"] += self.d_sch.update_from_output(so, self.d_agg.aggregate(outs))

    def step_p(self, abort: bool = False) -> None:
        """One P step: the forward writes the scheduled tokens' KV, P's ranks post the
        step's sends (a pipelined one piece by piece) and report what finished.
        ``abort``: the step's prefills are aborted while it runs (async scheduling: an
        abort between a step's schedule and its update), mid-pipeline. ``stall`` (rank,
        layer, seconds): in the next step that computes, that rank stalls after computing
        that layer (swap, a hung GPU)."""
        so = self.p_sch.schedule()
        md = so.kv_connector_metadata
        self.p_agg.forget(md.ended_transfer_keys())
        self._sends = {Notif.unpack(send.notif).k: send for send in md.sends}
        sampled = {s.request_id: 7 for s in so.seqs if s.samples}
        table = self.p_sch.kv.block_ids

        stall, self.stall = (self.stall, None) if so.num_scheduled_tokens else (None, self.stall)

        def after_layer(rank: int, layer: int) -> None:
            if stall is not None and stall[:2] == (rank, layer):
                self.clock.now += stall[2]

        outs = [p_rank_step(w, so, table, sampled, after_layer) for w in self.p_workers]
        self.p_failures += [why for out in outs for why in out.kv_failed.values()]
        for rid in sampled if abort else ():
            self.p_sch.abort_request(rid)
        self.outputs["P"] += self.p_sch.update_from_output(so, self.p_agg.aggregate(outs))

    def report(self, piece: Piece, ok: bool, lands: bool, corrupt: bool = False) -> None:
        """P's rank finishes WRITE ``piece`` (the report reaches P's scheduler with a
        step). ok: its data is in D's rank, and its notification lands later (``lands``;
        else it is lost); failed: part of it may still land, until its notification does."""
        if piece.state != "posted":
            return
        if ok:
            piece.state, piece.handle.state = "ok", DONE
            if piece.d_incarnation == self.incarnation("D"):
                land(piece, self.d_kv(piece.d_rank), corrupt)
            piece.landed = True
            if lands:
                self.notifs.append(piece)
        else:
            self.p_workers[piece.p_rank].transport.fail(piece, "WRITE failed")  # type: ignore[union-attr]
        self.step_p()

    def d_kv(self, rank: int) -> torch.Tensor:
        kv = self.d_workers[rank]._kv_cache
        assert kv is not None
        return kv

    def land(self, index: int, corrupt: bool = False, stray: bool = False) -> None:
        """The notification of ``notifs[index]`` lands (and its data, if a failed WRITE's
        had not). One for a D process gone since lands nowhere -- or, ``stray``, its
        notification reaches the process serving D's address now (a transport routing by
        address; the data went to the old process's memory)."""
        piece = self.notifs.pop(index)
        if piece.d_incarnation != self.incarnation("D"):
            piece.landed = True
            if stray and piece.d_rank < len(self.d_workers):
                self.d_workers[piece.d_rank].transport.inbox.append(piece.notif)  # type: ignore[union-attr]
            return  # written into a D process that is gone
        if not piece.landed:  # a failed WRITE's data: in after all
            land(piece, self.d_kv(piece.d_rank), corrupt)
        self.d_workers[piece.d_rank].transport.inbox.append(piece.notif)  # type: ignore[union-attr]

    def may_land(self, piece: Piece) -> bool:
        """Its data may still reach D's blocks (its rank has not reported it, or it failed
        and its notification has not landed)."""
        if piece.state == "posted":
            return True
        return piece.state == "failed" and not piece.landed and any(q is piece for q in self.notifs)

    def restart_p(self) -> None:
        """P's process dies and a new one serves the same address: its state, blocks and
        queued calls are gone; WRITEs it posted (pieces of a pipelined send mid-way) are
        torn down with it, and what its failed WRITEs had not landed never will."""
        old = self.p_conn
        self.dead.append(old)
        self.incarnations["P"] += 1
        for piece in self.pieces:
            if piece.state == "posted" or (piece.state == "failed" and not piece.landed):
                piece.state = "gone"
        self.notifs[:] = [p for p in self.notifs if p.state != "gone"]
        self.pieces.clear()
        self.p_sch, self.p_conn = self._node("producer")
        self._p_workers()
        self.router.nodes[P_ADDRESS] = self.p_conn
        self.p_requests.clear()
        old.shutdown()

    def restart_d(self) -> None:
        """D's process dies and a new one serves the same address: its requests, blocks,
        waits and queued calls are gone (a WRITE into the old process lands nowhere)."""
        old = self.d_conn
        self.dead.append(old)
        self.incarnations["D"] += 1
        self.d_sch, self.d_conn = self._node("consumer")
        conn = self.d_conn
        conn.address = conn.service.address = conn.links.address = old.address
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
    for p in pair.pieces:
        # A rank posts it by ``post_by`` at the latest and its WRITE times out after T (a
        # rank stuck inside a WRITE past that is an open hole, docs/reliability.md).
        if (
            p.d_incarnation == pair.incarnation("D")
            and pair.may_land(p)
            and now < p.post_by + TIMEOUT
        ):
            why = f"{p.state} WRITE of {p.p_request_id} (P rank {p.p_rank}, layers {p.layers})"
            out.append((Notif.unpack(p.notif).r, p.d_blocks, why))
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
    when every rank reported every piece of it (or 2T after it started: every WRITE timed
    out by then)."""
    sch = pair.p_sch
    for p in pair.writes:
        if pair.clock.now >= p.post_by + TIMEOUT:
            continue
        owned = set(sch.kv.block_ids(p.p_request_id))
        for b in p.p_blocks:
            assert sch.kv.pool.ref_cnt[b] > 0, f"P block {b} is free, rank {p.p_rank} reads it"
            assert b in owned, f"P block {b} is no longer {p.p_request_id}'s, a WRITE reads it"
