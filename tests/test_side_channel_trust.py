"""Forged side-channel messages from a peer that can reach a node's side channel (with the
default unsigned channel, or holding ``--kv-secret``): what each message may and may not
do. Real connectors with their real side-channel servers and clients; no mocks.

The holes these tests close were found by a black-box fuzz of running nodes: a decode node
answered handshakes with its NIXL rank metadata (anyone could then WRITE into its KV
cache), and a forged handshake naming a decode node's engine id made P drop the real one.

Not a hole: a cancel naming a transfer id with a made-up nonce drops P's held prefill when
no reservation for it has come (D recomputes). Knowing a transfer id is the capability in
this protocol -- a reservation naming it has the same power -- and the proxy makes them
unguessable (docs/reliability.md, "Access").
"""

from __future__ import annotations

import random
import socket
import threading
import time
from typing import Any

import msgpack
import pytest
from harness import free_port, wait_for

import kvconnector.nixl.decode_peers as decode_peers
import kvconnector.nixl.prefill_links as prefill_links
import kvconnector.nixl.producer as producer_module
from engine.config import CacheConfig, ConfigError, EngineConfig, KVTransferConfig, ModelConfig
from engine.core.request import Request
from engine.kv_cache_layout import KVCacheSpec
from engine.model.config import load_arch_config
from engine.sampling_params import SamplingParams
from kvconnector.nixl.messages import (
    Ack,
    Cancel,
    CancelReply,
    Handshake,
    HandshakeReply,
    Ping,
    PingReply,
    Refusal,
    Reserve,
    TransferFailed,
    decode_reply,
    ranks_digest,
)
from kvconnector.nixl.prefill_links import RPC_TIMEOUT_S
from kvconnector.nixl.producer import Producer, Reservation
from kvconnector.nixl.scheduler import NixlConnectorScheduler
from kvconnector.nixl.side_channel import (
    SideChannelClient,
    SideChannelError,
    SideChannelNotSent,
    SideChannelServer,
)
from kvconnector.params import KVTransferParams

SECRET_MD = b"nixl-agent-metadata: remote keys of this node's KV memory"


def rank_info(num_blocks: int = 64) -> dict[str, Any]:
    return {
        "library": "nixl",
        "agent_name": "agent-x",
        "agent_metadata": SECRET_MD,
        "base_addr": 140_000_000,
        "num_blocks": num_blocks,
        "block_bytes": 4096,
        "mem_type": "DRAM",
    }


def connector(role: str, **kv: Any) -> NixlConnectorScheduler:
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=256, dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=64),
        kv_transfer=KVTransferConfig(kv_connector="nixl", kv_role=role, peer_ping_interval=0, **kv),
    )
    conn = NixlConnectorScheduler(cfg, KVCacheSpec.for_model(load_arch_config("tiny"), cfg))
    conn.set_worker_info([rank_info()])
    return conn


@pytest.fixture
def conns():
    made: list[NixlConnectorScheduler] = []

    def make(role: str, **kv: Any) -> NixlConnectorScheduler:
        made.append(connector(role, **kv))
        return made[-1]

    yield make
    for c in made:
        c.shutdown()


def ask(address: str, msg: dict[str, Any]) -> dict[str, Any]:
    return SideChannelClient().request(address, msg, RPC_TIMEOUT_S)


def handshake_of(
    peer: NixlConnectorScheduler, to: NixlConnectorScheduler, **override: Any
) -> dict[str, Any]:
    """The handshake ``peer`` would send ``to`` (``override`` forges fields)."""
    fields: dict[str, Any] = {
        "engine_id": peer.engine_id,
        "incarnation": peer.incarnation,
        "peer_key": peer.links.pairing_key(to.address),
        "compat": peer.compat,
        "ranks": tuple(peer._ranks),
        "address": peer.address,
    }
    fields.update(override)
    return Handshake(**fields).to_wire()


# -- a decode node is not a prefill node ------------------------------------------------------


def test_a_decode_node_refuses_handshakes_and_gives_out_no_rank_metadata(conns):
    """Anyone who handshook with D got its NIXL agent metadata (the keys to WRITE into its
    KV memory). Only a prefill node pairs; D refuses and sends nothing of its own."""
    d = conns("consumer")
    stranger = conns("producer")
    raw = ask(d.address, handshake_of(stranger, d))
    reply = decode_reply(raw, HandshakeReply)
    assert isinstance(reply, Refusal) and "decode node" in reply.error
    assert "ranks" not in raw and SECRET_MD not in repr(raw).encode()


@pytest.mark.parametrize(
    "msg",
    [
        Reserve("t", "n", "r", "x:1", "tcp://127.0.0.1:1", (0, 1), 0, "p", time.time()).to_wire(),
        Cancel("t", "n", "k").to_wire(),
    ],
    ids=["reserve", "cancel"],
)
def test_a_decode_node_refuses_what_only_a_prefill_node_takes(conns, msg):
    d = conns("consumer")
    reply = decode_reply(ask(d.address, msg), Ack)
    assert isinstance(reply, Refusal) and "decode node" in reply.error
    assert d.producer.num_states() == 0 and not d.producer.cancelled


def test_a_prefill_node_refuses_failure_notices(conns):
    p = conns("producer")
    msg = TransferFailed("r", "t", "n", "forged", True).to_wire()
    reply = decode_reply(ask(p.address, msg), Ack)
    assert isinstance(reply, Refusal) and "prefill node" in reply.error


def test_a_prefill_nodes_handshake_reply_carries_no_memory_keys(conns):
    """D needs P's rank count (the TP map), not the keys to P's KV memory."""
    p, d = conns("producer"), conns("consumer")
    raw = ask(p.address, handshake_of(d, p))
    reply = decode_reply(raw, HandshakeReply)
    assert isinstance(reply, HandshakeReply) and len(reply.ranks) == 1
    assert SECRET_MD not in repr(raw).encode()
    assert not {"agent_metadata", "base_addr", "worker_address"} & set(reply.ranks[0])
    assert d.links.ensure_handshake(p.address).engine_id == p.engine_id  # still pairs


# -- bounds -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "named"),
    [
        ({"block_bytes": 4096}, "num_blocks is missing"),
        ({"num_blocks": 2**62}, "num_blocks"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": "64"}, "num_blocks"),
        ({"num_blocks": 64, "num_layers": 2**40}, "num_layers"),
        ({"num_blocks": 1 << 22, "num_layers": 1024}, "num_layers"),
        ({"num_blocks": 64, "block_bytes": 1 << 40, "base_addr": 2**64 - 2}, "address space"),
        ({"num_blocks": 64, "agent_name": "x" * 10_000}, "agent_name"),
    ],
)
def test_a_handshake_with_impossible_rank_metadata_is_refused(conns, rank, named):
    """P's workers build descriptor arrays from a decode rank's ``num_blocks``: a forged
    2**62 was an allocation on every P rank, a missing one disabled the reservation's
    block-range check."""
    p, d = conns("producer"), conns("consumer")
    reply = decode_reply(ask(p.address, handshake_of(d, p, ranks=(rank,))), HandshakeReply)
    assert isinstance(reply, Refusal) and named in reply.error
    assert not p.service.peers


def reserve_of(
    d: NixlConnectorScheduler, p: NixlConnectorScheduler, block_ids: Any, tid: str = "t1"
) -> dict[str, Any]:
    key = d.links.pairing_key(p.address)
    msg = Reserve(
        tid, f"nonce-{tid}", "d-req", key, d.address, (), 0, p.incarnation, time.time()
    ).to_wire()
    msg["block_ids"] = block_ids
    return msg


@pytest.mark.parametrize(
    ("block_ids", "named"),
    [
        ([3, 4, 3], "named twice"),
        ([3, 64], "out of range"),
        ([0] * (1 << 22 + 1), "at most"),
    ],
    ids=["duplicate", "past-the-peers-cache", "huge"],
)
def test_a_reservation_naming_blocks_the_peer_cannot_have_is_refused(conns, block_ids, named):
    p, d = conns("producer"), conns("consumer")
    assert d.links.ensure_handshake(p.address).engine_id == p.engine_id
    reply = decode_reply(ask(p.address, reserve_of(d, p, block_ids)), Ack)
    assert isinstance(reply, Refusal) and named in reply.error
    assert p.producer.num_states() == 0


def test_reservations_waiting_for_their_prefill_are_bounded_by_the_peers_cache(conns):
    """Early reservations (before their prefill) are state a peer grows at will: an honest
    D cannot have more blocks reserved than its cache holds, so P keeps no more."""
    p, d = conns("producer"), conns("consumer")
    d.set_worker_info([rank_info(num_blocks=4)])
    paired(p, d)
    assert decode_reply(ask(p.address, reserve_of(d, p, [0, 1, 2], tid="t1")), Ack) == Ack()
    assert (
        decode_reply(ask(p.address, reserve_of(d, p, [0, 1, 2], tid="t1")), Ack) == Ack()
    )  # retry
    assert decode_reply(ask(p.address, reserve_of(d, p, [3], tid="t2")), Ack) == Ack()
    reply = decode_reply(ask(p.address, reserve_of(d, p, [0], tid="t3")), Ack)
    assert isinstance(reply, Refusal) and "4 in all" in reply.error
    assert set(p.producer.early) == {"t1", "t2"}


def test_a_transfer_id_longer_than_the_wire_allows_is_refused(conns):
    p, d = conns("producer"), conns("consumer")
    d.links.ensure_handshake(p.address)
    reply = decode_reply(ask(p.address, reserve_of(d, p, [1], tid="t" * 100_000)), Ack)
    assert isinstance(reply, Refusal) and "at most 512 characters" in reply.error


# -- who P pushes to ---------------------------------------------------------------------------


def paired(p: NixlConnectorScheduler, d: NixlConnectorScheduler) -> None:
    """``d`` handshakes with ``p`` and ``p`` verifies it (its address answered as it)."""
    assert d.links.ensure_handshake(p.address).engine_id == p.engine_id
    wait_for(
        lambda: p.service.peers.ready(d.links.pairing_key(p.address)),
        10,
        "P to verify the decode peer",
    )


def settled(p: NixlConnectorScheduler, key: str) -> bool:
    """P has made up its mind about ``key``: trusted, or dropped."""
    peer = p.service.peers.get(key)
    return peer is None or peer.verified


def test_a_forged_handshake_naming_a_decode_nodes_engine_id_leaves_it_paired(conns):
    """P took a new incarnation under a known engine id as a restart and dropped the real
    D (its pushes then never started). Now only the claim's own address can confirm it."""
    p, d, evil = conns("producer"), conns("consumer"), conns("consumer")
    paired(p, d)
    forged = handshake_of(
        evil, p, engine_id=d.engine_id, peer_key=f"{d.engine_id}:{evil.incarnation}"
    )
    assert ask(p.address, forged)["ok"] is True  # a claim; nothing is trusted yet
    wait_for(lambda: settled(p, forged["peer_key"]), 15, "P to check the claim")
    assert forged["peer_key"] not in p.service.peers  # evil's address answered as evil
    assert p.service.peers.ready(d.links.pairing_key(p.address))


def test_a_forged_handshake_claiming_a_decode_nodes_address_leaves_it_paired(conns):
    p, d, evil = conns("producer"), conns("consumer"), conns("consumer")
    paired(p, d)
    forged = handshake_of(evil, p, address=d.address)  # D's address, evil's ranks
    assert ask(p.address, forged)["ok"] is True
    wait_for(lambda: settled(p, evil.links.pairing_key(p.address)), 15, "P to check the claim")
    assert evil.links.pairing_key(p.address) not in p.service.peers and p.service.peers.ready(
        d.links.pairing_key(p.address)
    )
    assert p.stats()["kv_handshake_failures_total"] == 1


def test_a_handshake_taking_over_a_paired_peers_key_is_refused(conns):
    """Under D's own key, with the attacker's address (where failure notices go) and
    ranks (where the KV would be written): it replaced D's entry."""
    p, d, evil = conns("producer"), conns("consumer"), conns("consumer")
    paired(p, d)
    forged = handshake_of(
        evil,
        p,
        engine_id=d.engine_id,
        incarnation=d.incarnation,
        peer_key=d.links.pairing_key(p.address),
    )
    reply = decode_reply(ask(p.address, forged), HandshakeReply)
    assert isinstance(reply, Refusal) and "already paired" in reply.error
    peer = p.service.peers.get(d.links.pairing_key(p.address))
    assert peer is not None and peer.address == d.address and peer.verified
    assert ask(p.address, handshake_of(d, p))["ok"] is True  # D's own retry still pairs


def test_nothing_is_pushed_to_a_peer_before_its_address_answered_as_it(conns):
    p = conns("producer")
    dead = f"tcp://127.0.0.1:{free_port()}"
    forged = handshake_of(p, p, engine_id="d", incarnation="i", peer_key="d:i", address=dead)
    forged["ranks"] = [rank_info()]
    assert ask(p.address, forged)["ok"] is True
    with p._lock:
        assert p.producer.prefill_finished("p-req", "t1", [0, 1], first_token=3)
        res = Reservation("t1", "n1", "d-req", "d:i", dead, [4, 5], 0, float("inf"))
        assert isinstance(p.producer.reserve(res), Ack)
    assert not p.build_connector_meta(None, lambda rid: []).sends  # type: ignore[arg-type]
    wait_for(lambda: "d:i" not in p.service.peers, RPC_TIMEOUT_S + 10, "the claim to be dropped")
    assert not p.build_connector_meta(None, lambda rid: []).sends  # type: ignore[arg-type]


def _bound(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def test_a_decode_node_restarted_at_the_same_address_replaces_the_old_one(conns):
    p = conns("producer")
    port = free_port()
    first = conns("consumer", side_channel_port=port)
    paired(p, first)
    first.shutdown()
    # ZMQ releases the port a moment after the socket closed (on a loaded box, long
    # enough for the first attempt to find it taken): held here for a moment, so the
    # restart below always meets a taken port first.
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    wait_for(lambda: _bound(blocker, port), 10, "the side-channel port to be free")
    blocker.listen()
    threading.Timer(0.5, blocker.close).start()
    started: list[NixlConnectorScheduler] = []

    def restart() -> bool:
        try:
            started.append(conns("consumer", side_channel_port=port))
        except ConfigError as e:  # "--side-channel-port: ... in use"
            assert isinstance(e.__cause__, SideChannelError), e
            return False
        return True

    wait_for(restart, 10, "the side-channel port to be free again")
    second = started[0]
    paired(p, second)
    wait_for(
        lambda: first.links.pairing_key(p.address) not in p.service.peers,
        10,
        "the old incarnation to go",
    )
    assert len(p.service.peers) == 1


def test_the_decode_peer_table_is_bounded(conns, monkeypatch):
    """A full table evicts the least recently used peer no reservation refers to; when
    every peer is in use, a new one is refused."""
    monkeypatch.setattr(decode_peers, "MAX_DECODE_PEERS", 2)
    p = conns("producer")
    ds = [conns("consumer") for _ in range(3)]
    paired(p, ds[0])
    paired(p, ds[1])
    with p._lock:
        res = Reservation(
            "t1", "n1", "r", ds[1].links.pairing_key(p.address), ds[1].address, [1], 0, float("inf")
        )
        assert isinstance(p.producer.reserve(res), Ack)
    paired(p, ds[2])  # evicts ds[0]: idle and least recently used
    assert set(p.service.peers.peers) == {
        ds[1].links.pairing_key(p.address),
        ds[2].links.pairing_key(p.address),
    }
    with p._lock:
        res = Reservation(
            "t2", "n2", "r", ds[2].links.pairing_key(p.address), ds[2].address, [1], 0, float("inf")
        )
        assert isinstance(p.producer.reserve(res), Ack)
    reply = decode_reply(ask(p.address, handshake_of(ds[0], p)), HandshakeReply)
    assert isinstance(reply, Refusal) and "2 decode peers" in reply.error


def test_a_full_peer_table_evicts_unconfirmed_claims_before_paired_peers(monkeypatch):
    monkeypatch.setattr(decode_peers, "MAX_DECODE_PEERS", 2)
    table = decode_peers.DecodePeers()

    def peer(name: str) -> decode_peers.DecodePeer:
        return decode_peers.DecodePeer(name, "i", f"tcp://127.0.0.1:{free_port()}", [], name)

    paired_one, claim, newer_claim = peer("paired"), peer("claim"), peer("newer")
    assert table.offer("paired:i", paired_one, in_use=())[2] is None
    table.confirm("paired:i", paired_one)
    assert table.offer("claim:i", claim, in_use=())[2] is None
    _, evicted, _ = table.offer("newer:i", newer_claim, in_use=())
    assert [p.name for p in evicted] == ["claim:i"] and table.ready("paired:i")


def test_a_decode_node_keeps_no_state_per_address_it_failed_to_reach(conns, monkeypatch):
    """Clients name the prefill address of a decode leg: a lock per address ever named
    was kept forever (with --kv-allowed-peers '*', one per address a client made up)."""
    monkeypatch.setattr(prefill_links, "MAX_P_LOCKS", 4)
    d, p = conns("consumer", kv_allowed_peers="*"), conns("producer")
    d.links.ensure_handshake(p.address)
    monkeypatch.setattr(prefill_links, "RPC_TIMEOUT_S", 0.05)  # only for the closed ports
    for _ in range(12):
        with pytest.raises(Exception):  # noqa: B017 - nothing listens there
            d.links.ensure_handshake(f"tcp://127.0.0.1:{free_port()}")
    assert len(d.links._locks) <= 5 and p.address in d.links._locks


def test_a_decode_node_keeps_little_of_each_prefill_node_it_paired_with(conns, monkeypatch):
    """A decode leg names its prefill address (any one --kv-allowed-peers allows: with
    the default ``loopback``, all of 127.0.0.0/8 at any port a local process binds). D
    kept every handshake reply whole, for good: a fake "prefill node" answering with 8 MiB
    of junk in its rank and transport maps held 16 MiB of D's memory per address named
    (20 addresses: +400 MB; a reply may be 64 MiB)."""
    monkeypatch.setattr(prefill_links, "MAX_PREFILL_PEERS", 4)
    d = conns("consumer")
    junk = "j" * (1 << 20)

    def fake_prefill(msg: dict[str, Any]) -> dict[str, Any]:
        ranks = tuple({**rank_info(), "junk": junk} for _ in msg["ranks"])
        return HandshakeReply(
            "fake", "i1", "tcp://127.0.0.1:1", "producer", {**msg["compat"], "junk": junk},
            {"junk": junk}, ranks,
        ).to_wire()  # fmt: skip

    fakes = [SideChannelServer("127.0.0.1", 0, fake_prefill) for _ in range(8)]
    try:
        for fake in fakes:
            assert d.links.ensure_handshake(fake.address).engine_id == "fake"
    finally:
        for fake in fakes:
            fake.close()
    assert len(d.links.peers) <= 4
    kept = sum(len(msgpack.packb(r.to_wire())) for r in d.links.peers.values())
    assert kept < 64 << 10, f"{kept} bytes of prefill handshake replies kept"
    # What D uses of a reply is kept: the incarnation its reservations are watched by.
    assert {r.incarnation for r in d.links.peers.values()} == {"i1"}


# -- a decode node's public name is not its pairing key ---------------------------------------


def public_key_of(d: NixlConnectorScheduler) -> str:
    """What anyone can learn of a decode node: a ping tells its engine id and incarnation
    (the peer key was ``engine_id:incarnation``)."""
    ping = decode_reply(ask(d.address, Ping().to_wire()), PingReply)
    assert isinstance(ping, PingReply)
    return f"{ping.engine_id}:{ping.incarnation}"


@pytest.fixture
def impostor():
    """A side channel answering pings as someone else: what an attacker runs."""
    servers: list[SideChannelServer] = []

    def make(engine_id: str, incarnation: str, ranks: list[dict[str, Any]]) -> str:
        reply = PingReply(incarnation, engine_id, ranks_digest(ranks)).to_wire()
        servers.append(SideChannelServer("127.0.0.1", 0, lambda msg: reply))
        return servers[-1].address

    yield make
    for s in servers:
        s.close()


def test_a_decode_nodes_pairing_key_is_in_no_ping_reply_or_info(conns):
    d, p = conns("consumer"), conns("producer")
    raw = ask(d.address, Ping().to_wire())
    key = d.links.pairing_key(p.address)
    assert key not in repr(raw) and key not in repr(d.info())
    assert key != public_key_of(d)  # it was engine_id:incarnation, which pings tell


def impersonate_by_public_name(p: NixlConnectorScheduler, d: NixlConnectorScheduler, impostor):
    """An attacker pairs with ``p`` under the key a ping of ``d`` tells, with its own ranks,
    answering P's check as ``d`` from its own address; returns once P made up its mind."""
    eid, inc = public_key_of(d).split(":")
    evil_ranks = [rank_info()]
    address = impostor(eid, inc, evil_ranks)
    forged = handshake_of(d, p, peer_key=public_key_of(d), ranks=evil_ranks, address=address)
    assert ask(p.address, forged)["ok"] is True
    wait_for(lambda: settled(p, forged["peer_key"]), 15, "P to check the claim")


def test_a_key_learned_from_a_ping_cannot_squat_on_a_decode_node(conns, impostor):
    """Before D's first handshake, an attacker paired under the key a ping told (D's
    engine id and incarnation), answering P's check as D from its own address: every
    handshake of the real D was then refused as a takeover."""
    p, d = conns("producer"), conns("consumer")
    impersonate_by_public_name(p, d, impostor)
    paired(p, d)  # the real D pairs all the same


def test_a_key_learned_from_a_ping_cannot_take_over_an_evicted_decode_nodes_pushes(conns, impostor):
    """D was evicted (a full table); an attacker paired under the key a ping told, with
    its own ranks, and D's next reservation -- D does not handshake again while it holds
    P's reply -- was accepted for the attacker's entry: P pushed D's clients' KV to it."""
    p, d = conns("producer"), conns("consumer")
    paired(p, d)
    with p._lock:
        p.service.evict(d.links.pairing_key(p.address), "evicted for the test")
    impersonate_by_public_name(p, d, impostor)
    reply = decode_reply(ask(p.address, reserve_of(d, p, [1, 2])), Ack)
    assert isinstance(reply, Refusal) and reply.code == Refusal.HANDSHAKE_REQUIRED
    assert not p.producer.early


def test_a_stranger_cannot_fill_a_decode_nodes_reservation_quota(conns):
    p, d = conns("producer"), conns("consumer")
    paired(p, d)
    stolen = {**reserve_of(d, p, list(range(64)), tid="evil"), "peer_key": public_key_of(d)}
    assert ask(p.address, stolen)["code"] == Refusal.HANDSHAKE_REQUIRED
    assert decode_reply(ask(p.address, reserve_of(d, p, [1, 2, 3])), Ack) == Ack()


def test_cancels_from_strangers_are_remembered_within_their_own_share(monkeypatch):
    """A cancel of a reservation P never saw is remembered, so that the reservation is
    refused if it comes late -- a stranger's too (a D P restarted under is one until it
    pairs again: its lost reservation arrived after the cancel and was accepted into
    blocks D had freed, test_pd_protocol_races.py). Strangers' nonces fill only their
    own share (1/16 of the bound) and never push out a paired peer's."""
    monkeypatch.setattr(producer_module, "MAX_CANCELLED", 64)
    p = Producer(timeout=30.0)
    assert p.cancel("t0", "n-peer", "key").state == "cancelled" and "n-peer" in p.cancelled
    for i in range(10):
        assert p.cancel(f"t{i}", f"n-stranger-{i}", None).state == "cancelled"
    assert "n-peer" in p.cancelled and "n-stranger-9" in p.cancelled
    assert sum(f"n-stranger-{i}" in p.cancelled for i in range(10)) == 64 // 16


def cancel_at(p: NixlConnectorScheduler, tid: str, nonce: str, key: str) -> str:
    """Send P a cancel over its side channel; the state it answers."""
    reply = decode_reply(ask(p.address, Cancel(tid, nonce, key).to_wire()), CancelReply)
    assert isinstance(reply, CancelReply), reply
    return reply.state


def prefill_leg(tid: str) -> Request:
    params = KVTransferParams(do_remote_decode=True, transfer_id=tid)
    return Request(f"leg-{tid}", [1, 2, 3], SamplingParams(max_tokens=1), kv_transfer_params=params)


def test_a_flood_of_cancels_from_strangers_leaves_a_paired_peers_cancel_in_force(
    conns, monkeypatch
):
    """D gave up on a leg before its reservation reached P: its cancel ends the leg at
    once when it comes (and a prefill of it is not pushed). P remembers such cancels,
    bounded -- and a cancel needs no pairing (a D whose handshake was refused sends it).
    Cancels from senders P never paired with, past the bound, pushed the real D's out: its
    leg then waited for a reservation until --kv-transfer-timeout."""
    monkeypatch.setattr(producer_module, "MAX_CANCELLED", 64)
    p, d = conns("producer", kv_reserve_first=True), conns("consumer")
    paired(p, d)
    key = d.links.pairing_key(p.address)
    assert cancel_at(p, "leg-waits", "n-1", key) == "cancelled"
    assert cancel_at(p, "leg-prefills", "n-2", key) == "cancelled"
    for i in range(200):  # never paired: made-up keys and transfer ids
        assert cancel_at(p, f"junk-{i}", f"n-junk-{i}", f"stranger-{i}") == "cancelled"

    leg = prefill_leg("leg-waits")
    assert p.delay_admission(leg)
    assert "ended before" in p.take_events().failed_waiting.get(leg.request_id, "")
    assert not p.producer.prefill_finished("leg-x", "leg-prefills", [0, 1], 5)
    assert not p.producer.pending


def test_a_peer_flooding_its_own_cancels_does_not_push_out_another_peers(conns, monkeypatch):
    """A paired peer (without --kv-secret any local process pairs under its own key) may
    cancel made-up reservations as fast as the side channel answers. The cancel a real D
    sent before its reservation (they raced) must stay remembered: that reservation is
    refused when it comes, as D freed its blocks."""
    monkeypatch.setattr(producer_module, "MAX_CANCELLED", 64)
    p, d, evil = conns("producer"), conns("consumer"), conns("consumer")
    paired(p, d)
    paired(p, evil)
    assert cancel_at(p, "t1", "nonce-t1", d.links.pairing_key(p.address)) == "cancelled"
    evil_key = evil.links.pairing_key(p.address)
    for i in range(200):
        assert cancel_at(p, f"evil-{i}", f"n-evil-{i}", evil_key) == "cancelled"
    reply = decode_reply(ask(p.address, reserve_of(d, p, [1, 2])), Ack)
    assert isinstance(reply, Refusal) and "cancelled" in reply.error


def test_the_cancel_memory_evicts_only_from_the_largest_paired_peer_or_strangers(monkeypatch):
    """Random adds, pops and expiries against the rule: paired peers' entries stay within
    the bound, and one is evicted only from a peer holding the most; strangers' entries
    stay within their share and evict only each other."""
    monkeypatch.setattr(producer_module, "MAX_CANCELLED", 32)
    rng = random.Random(7)
    memory = producer_module.CancelMemory(lifetime=1000.0)
    model: dict[str | None, list[str]] = {}  # owner -> keys, oldest first
    owners = [None, "a", "b", "c", "d"]
    for i in range(5000):
        key = f"k{rng.randrange(400)}"
        if rng.random() < 0.2:
            memory.pop(key)
            for keys in model.values():
                if key in keys:
                    keys.remove(key)
            continue
        owner = rng.choice(owners) if rng.random() < 0.5 else "a"  # "a" floods
        for keys in model.values():
            if key in keys:
                keys.remove(key)
        sizes = {o: len(k) for o, k in model.items() if o is not None}
        memory.add(key, owner)
        model.setdefault(owner, []).append(key)
        lost = {o: [k for k in keys if k not in memory] for o, keys in model.items()}
        for o, gone in lost.items():
            if not gone:
                continue
            assert len(gone) == 1 and gone[0] == model[o][0], (i, o, gone)  # its oldest
            if o is None:
                assert owner is None  # only a stranger's cancel pushes out a stranger's
            else:
                assert owner is not None and sizes[o] == max(sizes.values()), (i, o, sizes)
            model[o].pop(0)
        assert sum(len(k) for o, k in model.items() if o is not None) <= 32
        assert len(model.get(None, [])) <= 2
        assert len(memory) == sum(map(len, model.values()))
    memory.expire(time.monotonic() + 2000)
    assert len(memory) == 0


def test_tombstones_a_peer_leaves_at_will_are_bounded_but_not_one_whose_write_may_land(
    monkeypatch,
):
    """A paired peer (without --kv-secret, any local process pairing under its own key)
    may reserve and cancel as fast as the side channel answers (~6,000 pairs a second on
    one socket): each pair left a tombstone for 4 x --kv-transfer-timeout, with no bound,
    and every engine step walked them all (50,000 of them: +49 ms a step on P, ~1.3 KB
    each with 512-character ids)."""
    monkeypatch.setattr(producer_module, "MAX_TOMBSTONES", 8)
    p = Producer(timeout=30.0)

    def reservation(tid: str, nonce: str) -> Reservation:
        return Reservation(tid, nonce, "D1", "key", "tcp://127.0.0.1:1", [4], 0, time.time() + 60)

    # A send that errored: part of its WRITE may still land, so its cancel stays in_flight.
    assert p.prefill_finished("P1", "t-sent", [0, 1], 7)
    assert p.reserve(reservation("t-sent", "n-sent")) == Ack()
    assert [s.request_id for s in p.ready_sends(lambda key: True)] == ["P1"]
    p.send_finished("P1", error="WRITE timed out")
    for i in range(100):
        assert p.reserve(reservation(f"t{i}", f"n{i}")) == Ack()
        assert p.cancel(f"t{i}", f"n{i}", "key").state == "cancelled"
    assert len(p.tombstones) <= 8
    assert p.cancel("t-sent", "n-sent", "key").state == "in_flight"
    assert isinstance(p.reserve(reservation("t99", "late")), Refusal)  # the newest still fence


def test_a_reservation_is_bounded_by_one_prompt_and_their_number_by_the_nodes_queue(conns):
    p, d = conns("producer"), conns("consumer")
    d.set_worker_info([rank_info(num_blocks=1000)])
    paired(p, d)
    too_long = list(range(p.service.max_blocks_per_seq + 1))  # max_model_len 256 / block size 4
    reply = decode_reply(ask(p.address, reserve_of(d, p, too_long)), Ack)
    assert isinstance(reply, Refusal) and "max_model_len" in reply.error
    p.service.max_early = 2
    for tid in ("a", "b"):
        assert decode_reply(ask(p.address, reserve_of(d, p, [1], tid=tid)), Ack) == Ack()
    reply = decode_reply(ask(p.address, reserve_of(d, p, [2], tid="c")), Ack)
    assert isinstance(reply, Refusal) and "wait here for their prefill" in reply.error


class HeldChecks:
    """P's checks of the addresses in ``dead`` (its pings of a claimed address) wait until
    ``release()``, then fail as unanswered: the test, not a timer, decides when they end
    (a 0.3 s ping timeout made the counts below depend on the box's speed)."""

    def __init__(self, p: NixlConnectorScheduler, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dead: set[str] = set()
        self._released = threading.Event()
        real = p.service._client.request

        def request(address: str, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
            if address in self.dead:
                self._released.wait(60)
                raise SideChannelNotSent(f"no connection to {address} (held by the test)")
            return real(address, msg, timeout)

        monkeypatch.setattr(p.service._client, "request", request)

    def new_address(self) -> str:
        address = f"tcp://127.0.0.1:{free_port()}"
        self.dead.add(address)
        return address

    def release(self) -> None:
        self._released.set()


@pytest.fixture
def hold_checks(monkeypatch):
    """``hold_checks(p)``: a ``HeldChecks`` of P's, released at the latest when the test
    ends (before ``conns`` closes P; list this fixture after it)."""
    made: list[HeldChecks] = []

    def make(p: NixlConnectorScheduler) -> HeldChecks:
        made.append(HeldChecks(p, monkeypatch))
        return made[-1]

    yield make
    for held in made:
        held.release()


def test_a_flood_of_unconfirmable_claims_is_capped_and_takes_no_lane(conns, hold_checks):
    """Each claim's check ran on a lane of P's (256 in all, each kept 30 s): 256 claims of
    closed ports left P unable to call any new decode node."""
    p, d = conns("producer"), conns("consumer")
    checks = hold_checks(p)
    refused = 0
    for i in range(decode_peers.MAX_UNCONFIRMED + 8):
        dead = checks.new_address()
        flood = handshake_of(d, p, peer_key=f"flood-{i}", engine_id=f"flood-{i}", address=dead)
        reply = decode_reply(ask(p.address, flood), HandshakeReply)
        refused += isinstance(reply, Refusal) and "wait to be confirmed" in reply.error
    assert refused == 8 and p.channel.lanes.num_lanes() == 0
    checks.release()
    wait_for(lambda: len(p.service.peers) == 0, 30, "the claims to be dropped")
    paired(p, d)


def test_a_repeated_claim_queues_one_check(monkeypatch):
    table = decode_peers.DecodePeers()
    claim = decode_peers.DecodePeer("d", "i", "tcp://127.0.0.1:1", [], "x")
    assert table.offer("k", claim, in_use=())[0] is True
    again = decode_peers.DecodePeer("d", "i", "tcp://127.0.0.1:1", [], "x")
    assert table.offer("k", again, in_use=())[0] is False  # a flood of it queues nothing


def test_claims_replacing_claims_under_one_key_queue_a_bounded_number_of_checks(conns, hold_checks):
    """Each new claim under a key whose entry was still unconfirmed replaced it and queued
    one more ping: the verifier's queue had no bound."""
    p, d = conns("producer"), conns("consumer")
    checks = hold_checks(p)
    refused = 0
    for i in range(decode_peers.MAX_UNCONFIRMED + 16):
        dead = checks.new_address()
        claim = handshake_of(d, p, peer_key="one-key", engine_id=f"e{i}", address=dead)
        reply = decode_reply(ask(p.address, claim), HandshakeReply)
        refused += isinstance(reply, Refusal) and "wait to be confirmed" in reply.error
    assert refused == 16 and p.service.peers.checking == decode_peers.MAX_UNCONFIRMED
    checks.release()


@pytest.mark.parametrize(
    ("extra", "named"),
    [({"junk": b"x" * 64}, "unknown keys"), ({"agent_metadata": b"x" * (2 << 20)}, "bytes")],
)
def test_rank_metadata_carries_only_what_p_uses_and_in_bounded_sizes(conns, extra, named):
    """P keeps a peer's rank maps for as long as it pairs with it: 16 MiB of junk per rank
    was kept (256 peers: ~16 GiB)."""
    p, d = conns("producer"), conns("consumer")
    rank = {**rank_info(), **extra}
    reply = decode_reply(ask(p.address, handshake_of(d, p, ranks=(rank,))), HandshakeReply)
    assert isinstance(reply, Refusal) and named in reply.error and not p.service.peers


def test_one_peer_cannot_fill_the_reservations_waiting_for_their_prefill(conns):
    """The count of reservations waiting for their prefill is bounded for all peers
    together; one stranger with its own key filled it and every real D's early
    reservation was refused. Now the peer holding the most gives up its oldest."""
    p, d = conns("producer"), conns("consumer")
    stranger = conns("consumer")
    paired(p, d)
    paired(p, stranger)
    p.service.max_early = 4
    for i in range(4):
        msg = reserve_of(stranger, p, [i], tid=f"s{i}")
        assert decode_reply(ask(p.address, msg), Ack) == Ack()
    assert isinstance(
        decode_reply(ask(p.address, reserve_of(stranger, p, [5], tid="s5")), Ack), Refusal
    )
    for tid in ("d0", "d1"):
        assert decode_reply(ask(p.address, reserve_of(d, p, [1], tid=tid)), Ack) == Ack()
    assert set(p.producer.early) == {"s2", "s3", "d0", "d1"}  # the stranger's oldest went
    assert isinstance(decode_reply(ask(p.address, reserve_of(d, p, [2], tid="d2")), Ack), Refusal)


def test_reservations_of_a_claim_its_address_does_not_confirm_are_dropped(conns, hold_checks):
    p, d = conns("producer"), conns("consumer")
    checks = hold_checks(p)
    dead = checks.new_address()
    assert ask(p.address, handshake_of(d, p, address=dead))["ok"] is True
    assert decode_reply(ask(p.address, reserve_of(d, p, [1, 2])), Ack) == Ack()
    assert p.producer.early
    checks.release()  # the check fails: no answer from the address the claim gave
    wait_for(lambda: not p.producer.early, 15, "the claim's reservations to go")
    assert d.links.pairing_key(p.address) not in p.service.peers


# -- a fake "prefill node" a client names ----------------------------------------------------


@pytest.fixture
def recorder():
    """A side channel that records what it gets and refuses it: a fake "prefill node" a
    client names in a decode leg (any address --kv-allowed-peers allows)."""
    servers: list[SideChannelServer] = []
    seen: list[dict[str, Any]] = []

    def make(**kw: Any) -> str:
        def handle(msg: dict[str, Any]) -> dict[str, Any]:
            seen.append(msg)
            return Refusal("no").to_wire()

        servers.append(SideChannelServer("127.0.0.1", 0, handle, **kw))
        return servers[-1].address

    yield make, seen
    for s in servers:
        s.close()


class _Wiretap(SideChannelServer):
    """A side channel that keeps every byte it receives (what any listener can read)."""

    frames: list[bytes]

    def _dispatch(self, frames: list[bytes]) -> bytes | None:
        self.frames.append(b"".join(frames))
        return super()._dispatch(frames)


def test_a_key_a_fake_prefill_node_learned_is_worth_nothing_at_a_real_one(conns, recorder):
    """D sent one pairing key to every prefill address a client named: a fake one captured
    it, reserved D's blocks under it at the real P with its own prefills, and P wrote that
    KV into D's cache (D's clients then got wrong tokens with HTTP 200)."""
    p, d = conns("producer"), conns("consumer")
    make, seen = recorder
    fake = make()
    paired(p, d)
    with pytest.raises(Exception, match="refused the handshake"):
        d.links.ensure_handshake(fake)
    (shake,) = seen
    stolen = {**reserve_of(d, p, [0, 1, 2]), "peer_key": shake["peer_key"]}
    reply = decode_reply(ask(p.address, stolen), Ack)
    assert isinstance(reply, Refusal) and reply.code == Refusal.HANDSHAKE_REQUIRED
    assert not p.producer.early


def test_with_the_secret_d_hands_its_rank_metadata_only_to_an_address_that_proves_it(conns):
    """A signed message is not a secret one: D's signed handshake carried its NIXL agent
    metadata (the keys to write into its KV memory) to any address a client named, secret
    or not. Now the address first answers a signed ping."""
    d = conns("consumer", kv_secret="s3cret")
    _Wiretap.frames = []
    fake = _Wiretap("127.0.0.1", 0, lambda msg: {"ok": True})  # no secret: unsigned replies
    try:
        with pytest.raises(Exception, match="did not prove the secret"):
            d.links.ensure_handshake(fake.address)
    finally:
        fake.close()
    assert _Wiretap.frames and not any(SECRET_MD in f for f in _Wiretap.frames)
    p = conns("producer", kv_secret="s3cret")
    assert d.links.ensure_handshake(p.address).engine_id == p.engine_id  # a real one pairs
