"""UCXX transport for paged KV blocks: the same calls as ``NixlTransport``, on ``ucxx``.

Selected with ``--kv-transport ucxx`` (``pip install -e '.[ucxx]'``); ``ucxx`` is imported
only when a ``UcxxTransport`` is built, never when this module is imported.

Why tagged messages and not RMA
-------------------------------
UCX RMA (``ucp_put`` into the peer's registered KV memory with a packed rkey) would mirror
NIXL's WRITE exactly, and ``libucxx`` (C++) has it (``MemoryHandle``, ``RemoteKey``,
``memPut``), but the Python API of ``ucxx`` 0.52 does not expose it: ``ucxx._lib.libucxx``
has tag, stream and active-message calls only (``UCXWorker.tag_probe/tag_recv*``,
``UCXEndpoint.tag_send/am_send/stream_send``), no memory mapping, rkey or put. Active
messages are received per endpoint (``ep.am_recv``), so D would need an endpoint for every
inbound connection (a listener); tag receives are per worker, so D needs nothing from P.
Hence: **tagged send/receive into a bounce buffer that the receiver copies into its
reserved blocks.**

Protocol (one P rank -> one D rank, one WRITE)
----------------------------------------------
Each write is one 64-bit tag ``sender id (32 random bits per transport) << 32 | sequence``
and at most two messages with that tag, in order (UCX matches messages of one sender and
one tag in the order they were sent):

1. the header, a msgpack map ``{v, a, x, ts, n, nb, ids, h}``: protocol version, sender
   name, sequence, the sender's wall-clock time, the notification bytes, the data bytes
   that follow, D's block ids, and the head slice ``[first, count]`` of each (block,
   layer, kv) unit or null for whole blocks;
2. the data (absent when ``nb`` is 0): the blocks or head slices in ``ids`` order. P sends
   straight out of its KV cache when the blocks are one contiguous run of whole blocks,
   else it first gathers them into a staging buffer (one ``index_select``).

D's ``get_notifs`` (the worker's step thread) probes the worker for any message
(``tag_probe(remove=True)``), receives a tag's first message as its header and its second
into a staging buffer of the probed length, and when both are in validates the header
against its own cache (ids in range and distinct, slice inside its heads, ``nb`` equal to
what they describe), asks the worker's ``write_gate`` whether the reservation the
notification names owns those blocks and still waits for them on this rank (a nonce no
step named yet waits for that step, within the write's timeout; any other write is
dropped: before, D copied first and the worker checked the nonce after, so a stray or
forged write overwrote whichever request held the blocks), copies the data into the
blocks (``index_copy_``) and only then returns the notification. So **the notification is delivered after the data, by
construction**: D itself puts the data in place before it hands the notif to the worker.
A write whose data has not come within ``xfer_timeout_s`` of its header, or that was sent
more than ``xfer_timeout_s`` ago by the sender's clock (P gave up on it by then; this
assumes host clocks within that of each other, as NTP keeps them), is dropped without a
notif, and the connector's deadlines end the transfer. D's KV memory is written only by
D's own step thread, never by UCX, and never for a write that old, so a stalled message
cannot land in a block after its quarantine ended.

Progress: one thread per transport, ``ucxx``'s C++ progress thread
-------------------------------------------------------------------
``UCXWorker.start_progress_thread(polling_mode=False, epoll_timeout=1)``: a C++ thread that
progresses UCX in blocking mode (epoll, 1 ms wake-up like ``ucxx``'s own thread mode) and
never takes the GIL. Every Python call stays on the caller's thread (the worker's step
thread): ``write_blocks`` posts the sends, ``poll`` reads the requests' completion flags,
``get_notifs`` probes, posts receives and copies completed data into place. UCX moves
bytes in the background (rendezvous, wire-up, keepalive) whether or not the step thread is
in a call. The price against NIXL's one-sided WRITE: D posts its receive of a write's data
at its next ``get_notifs`` after the header arrived, and copies the data into place at the
one after the data completed, so a push costs D one more ``get_notifs`` (the worker polls
every 0.5 ms between steps while it expects KV, and once per step) and one copy of the
bytes on each side that had to stage (P: not for one run of whole blocks; D: always). The worker is created with ``UCS_THREAD_MODE_MULTI``
(``ucxx``'s default), so calls from the step thread and the progress thread are safe.

Failures: endpoints are created with error handling, so a peer that died fails its sends
(``poll`` -> ``"error"``); every write carries a deadline (a peer that hangs leaves a
rendezvous pending forever), past it ``poll`` says ``"error"`` (``error == "timeout"``).
``ucxx`` has no per-request cancel, so ``release`` of a write that has not finished closes
the peer's endpoint (``close_blocking``: it cancels everything in flight to it, within
100 ms even when the peer hangs; the connector evicts a peer whose write failed anyway)
and writes to that peer fail at once until ``add_peer`` re-adds it, as they do once UCX
reports the peer failed; buffers UCX may still read are kept until their requests
complete or the transport closes. (``UCXEndpoint.close()`` crashes the process when the
peer already died, ``ucxx`` 0.52; it is not used.)

Environment: importing ``ucxx`` sets ``UCX_MEMTYPE_CACHE``, ``UCX_RNDV_THRESH`` and
``UCX_RNDV_FRAG_MEM_TYPE`` in ``os.environ`` for the whole process; this module restores
the environment right after the import, so NIXL agents in the same process and child
processes see the user's UCX settings only. ``UCX_TLS`` / ``UCX_NET_DEVICES`` apply to the
``ucxx`` context as to NIXL's.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from kvconnector.nixl.transport_common import (
    DONE,
    ERROR,
    TransferHandle,
    TransportBase,
)

logger = logging.getLogger(__name__)

LIBRARY = "ucxx"
PROTOCOL = 1
_HEADER_MAX = 64 << 20  # a header larger than this is refused unread
_POOL_MAX_BYTES = 512 << 20  # staging buffers kept for reuse, per transport
_POOL_MIN_BUCKET = 64 << 10
_PROBES_PER_CALL = 1024  # messages taken from UCX per get_notifs call, at most
_CLOSE_PERIOD_NS = 100_000_000  # how long closing an endpoint waits for UCX
# UCX settings of this transport's context unless the environment sets them (UCX_<name>):
# endpoints need peer-failure handling, and without this UCX 1.21 leaves the shared-memory
# transports out of such endpoints: same-host pushes then crawl over tcp/lo (0.3-0.5 GB/s
# here instead of 3-4.6 GB/s over sysv/posix).
UCX_OPTIONS = {"MM_ERROR_HANDLING": "y"}

_ucx: Any = None  # ucxx._lib.libucxx, once imported
_Array: Any = None  # ucxx._lib.arr.Array
_import_lock = threading.Lock()


def ucxx_available() -> bool:
    """True when ``ucxx`` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("ucxx") is not None
    except (ImportError, ValueError):
        return False


class UcxxTransportError(RuntimeError):
    """Setup of the transport or of a peer failed."""


def _load_ucxx() -> Any:
    """Import ``ucxx`` once, leaving ``os.environ`` as it was (see the module docstring)."""
    global _ucx, _Array
    with _import_lock:
        if _ucx is None:
            saved = {k: v for k, v in os.environ.items() if k.startswith("UCX")}
            try:
                import ucxx._lib.libucxx as ucx
                from ucxx._lib.arr import Array
            except ImportError as exc:
                raise UcxxTransportError(
                    "the ucxx transport needs ucxx: pip install -e '.[ucxx]' "
                    "(or start the node with --kv-transport nixl)"
                ) from exc
            finally:
                for key in [k for k in os.environ if k.startswith("UCX") and k not in saved]:
                    del os.environ[key]
                os.environ.update(saved)
            _ucx, _Array = ucx, Array
    return _ucx


def _wide(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor's last (contiguous) dim as the widest integer word that divides it:
    torch's ``index_select``/``index_copy_`` move uint8 rows ~7x slower than int64 rows."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if t.shape[-1] % size == 0 and t.storage_offset() % size == 0:
            return t.view(dtype)
    return t


def _np_bytes(t: torch.Tensor) -> Any:
    """A 1-D uint8 view UCX can send from or receive into (no copy)."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


@dataclass
class _Peer:
    agent_name: str
    num_blocks: int
    ep: Any
    heads: tuple[int, int, int] | None  # (local first, remote first, count) or whole blocks
    unit_bytes: int  # bytes per (block, layer, kv) unit (slices) or per block
    stride: int = 1  # descriptors per block: 1, or layers x 2 for a head slice
    broken: str | None = None  # why writes to this peer fail until it is re-added


@dataclass
class _Xfer:
    """What a write keeps alive while UCX may read it."""

    peer_key: str
    reqs: list[Any]
    buffers: list[Any] = field(default_factory=list)
    staging: torch.Tensor | None = None


@dataclass
class _Rx:
    """One incoming write on D: its header, then its data."""

    tag: int
    started: float
    hdr_buf: Any = None
    hdr_len: int = 0
    hdr_req: Any = None
    header: dict[str, Any] | None = None
    data_req: Any = None
    staging: torch.Tensor | None = None
    data_len: int = 0
    error: str | None = None


class _StagingPool:
    """Reusable 1-D uint8 buffers in power-of-two buckets, on the KV cache's device."""

    def __init__(self, device: torch.device, max_bytes: int = _POOL_MAX_BYTES) -> None:
        self.device = device
        self.max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._bytes = 0

    @staticmethod
    def _bucket(n: int) -> int:
        return max(_POOL_MIN_BUCKET, 1 << max(0, n - 1).bit_length())

    def get(self, n: int) -> torch.Tensor:
        bucket = self._bucket(n)
        free = self._free.get(bucket)
        if free:
            buf = free.pop()
            self._bytes -= bucket
        else:
            buf = torch.empty(bucket, dtype=torch.uint8, device=self.device)
        return buf[:n]

    def put(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        bucket = base.numel()
        if bucket != self._bucket(bucket) or self._bytes + bucket > self.max_bytes:
            return
        self._free.setdefault(bucket, []).append(base)
        self._bytes += bucket

    def clear(self) -> None:
        self._free.clear()
        self._bytes = 0


def _req_state(req: Any) -> tuple[bool, str | None]:
    """(completed, error) of a ucxx request, without raising."""
    if not req.completed:
        return False, None
    try:
        req.check_error()
    except Exception as exc:
        return True, f"{type(exc).__name__}: {exc}"
    return True, None


class UcxxTransport(TransportBase):
    """Pushes KV blocks of one TP rank into a peer's reserved blocks with UCXX tagged
    messages; the same calls and stats as ``NixlTransport``."""

    KIND = "UCXX"
    ERROR_CLS = UcxxTransportError

    def __init__(
        self,
        agent_name: str,
        kv_cache: torch.Tensor,
        block_bytes: int,
        *,
        xfer_timeout_s: float = 60.0,
        num_layers: int | None = None,
        num_heads: int | None = None,
    ) -> None:
        ucx = _load_ucxx()
        self._init_common(agent_name, kv_cache, block_bytes, xfer_timeout_s, num_layers, num_heads)
        num_blocks = self.num_blocks
        self._kv_blocks = kv_cache.view(torch.uint8).view(num_blocks, block_bytes)
        self._pool = _StagingPool(kv_cache.device)
        self._lingering: list[_Xfer] = []  # released before UCX was done with them
        self._notif_sends: list[_Xfer] = []  # data-less notifications in flight
        self._rx: dict[int, _Rx] = {}  # incoming writes by tag, oldest first
        self._discards: list[tuple[Any, Any]] = []  # (request, buffer) of refused messages
        self._ready: list[bytes] = []
        self._sender_id = random.getrandbits(32) or 1
        self._seq = 0
        # D: asked before a write's data goes into the blocks (notification bytes, block
        # ids): True write it, False drop it, None not yet (asked again, within the
        # write's timeout). The worker sets it; None: every valid write is placed.
        self.write_gate: Callable[[bytes, list[int]], bool | None] | None = None
        self.writes_dropped = 0  # incoming writes dropped without a notification

        options = {k: v for k, v in UCX_OPTIONS.items() if f"UCX_{k}" not in os.environ}
        self._ctx = ucx.UCXContext(options, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        self._worker = ucx.UCXWorker(self._ctx)
        if self.mem_type == "VRAM":
            from ucxx._cuda_context import ensure_cuda_context

            self._worker.set_progress_thread_start_callback(
                ensure_cuda_context, cb_args=(self.device_id,)
            )
        self._worker.start_progress_thread(polling_mode=False, epoll_timeout=1)
        self._address: bytes = self._worker.address.tobytes()
        logger.info(
            "UCXX transport %s: %d blocks x %d bytes (%s:%d), UCX %s",
            agent_name,
            num_blocks,
            block_bytes,
            self.mem_type,
            self.device_id,
            ".".join(map(str, ucx.get_ucx_version())),
        )

    # ------------------------------------------------------------------ peers

    def metadata(self) -> dict[str, Any]:
        """What a peer needs for ``add_peer``; msgpack-able."""
        return {**self._common_metadata(), "library": LIBRARY, "worker_address": self._address}

    def add_peer(
        self,
        peer_key: str,
        peer_meta: dict[str, Any],
        heads: tuple[int, int, int] | None = None,
    ) -> None:
        """Connect an endpoint to the peer's worker, once.

        ``heads=(local_first, remote_first, count)``: writes to this peer move only that
        head range of each (block, layer, kv) -- rank-local head indices on each side --
        instead of whole blocks (heterogeneous TP)."""
        with self._lock:
            self._check_open()
            library = peer_meta.get("library", "nixl")
            if library != LIBRARY:
                raise ValueError(
                    f"peer {peer_key} uses the {library} transport, this rank uses {LIBRARY} "
                    "(--kv-transport must be the same on both nodes)"
                )
            self._check_new_peer(peer_key, peer_meta, heads)
            name = str(peer_meta.get("agent_name", ""))
            try:
                address = _ucx.UCXAddress.create_from_buffer(bytes(peer_meta["worker_address"]))
                ep = self._worker.create_endpoint_from_worker_address(address, True)
            except Exception as exc:
                raise UcxxTransportError(f"connecting to peer {peer_key}: {exc!r}") from exc
            if heads is None:
                peer = _Peer(name, int(peer_meta["num_blocks"]), ep, None, self.block_bytes)
            else:
                stride = 2 * int(peer_meta["num_layers"])
                peer = _Peer(
                    name,
                    int(peer_meta["num_blocks"]),
                    ep,
                    tuple(int(h) for h in heads),  # type: ignore[arg-type]
                    heads[2] * self.head_bytes,
                    stride,
                )
            self._peers[peer_key] = peer
            logger.info("UCXX peer %s added (agent %s, %d blocks)", peer_key, name, peer.num_blocks)

    def _drop_peer(self, peer_key: str, peer: _Peer) -> None:
        """Its endpoint (``remove_peer``, its writes released)."""
        self._close_ep(peer, "removed")

    def _close_ep(self, peer: _Peer, why: str) -> None:
        if peer.ep is None:
            return
        ep, peer.ep = peer.ep, None
        peer.broken = peer.broken or why
        try:
            # Cancels what is in flight on it; returns within ~the period even when the
            # peer hangs. (``ep.close()`` crashes on an endpoint whose peer died.)
            ep.close_blocking(period=_CLOSE_PERIOD_NS, max_attempts=1)
        except Exception as exc:
            logger.warning("closing the UCXX endpoint of %s failed: %r", peer.agent_name, exc)

    # -------------------------------------------------------------- transfers

    def write_blocks(
        self,
        peer_key: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes = b"",
        *,
        timeout_s: float | None = None,
    ) -> TransferHandle:
        """Write local blocks into the peer's blocks, pairwise; ``notif`` arrives after.

        Raises ``KeyError`` for an unknown peer and ``ValueError`` for bad block ids.
        Transport failures never raise: they give a handle whose ``poll`` is "error".
        With no blocks, ``notif`` (if any) is sent alone.
        """
        with self._lock:
            peer, runs = self._write_peer(peer_key, local_block_ids, remote_block_ids)
            num_blocks = len(local_block_ids)
            handle = self._new_handle(
                peer_key,
                num_blocks,
                # contiguous byte ranges moved: what NIXL would post as descriptors
                len(runs) if peer.heads is None else num_blocks * peer.stride,
                num_blocks * peer.stride * peer.unit_bytes,
                timeout_s,
            )
            if num_blocks == 0 and not notif:
                self._finish(handle, DONE)
                return handle
            if peer.ep is None or not peer.ep.alive:
                why = peer.broken or "UCX reported the peer failed"
                self._finish(handle, ERROR, f"peer endpoint closed: {why}")
                return handle
            try:
                xfer = self._post(peer_key, peer, local_block_ids, remote_block_ids, notif)
            except Exception as exc:
                logger.warning("UCXX write to %s not posted: %r", peer_key, exc)
                self._finish(handle, ERROR, f"send: {exc!r}")
                return handle
            handle._xfer = xfer
            self._live[id(handle)] = handle
            self._check(handle)
            return handle

    def _post(
        self,
        peer_key: str,
        peer: _Peer,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        notif: bytes,
    ) -> _Xfer:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        tag = _ucx.UCXXTag((self._sender_id << 32) | self._seq)
        n = len(local_ids)
        nbytes = n * peer.stride * peer.unit_bytes
        header = msgpack.packb(
            {
                "v": PROTOCOL,
                "a": self.agent_name,
                "ts": time.time(),
                "x": self._seq,
                "n": bytes(notif),
                "nb": nbytes,
                "ids": [int(i) for i in remote_ids],
                "h": None if peer.heads is None else [peer.heads[1], peer.heads[2]],
            },
            use_bin_type=True,
        )
        hdr = np.frombuffer(header, dtype=np.uint8)
        xfer = _Xfer(peer_key, [], [hdr])
        xfer.reqs.append(peer.ep.tag_send(_Array(hdr), tag))
        if n == 0:
            return xfer
        first = int(local_ids[0])
        if peer.heads is None and list(local_ids) == list(range(first, first + n)):
            data = self._kv_blocks[first : first + n]  # one run: straight from the cache
        else:
            data = xfer.staging = self._pool.get(nbytes)
            ids = torch.as_tensor(list(local_ids), dtype=torch.long, device=data.device)
            if peer.heads is None:
                out = _wide(data.view(n, self.block_bytes))
                torch.index_select(_wide(self._kv_blocks), 0, ids, out=out)
            else:
                src = _wide(self._unit_view(self._kv_blocks, self.num_heads))
                first_head, count = peer.heads[0], peer.heads[2]
                out = _wide(data.view(n, peer.stride, count, self.head_bytes))
                torch.index_select(src[:, :, first_head : first_head + count], 0, ids, out=out)
            if data.device.type == "cuda":
                torch.cuda.current_stream(data.device).synchronize()  # UCX reads it next
        buf = _np_bytes(data)
        xfer.buffers.append(buf)
        xfer.reqs.append(peer.ep.tag_send(_Array(buf), tag))
        return xfer

    def _unit_view(self, blocks: torch.Tensor, heads: int | None) -> torch.Tensor:
        assert self.num_layers is not None and heads
        return blocks.view(-1, 2 * self.num_layers, heads, self.head_bytes)

    def _check(self, handle: TransferHandle) -> None:
        xfer: _Xfer = handle._xfer
        done = True
        for req in xfer.reqs:
            completed, error = _req_state(req)
            if error is not None:
                logger.warning("UCXX write to %s failed: %s", handle.peer_key, error)
                self._finish(handle, ERROR, error)
                peer = self._peers.get(handle.peer_key)
                if peer is not None:  # writes to it fail at once until it is re-added
                    self._close_ep(peer, f"a write failed: {error}")
                return
            done = done and completed
        if done:
            self._finish(handle, DONE)
        else:
            self._timed_out(handle)

    def _release_locked(self, handle: TransferHandle, peer: _Peer | None) -> None:
        """Forget the write; one UCX has not finished closes the peer's endpoint (there is
        no per-request cancel), so the peer must be re-added."""
        xfer = self._take_xfer(handle)
        if xfer is None:
            return
        if all(req.completed for req in xfer.reqs):
            self._recycle(xfer)
            return
        if peer is not None:
            logger.warning(
                "UCXX write to %s released unfinished: closing its endpoint", handle.peer_key
            )
            self._close_ep(peer, f"a write was released unfinished ({handle.error})")
        self._lingering.append(xfer)

    def _recycle(self, xfer: _Xfer) -> None:
        if xfer.staging is not None:
            self._pool.put(xfer.staging)
            xfer.staging = None
        xfer.buffers.clear()

    def _reap(self) -> None:
        """Drop buffers of released writes and refused messages UCX is done with."""
        if self._lingering:
            still = []
            for xfer in self._lingering:
                if all(req.completed for req in xfer.reqs):
                    self._recycle(xfer)
                else:
                    still.append(xfer)
            self._lingering = still
        self._notif_sends = [x for x in self._notif_sends if not all(r.completed for r in x.reqs)]
        self._discards = [(r, b) for r, b in self._discards if not r.completed]

    # ---------------------------------------------------------- notifications

    def send_notif(self, peer_key: str, msg: bytes) -> bool:
        """Send a data-less notification; False if the peer is unknown or unreachable."""
        with self._lock:
            peer = self._peers.get(peer_key)
            if peer is None or self._closed or peer.ep is None or not peer.ep.alive:
                logger.warning("UCXX notif to unreachable peer %s dropped", peer_key)
                return False
            try:
                xfer = self._post(peer_key, peer, [], [], msg)
            except Exception as exc:
                logger.warning("UCXX notif to %s failed: %r", peer_key, exc)
                return False
            self._notif_sends.append(xfer)
            return True

    def get_notifs(self) -> list[bytes]:
        """Notifications of writes whose data is in place, from any peer, oldest first."""
        with self._lock:
            if self._closed:
                return []
            try:
                self._take_messages()
                self._advance()
            except Exception as exc:  # never raise into the worker's step
                logger.warning("UCXX receive failed: %r", exc)
            self._reap()
            out, self._ready = self._ready, []
            return out

    def _take_messages(self) -> None:
        ucx = _ucx
        any_tag, any_mask = ucx.UCXXTag(0), ucx.UCXXTagMask(0)
        for _ in range(_PROBES_PER_CALL):
            probe = self._worker.tag_probe(any_tag, any_mask, remove=True)
            if not probe.matched:
                return
            tag, length = int(probe.sender_tag.value), int(probe.length)
            rx = self._rx.get(tag)
            if rx is None and length <= _HEADER_MAX:  # a write's first message: its header
                rx = _Rx(tag, time.monotonic(), np.empty(max(length, 1), np.uint8), length)
                rx.hdr_req = self._worker.tag_recv_with_handle(_Array(rx.hdr_buf), probe)
                self._rx[tag] = rx
            elif (
                rx is not None
                and rx.data_req is None
                and rx.error is None
                and 0 < length <= self.num_blocks * self.block_bytes
            ):  # its second: the data, checked against the header once both are in
                rx.staging = self._pool.get(length)
                rx.data_len = length
                rx.data_req = self._worker.tag_recv_with_handle(
                    _Array(_np_bytes(rx.staging)), probe
                )
            else:
                self._discard(probe, tag, length, rx)

    def _discard(self, probe: Any, tag: int, length: int, rx: _Rx | None) -> None:
        """Consume a message nobody expects (a 1-byte receive: UCX truncates it)."""
        logger.warning("UCXX: dropping an unexpected %d-byte message (tag %x)", length, tag)
        if rx is not None and rx.error is None:
            rx.error = f"unexpected {length}-byte message"
        buf = np.empty(1, np.uint8)
        self._discards.append((self._worker.tag_recv_with_handle(_Array(buf), probe), buf))

    def _advance(self) -> None:
        now = time.monotonic()
        for tag, rx in list(self._rx.items()):
            if rx.header is None and rx.error is None:
                completed, error = _req_state(rx.hdr_req)
                if error is not None:
                    rx.error = f"header: {error}"
                elif completed:
                    rx.header, rx.error = self._parse_header(rx.hdr_buf[: rx.hdr_len].tobytes())
            if rx.error is not None:
                self._drop(tag, rx, rx.error)
                continue
            if rx.header is not None and rx.header["nb"] == 0:
                self._ready.append(rx.header["n"])
                del self._rx[tag]
                continue
            if rx.header is not None and rx.data_req is not None:
                completed, error = _req_state(rx.data_req)
                if error is not None:
                    self._drop(tag, rx, f"data: {error}")
                    continue
                verdict = self._gate(rx.header) if completed else None
                if verdict is False:
                    self._drop(tag, rx, "no reservation of this rank owns those blocks")
                    continue
                if verdict:
                    error = self._place(rx)
                    if error is not None:
                        self._drop(tag, rx, error)
                        continue
                    self._ready.append(rx.header["n"])
                    self._pool.put(rx.staging)  # type: ignore[arg-type]
                    del self._rx[tag]
                    continue
            if now - rx.started > self.xfer_timeout_s:
                self._drop(tag, rx, f"data not received within {self.xfer_timeout_s:.1f}s")

    def _gate(self, header: dict[str, Any]) -> bool | None:
        """``write_gate``'s verdict on a write whose data is in (True when unset)."""
        if self.write_gate is None:
            return True
        try:
            return self.write_gate(header["n"], header["ids"])
        except Exception as exc:  # never raise into the worker's step
            logger.warning("UCXX: write gate failed: %r", exc)
            return False

    def _drop(self, tag: int, rx: _Rx, why: str) -> None:
        logger.warning("UCXX: incoming write %x dropped, no notification: %s", tag, why)
        self.writes_dropped += 1
        del self._rx[tag]
        for req, buf in ((rx.hdr_req, rx.hdr_buf), (rx.data_req, rx.staging)):
            if req is not None and not req.completed:  # UCX may still write it: keep it
                self._discards.append((req, buf))
            elif buf is rx.staging and buf is not None:
                self._pool.put(buf)

    def _parse_header(self, raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
        try:
            h = msgpack.unpackb(raw, raw=False)
            if not isinstance(h, dict) or h.get("v") != PROTOCOL:
                return None, f"not a protocol-{PROTOCOL} header"
            notif, nb, ids, heads, sent = h["n"], h["nb"], h["ids"], h["h"], h["ts"]
        except Exception as exc:
            return None, f"malformed header: {exc!r}"
        if not isinstance(notif, bytes) or not isinstance(nb, int) or not isinstance(ids, list):
            return None, "malformed header fields"
        if not isinstance(sent, (int, float)):
            return None, "malformed header time"
        if not all(isinstance(i, int) and 0 <= i < self.num_blocks for i in ids):
            return None, f"block ids out of range (this rank has {self.num_blocks})"
        if len(set(ids)) != len(ids):
            return None, "repeated block ids"
        if heads is None:
            expect = len(ids) * self.block_bytes
        else:
            ok = (
                isinstance(heads, list)
                and len(heads) == 2
                and all(isinstance(x, int) for x in heads)
                and self.head_bytes > 0
                and self.num_heads is not None
                and heads[1] >= 1
                and heads[0] >= 0
                and heads[0] + heads[1] <= self.num_heads
            )
            if not ok:
                return None, f"head slice {heads!r} out of this rank's heads"
            assert self.num_layers is not None
            expect = len(ids) * 2 * self.num_layers * heads[1] * self.head_bytes
        if nb != expect:
            return None, f"{nb} data bytes announced, the blocks hold {expect}"
        return {"n": notif, "nb": nb, "ids": ids, "h": heads, "ts": float(sent)}, None

    def _place(self, rx: _Rx) -> str | None:
        """Copy a write's data from its staging buffer into the blocks it names."""
        header = rx.header
        assert header is not None and rx.staging is not None
        if rx.data_len != header["nb"]:
            return f"{rx.data_len} data bytes received, the header said {header['nb']}"
        age = time.time() - header["ts"]
        if age > self.xfer_timeout_s:  # the sender gave up on it long ago
            return f"sent {age:.1f}s ago, more than the {self.xfer_timeout_s:.1f}s deadline"
        ids = torch.as_tensor(header["ids"], dtype=torch.long, device=self._kv_cache.device)
        n = len(header["ids"])
        if header["h"] is None:
            _wide(self._kv_blocks).index_copy_(0, ids, _wide(rx.staging.view(n, self.block_bytes)))
        else:
            first, count = header["h"]
            dst = _wide(self._unit_view(self._kv_blocks, self.num_heads))[
                :, :, first : first + count
            ]
            units = 2 * (self.num_layers or 0)
            dst.index_copy_(0, ids, _wide(rx.staging.view(n, units, count, self.head_bytes)))
        if rx.staging.device.type == "cuda":
            torch.cuda.current_stream(rx.staging.device).synchronize()  # before reuse
        return None

    # -------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Fail and forget all writes, close all endpoints, stop the progress thread."""
        with self._lock:
            if self._closed:
                return
            for key in list(self._peers):
                self.remove_peer(key)
            for handle in list(self._live.values()):
                self._release_locked(handle, None)
            self._closed = True
            try:
                self._worker.cancel_inflight_requests()
            except Exception as exc:
                logger.warning("UCXX cancel at close failed: %r", exc)
            try:
                self._worker.stop_progress_thread()
            except Exception as exc:
                logger.warning("stopping the UCXX progress thread failed: %r", exc)
            self._rx.clear()
            self._lingering.clear()
            self._discards.clear()
            self._notif_sends.clear()
            self._pool.clear()
            self._worker = None
            self._ctx = None
            logger.info("UCXX transport %s closed", self.agent_name)
