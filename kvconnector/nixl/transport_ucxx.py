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
Each write is one tag and at most two messages with it, a header (msgpack) and the data
(``ucxx_wire.py`` has the format). P sends the data straight out of its KV cache when the
blocks are one contiguous run of whole blocks, else it first gathers them into a staging
buffer (one ``index_select``).

D's ``get_notifs`` (the worker's step thread) receives, validates, asks the worker's
``write_gate`` and copies each write's data into the blocks before it returns the
notification (``ucxx_receive.py``): **the notification is delivered after the data, by
construction**, and D's KV memory is written only by D's own step thread, never by UCX.

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

Environment: importing ``ucxx`` changes UCX variables in ``os.environ``; ``ucxx_lib.py``
restores them.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvconnector.nixl.transport_common import (
    DONE,
    ERROR,
    TransferHandle,
    TransportBase,
)
from kvconnector.nixl.ucxx_lib import (
    StagingPool,
    UcxxTransportError,
    load_ucxx,
    np_bytes,
    req_state,
    ucxx_available,
    unit_view,
    wide,
)
from kvconnector.nixl.ucxx_receive import UcxxReceiver
from kvconnector.nixl.ucxx_wire import BlockLayout, pack_header, write_tag

__all__ = ["LIBRARY", "UCX_OPTIONS", "UcxxTransport", "UcxxTransportError", "ucxx_available"]

logger = logging.getLogger(__name__)

LIBRARY = "ucxx"
_CLOSE_PERIOD_NS = 100_000_000  # how long closing an endpoint waits for UCX
# UCX settings of this transport's context unless the environment sets them (UCX_<name>):
# endpoints need peer-failure handling, and without this UCX 1.21 leaves the shared-memory
# transports out of such endpoints: same-host pushes then crawl over tcp/lo (0.3-0.5 GB/s
# here instead of 3-4.6 GB/s over sysv/posix).
UCX_OPTIONS = {"MM_ERROR_HANDLING": "y"}


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
        ucx, self._Array = load_ucxx()
        self._ucx = ucx
        self._init_common(agent_name, kv_cache, block_bytes, xfer_timeout_s, num_layers, num_heads)
        num_blocks = self.num_blocks
        self._kv_blocks = kv_cache.view(torch.uint8).view(num_blocks, block_bytes)
        self._pool = StagingPool(kv_cache.device)
        self._lingering: list[_Xfer] = []  # released before UCX was done with them
        self._notif_sends: list[_Xfer] = []  # data-less notifications in flight
        self._sender_id = random.getrandbits(32) or 1
        self._seq = 0

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
        layout = BlockLayout(
            num_blocks, block_bytes, self.num_layers, self.num_heads, self.head_bytes
        )
        # D's side: incoming writes, placed before their notifications are handed on.
        self._receiver = UcxxReceiver(
            self._worker, self._pool, self._kv_blocks, layout, xfer_timeout_s
        )
        logger.info(
            "UCXX transport %s: %d blocks x %d bytes (%s:%d), UCX %s",
            agent_name,
            num_blocks,
            block_bytes,
            self.mem_type,
            self.device_id,
            ".".join(map(str, ucx.get_ucx_version())),
        )

    @property
    def write_gate(self) -> Callable[[bytes, list[int]], bool | None] | None:
        """D: asked before a write's data goes into the blocks (notification bytes, block
        ids): True write it, False drop it, None not yet (asked again, within the write's
        timeout). The worker sets it; None: every valid write is placed."""
        return self._receiver.write_gate

    @write_gate.setter
    def write_gate(self, gate: Callable[[bytes, list[int]], bool | None] | None) -> None:
        self._receiver.write_gate = gate

    @property
    def writes_dropped(self) -> int:
        """Incoming writes dropped without a notification."""
        return self._receiver.writes_dropped

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
                address = self._ucx.UCXAddress.create_from_buffer(
                    bytes(peer_meta["worker_address"])
                )
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
        tag = self._ucx.UCXXTag(write_tag(self._sender_id, self._seq))
        n = len(local_ids)
        nbytes = n * peer.stride * peer.unit_bytes
        heads = None if peer.heads is None else (peer.heads[1], peer.heads[2])
        header = pack_header(self.agent_name, self._seq, notif, nbytes, remote_ids, heads)
        hdr = np.frombuffer(header, dtype=np.uint8)
        xfer = _Xfer(peer_key, [], [hdr])
        xfer.reqs.append(peer.ep.tag_send(self._Array(hdr), tag))
        if n == 0:
            return xfer
        first = int(local_ids[0])
        if peer.heads is None and list(local_ids) == list(range(first, first + n)):
            data = self._kv_blocks[first : first + n]  # one run: straight from the cache
        else:
            data = xfer.staging = self._pool.get(nbytes)
            ids = torch.as_tensor(list(local_ids), dtype=torch.long, device=data.device)
            if peer.heads is None:
                out = wide(data.view(n, self.block_bytes))
                torch.index_select(wide(self._kv_blocks), 0, ids, out=out)
            else:
                blocks = unit_view(
                    self._kv_blocks, self.num_layers, self.num_heads, self.head_bytes
                )
                src = wide(blocks)
                first_head, count = peer.heads[0], peer.heads[2]
                out = wide(data.view(n, peer.stride, count, self.head_bytes))
                torch.index_select(src[:, :, first_head : first_head + count], 0, ids, out=out)
            if data.device.type == "cuda":
                torch.cuda.current_stream(data.device).synchronize()  # UCX reads it next
        buf = np_bytes(data)
        xfer.buffers.append(buf)
        xfer.reqs.append(peer.ep.tag_send(self._Array(buf), tag))
        return xfer

    def _check(self, handle: TransferHandle) -> None:
        xfer: _Xfer = handle._xfer
        done = True
        for req in xfer.reqs:
            completed, error = req_state(req)
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
        self._receiver.reap()

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
            out = self._receiver.receive()
            self._reap()
            return out

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
            self._receiver.clear()
            self._lingering.clear()
            self._notif_sends.clear()
            self._pool.clear()
            self._worker = None
            self._ctx = None
            logger.info("UCXX transport %s closed", self.agent_name)
