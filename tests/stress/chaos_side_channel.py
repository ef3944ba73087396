"""The chaos suite's side-channel bursts: malformed, forged, wrongly signed and replayed
messages to every node's side channel, each with the answer it must get."""

from __future__ import annotations

import contextlib
import os
import random
import time
from typing import Any

import httpx
import msgpack
import zmq
from chaos_cluster import Cluster
from harness import (
    free_port,
)

from kvconnector.nixl.side_channel import _request_mac

# -- side-channel fuzzing ---------------------------------------------------------------------


def _pack(msg: Any) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def sign(secret: bytes, msg: Any, *, ts: float | None = None, nonce: bytes | None = None) -> bytes:
    """A request envelope as a peer with ``secret`` sends it (``side_channel``'s format)."""
    body = _pack(msg)
    ts = time.time() if ts is None else ts
    nonce = os.urandom(16) if nonce is None else nonce
    mac = _request_mac(secret, ts, nonce, body)
    return _pack({"ts": ts, "n": nonce, "body": body, "mac": mac})


def _dealer_call(addr: str, frames: list[bytes], timeout: float = 3.0) -> Any:
    """Send ``frames`` on a fresh DEALER; the decoded reply (a signed one opened), or a
    string saying what happened."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            return "no-reply"
        reply = [f for f in sock.recv_multipart() if f]
        if not reply:
            return "empty-reply"
        try:
            out = msgpack.unpackb(reply[-1], raw=False)
            if isinstance(out, dict) and isinstance(out.get("body"), bytes) and "mac" in out:
                out = msgpack.unpackb(out["body"], raw=False)
            return out
        except Exception as e:
            return f"undecodable-reply: {e}"
    finally:
        sock.close(linger=0)


def fuzz_messages(
    target: dict[str, Any],
    decode_infos: list[dict[str, Any]],
    rng: random.Random,
    tag: str,
    secret: bytes | None,
) -> list[tuple[str, list[bytes], str]]:
    """A burst for one node: (name, frames, expected) with ``expected`` one of 'refused'
    (``ok`` false, or no reply for frames the server cannot answer), 'ok' or 'any'.

    With ``secret`` (the nodes' ``--kv-secret``) the schema and state checks behind the
    signature are reached by signing the message as a confused peer would; unsigned,
    wrongly signed, tampered, stale and replayed envelopes must all be refused."""
    enc = (lambda m: sign(secret, m)) if secret else _pack  # noqa: E731
    compat = dict(target.get("compat") or {})
    tp = int(compat.get("tp_size") or 1)
    fake_engine = "chaos-fuzzer"
    incarnation = f"{tag}-{rng.getrandbits(32):08x}"
    fake_key = f"{fake_engine}:{incarnation}"
    # Nobody listens there: P's failure notices to it time out on that peer's own lane.
    dead_addr = f"tcp://127.0.0.1:{free_port()}"
    tid = f"chaos-forged-{tag}-{rng.getrandbits(32):08x}"
    nonce = f"forged-{rng.getrandbits(64):016x}"
    reserve = {
        "kind": "reserve",
        "transfer_id": tid,
        "nonce": nonce,
        "d_request_id": "chaos-x",
        "peer_key": fake_key,
        "address": dead_addr,
        "block_ids": [3, 4, 5],
        "skip_blocks": 0,
        "p_incarnation": str(target.get("incarnation") or "unknown"),  # the P it is for
        "sent_at": time.time(),  # fresh: refused for its key, not its age
    }
    msgs: list[tuple[str, list[bytes], str]] = [
        ("garbage bytes", [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))], "any"),
        ("not msgpack", [b"\xc1\xc1\xc1 not msgpack"], "refused"),
        ("msgpack list", [_pack([1, 2, 3])], "refused"),
        ("msgpack string", [_pack("reserve")], "refused"),
        ("msgpack nil", [_pack(None)], "refused"),
        ("two frames", [enc({"kind": "ping"}), enc({"kind": "ping"})], "refused"),
        ("empty map", [enc({})], "refused"),
        ("unknown kind", [enc({"kind": "launch_missiles"})], "refused"),
        ("kind not a string", [enc({"kind": 7})], "refused"),
        ("reserve without fields", [enc({"kind": "reserve"})], "refused"),
        ("reserve negative block", [enc({**reserve, "block_ids": [1, -5]})], "refused"),
        ("reserve float block", [enc({**reserve, "block_ids": [1.5]})], "refused"),
        (
            "reserve huge block list",
            [enc({**reserve, "block_ids": list(range(100_000))})],
            "refused",
        ),
        ("reserve from an unknown peer", [enc({**reserve, "peer_key": "nobody:0"})], "refused"),
        (
            "handshake with wrong types",
            [
                enc(
                    {
                        "kind": "handshake",
                        "engine_id": 1,
                        "compat": [],
                        "ranks": "x",
                        "address": "http://x",
                    }
                )
            ],
            "refused",
        ),
        (
            "handshake with another block size",
            [
                enc(
                    {
                        "kind": "handshake",
                        "engine_id": fake_engine,
                        "incarnation": incarnation,
                        "peer_key": fake_key,
                        "compat": {**compat, "block_size": 2 * int(compat.get("block_size", 16))},
                        "ranks": [{"num_blocks": 64}] * tp,
                        "address": dead_addr,
                    }
                )
            ],
            "refused",
        ),
        (
            "handshake from a peer outside the allowlist",
            [
                enc(
                    {
                        "kind": "handshake",
                        "engine_id": fake_engine,
                        "incarnation": incarnation,
                        "peer_key": fake_key,
                        "compat": compat,
                        "ranks": [{"num_blocks": 64}] * tp,
                        "address": "tcp://203.0.113.7:5555",
                    }
                )
            ],
            "refused",
        ),
        (
            "cancel unknown nonce",
            [
                enc(
                    {
                        "kind": "cancel",
                        "transfer_id": tid,
                        "nonce": "never-issued",
                        "peer_key": fake_key,
                    }
                )
            ],
            "any",
        ),
        (
            "transfer_failed unknown nonce",
            [
                enc(
                    {
                        "kind": "transfer_failed",
                        "d_request_id": "chaos-nobody",
                        "transfer_id": tid,
                        "nonce": "never-issued",
                        "reason": "forged",
                        "safe": True,
                    }
                )
            ],
            "any",
        ),
        ("ping", [enc({"kind": "ping"})], "ok"),
    ]
    if secret:
        ping = sign(secret, {"kind": "ping"})
        body = _pack({"kind": "ping"})
        ts, n = time.time(), os.urandom(16)
        tampered = _pack(
            {
                "ts": ts,
                "n": n,
                "body": _pack({"kind": "cancel"}),
                "mac": _request_mac(secret, ts, n, body),
            }
        )
        msgs += [
            ("unsigned ping", [_pack({"kind": "ping"})], "refused"),
            ("unsigned reserve", [_pack(reserve)], "refused"),
            (
                "ping signed with another secret",
                [sign(b"not-the-secret", {"kind": "ping"})],
                "refused",
            ),
            ("tampered body", [tampered], "refused"),
            ("stale timestamp", [sign(secret, {"kind": "ping"}, ts=time.time() - 3600)], "refused"),
            ("signed ping", [ping], "ok"),
            ("signed ping replayed byte for byte", [ping], "refused"),
        ]
    else:
        msgs.append(("ping replayed", [_pack({"kind": "ping"})], "ok"))
    # Reservations naming a real decode node (its public engine id and incarnation) with
    # block ids past its pool: refused before any WRITE is posted.
    for info in decode_infos:
        real_key = f"{info.get('engine_id')}:{info.get('incarnation')}"
        msgs.append(
            (
                f"reserve out of range as {info.get('engine_id')}",
                [
                    enc(
                        {
                            **reserve,
                            "transfer_id": tid + "-oor",
                            "nonce": nonce + "-oor",
                            "peer_key": real_key,
                            "address": info.get("side_channel") or dead_addr,
                            "block_ids": [0, 10**6, 2**40],
                        }
                    )
                ],
                "refused",
            )
        )
    # A compatible peer of our own (an identity no real node uses), then an in-range
    # reservation of a transfer no prefill has, repeated, cancelled, repeated again.
    handshake = {
        "kind": "handshake",
        "engine_id": fake_engine,
        "incarnation": incarnation,
        "peer_key": fake_key,
        "compat": compat,
        "ranks": [{"num_blocks": 64} for _ in range(tp)],
        "address": dead_addr,
    }
    cancel = {"kind": "cancel", "transfer_id": tid, "nonce": nonce, "peer_key": fake_key}
    if target.get("role") == "producer":
        msgs += [
            ("handshake (own identity)", [enc(handshake)], "ok"),
            ("handshake again", [enc(handshake)], "ok"),
            ("reserve in range, unknown transfer", [enc(reserve)], "ok"),
            ("same reserve again (a retry)", [enc(reserve)], "ok"),
            (
                "reserve for another prefill incarnation (replayed after a restart)",
                [enc({**reserve, "nonce": nonce + "-inc", "p_incarnation": "gone"})],
                "refused",
            ),
            (
                "reserve out of range for our own peer",
                [
                    enc(
                        {
                            **reserve,
                            "nonce": nonce + "-2",
                            "transfer_id": tid + "-2",
                            "block_ids": [63, 64],
                        }
                    )
                ],
                "refused",
            ),
            ("cancel", [enc(cancel)], "ok"),
            ("cancel again", [enc(cancel)], "ok"),
            ("reserve again after its cancel", [enc(reserve)], "refused"),
            # Held until the deadline: P then tells our dead address transfer_failed.
            (
                "early reservation left to expire",
                [enc({**reserve, "transfer_id": tid + "-e", "nonce": nonce + "-e"})],
                "ok",
            ),
        ]
        # Claims naming a real decode node: P takes them as claims its address must confirm
        # (that address answers as the real node, so they are dropped), never as that
        # node restarting; the real node's pushes go on (the run's token checks see it).
        for info in decode_infos:
            eid, inc = info.get("engine_id"), info.get("incarnation")
            msgs += [
                (
                    f"handshake claiming {eid}'s engine id and address",
                    [
                        enc(
                            {
                                **handshake,
                                "engine_id": eid,
                                "peer_key": f"{eid}:{incarnation}",
                                "address": info.get("side_channel") or dead_addr,
                            }
                        )
                    ],
                    "any",
                ),
                (
                    f"handshake under {eid}'s own key",
                    [
                        enc(
                            {
                                **handshake,
                                "engine_id": eid,
                                "incarnation": inc,
                                "peer_key": f"{eid}:{inc}",
                            }
                        )
                    ],  # fmt: skip
                    "any",
                ),
            ]
    else:  # a decode node pairs with no one and takes no reservation or cancel
        msgs += [
            ("handshake to a decode node", [enc(handshake)], "refused"),
            ("reserve to a decode node", [enc(reserve)], "refused"),
        ]
    return msgs


def side_channel_burst(cluster: Cluster, rng: random.Random, tag: str) -> dict[str, Any]:
    """One burst to every live node; returns what each answered that was unexpected."""
    infos = {}
    for n in cluster.nodes:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            infos[n.name] = httpx.get(n.url + "/v1/kv_transfer_info", timeout=5).json()
    decode_infos = [infos[n.name] for n in cluster.decode if n.name in infos]
    sent, unexpected = 0, []
    secret = cluster.cfg.kv_secret.encode() or None
    for name, info in infos.items():
        addr = info.get("side_channel")
        if not addr:
            continue
        for what, frames, expected in fuzz_messages(info, decode_infos, rng, tag, secret):
            reply = _dealer_call(addr, frames)
            sent += 1
            ok = isinstance(reply, dict) and reply.get("ok") is True
            if expected == "ok" and not ok:
                unexpected.append(f"{name}: {what}: expected success, got {reply!r:.160}")
            elif expected == "refused" and ok:
                unexpected.append(f"{name}: {what}: accepted: {reply!r:.160}")
            elif expected == "refused" and not isinstance(reply, dict) and reply != "no-reply":
                unexpected.append(f"{name}: {what}: {reply!r:.160}")
    healthy = {}
    for n in cluster.nodes:
        with contextlib.suppress(httpx.HTTPError):
            healthy[n.name] = httpx.get(n.url + "/health", timeout=5).status_code
    for n, code in healthy.items():
        if code != 200:
            unexpected.append(f"{n}: /health {code} right after the burst")
    return {"messages": sent, "unexpected": unexpected}
