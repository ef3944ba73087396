"""Access to the side channel (issue 9, hole 4): signed messages with a shared secret
(``--kv-secret``; unsigned, forged and replayed ones refused), and the peers a node may
talk to (``--kv-allowed-peers``; a decode leg cannot make D connect anywhere)."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

import kvconnector.nixl.side_channel as sc
from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
)
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.kv_cache_layout import KVCacheSpec
from engine.log_limit import held_back
from engine.model.config import load_arch_config
from engine.sampling_params import InvalidRequestError, SamplingParams
from kvconnector.nixl.messages import Handshake, HandshakeReply, Refusal, decode_reply
from kvconnector.nixl.peers import PeerAllowlist
from kvconnector.nixl.scheduler import NixlConnectorScheduler
from kvconnector.params import KVTransferParams

SECRET = b"correct horse battery staple"


@pytest.fixture
def signed_server():
    calls: list[dict] = []

    def handler(msg: dict) -> dict:
        calls.append(msg)
        return {"ok": True, "echo": msg.get("x")}

    srv = sc.SideChannelServer("127.0.0.1", 0, handler, secret=SECRET)
    try:
        yield srv, calls
    finally:
        srv.close()


def raw_request(address: str, payload: bytes, timeout: float = 5.0) -> dict:
    """Send bytes as they are (no signing): what a forger or a replayer does."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(payload)
        assert sock.poll(int(timeout * 1000)), "no reply"
        return msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
    finally:
        sock.close()


def test_signed_requests_with_the_same_secret_are_served(signed_server):
    srv, calls = signed_server
    reply = sc.SideChannelClient(secret=SECRET).request(srv.address, {"x": 1}, timeout=5)
    assert reply == {"ok": True, "echo": 1} and calls == [{"x": 1}]


@pytest.mark.parametrize("client_secret", [None, b"another secret"], ids=["unsigned", "wrong"])
def test_unsigned_or_wrongly_signed_requests_are_refused(signed_server, client_secret):
    srv, calls = signed_server
    if client_secret is None:
        reply = sc.SideChannelClient().request(srv.address, {"kind": "ping"}, timeout=5)
        assert reply["code"] == "unauthenticated" and "--kv-secret" in reply["error"]
    else:
        with pytest.raises(sc.SideChannelError, match="bad signature"):
            sc.SideChannelClient(secret=client_secret).request(srv.address, {"x": 1}, timeout=5)
    assert calls == [] and srv.refused_unauthenticated == 1


def _signed(msg: dict, ts: float | None = None, nonce: bytes = b"n" * 16) -> bytes:
    ts = time.time() if ts is None else ts
    body = msgpack.packb(msg, use_bin_type=True)
    mac = sc._request_mac(SECRET, ts, nonce, body)
    return msgpack.packb({"ts": ts, "n": nonce, "body": body, "mac": mac}, use_bin_type=True)


def test_a_replayed_request_is_refused(signed_server):
    srv, calls = signed_server
    once = _signed({"x": 2})
    first = raw_request(srv.address, once)
    assert "mac" in first and calls == [{"x": 2}]
    again = raw_request(srv.address, once)
    assert again["code"] == "unauthenticated" and "replayed" in again["error"]
    assert calls == [{"x": 2}]


def test_a_request_signed_long_ago_is_refused(signed_server):
    srv, calls = signed_server
    old = raw_request(srv.address, _signed({"x": 3}, ts=time.time() - 10 * sc.REPLAY_WINDOW_S))
    assert old["code"] == "unauthenticated" and "clock" in old["error"] and calls == []


def test_a_tampered_request_is_refused(signed_server):
    srv, calls = signed_server
    env = msgpack.unpackb(_signed({"x": 4}, nonce=b"t" * 16), raw=False)
    env["body"] = msgpack.packb({"x": 5}, use_bin_type=True)  # signature of another body
    reply = raw_request(srv.address, msgpack.packb(env, use_bin_type=True))
    assert reply["code"] == "unauthenticated" and calls == []


def test_an_unsigned_reply_is_refused_by_a_signing_client():
    """A server without the secret (or someone answering in its place) cannot feed a
    signing client replies."""
    srv = sc.SideChannelServer("127.0.0.1", 0, lambda msg: {"ok": True})
    try:
        with pytest.raises(sc.SideChannelError, match="did not sign"):
            sc.SideChannelClient(secret=SECRET).request(srv.address, {"x": 1}, timeout=5)
    finally:
        srv.close()


# -- the connectors --------------------------------------------------------------------


def connector(role: str, **kv) -> NixlConnectorScheduler:
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=256, dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=64),
        kv_transfer=KVTransferConfig(kv_connector="nixl", kv_role=role, peer_ping_interval=0, **kv),
    )
    conn = NixlConnectorScheduler(cfg, KVCacheSpec.for_model(load_arch_config("tiny"), cfg))
    conn.set_worker_info([{"num_blocks": 64}])
    return conn


def test_a_decode_node_without_the_secret_cannot_pair_with_a_prefill_node_that_has_it():
    p = connector("producer", kv_secret="s3cret")
    good = connector("consumer", kv_secret="s3cret")
    bad = connector("consumer", kv_secret="")
    try:
        assert good.links.ensure_handshake(p.address).engine_id == p.engine_id
        with pytest.raises(Exception, match="unauthenticated"):
            bad.links.ensure_handshake(p.address)
        assert set(p.service.peers.peers) == {good.links.pairing_key(p.address)}
    finally:
        for c in (p, good, bad):
            c.shutdown()


def test_the_secret_is_never_in_the_logged_config():
    cfg = KVTransferConfig(kv_connector="nixl", kv_secret="do-not-log-me")
    assert "do-not-log-me" not in repr(cfg) and "do-not-log-me" not in repr(EngineConfig())


def test_a_decode_leg_naming_a_peer_outside_the_allowlist_is_refused_before_any_connection():
    """The server-side request forgery: any client could make D connect to any address
    it named in ``remote_side_channel``. Now it is a 400 naming the field, and nothing
    is reserved or queued."""
    d = connector("consumer")  # default: loopback
    sch = Scheduler(d.config, 64, 256, d)
    try:
        params = KVTransferParams(
            do_remote_prefill=True, transfer_id="t", remote_side_channel="tcp://10.1.2.3:5555"
        )
        req = Request("r", [1, 2, 3], SamplingParams(max_tokens=2), kv_transfer_params=params)
        with pytest.raises(InvalidRequestError) as info:
            sch.add_request(req)
        assert info.value.param == "kv_transfer_params.remote_side_channel"
        assert "--kv-allowed-peers" in str(info.value)
        assert not sch.requests and not d.consumer.recvs and d.channel.lanes.num_lanes() == 0
    finally:
        d.shutdown()


def _loopback_handshake(p: NixlConnectorScheduler) -> Handshake:
    """A decode node's handshake from a loopback address, compatible with ``p``."""
    return Handshake(
        engine_id="d",
        incarnation="i",
        peer_key="d:i",
        compat=p.compat,
        ranks=({"num_blocks": 64},),
        address="tcp://127.0.0.1:5600",
    )


def test_a_prefill_node_refuses_handshakes_from_peers_outside_its_allowlist():
    p = connector("producer", kv_allowed_peers="10.0.0.0/8")
    try:
        reply = decode_reply(p.channel.handle(_loopback_handshake(p).to_wire()), HandshakeReply)
        assert isinstance(reply, Refusal) and "--kv-allowed-peers" in reply.error
        assert not p.service.peers
    finally:
        p.shutdown()


@pytest.mark.parametrize(
    ("spec", "allowed", "refused"),
    [
        (
            "loopback",
            ["tcp://127.0.0.1:1", "tcp://127.9.9.9:2", "tcp://localhost:3", "tcp://[::1]:4"],
            ["tcp://10.0.0.1:1", "tcp://example.com:1", "tcp://0.0.0.0:1"],
        ),
        (
            "10.0.0.0/8, prefill",
            ["tcp://10.2.3.4:5600", "tcp://prefill:5600", "tcp://PREFILL:1"],
            ["tcp://11.0.0.1:1", "tcp://127.0.0.1:1", "tcp://prefill-2:5600"],
        ),
        (
            "p1.internal:5600,[fd00::1]:7",
            ["tcp://p1.internal:5600", "tcp://[fd00::1]:7"],
            ["tcp://p1.internal:5601", "tcp://[fd00::1]:8"],
        ),
        ("*", ["tcp://203.0.113.9:1"], []),
        (  # an IPv4 address written as IPv6 (::ffff:a.b.c.d) is that IPv4 address
            "::/0, 10.0.0.0/8",
            ["tcp://[fd00::1]:1", "tcp://10.0.0.1:1", "tcp://[::ffff:10.0.0.1]:1"],
            ["tcp://[::ffff:169.254.169.254]:80", "tcp://[::ffff:a9fe:a9fe]:80"],
        ),
        ("loopback, ::ffff:10.0.0.7", ["tcp://[::ffff:127.0.0.1]:1", "tcp://10.0.0.7:2"], []),
        (
            "loopback",
            [],
            ["tcp://127.0.0.1", "http://127.0.0.1:1", "tcp://127.0.0.1:1/x", "tcp://:1"],
        ),
    ],
)
def test_peer_allowlist(spec, allowed, refused):
    allow = PeerAllowlist.parse(spec)
    assert [a for a in allowed if not allow.allows(a)] == []
    assert [a for a in refused if allow.allows(a)] == []


@pytest.mark.parametrize("spec", ["", " , ", "10.0.0.0/33", "bad host!", "h:notaport"])
def test_a_bad_allowlist_is_a_config_error_naming_the_flag(spec):
    with pytest.raises(ConfigError, match="--kv-allowed-peers"):
        KVTransferConfig(kv_allowed_peers=spec)


@pytest.mark.parametrize(
    ("role", "leg", "field"),
    [
        (
            "producer",
            {"do_remote_prefill": True, "remote_side_channel": "tcp://127.0.0.1:1"},
            "do_remote_prefill",
        ),
        ("consumer", {"do_remote_decode": True}, "do_remote_decode"),
    ],
)
def test_a_leg_sent_to_a_node_of_the_other_role_is_a_400(role, leg, field):
    """A prefill node used to accept a decode leg and try to pull the KV itself."""
    node = connector(role)
    sch = Scheduler(node.config, 64, 256, node)
    try:
        params = KVTransferParams.from_dict({"transfer_id": "t", **leg})
        req = Request("r", [1, 2, 3], SamplingParams(max_tokens=2), kv_transfer_params=params)
        with pytest.raises(InvalidRequestError) as info:
            sch.add_request(req)
        assert info.value.param == f"kv_transfer_params.{field}"
        assert not sch.requests
    finally:
        node.shutdown()


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), float("-inf")])
def test_a_request_whose_clock_is_not_a_number_is_refused(signed_server, ts):
    """NaN compared false with the replay window's bounds, so a NaN-stamped request was
    served (and its nonce remembered forever)."""
    srv, calls = signed_server
    reply = raw_request(srv.address, _signed({"x": 6}, ts=ts, nonce=b"f" * 16))
    assert reply["code"] == "unauthenticated" and "clock" in reply["error"] and calls == []


@pytest.mark.parametrize("body", [b"\xc1", msgpack.packb([1, 2])], ids=["undecodable", "array"])
def test_a_signed_body_that_is_not_a_map_is_refused_in_one_line(signed_server, body, caplog):
    """A holder of the secret signing garbage gets a refusal; the log gets one line, not
    a traceback per message."""
    srv, calls = signed_server
    ts, nonce = time.time(), b"g" * 16
    mac = sc._request_mac(SECRET, ts, nonce, body)
    env = msgpack.packb({"ts": ts, "n": nonce, "body": body, "mac": mac}, use_bin_type=True)
    with caplog.at_level("WARNING", logger="kvconnector.nixl.side_channel"):
        reply = raw_request(srv.address, env)
    assert "body" in reply and calls == []  # a signed refusal
    assert msgpack.unpackb(reply["body"])["ok"] is False
    assert not [r for r in caplog.records if r.exc_info]


def test_a_message_over_the_size_limit_is_dropped_and_the_server_serves_on(monkeypatch):
    monkeypatch.setattr(sc, "MAX_MESSAGE_BYTES", 4096)
    srv = sc.SideChannelServer("127.0.0.1", 0, lambda msg: {"ok": True})
    try:
        with pytest.raises(sc.SideChannelTimeout):
            sc.SideChannelClient().request(srv.address, {"x": b"y" * 10_000}, timeout=1.0)
        assert sc.SideChannelClient().request(srv.address, {"x": 1}, timeout=5) == {"ok": True}
    finally:
        srv.close()


def test_a_node_whose_own_side_channel_is_outside_its_allowlist_says_so_at_start():
    """Bound to 0.0.0.0 (the launch scripts advertise the host's address) with the default
    allowlist, every handshake was refused and every request recomputed on D, answers
    right and nothing said (found by a new-user audit of docs/deploy.md)."""
    from kvconnector.nixl.peers import own_address_refused

    default = PeerAllowlist.parse("loopback")
    msg = own_address_refused("tcp://192.0.2.2:5600", default, "loopback")
    assert msg is not None and "--kv-allowed-peers" in msg and "192.0.2.2" in msg
    assert own_address_refused("tcp://127.0.0.1:5600", default, "loopback") is None
    wide = PeerAllowlist.parse("192.0.2.0/24")
    assert own_address_refused("tcp://192.0.2.2:5600", wide, "192.0.2.0/24") is None
    assert own_address_refused("tcp://192.0.2.2:5600", wide, "10.0.0.0/8") is None
    narrow = PeerAllowlist.parse("10.0.0.0/8")
    assert own_address_refused("tcp://192.0.2.2:5600", narrow, "10.0.0.0/8") is not None


@pytest.mark.parametrize(
    "own, spec",
    [
        ("tcp://prefill:5600", "decode"),  # scripts/deploy/compose.yaml's prefill node
        ("tcp://192.0.2.1:5600", "192.0.2.2"),  # docs/deploy.md's docker run: the other host
        ("tcp://192.0.2.1:5600", "192.0.2.2:5600,192.0.2.3"),
        ("tcp://127.0.0.1:5600", "127.0.0.2"),
    ],
)
def test_a_list_that_names_the_peers_does_not_warn_about_the_own_address(own, spec):
    """A list naming the peers' hosts says nothing about this node's own address: P's
    allowlist names the decode nodes, D's the prefill nodes. Such nodes pair (a walkthrough
    of the compose file on one box: P pushed, D computed no prompt token), but each warned
    at start that every prompt would be prefilled on the decode node, and the launch
    scripts repeated it."""
    from kvconnector.nixl.peers import own_address_refused

    assert own_address_refused(own, PeerAllowlist.parse(spec), spec) is None


def test_the_connector_logs_the_own_address_warning(caplog):
    with caplog.at_level("WARNING"):
        conn = connector("consumer", kv_allowed_peers="10.9.9.0/24")  # not loopback
        conn.shutdown()
    assert any("is outside --kv-allowed-peers" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING"):
        connector("consumer").shutdown()
    assert not any("is outside --kv-allowed-peers" in r.getMessage() for r in caplog.records)


def test_a_flood_of_unsigned_requests_logs_a_few_lines_and_counts_every_refusal(
    monkeypatch, caplog
):
    """Anyone who reaches the side-channel port can send unsigned messages: each was
    logged at WARNING, so a flood filled the log. Now the first is logged at once, then at
    most one line per ``REFUSAL_LOG_S`` saying how many were held back; every refusal is
    counted (``refused``, exported as ``pdserve_engine_kv_side_channel_requests_refused_total``)."""
    monkeypatch.setattr(sc, "REFUSAL_LOG_S", 0.3)
    calls: list[dict] = []
    srv = sc.SideChannelServer("127.0.0.1", 0, calls.append, secret=SECRET)
    client = sc.SideChannelClient()
    n = 200

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "refusing a request" in r.getMessage()]

    try:
        with caplog.at_level("WARNING", logger="kvconnector.nixl.side_channel"):
            start = time.monotonic()
            for i in range(n):
                reply = client.request(srv.address, {"kind": "ping", "i": i}, timeout=5)
                assert reply["code"] == "unauthenticated"
            took = time.monotonic() - start
            assert "--kv-secret" in lines()[0] and held_back(lines()[0]) == 0
            assert len(lines()) <= 2 + took / 0.3, (len(lines()), took)  # was one per request
            time.sleep(0.4)  # past the period: the next is logged, with what was held back
            client.request(srv.address, {"kind": "ping"}, timeout=5)
        assert len(lines()) + sum(map(held_back, lines())) == n + 1, lines()
        assert calls == [] and srv.refused == srv.refused_unauthenticated == n + 1
    finally:
        srv.close()


def test_floods_of_unreadable_malformed_or_refused_messages_log_one_line_per_kind(caplog):
    """Without ``--kv-secret`` (the default) anyone who reaches a prefill node's side
    channel is read: unreadable bytes, malformed messages, messages for the other role and
    handshakes from peers outside ``--kv-allowed-peers`` each logged a warning per
    message, so a flood filled the log. Now each kind logs its first at once and then at
    most one line per 10 s; every message still gets its refusal."""
    p = connector("producer", kv_allowed_peers="10.0.0.0/8")
    shake = _loopback_handshake(p).to_wire()
    floods = {
        "unreadable": msgpack.packb([1, 2]),
        "malformed": msgpack.packb({"kind": "reserve", "transfer_id": 5}),
        "other role": msgpack.packb({"kind": "transfer_failed", "v": 1}),
        "allowlist": msgpack.packb(shake),
    }
    n = 40
    try:
        with caplog.at_level("WARNING"):
            for payload in floods.values():
                for _ in range(n):
                    reply = raw_request(p.address, payload)
                    assert reply.get("ok") is False or reply.get("kind") == "refusal", reply
        lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(lines) <= 2 * len(floods), lines  # was n per kind
        assert any("not in --kv-allowed-peers" in line for line in lines), lines
    finally:
        p.shutdown()
