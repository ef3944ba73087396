"""The scheduler with the real scheduler-side NIXL connector (no workers, no transport):
ordering races between connector events, aborts and landed KV."""

from __future__ import annotations

import time

import pytest
import zmq
from harness import free_port

import kvconnector.nixl.prefill_links as prefill_links
import kvconnector.nixl.scheduler as nixl_scheduler
from engine.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput
from engine.kv_cache_layout import KVCacheSpec
from engine.model.config import load_arch_config
from engine.sampling_params import SamplingParams
from kvconnector.nixl.decode_peers import DecodePeer
from kvconnector.nixl.messages import Cancel, HandshakeReply, Reserve, ranks_digest
from kvconnector.params import KVTransferParams

# What a stubbed handshake returns: the P process D paired with (its reservations name it).
PAIRED = HandshakeReply("p", "p-inc", "tcp://127.0.0.1:1", "producer", {}, {}, ({},))

BLOCKS = 64


def dead_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"  # nothing listens there


def connector_config(role: str) -> EngineConfig:
    """A tiny model's config with the NIXL connector in ``role`` (no peer pings)."""
    return EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=256, dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=BLOCKS),
        kv_transfer=KVTransferConfig(
            kv_connector="nixl", kv_role=role, kv_transfer_timeout=30, peer_ping_interval=0
        ),
    )


@pytest.fixture
def decode():
    cfg = connector_config("consumer")
    spec = KVCacheSpec.for_model(load_arch_config("tiny"), cfg)
    conn = nixl_scheduler.NixlConnectorScheduler(cfg, spec)
    try:
        yield Scheduler(cfg, BLOCKS, 256, conn), conn
    finally:
        conn.shutdown()


def _silent_peer() -> tuple[zmq.Socket, str]:
    """A side channel that takes every message and answers none."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{free_port()}"
    sock.bind(address)
    return sock, address


def remote(rid: str, address: str, max_tokens: int = 4) -> Request:
    params = KVTransferParams(do_remote_prefill=True, transfer_id=rid, remote_side_channel=address)
    return Request(
        rid, list(range(1, 30)), SamplingParams(max_tokens=max_tokens), kv_transfer_params=params
    )


def step(sch: Scheduler, out: ModelRunnerOutput | None = None):
    return sch.update_from_output(sch.schedule(), out or ModelRunnerOutput())


def test_abort_after_an_unsafe_failure_keeps_blocks_quarantined(decode, monkeypatch, request):
    """The reserve call times out on a pool thread (P may hold the reservation), then the
    client aborts before the scheduler saw that failure: the blocks must stay held."""
    sch, conn = decode
    monkeypatch.setattr(prefill_links, "RPC_TIMEOUT_S", 0.2)
    # P answered the handshake; it takes the reservation and never answers it.
    monkeypatch.setattr(
        prefill_links.PrefillLinks, "ensure_handshake", lambda s, a, force=False: PAIRED
    )
    silent, address = _silent_peer()
    request.addfinalizer(lambda: silent.close(linger=0))
    sch.add_request(remote("X", address))
    step(sch)
    reserved = len(sch.kv.block_ids("X"))
    assert reserved > 0 and sch.kv.pool.num_free == BLOCKS - reserved
    deadline = time.monotonic() + 10
    while "X" not in conn.consumer.quarantine:
        assert time.monotonic() < deadline, "the reserve call never failed"
        time.sleep(0.05)
    sch.abort_request("X")
    step(sch)
    assert sch.kv.pool.num_free == BLOCKS - reserved, "quarantined blocks went back to the pool"
    # A new request may not take the id while its old blocks are quarantined.
    with pytest.raises(Exception, match="already in use"):
        sch.add_request(remote("X", dead_address()))


def test_request_that_finishes_as_its_kv_lands_is_not_treated_as_aborted(decode, monkeypatch):
    sch, conn = decode
    monkeypatch.setattr(prefill_links.PrefillLinks, "reserve_job", lambda s, r: None)
    sch.add_request(remote("X", "tcp://127.0.0.1:1", max_tokens=1))
    step(sch)
    nonce = conn.consumer.recvs["X"].nonce
    info = {nonce: {"request_id": "X", "first_token": 5}}
    outs = step(sch, ModelRunnerOutput(finished_recving={nonce}, kv_recv_info=info))
    assert [(o.request_id, o.finish_reason) for o in outs] == [("X", "length")]
    assert outs[0].new_token_ids == [5]
    assert not sch.held and not conn.consumer.quarantine
    assert conn.consumer.outcome.cancels == []  # no spurious cancel to P
    assert sch.kv.pool.num_free == BLOCKS


def test_a_first_token_that_completes_a_grammar_which_cannot_take_eos_ends_the_answer(
    monkeypatch,
):
    """D's first token from P completes the request's grammar and none of its
    ``allowed_token_ids`` is EOS: the answer ends "stop" at that token, as colocated (D had
    made no mask for it yet: the next step found it stuck, ``structured_output_stuck``)."""
    pytest.importorskip("llguidance")
    from engine.structured.compiler import GrammarCompiler
    from engine.structured.spec import StructuredOutput
    from engine.tokenizer import ByteTokenizer

    cfg = connector_config("consumer")
    conn = nixl_scheduler.NixlConnectorScheduler(
        cfg, KVCacheSpec.for_model(load_arch_config("tiny"), cfg)
    )
    try:
        grammars = GrammarCompiler(ByteTokenizer, 512)
        sch = Scheduler(cfg, BLOCKS, 256, conn, grammars=grammars, vocab_size=512)
        monkeypatch.setattr(prefill_links.PrefillLinks, "reserve_job", lambda s, r: None)
        req = remote("X", "tcp://127.0.0.1:1", max_tokens=8)
        req.sampling_params = SamplingParams(
            max_tokens=8, allowed_token_ids=list(b"abc"),
            structured_output=StructuredOutput.choice(["a"]),
        )  # fmt: skip
        req.eos_token_ids = frozenset([ByteTokenizer.EOS])
        sch.add_request(req)
        step(sch)
        nonce = conn.consumer.recvs["X"].nonce
        info = {nonce: {"request_id": "X", "first_token": ord("a")}}
        outs = step(sch, ModelRunnerOutput(finished_recving={nonce}, kv_recv_info=info))
        outs += step(sch)  # the step after it: stuck, when the answer did not end
        got = [
            (o.new_token_ids, o.finish_reason, o.error_code) for o in outs if o.request_id == "X"
        ]
        assert got == [([ord("a")], "stop", None)], got
        assert outs[0].ended_by_grammar
    finally:
        conn.shutdown()


@pytest.fixture
def prefill():
    cfg = connector_config("producer")
    conn = nixl_scheduler.NixlConnectorScheduler(
        cfg, KVCacheSpec.for_model(load_arch_config("tiny"), cfg)
    )
    try:
        yield conn
    finally:
        conn.shutdown()


@pytest.mark.parametrize(
    ("error", "state"), [("WRITE timed out", "in_flight"), (None, "cancelled")]
)
def test_a_cancel_after_a_failed_send_says_a_write_may_still_land(prefill, error, state):
    """A send that errored or timed out may still land (UCX may not really have aborted the
    WRITE): P's tombstone keeps that outcome, and a cancel of it is answered ``in_flight``
    so D keeps its blocks quarantined until its deadline. It used to answer ``cancelled``
    and D freed the blocks at once. A send that completed is safe to confirm."""
    conn = prefill
    d_key = "decode:abc"
    ranks = [{"num_blocks": BLOCKS}]
    conn.service.peers.peers[d_key] = DecodePeer(
        "decode", "abc", dead_address(), ranks, ranks_digest(ranks), verified=True
    )
    assert conn.producer.prefill_finished("P1", "t1", [0, 1, 2], 7)
    reserve = Reserve(
        "t1", "n1", "D1", d_key, dead_address(), (5, 6, 7), 0, conn.incarnation, time.time()
    ).to_wire()
    assert conn.channel.handle(reserve) == {"ok": True}
    (send,) = conn.build_connector_meta(None, lambda rid: []).sends  # type: ignore[arg-type]
    assert send.request_id == "P1"
    failed = {"P1": error} if error else {}
    conn.update_connector_output(ModelRunnerOutput(finished_sending={"P1"}, kv_failed=failed))
    reply = conn.channel.handle(Cancel("t1", "n1", d_key).to_wire())
    assert reply == {"ok": True, "state": state}
    # Still so on a second ask (D retries the cancel until its quarantine ends).
    assert conn.channel.handle(Cancel("t1", "n1", d_key).to_wire())["state"] == state


def test_workers_keep_watching_while_quarantined_blocks_may_get_a_late_write(decode, monkeypatch):
    """A reservation that failed unsafely holds its blocks in quarantine (up to 2 x the
    timeout) in case a WRITE still lands. D's workers must keep progressing their
    transport meanwhile: a WRITE to D does not complete without D's progress (UCX on
    CPU, no progress thread), so P's late push hung to its own timeout and D held the
    blocks for the whole 2T (a fault round found it after 21ee9bc stopped the watch to
    save the poll's CPU)."""
    sch, conn = decode
    monkeypatch.setattr(prefill_links.PrefillLinks, "reserve_job", lambda s, r: None)
    sch.add_request(remote("X", "tcp://127.0.0.1:1"))
    out = sch.schedule()
    assert out.kv_connector_metadata.watch is True  # KV expected: watch
    sch.update_from_output(out, ModelRunnerOutput())
    sch.abort_request("X")  # the client left while the KV was expected
    out = sch.schedule()
    sch.update_from_output(out, ModelRunnerOutput())
    assert "X" in conn.consumer.quarantine and sch.kv.pool.num_free < BLOCKS
    assert out.kv_connector_metadata.watch is None  # unchanged: still watching
    assert conn.needs_worker_poll()


def test_a_prefill_address_that_never_answers_the_handshake_holds_no_blocks(decode, monkeypatch):
    """The handshake got no reply, so no reservation was sent: nothing can write into the
    blocks, and they are not quarantined. (A decode leg aimed at a port that takes the
    connection and never answers held its blocks for 2 x the timeout: two such legs of
    3,900 tokens left 24 of 512 blocks free for a minute.)"""
    sch, conn = decode
    monkeypatch.setattr(prefill_links, "RPC_TIMEOUT_S", 0.2)
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # takes every message, answers none
    address = f"tcp://127.0.0.1:{free_port()}"
    silent.bind(address)
    try:
        sch.add_request(remote("X", address))
        step(sch)
        assert sch.kv.block_ids("X")
        deadline = time.monotonic() + 10
        while "X" in conn.consumer.recvs:
            assert time.monotonic() < deadline, "the handshake never failed"
            time.sleep(0.05)
        assert "X" not in conn.consumer.quarantine
        assert conn.consumer.loads_failed == 1
        assert conn.links.handshake_failures == 1
    finally:
        silent.close(linger=0)
        ctx.term()


def _failed_loads(sch: Scheduler, conn, rids: list[str], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while any(r in conn.consumer.recvs for r in rids):
        assert time.monotonic() < deadline, "the reservations never failed"
        time.sleep(0.02)


def test_a_reservation_that_never_left_is_a_safe_failure(decode, monkeypatch):
    """Nothing listens at P's address (or P's process is stopped): the side channel never
    connects, so the reservation was never sent and P cannot hold it. The blocks go back
    at once instead of a 2 x timeout quarantine (a stopped P held every decode leg's
    blocks for a minute after its restart)."""
    sch, conn = decode
    monkeypatch.setattr(prefill_links, "RPC_TIMEOUT_S", 0.2)
    monkeypatch.setattr(
        prefill_links.PrefillLinks, "ensure_handshake", lambda s, a, force=False: PAIRED
    )
    sch.add_request(remote("X", dead_address()))
    step(sch)
    _failed_loads(sch, conn, ["X"])
    assert "X" not in conn.consumer.quarantine and conn.consumer.loads_failed == 1


def test_reservations_queued_behind_an_unanswered_call_to_p_fail_at_once(decode, monkeypatch):
    """P takes calls and answers none (hung). Its lane runs one call at a time, each
    waiting out the timeout: the 4th reservation failed after 4 timeouts (a hung P made
    in-flight requests wait 5, 10, 15 ... s). Calls queued behind an unanswered one now
    fail at once, unsent (safe); only the one that was sent is quarantined."""
    sch, conn = decode
    monkeypatch.setattr(prefill_links, "RPC_TIMEOUT_S", 0.5)
    monkeypatch.setattr(
        prefill_links.PrefillLinks, "ensure_handshake", lambda s, a, force=False: PAIRED
    )
    silent, address = _silent_peer()
    try:
        rids = ["A", "B", "C", "D"]
        for rid in rids:
            sch.add_request(remote(rid, address))
        step(sch)
        assert all(r in conn.consumer.recvs for r in rids)  # all four queued on P's lane
        _failed_loads(sch, conn, rids)
        assert list(conn.consumer.quarantine) == ["A"]  # sent, unanswered: P may hold it
        assert conn.consumer.loads_failed == 4
    finally:
        silent.close(linger=0)
