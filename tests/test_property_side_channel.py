"""Property-based tests (hypothesis) of the side channel: generated bad messages against a
real prefill-side connector (its real side-channel server, signed with ``--kv-secret``).

For every generated message:

- the server answers with a map (``ok`` true or false) and never raises -- the handler is
  called directly for the structured messages (fast) and through the real socket for raw
  bytes, unsigned and replayed envelopes;
- a reservation is acknowledged only when every block id is inside the decode peer's KV
  cache (no WRITE could ever be posted outside registered memory) and only for a peer
  that handshook;
- afterwards the server still serves a valid ping, and once every deadline has passed the
  producer holds nothing (no reservation, send, tombstone or cancelled nonce left).

The examples are fixed (``derandomize``, no example database), so CI runs the same inputs.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
import zmq
from fakes import fixed_examples
from hypothesis import given
from hypothesis import strategies as st

import kvconnector.nixl.producer as producer_module
import kvconnector.nixl.side_channel as sc
from engine.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from engine.kv_cache_layout import KVCacheSpec
from engine.model.config import load_arch_config
from kvconnector.nixl.messages import Handshake, Ping, PingReply, Reserve, decode_reply
from kvconnector.nixl.scheduler import NixlConnectorScheduler

SECRET = "property-secret"
D_BLOCKS = 48  # the decode peer's KV cache size, as its handshake says
D_KEY = "d-0:inc"
TIMEOUT = 5.0


_settings = fixed_examples


@pytest.fixture(scope="module")
def prefill():
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=256, dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=64),
        kv_transfer=KVTransferConfig(
            kv_connector="nixl",
            kv_role="producer",
            peer_ping_interval=0,
            kv_transfer_timeout=TIMEOUT,
            kv_secret=SECRET,
        ),
    )
    conn = NixlConnectorScheduler(cfg, KVCacheSpec.for_model(load_arch_config("tiny"), cfg))
    conn.set_worker_info([{"num_blocks": 64}])
    shake = Handshake(
        engine_id="d-0",
        incarnation="inc",
        peer_key=D_KEY,
        compat=conn.compat,
        ranks=({"num_blocks": D_BLOCKS},),
        address="tcp://127.0.0.1:5600",
    )
    assert conn.channel.handle(shake.to_wire())["ok"] is True
    try:
        yield conn
    finally:
        conn.shutdown()


# -- strategies ------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=30,
)
KINDS = ["handshake", "reserve", "cancel", "transfer_failed", "ping", "launch", ""]
FIELDS = [
    "transfer_id", "nonce", "d_request_id", "peer_key", "address", "block_ids",
    "skip_blocks", "engine_id", "incarnation", "compat", "ranks", "reason", "safe",
    "p_incarnation", "sent_at",
]  # fmt: skip
THIS_P = "<the prefill node's incarnation>"  # replaced by the test


@st.composite
def structured(draw) -> dict[str, Any]:
    """A map with a (mostly) known kind and a random subset of fields of random values."""
    msg: dict[str, Any] = {"kind": draw(st.sampled_from(KINDS) | st.text(max_size=10))}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=len(FIELDS), unique=True)):
        msg[name] = draw(values)
    return msg


block_id = st.integers(min_value=-(2**70), max_value=2**70) | st.integers(0, 2 * D_BLOCKS)


@st.composite
def reservations(draw) -> dict[str, Any]:
    """Well-shaped reservations from the handshaken peer (or a stranger) with hostile
    block ids, transfer ids and nonces."""
    wire = Reserve(
        transfer_id=draw(st.text(min_size=1, max_size=20)),
        nonce=draw(st.text(min_size=1, max_size=20)),
        d_request_id=draw(st.text(min_size=1, max_size=20)),
        peer_key=draw(st.sampled_from([D_KEY, "stranger:1"])),
        address="tcp://127.0.0.1:5600",
        block_ids=(),
        skip_blocks=draw(st.integers(0, 8)),
        p_incarnation=draw(st.sampled_from([THIS_P, "a-restarted-p"])),
        sent_at=time.time(),
    ).to_wire()
    wire["block_ids"] = draw(st.lists(block_id, max_size=12))
    return wire


def _packed(value: Any) -> bytes | None:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):  # ints msgpack cannot carry
        return None


packed_values = values.map(_packed).filter(lambda b: b is not None)


def _check_reply(reply: Any) -> None:
    assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
    if reply["ok"] is False:
        assert isinstance(reply.get("error"), str) and reply["error"]


# -- properties ------------------------------------------------------------------------------


@_settings(400)
@given(msg=structured() | values)
def test_any_message_gets_a_map_reply_and_never_raises(prefill, msg):
    _check_reply(
        prefill.channel.handle(msg) if isinstance(msg, dict) else _handle_any(prefill, msg)
    )


def _handle_any(conn: NixlConnectorScheduler, raw: Any) -> dict[str, Any]:
    # The server hands the handler maps only; anything else is refused before it.
    return (
        conn.channel.handle(raw) if isinstance(raw, dict) else {"ok": False, "error": "not a map"}
    )


@_settings(300)
@given(res=reservations())
def test_a_reservation_is_acked_only_inside_the_peers_kv_cache(prefill, res):
    before = dict(prefill.producer.early)
    if res["p_incarnation"] == THIS_P:
        res = {**res, "p_incarnation": prefill.incarnation}
    reply = prefill.channel.handle(res)
    _check_reply(reply)
    if reply["ok"]:
        assert res["peer_key"] == D_KEY, "acked a reservation from a peer that never handshook"
        assert res["p_incarnation"] == prefill.incarnation, "acked one for another P process"
        assert all(isinstance(b, int) and 0 <= b < D_BLOCKS for b in res["block_ids"])
        held = prefill.producer.early.get(res["transfer_id"])
        assert held is not None and held.nonce == res["nonce"]
    else:
        assert prefill.producer.early == before  # a refusal changes nothing


@_settings(60)
@given(payload=st.binary(max_size=200) | packed_values)
def test_raw_bytes_and_unsigned_maps_over_the_socket_are_refused(prefill, payload):
    reply = _send_raw(prefill.address, payload)
    _check_reply(reply)
    assert reply["ok"] is False


def test_a_replayed_signed_message_is_refused_and_the_server_still_serves(prefill):
    client = sc.SideChannelClient(secret=SECRET.encode())
    ts, nonce = time.time(), b"r" * 16
    body = msgpack.packb(Ping().to_wire(), use_bin_type=True)
    env = {
        "ts": ts,
        "n": nonce,
        "body": body,
        "mac": sc._request_mac(SECRET.encode(), ts, nonce, body),
    }
    raw = msgpack.packb(env, use_bin_type=True)
    assert "mac" in _send_raw(prefill.address, raw)  # first time: a signed reply
    assert _send_raw(prefill.address, raw)["code"] == "unauthenticated"  # replay
    reply = decode_reply(client.request(prefill.address, Ping().to_wire(), 5.0), PingReply)
    assert isinstance(reply, PingReply) and reply.incarnation == prefill.incarnation


def test_after_the_barrage_every_deadline_ends_every_state(prefill, monkeypatch):
    """Runs after the properties above (same module fixture): whatever they left behind
    (early reservations, tombstones, cancelled nonces) is gone once deadlines pass."""
    p = prefill.producer
    for hops in (1, 2):  # waits end (tombstoned), then the tombstones end
        later = time.monotonic() + 5 * hops * TIMEOUT
        monkeypatch.setattr(producer_module.time, "monotonic", lambda t=later: t)
        p.expire()
    assert (p.num_states(), len(p.tombstones), len(p.cancelled)) == (0, 0, 0)


def _send_raw(address: str, payload: bytes) -> dict[str, Any]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(payload)
        assert sock.poll(10_000), "the side channel stopped answering"
        return msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
    finally:
        sock.close()
