"""What every KV transport shares (``transport.py``: NIXL; ``transport_ucxx.py``: UCXX):
the transfer handle and counters, the checks a peer's metadata and a write's block runs
must pass, and ``TransportBase``, the peer bookkeeping both build on.

A transport subclass provides ``agent_name``, ``block_bytes``, ``head_bytes``,
``num_layers``, ``num_heads``, ``stats``, ``_peers`` (values with ``agent_name``),
``_closed``, ``remove_peer`` and ``close``, and names itself in ``KIND`` (log lines) and
``ERROR_CLS`` (what a closed transport raises).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvconnector.nixl.block_runs import BlockRun

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
    block_bytes: int
    stats: TransportStats
    _peers: dict[str, Any]
    _closed: bool

    def remove_peer(self, peer_key: str) -> None:  # pragma: no cover - each transport's
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - each transport's
        raise NotImplementedError

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
