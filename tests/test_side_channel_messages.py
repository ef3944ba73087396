"""Typed side-channel messages: valid ones round-trip, forged or malformed ones are refused
(by the decoder, and by a live connector's side-channel server, which keeps serving)."""

from __future__ import annotations

import time

import msgpack
import pytest

from engine.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from engine.kv_cache_layout import KVCacheSpec
from engine.model.config import load_arch_config
from kvconnector.nixl import messages as m
from kvconnector.nixl.scheduler import NixlConnectorScheduler
from kvconnector.nixl.side_channel import SideChannelClient

HANDSHAKE = m.Handshake(
    engine_id="d-0",
    incarnation="abc",
    peer_key="d-0:abc",
    compat={"connector_version": m.CONNECTOR_VERSION},
    ranks=({"agent_name": "a", "agent_metadata": b"\x00\x01", "num_blocks": 8},),
    address="tcp://127.0.0.1:5600",
)
RESERVE = m.Reserve(
    transfer_id="t1",
    nonce="abc.1.00ff",
    d_request_id="d1",
    peer_key="d-0:abc",
    address="tcp://127.0.0.1:5600",
    block_ids=(3, 4, 7),
    skip_blocks=1,
    p_incarnation="p-inc",
    sent_at=1.7e9,
)
REQUESTS = [
    HANDSHAKE,
    RESERVE,
    m.Cancel("t1", "abc.1.00ff", "d-0:abc"),
    m.TransferFailed("d1", "t1", "abc.1.00ff", "gone", True),
    m.Ping(),
]
REPLIES = [
    m.HandshakeReply(
        engine_id="p-0",
        incarnation="def",
        side_channel="tcp://127.0.0.1:5700",
        role="producer",
        compat={"block_size": 16},
        transport={"library": "nixl"},
        ranks=({"num_blocks": 8},),
    ),
    m.Ack(),
    m.CancelReply("in_flight"),
    m.PingReply(incarnation="def", engine_id="p-0"),
    m.PingReply(incarnation="def", engine_id="p-0", ranks_digest=m.ranks_digest(HANDSHAKE.ranks)),
]


def _over_msgpack(wire: dict) -> dict:
    """What the peer decodes: the map through msgpack, as the side channel sends it."""
    return msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False)


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda x: type(x).__name__)
def test_requests_round_trip(msg):
    wire = msg.to_wire()
    assert wire["kind"] == msg.KIND
    assert m.decode_request(_over_msgpack(wire)) == msg


@pytest.mark.parametrize("reply", REPLIES, ids=lambda x: type(x).__name__)
def test_replies_round_trip(reply):
    wire = reply.to_wire()
    assert wire["ok"] is True
    assert m.decode_reply(_over_msgpack(wire), type(reply)) == reply


def test_the_wire_keeps_its_v9_shape():
    assert m.CONNECTOR_VERSION == 9
    assert m.Ping().to_wire() == {"kind": "ping"}
    assert m.Cancel("t", "n", "k").to_wire() == {
        "kind": "cancel",
        "transfer_id": "t",
        "nonce": "n",
        "peer_key": "k",
    }
    assert RESERVE.to_wire()["block_ids"] == [3, 4, 7]
    assert RESERVE.to_wire()["p_incarnation"] == "p-inc"  # v8: the P process it is for
    assert RESERVE.to_wire()["sent_at"] == 1.7e9  # v9: D's wall clock when it sent it
    assert m.CancelReply("cancelled").to_wire() == {"ok": True, "state": "cancelled"}
    refusal = m.Refusal("handshake first", code=m.Refusal.HANDSHAKE_REQUIRED)
    assert refusal.to_wire() == {
        "ok": False,
        "error": "handshake first",
        "code": "handshake_required",
    }
    assert m.Refusal("no").to_wire() == {"ok": False, "error": "no"}
    ping = m.PingReply("i", "e", "d").to_wire()
    assert ping == {"ok": True, "incarnation": "i", "engine_id": "e", "ranks_digest": "d"}
    # The digest names the ranks as they travel: the same after a msgpack round trip.
    wire = _over_msgpack(HANDSHAKE.to_wire())
    assert m.ranks_digest(wire["ranks"]) == m.ranks_digest(HANDSHAKE.ranks)
    assert m.decode_reply({"ok": False, "error": "no"}, m.Ack) == m.Refusal("no")
    # A reply that carries more than the decoder knows (a newer peer) still decodes.
    assert m.decode_reply({"ok": True, "state": "cancelled", "extra": 1}, m.CancelReply)


def _reserve(**override) -> dict:
    return {**RESERVE.to_wire(), **override}


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        ([1, 2], "must be a map"),
        ({"transfer_id": "t"}, "unknown message kind None"),
        ({"kind": "launch_missiles"}, "unknown message kind 'launch_missiles'"),
        ({"kind": 7}, "unknown message kind 7"),
        ({"kind": "cancel"}, "cancel: missing field 'transfer_id'"),
        ({"kind": "cancel", "transfer_id": 5}, "cancel.transfer_id must be a non-empty string"),
        ({"kind": "cancel", "transfer_id": ""}, "cancel.transfer_id must be a non-empty string"),
        (_reserve(block_ids=[1, -2]), "reserve.block_ids[1] must be a non-negative integer"),
        (_reserve(block_ids=[1, 2.0]), "reserve.block_ids[1] must be a non-negative integer"),
        (_reserve(block_ids=[True]), "reserve.block_ids[0] must be a non-negative integer"),
        (_reserve(block_ids="1,2"), "reserve.block_ids must be an array of at most"),
        (_reserve(block_ids={"0": 1}), "reserve.block_ids must be an array of at most"),
        (_reserve(skip_blocks=-1), "reserve.skip_blocks must be a non-negative integer"),
        (_reserve(skip_blocks="1"), "reserve.skip_blocks must be a non-negative integer"),
        (_reserve(address="http://x"), "reserve.address must be a side-channel address"),
        ({**RESERVE.to_wire(), "d_request_id": None}, "reserve.d_request_id must be"),
        (_reserve(sent_at=float("nan")), "reserve.sent_at must be a finite non-negative time"),
        (_reserve(sent_at="now"), "reserve.sent_at must be a finite non-negative time"),
        (_reserve(sent_at=True), "reserve.sent_at must be a finite non-negative time"),
        (
            {k: v for k, v in RESERVE.to_wire().items() if k != "sent_at"},
            "reserve: missing field 'sent_at'",  # a v8 reservation
        ),
        (
            {k: v for k, v in RESERVE.to_wire().items() if k != "peer_key"},
            "reserve: missing field 'peer_key'",
        ),
        ({**REQUESTS[3].to_wire(), "safe": 1}, "transfer_failed.safe must be a boolean"),
        ({"kind": "cancel", "transfer_id": "t"}, "missing field 'nonce'"),
        ({**HANDSHAKE.to_wire(), "compat": [1]}, "handshake.compat must be a map"),
        ({**HANDSHAKE.to_wire(), "ranks": [1]}, "handshake.ranks[0] must be a map"),
        ({**HANDSHAKE.to_wire(), "ranks": {}}, "handshake.ranks must be an array of 1 to"),
    ],
)
def test_malformed_requests_are_refused_with_the_field_named(raw, error):
    with pytest.raises(m.MessageError) as info:
        m.decode_request(raw)
    assert error in str(info.value)


@pytest.mark.parametrize(
    ("raw", "cls", "error"),
    [
        ("yes", m.Ack, "must be a map"),
        ({"state": "cancelled"}, m.CancelReply, "'ok' must be true or false"),
        ({"ok": True, "state": "gone"}, m.CancelReply, "cancel reply.state must be"),
        ({"ok": True}, m.PingReply, "ping reply: missing field 'incarnation'"),
        ({"ok": False}, m.Ack, "refusal: missing field 'error'"),
        ({"ok": True, "engine_id": "p"}, m.HandshakeReply, "missing field"),
    ],
)
def test_malformed_replies_are_refused(raw, cls, error):
    with pytest.raises(m.MessageError, match=error):
        m.decode_reply(raw, cls)


def test_notifications():
    notif = m.Notif("d1", "t1", "k1", 2, 17)
    assert m.Notif.unpack(notif.pack()) == notif
    wire = {"r": "d1", "t": "t1", "k": "k1", "n": 2, "ft": 17}  # v2
    assert msgpack.unpackb(notif.pack()) == wire
    no_first = {"r": "d1", "t": "t1", "k": "k", "n": 1, "ft": None}
    assert m.Notif.unpack(msgpack.packb(no_first)).ft is None
    with pytest.raises(m.MessageError, match="missing field 'k'"):  # a v1 notif: no fence
        m.Notif.unpack(msgpack.packb({"r": "d1", "t": "t1", "n": 1, "ft": None}))
    for bad, error in [
        (b"\xc1", "undecodable"),
        (msgpack.packb([1]), "expected a map"),
        (msgpack.packb({"t": "t1"}), "missing field 'r'"),
        (
            msgpack.packb({"r": "d", "t": "t", "k": "k", "n": 0}),
            "notif.n must be a positive integer",
        ),
        (msgpack.packb({"r": "d", "t": "t", "k": "k", "ft": -3}), "notif.ft must be a token id"),
    ]:
        with pytest.raises(m.MessageError, match=error):
            m.Notif.unpack(bad)


@pytest.fixture
def prefill():
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", dtype="float32"),
        cache=CacheConfig(num_blocks=64),
        kv_transfer=KVTransferConfig(kv_connector="nixl", kv_role="producer"),
    )
    conn = NixlConnectorScheduler(cfg, KVCacheSpec.for_model(load_arch_config("tiny"), cfg))
    conn.set_worker_info([{"num_blocks": 64, "mem_type": "DRAM"}])
    try:
        yield conn
    finally:
        conn.shutdown()


def test_a_live_server_refuses_forged_messages_and_keeps_serving(prefill):
    client = SideChannelClient()

    def ask(msg: dict) -> dict:
        return client.request(prefill.address, msg, 5.0)

    for forged in (
        {"kind": "launch_missiles"},
        {"kind": "cancel", "transfer_id": ["t"]},
        _reserve(block_ids=[-1]),
        {"kind": "handshake"},
    ):
        reply = ask(forged)
        assert reply["ok"] is False and reply["error"].startswith("malformed message: ")
    # A handshake of another connector version is told about the version, not the shape.
    other = {"kind": "handshake", "compat": {**prefill.compat, "connector_version": 99}}
    assert "connector_version mismatch" in ask(other)["error"]

    # A reservation before the handshake, then one that names blocks the peer lacks.
    assert ask(RESERVE.to_wire())["code"] == "handshake_required"
    shake = m.Handshake(
        engine_id="d-0",
        incarnation="abc",
        peer_key="d-0:abc",
        compat=prefill.compat,
        ranks=({"num_blocks": 8},),
        address="tcp://127.0.0.1:5600",
    )
    reply = m.decode_reply(ask(shake.to_wire()), m.HandshakeReply)
    assert isinstance(reply, m.HandshakeReply) and reply.incarnation == prefill.incarnation
    # One made for another P process at this address (P restarted since): refused.
    stale = m.decode_reply(ask(RESERVE.to_wire()), m.Ack)
    assert isinstance(stale, m.Refusal) and stale.code == m.Refusal.WRONG_INCARNATION
    assert "t1" not in prefill.producer.early
    # One that got here long after D sent it (D's quarantine may be over), or dated ahead
    # of this node's clock by more than the hosts may differ: refused, nothing held.
    for sent_at in (time.time() - m.RESERVE_MAX_AGE_S - 1, time.time() + m.CLOCK_SLACK_S + 1):
        late = m.decode_reply(
            ask(_reserve(p_incarnation=reply.incarnation, sent_at=sent_at)), m.Ack
        )
        assert isinstance(late, m.Refusal) and late.code == m.Refusal.STALE_RESERVATION
        assert "t1" not in prefill.producer.early
    reserve = _reserve(p_incarnation=reply.incarnation, sent_at=time.time())
    out_of_range = m.decode_reply(ask({**reserve, "block_ids": [3, 8]}), m.Ack)
    assert isinstance(out_of_range, m.Refusal) and "out of range" in out_of_range.error
    assert m.decode_reply(ask(reserve), m.Ack) == m.Ack()
    assert prefill.producer.early["t1"].block_ids == [3, 4, 7]
    assert m.decode_reply(ask(reserve), m.Ack) == m.Ack()  # a retry: same nonce
    other = {**reserve, "nonce": "abc.2.11ee"}  # another reservation: no
    assert isinstance(m.decode_reply(ask(other), m.Ack), m.Refusal)
    # A cancel naming another reservation leaves this one alone.
    cancel = m.decode_reply(
        ask(m.Cancel("t1", "abc.2.11ee", RESERVE.peer_key).to_wire()), m.CancelReply
    )
    assert cancel == m.CancelReply("cancelled") and "t1" in prefill.producer.early
    cancel = m.decode_reply(
        ask(m.Cancel("t1", RESERVE.nonce, RESERVE.peer_key).to_wire()), m.CancelReply
    )
    assert cancel == m.CancelReply("cancelled") and "t1" not in prefill.producer.early
    ping = m.decode_reply(ask(m.Ping().to_wire()), m.PingReply)
    assert ping == m.PingReply(
        incarnation=prefill.incarnation,
        engine_id=prefill.engine_id,
        ranks_digest=m.ranks_digest(prefill._ranks),
    )


def test_a_ping_answered_with_a_refusal_or_garbage_counts_as_a_miss():
    """Only a valid ping reply tells the incarnation: anything else is not a restart
    (which would free blocks a live peer may still write) but a miss."""
    from concurrent.futures import Future

    from kvconnector.nixl.liveness import PeerLiveness

    class Inline:
        def submit(self, peer, fn, *args, proven=False):
            fut: Future = Future()
            fut.set_result(fn(*args))
            return fut

    replies = [{"ok": False, "error": "unknown message kind 'ping'"}, {"ok": True}]
    lost: list = []
    live = PeerLiveness(
        0.001, lambda a, msg, t: replies.pop(0), Inline(), lambda *args: lost.append(args)
    )
    for _ in range(2):
        live._last = -1.0
        live.tick({("tcp://p:1", "a")})
    assert lost == [("tcp://p:1", None, "prefill tcp://p:1 stopped answering", False)]
