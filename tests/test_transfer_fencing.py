"""Transfer fencing (issue 9, hole 2): every count, notification and reply about a transfer
is keyed by its reservation's nonce, and counts of a transfer that ended are purged on
every rank and in the aggregator.

The decode side here is the real scheduler, the real scheduler-side NIXL connector, two
real worker-side connectors (TP=2) and the real all-ranks aggregator, wired the way the
executor wires them; only the NIXL transport under the workers is a stand-in that delivers
the notifications a test hands it (fault injection: "rank 1's WRITE never lands").
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from fakes import NotifsOnly
from harness import free_port
from pd_ranks import counts_left, d_rank_step

import kvconnector.nixl.scheduler as nixl_scheduler
import kvconnector.nixl.worker as nixl_worker
from engine.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, ParallelConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.executor.aggregator import KVOutputAggregator
from engine.kv_cache_layout import KVCacheSpec
from engine.model.config import load_arch_config
from engine.sampling_params import SamplingParams
from kvconnector.nixl.messages import Ack, Cancel, Notif, Refusal, Reserve, TransferFailed
from kvconnector.nixl.prefill_links import PrefillLinks
from kvconnector.nixl.producer import Producer, Reservation
from kvconnector.nixl.worker import NixlConnectorWorker
from kvconnector.params import KVTransferParams

BLOCKS = 64
TIMEOUT = 30.0


class DecodeTP2:
    """D with TP=2: scheduler + connector + 2 worker connectors + aggregator."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # Reservations are not sent anywhere: the test plays P.
        monkeypatch.setattr(PrefillLinks, "reserve_job", _no_rpc)
        monkeypatch.setattr(PrefillLinks, "cancel_job", _no_rpc)
        self.cfg = EngineConfig(
            model=ModelConfig(model="tiny", max_model_len=256, dtype="float32"),
            cache=CacheConfig(block_size=4, num_blocks=BLOCKS),
            parallel=ParallelConfig(tp=2),
            kv_transfer=KVTransferConfig(
                kv_connector="nixl",
                kv_role="consumer",
                kv_transfer_timeout=TIMEOUT,
                peer_ping_interval=0,
            ),
        )
        spec = KVCacheSpec.for_model(load_arch_config("tiny"), self.cfg)
        self.conn = nixl_scheduler.NixlConnectorScheduler(self.cfg, spec)
        self.sch = Scheduler(self.cfg, BLOCKS, 256, self.conn)
        self.agg = KVOutputAggregator(2)
        self.workers = []
        for rank in range(2):
            w = NixlConnectorWorker(self.cfg, rank, 2)
            w.transport = NotifsOnly()  # type: ignore[assignment]
            self.workers.append(w)
        self.p_address = f"tcp://127.0.0.1:{free_port()}"

    def add(self, rid: str, transfer_id: str) -> str:
        """A decode request waiting for its prompt's KV; returns its reservation's nonce."""
        params = KVTransferParams(
            do_remote_prefill=True, transfer_id=transfer_id, remote_side_channel=self.p_address
        )
        self.sch.add_request(
            Request(
                rid, list(range(1, 30)), SamplingParams(max_tokens=4), kv_transfer_params=params
            )
        )
        self.step()
        return self.conn.consumer.recvs[rid].nonce

    def deliver(self, rank: int, rid: str, transfer_id: str, nonce: str, ft: int = 5) -> None:
        notif = Notif(r=rid, t=transfer_id, k=nonce, n=1, ft=ft)
        self.workers[rank].transport.inbox.append(notif.pack())  # type: ignore[union-attr]

    def step(self) -> list[Any]:
        """One engine step the way the executor runs it (multiproc.execute_model, then
        worker.py's connector calls on every rank, then the all-ranks aggregation)."""
        so = self.sch.schedule()
        md = so.kv_connector_metadata
        self.agg.forget(md.ended_transfer_keys())
        # rank 0 samples: any token will do, the model is not what is tested
        sampled = {seq.request_id: 1 for seq in so.seqs if seq.samples}
        outs = [d_rank_step(w, so, sampled) for w in self.workers]
        return self.sch.update_from_output(so, self.agg.aggregate(outs))

    def counts_left(self) -> dict[str, Any]:
        return counts_left(self.agg, self.workers)

    def close(self) -> None:
        self.conn.shutdown()


def _no_rpc(*args: Any) -> None:
    return None


@pytest.fixture
def decode(monkeypatch):
    d = DecodeTP2(monkeypatch)
    try:
        yield d
    finally:
        d.close()


def _running(d: DecodeTP2, rid: str) -> bool:
    return any(r.request_id == rid for r in d.sch.running)


def test_a_partial_count_of_a_failed_tp2_transfer_is_purged_on_every_rank(decode, monkeypatch):
    """P rank 0's WRITE landed, rank 1's failed: D got one of two notifications. When the
    transfer ends (P says it failed, the quarantine runs out), no count of it is left on
    any rank or in the aggregator, and rank 1's notification arriving late starts none.
    Before, the aggregator kept ``remaining = 1`` for the request id forever."""
    d = decode
    nonce = d.add("X", "t1")
    d.deliver(0, "X", "t1", nonce)
    d.step()
    assert not _running(d, "X")  # one rank is not all ranks
    assert nonce in d.agg.pending_ids
    d.conn.channel.handle(
        TransferFailed("X", "t1", nonce, "rank 1's WRITE failed", False).to_wire()
    )
    d.step()  # the load failed: recompute; its blocks stay quarantined for 2T
    assert "X" in d.conn.consumer.quarantine
    clock = time.monotonic() + 2 * TIMEOUT + 1  # the quarantine's deadline has passed
    monkeypatch.setattr(nixl_scheduler.time, "monotonic", lambda: clock)
    monkeypatch.setattr("kvconnector.nixl.consumer.time.monotonic", lambda: clock)
    d.step()  # the quarantine ends: the nonce is listed as ended in the next metadata
    d.step()
    assert not d.conn.consumer.quarantine
    assert d.counts_left() == {"aggregator": set(), "rank0": {}, "rank1": {}}
    d.deliver(1, "X", "t1", nonce)  # rank 1's notification, very late
    d.step()
    assert d.counts_left() == {"aggregator": set(), "rank0": {}, "rank1": {}}


def test_a_stale_notification_cannot_complete_a_newer_transfer_of_the_same_request_id(decode):
    """The wrong-tokens scenario: an old transfer's notification from rank 0 (its rank 1
    never came) and the new transfer's notification from rank 1 must not add up to "all
    ranks have it". Only the new transfer's two notifications do."""
    d = decode
    old = d.add("X", "t1")
    d.deliver(0, "X", "t1", old)
    d.step()
    d.conn.channel.handle(TransferFailed("X", "t1", old, "push failed", True).to_wire())
    d.step()  # failed safely: recomputed; it finishes, the id is free again
    for _ in range(8):
        d.step()
    d.sch.abort_request("X")
    d.step()
    assert "X" not in d.sch.requests
    new = d.add("X", "t2")
    assert new != old
    d.deliver(0, "X", "t1", old)  # a duplicate of the old transfer's notif
    d.deliver(1, "X", "t2", new)
    d.step()
    assert not _running(d, "X"), "KV counted as landed from two different transfers"
    d.deliver(0, "X", "t2", new)
    d.step()
    assert _running(d, "X")


def test_a_notification_without_the_reservations_nonce_completes_nothing(decode):
    """A peer that knows a request id and transfer id but not the nonce (another prefill
    node, a replay of an old notification) cannot make D decode from blocks nobody wrote."""
    d = decode
    nonce = d.add("X", "t1")
    for rank in (0, 1):
        d.deliver(rank, "X", "t1", "guessed-nonce")
    d.step()
    assert not _running(d, "X") and "X" in d.conn.consumer.recvs
    for rank in (0, 1):
        d.deliver(rank, "X", "t1", nonce)
    d.step()
    assert _running(d, "X")


def test_a_transfer_failed_about_another_reservation_changes_nothing(decode):
    """``transfer_failed`` used to carry only the D request id: a delayed one about an old
    transfer failed (or freed) the current one."""
    d = decode
    nonce = d.add("X", "t1")
    stale = TransferFailed("X", "t1", "an-older-reservation", "old push failed", True)
    assert d.conn.channel.handle(stale.to_wire()) == Ack().to_wire()
    d.step()
    assert "X" in d.conn.consumer.recvs and not d.conn.consumer.outcome.failed_loads
    for rank in (0, 1):
        d.deliver(rank, "X", "t1", nonce)
    d.step()
    assert _running(d, "X")


def test_partial_counts_no_reservation_can_complete_expire_on_the_worker(monkeypatch):
    """Notifications with nonces D never made (forged, or of a D before a restart) leave
    a count on one rank; it is dropped after 4 x the transfer timeout."""
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=256, dtype="float32"),
        kv_transfer=KVTransferConfig(
            kv_connector="nixl", kv_role="consumer", kv_transfer_timeout=TIMEOUT
        ),
    )
    w = NixlConnectorWorker(cfg, 0, 1)
    w.transport = NotifsOnly()  # type: ignore[assignment]
    w.transport.inbox.append(Notif(r="X", t="t", k="k", n=2).pack())  # type: ignore[union-attr]
    assert w.get_finished(set()) == (set(), set())
    assert w.num_partial_counts == 1
    later = time.monotonic() + 4 * TIMEOUT + 1
    monkeypatch.setattr(nixl_worker.time, "monotonic", lambda: later)
    w.get_finished(set())
    assert w.num_partial_counts == 0


# -- prefill side: cancels are fenced too ---------------------------------------------------


def _reservation(nonce: str, tid: str = "t1") -> Reservation:
    return Reservation(tid, nonce, "D1", "d:1", "tcp://127.0.0.1:1", [4, 5], 0, time.time() + 60)


def test_a_delayed_cancel_of_an_old_reservation_leaves_the_current_one_alone():
    p = Producer(TIMEOUT)
    assert p.prefill_finished("P1", "t1", [0, 1], 7)
    assert p.reserve(_reservation("new")) == Ack()
    assert p.cancel("t1", "old", "d:1").state == "cancelled"  # nothing of "old" was written...
    assert p.pending["t1"].reservation is not None  # ...and "new" still gets its push
    assert p.pending["t1"].reservation.nonce == "new"
    assert p.cancel("t1", "new", "d:1").state == "cancelled"
    assert "t1" not in p.pending and p.take_outcome().free_blocks == {"P1"}


def test_a_reservation_that_arrives_after_its_own_cancel_is_refused():
    """Reserve and cancel raced (different threads on D): P answered the cancel first,
    D freed the blocks; the reservation must not be accepted afterwards."""
    p = Producer(TIMEOUT)
    assert p.cancel("t1", "n1", "d:1").state == "cancelled"
    assert isinstance(p.reserve(_reservation("n1")), Refusal)
    assert p.reserve(_reservation("n2")) == Ack()  # another reservation is fine


def test_a_cancel_of_a_send_in_flight_is_in_flight_only_for_its_own_reservation():
    p = Producer(TIMEOUT)
    assert p.prefill_finished("P1", "t1", [0, 1], 7)
    assert p.reserve(_reservation("n1")) == Ack()
    assert [s.request_id for s in p.ready_sends(lambda key: True)] == ["P1"]
    assert p.cancel("t1", "n1", "d:1").state == "in_flight"
    assert p.cancel("t1", "someone-else", "d:1").state == "cancelled"
    p.send_finished("P1", error="WRITE timed out")
    assert p.cancel("t1", "n1", "d:1").state == "in_flight"  # may still land: keep quarantine
    assert p.cancel("t1", "someone-else", "d:1").state == "cancelled"


def test_side_channel_cancel_and_reserve_carry_the_nonce():
    wire = Reserve("t", "n", "d", "k", "tcp://h:1", (1,), 0, "p", time.time()).to_wire()
    assert wire["nonce"] == "n"
    assert Cancel("t", "n", "k").to_wire()["nonce"] == "n"


def test_a_send_no_rank_reports_is_given_up_after_twice_the_timeout(monkeypatch):
    """A send counted in flight that no all-ranks report ever ends (a rank never posted
    it) used to hold P's blocks forever. After 2T: P's blocks are freed, D is told that
    a WRITE may still land (it quarantines), the counts are dropped, and a cancel of it
    is answered ``in_flight``."""
    import kvconnector.nixl.producer as producer_module

    p = Producer(TIMEOUT)
    assert p.prefill_finished("P1", "t1", [0, 1], 7)
    assert p.reserve(_reservation("n1")) == Ack()
    assert [s.request_id for s in p.ready_sends(lambda key: True)] == ["P1"]
    p.expire()
    assert "P1" in p.in_flight  # not yet
    later = time.monotonic() + 2 * TIMEOUT + 1
    monkeypatch.setattr(producer_module.time, "monotonic", lambda: later)
    p.expire()
    out = p.take_outcome()
    assert not p.in_flight and out.free_blocks == {"P1"} and out.ended == ["P1"]
    assert [(res.nonce, why) for res, why in out.notify_unsafe] == [("n1", "push lost on prefill")]
    assert p.cancel("t1", "n1", "d:1").state == "in_flight"


def test_a_rank_that_gets_to_a_send_after_its_deadline_posts_nothing_of_it():
    """A P worker stalled (SIGSTOP, swap, a hung GPU) past the reservation's deadline while
    D gave up, quarantined and freed the blocks -- which then took another request's KV.
    Woken, it used to post the old WRITE into them: D's cache (and prefix cache) held
    wrong KV and answered with HTTP 200. Now a rank posts nothing after ``post_by``,
    whole sends and the remaining pieces of a pipelined one, and reports the send failed."""
    from kvconnector.nixl.metadata import TOO_LATE, NixlConnectorMetadata, SendSpec

    writes: list[tuple] = []

    class Transport:
        def write_blocks(self, sub, local, remote, notif, layers=None):
            writes.append((sub, layers))
            return object()

    cfg = EngineConfig(kv_transfer=KVTransferConfig(kv_connector="nixl", kv_role="producer"))
    w = NixlConnectorWorker(cfg, 0, 1)
    w.transport = Transport()  # type: ignore[assignment]
    w._targets = {"peer": [("sub", None, 1)]}  # type: ignore[dict-item]
    now = time.monotonic()
    notif = Notif(r="r", t="t", k="n1").pack()
    late = SendSpec("late", "peer", [1], [2], notif, post_by=now - 1)
    in_time = SendSpec("ok", "peer", [3], [4], notif, post_by=now + 60)
    w.bind_connector_metadata(NixlConnectorMetadata(sends=[late, in_time]))
    w.start_load_kv()
    w.wait_for_save({})
    w.clear_connector_metadata()
    assert writes == [("sub", None)]  # only the send still in time
    assert w.take_failures() == {"late": TOO_LATE}
    # Pipelined: the deadline passes between the first piece and the last.
    writes.clear()
    w._groups = [(0, 2), (2, 4)]
    piped = SendSpec("pipe", "peer", [1], [2], notif, pipelined=True, post_by=now + 60)
    w.bind_connector_metadata(NixlConnectorMetadata(sends=[piped]))
    w.start_load_kv()
    w.save_kv_layer(1)
    piped.post_by = time.monotonic() - 1
    w.wait_for_save({"pipe": 5})
    w.clear_connector_metadata()
    assert writes == [("sub", (0, 2))]  # the last piece never went
    assert w.take_failures() == {"pipe": TOO_LATE}
