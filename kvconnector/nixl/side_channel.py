"""A small request/reply side channel over ZeroMQ + msgpack.

Used to exchange NIXL agent metadata and other small control messages between prefill
and decode workers (NIXL's own metadata listener is not used).

Wire format: one msgpack-encoded map per message, each way. The server is a ROUTER
socket served by one background thread; the client opens a fresh DEALER socket for
every request and closes it afterwards (linger 0), so a reply that arrives after a
timeout can never be mistaken for the reply to a later request.

Threading: ``SideChannelServer`` runs its handler on its own thread, one request at a
time (a slow handler delays later requests; keep handlers short). ``SideChannelClient``
is safe to use from several threads at once: sockets are per call, and the shared
``zmq.Context`` is thread-safe.

Authentication (``secret``, the nodes' ``--kv-secret``): every request travels as an
envelope ``{"ts", "n", "body", "mac"}`` -- ``body`` the msgpack of the message, ``n`` 16
random bytes, ``ts`` the sender's wall clock, ``mac`` HMAC-SHA256 over them -- and every
reply as ``{"body", "mac"}`` with the MAC bound to the request's ``n``. The server refuses
(``code: "unauthenticated"``) a request without a valid MAC, one whose ``ts`` is more
than ``REPLAY_WINDOW_S`` away from its own clock, and one whose ``n`` it has seen
(a replay); the client refuses a reply without a valid MAC. Both ends must have the same
secret; without one, messages are plain maps (loopback development).

Size: a message over ``MAX_MESSAGE_BYTES`` (either way) is never read; ZMQ drops the
connection it came on (the sender sees a timeout). One with an array or map of more than
``MAX_WIRE_ITEMS`` items is refused when decoding reaches its header (a request: an
``ok: False`` reply naming the limit).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from engine.log_limit import LimitedLog

logger = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any]]

_POLL_INTERVAL_MS = 50
_WILDCARD_HOSTS = ("", "*", "0.0.0.0")


class SideChannelError(Exception):
    """A side-channel request failed (bad reply, socket error)."""


class SideChannelTimeout(SideChannelError, TimeoutError):
    """No reply arrived within the request's timeout."""


class SideChannelNotSent(SideChannelTimeout):
    """No connection within the timeout: the request never left this process (the
    socket queues nothing for a peer that never connected)."""


def _pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(
            data, raw=False, max_array_len=MAX_WIRE_ITEMS, max_map_len=MAX_WIRE_ITEMS
        )
    except ValueError as exc:
        if "exceeds max_" not in str(exc):
            raise
        raise ValueError(f"arrays and maps hold at most {MAX_WIRE_ITEMS} items ({exc})") from None


def _remaining_ms(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))


MAX_MESSAGE_BYTES = 64 << 20  # a bigger request drops its connection (ZMQ_MAXMSGSIZE)
# Items in one msgpack array or map: the longest any message carries (``messages``'
# MAX_RESERVE_IDS, MAX_CHECKSUMS). Decoding stops at a longer one's header, so a peer's
# 64 MiB of one-byte ints is not built into 64 M Python objects (half a GiB) to be refused.
MAX_WIRE_ITEMS = 1 << 20
REPLAY_WINDOW_S = 60.0  # a signed request older or newer than this is refused
MAX_SEEN = 200_000  # request nonces remembered for replay checks (at most)
# Lines a peer's bytes provoke (unreadable, unsigned, forged, replayed requests: anyone who
# reaches the port can send them): each kind at most once per this many seconds, the next
# saying how many were held back.
REFUSAL_LOG_S = 10.0


def _mac(secret: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


def _request_mac(secret: bytes, ts: float, nonce: bytes, body: bytes) -> bytes:
    return _mac(secret, b"pdserve-side-channel-request-v1", repr(ts).encode(), nonce, body)


def _reply_mac(secret: bytes, nonce: bytes, body: bytes) -> bytes:
    return _mac(secret, b"pdserve-side-channel-reply-v1", nonce, body)


def _unauthenticated(why: str) -> dict[str, Any]:
    return {"ok": False, "error": f"unauthenticated: {why}", "code": "unauthenticated"}


class _ReplayGuard:
    """Signed requests' nonces seen within the replay window."""

    def __init__(self) -> None:
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def check(self, ts: float, nonce: bytes) -> str | None:
        """None when fresh (and remembered), else why it is refused."""
        now = time.time()
        while self._seen and next(iter(self._seen.values())) < now - 2 * REPLAY_WINDOW_S:
            self._seen.popitem(last=False)
        if not math.isfinite(ts) or abs(now - ts) > REPLAY_WINDOW_S:
            return f"timestamp {now - ts:+.0f}s away from this node's clock (window {REPLAY_WINDOW_S:.0f}s)"
        if nonce in self._seen:
            return "a replayed request"
        self._seen[nonce] = now
        if len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)
        return None


class SideChannelServer:
    """Serve ``handler(request) -> reply`` on a ROUTER socket from a background thread.

    ``port=0`` binds an ephemeral port; the bound port is ``.port`` and the address
    clients should use is ``.address`` (``tcp://host:port``, where a wildcard bind host
    is replaced by ``advertise_host``, default ``127.0.0.1``). A handler exception or a
    non-dict reply is answered with ``{"ok": False, "error": "..."}``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        *,
        advertise_host: str | None = None,
        name: str = "side-channel",
        secret: bytes | None = None,
    ) -> None:
        self._handler = handler
        self._secret = secret or None
        self._replays = _ReplayGuard()
        self.refused = 0  # requests refused before the handler (signature, clock, replay)
        self.refused_unauthenticated = 0  # of those, the ones not answered signed
        self._peer_log = LimitedLog(logger, REFUSAL_LOG_S)  # lines a peer's bytes provoke
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._bind_error: BaseException | None = None
        bind_host = "*" if host in _WILDCARD_HOSTS else host
        self._bind_addr = f"tcp://{bind_host}:{port if port else '*'}"
        self.port: int = 0
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._bind_error is not None:
            self._thread.join()
            raise SideChannelError(
                f"cannot bind {self._bind_addr}: {self._bind_error}"
            ) from self._bind_error
        adv = advertise_host or (host if host not in _WILDCARD_HOSTS else "127.0.0.1")
        self.address: str = f"tcp://{adv}:{self.port}"
        logger.info("side channel %s listening on %s", name, self.address)

    def _serve(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            sock.bind(self._bind_addr)
            endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            self.port = int(endpoint.rsplit(":", 1)[1])
        except Exception as exc:
            self._bind_error = exc
            sock.close()
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_INTERVAL_MS):
                    continue
                while not self._stop.is_set():
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reply = self._dispatch(frames)
                    if reply is not None:
                        try:
                            sock.send_multipart([frames[0], reply], zmq.NOBLOCK)
                        except zmq.ZMQError as exc:
                            logger.warning("side channel: reply not sent: %s", exc)
        except zmq.ZMQError:
            if not self._stop.is_set():
                logger.exception("side channel server loop failed")
        finally:
            sock.close(linger=0)

    def _dispatch(self, frames: list[bytes]) -> bytes | None:
        # DEALER request: [identity, payload] (an empty delimiter frame is tolerated).
        payload_frames = [f for f in frames[1:] if f]
        if len(frames) < 2 or len(payload_frames) != 1:
            self._peer_log.warning(
                "frames", "side channel: malformed request (%d frames)", len(frames)
            )
            return None if len(frames) < 2 else _pack({"ok": False, "error": "malformed request"})
        try:
            msg = _unpack(payload_frames[0])
            if not isinstance(msg, dict):
                raise TypeError(f"request must be a map, got {type(msg).__name__}")
        except Exception as exc:  # the peer's bytes, not our bug: one line, no traceback
            self._peer_log.warning(
                "unreadable", "side channel: unreadable request: %s: %s", type(exc).__name__, exc
            )
            return _pack({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        try:
            if self._secret is None:
                if "mac" in msg:
                    return _pack(
                        {
                            "ok": False,
                            "error": "this node runs without --kv-secret; its peers must too",
                        }
                    )
                reply = self._handler(msg)
                nonce = None
            else:
                msg, nonce, refused = self._open(msg)
                if refused is not None:
                    self.refused += 1
                    self._peer_log.warning(
                        "refused", "side channel: refusing a request: %s", refused["error"]
                    )
                    if nonce is not None:  # signed, but not a message: a signed refusal
                        return self._seal(refused, nonce)
                    self.refused_unauthenticated += 1
                    return _pack(refused)
                reply = self._handler(msg)
            if not isinstance(reply, dict):
                raise TypeError(f"handler returned {type(reply).__name__}, expected dict")
            return self._seal(reply, nonce)
        except Exception as exc:
            logger.warning("side channel handler failed: %r", exc, exc_info=True)
            return _pack({"ok": False, "error": f"{type(exc).__name__}: {exc}"})

    def _open(self, env: dict[str, Any]) -> tuple[Any, bytes | None, dict[str, Any] | None]:
        """(message, its nonce, None) for a valid signed envelope, else (None, None, why);
        (None, nonce, why) when it is authentic but its body is not a map."""
        assert self._secret is not None
        ts, nonce, body, mac = env.get("ts"), env.get("n"), env.get("body"), env.get("mac")
        if not (
            isinstance(ts, float)
            and isinstance(nonce, bytes)
            and len(nonce) == 16
            and isinstance(body, bytes)
            and isinstance(mac, bytes)
        ):
            return None, None, _unauthenticated("this node requires signed messages (--kv-secret)")
        if not hmac.compare_digest(mac, _request_mac(self._secret, ts, nonce, body)):
            return None, None, _unauthenticated("bad signature (is --kv-secret the same?)")
        if (why := self._replays.check(ts, nonce)) is not None:
            return None, None, _unauthenticated(why)
        try:
            msg = _unpack(body)
        except Exception as exc:  # a secret holder's garbage: one line, no traceback
            return None, nonce, {"ok": False, "error": f"unreadable body: {type(exc).__name__}"}
        if not isinstance(msg, dict):
            return (
                None,
                nonce,
                {"ok": False, "error": f"body must be a map, got {type(msg).__name__}"},
            )
        return msg, nonce, None

    def _seal(self, reply: dict[str, Any], nonce: bytes | None) -> bytes:
        if self._secret is None or nonce is None:
            return _pack(reply)
        body = _pack(reply)
        return _pack({"body": body, "mac": _reply_mac(self._secret, nonce, body)})

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket; returns within ~poll interval + handler time."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("side channel server thread did not stop within %.1fs", timeout)

    def __enter__(self) -> SideChannelServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SideChannelClient:
    """Request/reply client; one DEALER socket per request, closed afterwards."""

    def __init__(self, context: zmq.Context | None = None, secret: bytes | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self._secret = secret or None

    @property
    def signed(self) -> bool:
        """Requests are signed, and replies must be (``--kv-secret``)."""
        return self._secret is not None

    def request(self, address: str, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send ``msg`` to ``address`` and return the reply map.

        Raises ``SideChannelTimeout`` when no reply arrives within ``timeout`` seconds --
        ``SideChannelNotSent`` when no connection was made (nothing listens at
        ``address``, or its process is stopped): the request was not sent --, and
        ``SideChannelError`` on a reply that is not a msgpack map. An ``{"ok": False,
        ...}`` reply is returned, not raised.
        """
        nonce = os.urandom(16)
        payload_out = _pack(msg)
        if self._secret is not None:
            ts = time.time()
            payload_out = _pack(
                {
                    "ts": ts,
                    "n": nonce,
                    "body": payload_out,
                    "mac": _request_mac(self._secret, ts, nonce, payload_out),
                }
            )
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a bigger reply: a timeout
        # Do not queue the request for a peer that never connects; the timeout covers it.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        try:
            sock.connect(address)
            deadline = time.monotonic() + timeout
            # The request may wait for the connection; one deadline bounds both waits.
            if not sock.poll(_remaining_ms(deadline), zmq.POLLOUT):
                raise SideChannelNotSent(f"no connection to {address} within {timeout:.3f}s")
            sock.send(payload_out, zmq.NOBLOCK)
            if not sock.poll(_remaining_ms(deadline), zmq.POLLIN):
                raise SideChannelTimeout(f"no reply from {address} within {timeout:.3f}s")
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise SideChannelError(f"side channel request to {address} failed: {exc}") from exc
        finally:
            sock.close(linger=0)
        payload = [f for f in frames if f]
        try:
            reply = _unpack(payload[-1]) if payload else None
        except Exception as exc:
            raise SideChannelError(f"undecodable reply from {address}: {exc}") from exc
        if not isinstance(reply, dict):
            raise SideChannelError(f"reply from {address} is not a map: {type(reply).__name__}")
        if self._secret is not None:
            reply = self._open_reply(address, reply, nonce)
        return reply

    def _open_reply(self, address: str, env: dict[str, Any], nonce: bytes) -> dict[str, Any]:
        assert self._secret is not None
        body, mac = env.get("body"), env.get("mac")
        if not (isinstance(body, bytes) and isinstance(mac, bytes)):
            why = env.get("error") if env.get("ok") is False else "an unsigned reply"
            raise SideChannelError(f"{address} did not sign its reply: {why}")
        if not hmac.compare_digest(mac, _reply_mac(self._secret, nonce, body)):
            raise SideChannelError(f"reply from {address} has a bad signature")
        try:
            reply = _unpack(body)
        except Exception as exc:
            raise SideChannelError(f"undecodable reply from {address}: {exc}") from exc
        if not isinstance(reply, dict):
            raise SideChannelError(f"reply from {address} is not a map: {type(reply).__name__}")
        return reply
