"""What every KV transport shares (``transport.py``: NIXL; ``transport_ucxx.py``: UCXX):
the transfer handle and counters, the checks a peer's metadata and a write's block runs
must pass, and ``TransportBase``, the peer bookkeeping both build on.

A transport subclass calls ``_init_common`` first in its constructor (the registered
cache's geometry, the lock, the peer and handle tables, the counters), names itself in
``KIND`` (log lines) and ``ERROR_CLS`` (what a closed transport raises), and provides the
library's parts: ``_check(handle)`` (advance a posted write, ``_finish`` it when it ended),
``_release_locked(handle, peer)``, ``_drop_peer(peer_key, peer)`` and ``close``. Its
peers have ``agent_name`` and ``num_blocks``. ``poll``, ``remove_peer``, ``has_peer``,
the metadata's common part and a write's checks and handle are this class's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvconnector.nixl.block_runs import BlockRun, block_runs

logger = logging.getLogger(__name__)

DONE = "done"
PENDING = "pending"
ERROR = "error"


@dataclass
class TransferHandle:
    """One WRITE issued by :meth:`NixlTransport.write_blocks`."""

    peer_key: str
    num_blocks: int
    num_descriptors: int
    num_bytes: int
    started_at: float
    deadline: float | None
    state: str = PENDING
    error: str | None = None
    finished_at: float | None = None
    # Descriptor count NIXL reports after completion (only with telemetry enabled).
    nixl_desc_count: int | None = None
    _xfer: Any = field(default=None, repr=False)

    @property
    def duration_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started_at


@dataclass
class TransportStats:
    transfers_started: int = 0
    transfers_done: int = 0
    transfers_failed: int = 0
    bytes_written: int = 0  # bytes of transfers that completed
    blocks_written: int = 0
    descriptors_total: int = 0  # over all started transfers
    write_seconds: float = 0.0  # posted -> completion seen, summed over completed transfers
    last_descriptors: int = 0


def check_head_slice(
    local: Any, peer_key: str, meta: dict[str, Any], heads: tuple[int, int, int]
) -> None:
    """``ValueError`` unless ``heads=(local_first, remote_first, count)`` fits both this
    rank's geometry (``local``: ``head_bytes``, ``num_layers``, ``num_heads``) and the
    peer's metadata -- shared by every transport that writes head slices."""
    local_first, remote_first, count = heads
    if not local.head_bytes:
        raise ValueError("head slices need num_layers and num_heads at construction")
    layers, peer_heads = meta.get("num_layers"), meta.get("num_heads")
    if layers != local.num_layers or not isinstance(peer_heads, int) or peer_heads < 1:
        raise ValueError(f"peer {peer_key}: layers {layers} / heads {peer_heads} do not fit")
    if int(meta["block_bytes"]) != local.head_bytes * 2 * layers * peer_heads:
        raise ValueError(f"peer {peer_key}: its heads are not the size of this node's")
    if count < 1 or local_first < 0 or local_first + count > local.num_heads:
        raise ValueError(f"local heads {local_first}+{count} out of {local.num_heads}")
    if remote_first < 0 or remote_first + count > peer_heads:
        raise ValueError(f"peer {peer_key}: heads {remote_first}+{count} out of {peer_heads}")


def check_runs(runs: list[BlockRun], local_limit: int, remote_limit: int) -> None:
    """Ids grow by one inside a run, so a run's last id is its largest."""
    for src, dst, length in runs:
        if src + length > local_limit or dst + length > remote_limit:
            raise ValueError(
                f"block run {src}..{src + length - 1} -> {dst}..{dst + length - 1} out of "
                f"range (local {local_limit}, remote {remote_limit} blocks)"
            )


class TransportBase:
    KIND = "KV"
    ERROR_CLS: type[Exception] = RuntimeError

    agent_name: str
    num_blocks: int
    block_bytes: int
    head_bytes: int
    num_layers: int | None
    num_heads: int | None
    xfer_timeout_s: float
    mem_type: str
    device_id: int
    stats: TransportStats
    _peers: dict[str, Any]
    _live: dict[int, TransferHandle]
    _closed: bool

    def _init_common(
        self,
        agent_name: str,
        kv_cache: Any,
        block_bytes: int,
        xfer_timeout_s: float,
        num_layers: int | None,
        num_heads: int | None,
    ) -> None:
        """The registered cache's geometry (``ValueError`` when ``block_bytes`` does not
        cut it into blocks, or a block into head units), and the empty tables."""
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")
        num_blocks = int(kv_cache.shape[0])
        nbytes = kv_cache.numel() * kv_cache.element_size()
        if block_bytes <= 0 or num_blocks * block_bytes != nbytes:
            raise ValueError(
                f"block_bytes={block_bytes} x {num_blocks} blocks != tensor bytes {nbytes}"
            )
        self.agent_name = agent_name
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_bytes = 0  # bytes of one head in one (block, layer, kv) unit
        if num_layers and num_heads:
            units = num_layers * 2 * num_heads
            if block_bytes % units:
                raise ValueError(f"block_bytes={block_bytes} is not {units} equal head units")
            self.head_bytes = block_bytes // units
        self.xfer_timeout_s = xfer_timeout_s
        self.mem_type = "DRAM" if kv_cache.device.type == "cpu" else "VRAM"
        self.device_id = 0 if self.mem_type == "DRAM" else int(kv_cache.device.index or 0)
        self._kv_cache = kv_cache  # keep the registered memory alive
        self._base_addr = int(kv_cache.data_ptr())
        self._lock = threading.RLock()
        self._peers = {}
        self._live = {}  # id(handle) -> handles not released yet
        self._closed = False
        self.stats = TransportStats()

    def _common_metadata(self) -> dict[str, Any]:
        """What every transport's ``metadata()`` tells a peer about this rank's cache."""
        return {
            "agent_name": self.agent_name,
            "base_addr": self._base_addr,
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
        }

    # -- each transport's -------------------------------------------------------------------
    def _check(self, handle: TransferHandle) -> None:  # pragma: no cover - each transport's
        """Advance a posted write (its ``_xfer``); ``_finish`` it when it ended."""
        raise NotImplementedError

    def _release_locked(self, handle: TransferHandle, peer: Any) -> None:  # pragma: no cover
        raise NotImplementedError

    def _drop_peer(self, peer_key: str, peer: Any) -> None:  # pragma: no cover
        """Free what the library holds for a peer that left the table."""
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - each transport's
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------------
    def remove_peer(self, peer_key: str) -> None:
        """Fail the peer's pending writes, release them, and drop the peer."""
        with self._lock:
            peer = self._peers.pop(peer_key, None)
            if peer is None:
                return
            for handle in [h for h in self._live.values() if h.peer_key == peer_key]:
                if handle.state == PENDING:
                    self._finish(handle, ERROR, "peer removed")
                self._release_locked(handle, peer)
            self._drop_peer(peer_key, peer)
            logger.info("%s peer %s removed", self.KIND, peer_key)

    def poll(self, handle: TransferHandle) -> str:
        """Return "done", "pending" or "error"; never raises on transport errors."""
        with self._lock:
            if handle.state != PENDING:
                return handle.state
            if handle._xfer is None:  # released while pending
                self._finish(handle, ERROR, "released")
                return handle.state
            self._check(handle)
            return handle.state

    def release(self, handle: TransferHandle) -> None:
        """Forget the write (cancelling it if still pending; each transport says how).
        Idempotent."""
        with self._lock:
            self._release_locked(handle, self._peers.get(handle.peer_key))

    def _take_xfer(self, handle: TransferHandle) -> Any:
        """A release's first part (under the lock): the handle forgotten, failed if still
        pending; its library request, or None when there is none (left to free)."""
        self._live.pop(id(handle), None)
        xfer, handle._xfer = handle._xfer, None
        if handle.state == PENDING:
            self._finish(handle, ERROR, "released while pending")
        return xfer

    def _write_peer(
        self, peer_key: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int]
    ) -> tuple[Any, list[BlockRun]]:
        """A write's checks (under the lock): the transport open, the peer known
        (``KeyError``), the ids paired and in range on both sides (``ValueError``); the
        peer and the ids' contiguous runs."""
        self._check_open()
        peer = self._peers.get(peer_key)
        if peer is None:
            raise KeyError(f"unknown {self.KIND} peer {peer_key!r}")
        if len(local_block_ids) != len(remote_block_ids):
            raise ValueError(
                f"{len(local_block_ids)} local block ids but {len(remote_block_ids)} remote"
            )
        runs = block_runs(local_block_ids, remote_block_ids)  # also rejects negative ids
        check_runs(runs, self.num_blocks, peer.num_blocks)
        return peer, runs

    def _new_handle(
        self,
        peer_key: str,
        num_blocks: int,
        num_descriptors: int,
        num_bytes: int,
        timeout_s: float | None,
    ) -> TransferHandle:
        """A write's handle, counted as started (``timeout_s`` None: the transport's
        ``xfer_timeout_s``; <= 0: no deadline)."""
        timeout = self.xfer_timeout_s if timeout_s is None else timeout_s
        now = time.monotonic()
        handle = TransferHandle(
            peer_key=peer_key,
            num_blocks=num_blocks,
            num_descriptors=num_descriptors,
            num_bytes=num_bytes,
            started_at=now,
            deadline=None if timeout <= 0 else now + timeout,
        )
        self.stats.transfers_started += 1
        self.stats.descriptors_total += num_descriptors
        self.stats.last_descriptors = num_descriptors
        return handle

    def _timed_out(self, handle: TransferHandle) -> bool:
        """A pending write past its deadline ends with "timeout" (True)."""
        if handle.deadline is None or time.monotonic() <= handle.deadline:
            return False
        logger.warning(
            "%s write to %s timed out after %.1fs",
            self.KIND,
            handle.peer_key,
            time.monotonic() - handle.started_at,
        )
        self._finish(handle, ERROR, "timeout")
        return True

    def _check_new_peer(
        self, peer_key: str, peer_meta: dict[str, Any], heads: tuple[int, int, int] | None
    ) -> None:
        """What ``add_peer`` checks before touching the library (called holding the lock):
        the geometry fits, and no other key holds the same agent; a key added again drops
        its old peer first."""
        self._check_open()
        if heads is None and int(peer_meta["block_bytes"]) != self.block_bytes:
            raise ValueError(
                f"peer {peer_key} block_bytes {peer_meta['block_bytes']} != {self.block_bytes}"
            )
        if heads is not None:
            check_head_slice(self, peer_key, peer_meta, heads)
        if peer_key in self._peers:
            logger.info("%s peer %s re-added; dropping the old one", self.KIND, peer_key)
            self.remove_peer(peer_key)
        name = str(peer_meta.get("agent_name", ""))
        for key, peer in self._peers.items():
            if name and peer.agent_name == name:
                raise ValueError(f"agent {name} already added as peer {key}")

    def has_peer(self, peer_key: str) -> bool:
        return peer_key in self._peers

    def _finish(self, handle: TransferHandle, state: str, error: str | None = None) -> None:
        """A write ended (once): its state and the counters."""
        if handle.state != PENDING:
            return
        handle.state = state
        handle.error = error
        handle.finished_at = time.monotonic()
        if state == DONE:
            self.stats.transfers_done += 1
            self.stats.write_seconds += handle.finished_at - handle.started_at
            self.stats.bytes_written += handle.num_bytes
            self.stats.blocks_written += handle.num_blocks
        else:
            self.stats.transfers_failed += 1

    def _check_open(self) -> None:
        if self._closed:
            raise self.ERROR_CLS(f"{self.KIND} transport {self.agent_name} is closed")

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
