"""Wire formats of the NIXL connector: compatibility info, side-channel messages, notifs.

Side-channel messages are msgpack maps over ``kvconnector.nixl.side_channel``. Each kind
is a frozen dataclass here, with ``to_wire()`` (the map to send) and a decoder that
validates every field: ``decode_request(raw)`` on the serving side (the map's ``kind``
picks the class), ``decode_reply(raw, cls)`` on the calling side. A map that is not a
known kind, lacks a field, or has a field of the wrong type (e.g. a negative or non-int
block id) raises ``MessageError`` naming it; the scheduler answers such a message with
a ``Refusal`` and never lets the error out of the side-channel server's loop. Fields a
decoder does not know are ignored.

Requests (``kind``) and their replies:

* ``handshake`` (``Handshake``) D -> P: D's ``engine_id``, ``incarnation``, ``peer_key``,
  ``compat``, ``ranks`` (each rank's transport metadata), ``address`` (D's side channel).
  Reply ``HandshakeReply``: P's ``engine_id``, ``incarnation``, ``side_channel``,
  ``role``, ``compat``, ``transport``, ``ranks`` -- or a ``Refusal`` naming the mismatch.
* ``reserve`` (``Reserve``) D -> P: ``transfer_id``, ``nonce``, ``d_request_id``,
  ``peer_key``, ``address``, ``block_ids`` (D blocks to write), ``skip_blocks`` (leading
  prompt blocks D already has), ``p_incarnation`` (the P process D paired with),
  ``sent_at`` (D's wall clock when sent). Reply ``Ack``, or a ``Refusal``
  (``code="handshake_required"`` when P does not know the peer, ``"wrong_incarnation"``
  when it names another P process: D pairs again and resends it once;
  ``"stale_reservation"`` when it came too late for D's quarantine to cover, or its
  clock is off). The same reservation sent twice (same ``nonce``) is acknowledged twice.
* ``cancel`` (``Cancel``) D -> P: ``transfer_id``, ``nonce``, ``peer_key`` (refused with
  ``handshake_required`` from a key P does not pair with). Reply ``CancelReply``,
  ``state``: ``cancelled`` (nothing was or will be written for that reservation) or
  ``in_flight`` (a WRITE may still land: one running, or one that errored or timed out,
  which UCX may not really have aborted; wait for its notif or a deadline).
* ``transfer_failed`` (``TransferFailed``) P -> D: ``d_request_id``, ``transfer_id``,
  ``nonce``, ``reason``, ``safe``: the KV will not come and, when ``safe``, nothing more
  will be written into its blocks. Reply ``Ack``.
* ``ping`` (``Ping``): liveness, and P's check of a new decode peer. Reply
  ``PingReply``: ``incarnation``, ``engine_id`` and ``ranks_digest`` (of the rank
  metadata this node hands out in its handshakes).

Every reply is a map with ``ok``; a ``Refusal`` is ``{"ok": False, "error": ..., "code"?}``.

A NIXL notification (``Notif``; P rank -> D rank, delivered after that rank's WRITE
landed) is a msgpack map: ``r`` D request id, ``t`` transfer id, ``k`` the reservation's
nonce, ``n`` parts that D rank expects, ``ft`` the first token sampled by P, and with
``--kv-checksum`` ``c``, the checksums of (some of) the blocks written.

Fencing: D makes a fresh ``nonce`` for every reservation (its incarnation, a counter and
64 random bits). Everything about one transfer names it -- the reservation, the
notifications, ``transfer_failed`` and ``cancel`` -- and every count is keyed by it, so a
delayed or forged message about another reservation (an old one of the same transfer id,
another client's) matches nothing: it cannot complete, fail or free this one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

import msgpack

# Version of everything this module puts on the wire: the side-channel messages, the
# notification and the compatibility info. Peers of different versions refuse to pair
# (``check_compat`` compares it first), so bump it whenever one of them changes, and add a
# line here saying what changed:
#   1  side-channel maps dispatched on ``kind`` (handshake, reserve, cancel,
#      transfer_failed, ping) with ``ok``/``error``/``code`` replies; notif ``{r, t, n, ft}``.
#      Decoding them into the typed messages below, which refuse malformed maps, changed
#      no byte on the wire, so the version stayed 1.
#   2  transfer fencing: ``nonce`` in reserve, cancel and transfer_failed (which also
#      gained ``transfer_id``); the notif gained ``k`` (the nonce). D counts notifs and
#      matches replies by nonce, not by request id.
#   3  ``kv_checksum`` in the compatibility info; the notif gained ``c`` (block checksums,
#      ``[[D block id, sum], ...]``, or null).
#   4  heterogeneous TP: ``tp_size`` is no longer compared (``num_kv_heads`` is the
#      model's, each side's TP must divide it or be a multiple of it); rank metadata
#      carries ``num_layers``/``num_heads``; the notif gained ``hs`` (the D-rank head
#      slice ``[first, count]`` its checksums cover, or null for whole blocks).
#   5  ``kv_transport`` (``nixl`` or ``ucxx``, ``--kv-transport``) in the compatibility info,
#      compared right after the version: a NIXL rank cannot talk to a UCXX rank; rank
#      metadata of the ucxx transport says ``library: ucxx`` and carries its UCX worker
#      address instead of NIXL agent metadata.
#   6  pipelined push (``--kv-layer-group-size``): a send may come in pieces, each with a
#      notif; ``n`` counts senders x pieces, and only the last piece carries ``ft`` and
#      ``c``. D keeps ``ft`` and the sums from whichever notif has them and checks the sums
#      once every piece landed (a v5 D took ``ft`` from the last notif to arrive).
#   7  peer trust: a decode node refuses handshake/reserve/cancel and a prefill node
#      transfer_failed (``code: wrong_role``); P's handshake reply carries only public rank
#      info (``public_rank_info``); the ping reply gained ``ranks_digest``, which P checks
#      before it pushes to a peer (``decode_peers``); ``peer_key`` is a secret of D's
#      incarnation and the prefill address (was ``engine_id:incarnation``, which pings hand
#      out) and ``cancel`` gained it; with a secret, D's handshake follows a signed ping;
#      names, texts and arrays are bounded.
#   8  ``reserve`` gained ``p_incarnation`` (required): the P process D paired with; another
#      process at that address (P restarted) refuses it (``code: wrong_incarnation``), so a
#      reservation captured on the wire and replayed to a restarted P -- whose replay guard
#      is empty, within the signed envelope's 60 s -- holds nothing there. A v7 peer's
#      handshake is refused by ``check_compat`` (``connector_version mismatch: this node
#      has 8, the peer has 7``), as any other version's; a v7 ``reserve`` that gets past
#      it anyway lacks the field and is refused as malformed.
#   9  ``reserve`` gained ``sent_at`` (required): D's wall clock when it sent it. P refuses
#      one it gets more than ``RESERVE_MAX_AGE_S`` after that, or dated more than
#      ``CLOCK_SLACK_S`` ahead of its own clock (``code: stale_reservation``), and D's
#      quarantine of a reservation it sent lasts 2T from ``sent_at + RESERVE_MAX_AGE_S +
#      CLOCK_SLACK_S`` at the earliest: a reservation delayed in a socket buffer or a
#      network partition past D's quarantine used to be taken, and P pushed into blocks D
#      had freed. A v8 ``reserve`` lacks the field and is refused as malformed.
CONNECTOR_VERSION = 9
# A reservation P gets more than this long after D sent it (by the hosts' wall clocks) is
# refused: D's quarantine of a reservation it sent counts 2T from no earlier than its send
# plus this plus ``CLOCK_SLACK_S`` -- P takes it by then, or never.
RESERVE_MAX_AGE_S = 5.0
# How far apart the hosts' wall clocks may be (NTP keeps them within milliseconds). A
# reservation dated further ahead of P's clock is refused as well: a skew past the bound
# refuses every reservation (loud, D recomputes) instead of letting a late one through.
CLOCK_SLACK_S = 5.0
LAYOUT = "block,layer,kv,head,token,dim"

# Compared in this order; the first difference is the error message.
COMPAT_KEYS = (
    "connector_version",
    "kv_transport",
    "layout",
    "model",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "block_size",
    "kv_checksum",
)


def model_fingerprint(model: str, seed: int) -> str:
    """Identifies the weights: 'tiny' by its seed, a checkpoint by its config and sizes --
    never by its path, so a local copy and a Hugging Face cache snapshot of one model (on
    nodes with different cache directories) match."""
    if model == "tiny":
        return f"tiny/seed={seed}"
    h = hashlib.sha256()
    with open(os.path.join(model, "config.json"), "rb") as f:
        raw = f.read()
    h.update(raw)
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            h.update(f"{name}:{os.path.getsize(os.path.join(model, name))}".encode())
    try:
        arch = (json.loads(raw).get("architectures") or ["checkpoint"])[0]
    except (ValueError, AttributeError, TypeError):
        arch = "checkpoint"
    return f"{arch}/{h.hexdigest()[:16]}"


def check_compat(local: dict[str, Any], remote: dict[str, Any]) -> str | None:
    """None when compatible, else a message naming the first mismatch."""
    for key in COMPAT_KEYS:
        if local.get(key) != remote.get(key):
            hint = " (start both with the same --kv-transport)" if key == "kv_transport" else ""
            return f"{key} mismatch: this node has {local.get(key)!r}, the peer has {remote.get(key)!r}{hint}"
    return None


def compat_mismatch(local: dict[str, Any], raw: Any) -> str | None:
    """The mismatch with the ``compat`` map of a raw message that did not decode, if it
    has one: a peer of another connector version may speak another shape, and the version
    is the more useful thing to name."""
    compat = raw.get("compat") if isinstance(raw, dict) else None
    return check_compat(local, compat) if isinstance(compat, dict) else None


MAX_NAME_CHARS = 512  # ids, keys, nonces, addresses (a transfer id is at most 256)
MAX_TEXT_CHARS = 4096  # reasons and errors
MAX_RANKS = 1024  # rank metadata maps in one handshake
MAX_BLOCK_IDS = 1 << 22  # blocks of one peer rank
MAX_RESERVE_IDS = 1 << 20  # block ids in one reservation (P bounds it by max_model_len)

# What of a rank's transport metadata a decode peer may see: what tells it the rank's
# place and size, never what opens its memory (agent metadata, addresses, worker address).
PUBLIC_RANK_KEYS = ("library", "num_blocks", "mem_type", "num_layers", "num_heads")


def public_rank_info(rank: dict[str, Any]) -> dict[str, Any]:
    return {k: rank[k] for k in PUBLIC_RANK_KEYS if k in rank}


def ranks_digest(ranks: Any) -> str:
    """Names a node's rank metadata exactly as it travels (msgpack), so that P can ask the
    address a handshake claims whether those ranks are its own."""
    return hashlib.sha256(msgpack.packb(list(ranks), use_bin_type=True)).hexdigest()[:32]


# Bounds of a decode rank's metadata, checked when P pairs with it: P's workers build
# descriptor arrays from these numbers (num_blocks x layers of them), so a forged 2**62
# must be refused here, not found out as an allocation on every P rank.
RANK_INT_BOUNDS = {
    "num_blocks": (1, MAX_BLOCK_IDS),  # required
    "block_bytes": (1, 1 << 40),
    "base_addr": (0, (1 << 64) - 1),
    "num_layers": (1, 1 << 12),
    "num_heads": (1, 1 << 12),
    "device_id": (0, 1 << 16),
}
MAX_RANK_UNITS = 1 << 26  # num_blocks x 2 x num_layers: the largest descriptor list


RANK_BYTES_KEYS = ("agent_metadata", "worker_address")  # NIXL agent / UCX worker address
RANK_KEYS = {*RANK_INT_BOUNDS, *RANK_BYTES_KEYS, "agent_name", "mem_type", "library"}
MAX_RANK_BLOB_BYTES = 1 << 20


def rank_info_error(rank: dict[str, Any], where: str) -> str | None:
    """Why a peer rank's transport metadata cannot be used, or None."""
    if "num_blocks" not in rank:
        return f"{where}.num_blocks is missing"
    for key, (lo, hi) in RANK_INT_BOUNDS.items():
        if key in rank and not (_is_int(rank[key]) and lo <= rank[key] <= hi):
            return f"{where}.{key} must be an integer in [{lo}, {hi}], got {rank[key]!r:.40}"
    if rank["num_blocks"] * 2 * rank.get("num_layers", 1) > MAX_RANK_UNITS:
        return f"{where}: num_blocks x num_layers is over {MAX_RANK_UNITS // 2}"
    end = rank.get("base_addr", 0) + rank["num_blocks"] * rank.get("block_bytes", 1)
    if end > 1 << 64:
        return f"{where}: its KV cache ends past the 64-bit address space"
    for key in ("agent_name", "mem_type", "library"):
        if key in rank and not (isinstance(rank[key], str) and len(rank[key]) <= MAX_NAME_CHARS):
            return f"{where}.{key} must be a string of at most {MAX_NAME_CHARS} characters"
    for key in RANK_BYTES_KEYS:
        value = rank.get(key)
        if key in rank and not (isinstance(value, bytes) and len(value) <= MAX_RANK_BLOB_BYTES):
            return f"{where}.{key} must be at most {MAX_RANK_BLOB_BYTES} bytes"
    if unknown := set(rank) - RANK_KEYS:
        # P keeps what a peer sends for as long as it pairs with it: nothing it does not use.
        return f"{where} has unknown keys {sorted(unknown)[:4]!r:.80}"
    return None


# -- typed messages ------------------------------------------------------------------------


class MessageError(ValueError):
    """A side-channel message or reply that is malformed, forged or of an unknown kind."""


Check = Callable[[Any, str], Any]  # (value, where) -> the value to keep; raises MessageError


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(where: str, what: str, value: Any) -> MessageError:
    return MessageError(f"{where} must be {what}, got {type(value).__name__} {value!r:.60}")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT_CHARS:
        raise _fail(where, f"a string of at most {MAX_TEXT_CHARS} characters", value)
    return value


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise _fail(where, f"a non-empty string of at most {MAX_NAME_CHARS} characters", value)
    return value


def _address(value: Any, where: str) -> str:
    ok = isinstance(value, str) and value.startswith("tcp://") and len(value) <= MAX_NAME_CHARS
    if not ok:
        raise _fail(where, "a side-channel address (tcp://host:port)", value)
    return value


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, "a boolean", value)
    return value


def _count(value: Any, where: str) -> int:
    if not _is_int(value) or value < 0:
        raise _fail(where, "a non-negative integer", value)
    return value


def _positive(value: Any, where: str) -> int:
    if not _is_int(value) or value < 1:
        raise _fail(where, "a positive integer", value)
    return value


def _map(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _fail(where, "a map with string keys", value)
    return value


def _maps(value: Any, where: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list | tuple) or not 0 < len(value) <= MAX_RANKS:
        raise _fail(where, f"an array of 1 to {MAX_RANKS} maps", value)
    return tuple(_map(v, f"{where}[{i}]") for i, v in enumerate(value))


def _block_ids(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or len(value) > MAX_RESERVE_IDS:
        raise _fail(where, f"an array of at most {MAX_RESERVE_IDS} block ids", value)
    for i, b in enumerate(value):
        if not _is_int(b) or b < 0:
            raise _fail(f"{where}[{i}]", "a non-negative integer block id", b)
    return tuple(value)


def _time(value: Any, where: str) -> float:
    ok = isinstance(value, float | int) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0:
        raise _fail(where, "a finite non-negative time in seconds", value)
    return float(value)


def _cancel_state(value: Any, where: str) -> str:
    if value not in ("cancelled", "in_flight"):
        raise _fail(where, "'cancelled' or 'in_flight'", value)
    return value


def _token(value: Any, where: str) -> int | None:
    if value is not None and (not _is_int(value) or value < 0):
        raise _fail(where, "a token id or null", value)
    return value


MAX_CHECKSUMS = 1 << 20  # more [block, sum] pairs than any KV cache has blocks


def _sums(value: Any, where: str) -> tuple[tuple[int, int], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) > MAX_CHECKSUMS:
        raise _fail(where, "an array of [block id, checksum] pairs or null", value)
    out = []
    for i, pair in enumerate(value):
        ok = isinstance(pair, list | tuple) and len(pair) == 2
        if not ok or not all(_is_int(v) and 0 <= v < (1 << 64) for v in pair):
            raise _fail(f"{where}[{i}]", "a [block id, checksum] pair of non-negative ints", pair)
        out.append((pair[0], pair[1]))
    return tuple(out)


def _head_slice(value: Any, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    ok = isinstance(value, list | tuple) and len(value) == 2
    if not ok or not _is_int(value[0]) or not _is_int(value[1]) or value[0] < 0 or value[1] < 1:
        raise _fail(where, "a [first head, count] pair or null", value)
    return (value[0], value[1])


def _wire_value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


M = TypeVar("M", bound="_Message")


class _Message:
    """Shared by every message and reply: validated decoding and the wire map."""

    CHECKS: ClassVar[dict[str, Check]]
    NAME: ClassVar[str]

    def _wire_fields(self) -> dict[str, Any]:
        return {
            f.name: _wire_value(getattr(self, f.name))
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
        }

    @classmethod
    def from_wire(cls: type[M], raw: Any) -> M:
        if not isinstance(raw, dict):
            raise MessageError(f"{cls.NAME}: expected a map, got {type(raw).__name__}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            where = f"{cls.NAME}.{f.name}"
            if f.name not in raw:
                if f.default is dataclasses.MISSING:
                    raise MessageError(f"{cls.NAME}: missing field {f.name!r}")
                continue
            values[f.name] = cls.CHECKS[f.name](raw[f.name], where)
        return cls(**values)


class _Request(_Message):
    KIND: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.KIND, **self._wire_fields()}


class _Reply(_Message):
    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, **self._wire_fields()}


@dataclass(frozen=True)
class Handshake(_Request):
    KIND: ClassVar[str] = "handshake"
    NAME: ClassVar[str] = "handshake"
    CHECKS: ClassVar[dict[str, Check]] = {
        "engine_id": _name,
        "incarnation": _name,
        "peer_key": _name,
        "compat": _map,
        "ranks": _maps,
        "address": _address,
    }
    engine_id: str
    incarnation: str
    peer_key: str
    compat: dict[str, Any]
    ranks: tuple[dict[str, Any], ...]
    address: str


@dataclass(frozen=True)
class Reserve(_Request):
    KIND: ClassVar[str] = "reserve"
    NAME: ClassVar[str] = "reserve"
    CHECKS: ClassVar[dict[str, Check]] = {
        "transfer_id": _name,
        "nonce": _name,
        "d_request_id": _name,
        "peer_key": _name,
        "address": _address,
        "block_ids": _block_ids,
        "skip_blocks": _count,
        "p_incarnation": _name,
        "sent_at": _time,
    }
    transfer_id: str
    nonce: str
    d_request_id: str
    peer_key: str
    address: str
    block_ids: tuple[int, ...]
    skip_blocks: int
    # The P process D paired with (its handshake reply's incarnation): another process at
    # P's address -- one that restarted since -- refuses it (``Refusal.WRONG_INCARNATION``).
    p_incarnation: str
    # D's wall clock (``clock.wall``) when it sent this: P refuses it when it comes too late
    # (``RESERVE_MAX_AGE_S``), after D may have stopped quarantining the blocks.
    sent_at: float


@dataclass(frozen=True)
class Cancel(_Request):
    KIND: ClassVar[str] = "cancel"
    NAME: ClassVar[str] = "cancel"
    CHECKS: ClassVar[dict[str, Check]] = {"transfer_id": _name, "nonce": _name, "peer_key": _name}
    transfer_id: str
    nonce: str
    peer_key: str  # the sender's pairing key: only a paired decode peer cancels


@dataclass(frozen=True)
class TransferFailed(_Request):
    KIND: ClassVar[str] = "transfer_failed"
    NAME: ClassVar[str] = "transfer_failed"
    CHECKS: ClassVar[dict[str, Check]] = {
        "d_request_id": _name,
        "transfer_id": _name,
        "nonce": _name,
        "reason": _text,
        "safe": _flag,
    }
    d_request_id: str
    transfer_id: str
    nonce: str
    reason: str
    safe: bool


@dataclass(frozen=True)
class Ping(_Request):
    KIND: ClassVar[str] = "ping"
    NAME: ClassVar[str] = "ping"
    CHECKS: ClassVar[dict[str, Check]] = {}


REQUESTS: dict[str, type[_Request]] = {
    cls.KIND: cls for cls in (Handshake, Reserve, Cancel, TransferFailed, Ping)
}
SideChannelRequest = Handshake | Reserve | Cancel | TransferFailed | Ping


def decode_request(raw: Any) -> SideChannelRequest:
    """The typed request a peer sent; ``MessageError`` when it is not a valid one."""
    if not isinstance(raw, dict):
        raise MessageError(f"a request must be a map, got {type(raw).__name__}")
    kind = raw.get("kind")
    cls = REQUESTS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"unknown message kind {kind!r:.40}")
    return cls.from_wire(raw)  # type: ignore[return-value]


@dataclass(frozen=True)
class HandshakeReply(_Reply):
    NAME: ClassVar[str] = "handshake reply"
    CHECKS: ClassVar[dict[str, Check]] = {
        "engine_id": _name,
        "incarnation": _name,
        "side_channel": _address,
        "role": _text,
        "compat": _map,
        "transport": _map,
        "ranks": _maps,
    }
    engine_id: str
    incarnation: str
    side_channel: str
    role: str
    compat: dict[str, Any]
    transport: dict[str, Any]
    ranks: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Ack(_Reply):
    """Success without data (``reserve``, ``transfer_failed``)."""

    NAME: ClassVar[str] = "reply"
    CHECKS: ClassVar[dict[str, Check]] = {}


@dataclass(frozen=True)
class CancelReply(_Reply):
    NAME: ClassVar[str] = "cancel reply"
    CHECKS: ClassVar[dict[str, Check]] = {"state": _cancel_state}
    state: Literal["cancelled", "in_flight"]


@dataclass(frozen=True)
class PingReply(_Reply):
    NAME: ClassVar[str] = "ping reply"
    CHECKS: ClassVar[dict[str, Check]] = {
        "incarnation": _name,
        "engine_id": _text,
        "ranks_digest": _text,
    }
    incarnation: str
    engine_id: str = ""
    ranks_digest: str = ""  # ``ranks_digest`` of the ranks this node hands out, if any


@dataclass(frozen=True)
class Refusal(_Message):
    """Any request refused: ``error`` says why; ``code`` is machine-readable, if any."""

    NAME: ClassVar[str] = "refusal"
    CHECKS: ClassVar[dict[str, Check]] = {"error": _text, "code": _text}
    HANDSHAKE_REQUIRED: ClassVar[str] = "handshake_required"
    WRONG_ROLE: ClassVar[str] = "wrong_role"  # a message only the other role takes
    # a reservation made for another P process at this address (P restarted since)
    WRONG_INCARNATION: ClassVar[str] = "wrong_incarnation"
    # a reservation that came too late (``RESERVE_MAX_AGE_S``), or from a skewed clock
    STALE_RESERVATION: ClassVar[str] = "stale_reservation"
    error: str
    code: str = ""

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": False, "error": self.error}
        if self.code:
            out["code"] = self.code
        return out


R = TypeVar("R", bound=_Reply)


def decode_reply(raw: Any, cls: type[R]) -> R | Refusal:
    """A peer's reply: ``cls`` when ``ok`` is true, else a ``Refusal``; ``MessageError``
    when it is neither."""
    if not isinstance(raw, dict):
        raise MessageError(f"a reply must be a map, got {type(raw).__name__}")
    ok = raw.get("ok")
    if ok is True:
        return cls.from_wire(raw)
    if ok is False:
        return Refusal.from_wire(raw)
    raise MessageError(f"{cls.NAME}: 'ok' must be true or false, got {ok!r:.40}")


# -- NIXL notification ---------------------------------------------------------------------


@dataclass(frozen=True)
class Notif(_Message):
    """What a P rank's WRITE carries to the matching D rank (delivered after the data)."""

    NAME: ClassVar[str] = "notif"
    CHECKS: ClassVar[dict[str, Check]] = {
        "r": _name,
        "t": _text,
        "k": _name,
        "n": _positive,
        "ft": _token,
        "c": _sums,
        "hs": _head_slice,
    }
    r: str  # D request id
    t: str  # transfer id
    k: str  # the reservation's nonce: what D counts by
    n: int = 1  # parts the receiving rank counts before the request is received
    ft: int | None = None  # the first token sampled by P
    c: tuple[tuple[int, int], ...] | None = None  # [D block id, checksum] (--kv-checksum)
    hs: tuple[int, int] | None = None  # D-rank heads [first, count] the sums cover

    def pack(self) -> bytes:
        wire: dict[str, Any] = {"r": self.r, "t": self.t, "k": self.k, "n": self.n, "ft": self.ft}
        if self.c is not None:
            wire["c"] = [list(pair) for pair in self.c]
        if self.hs is not None:
            wire["hs"] = list(self.hs)
        return msgpack.packb(wire)

    @classmethod
    def unpack(cls, data: bytes) -> Notif:
        """``MessageError`` for bytes that are not a valid notification."""
        try:
            raw = msgpack.unpackb(data)
        except Exception as e:
            raise MessageError(f"notif: undecodable ({type(e).__name__})") from e
        return cls.from_wire(raw)
