"""The receiving side of the UCXX transport (D): writes from any peer, put in place before
their notifications are handed on.

``UcxxReceiver.receive`` (called by the transport's ``get_notifs``, on the worker's step
thread) probes the worker for any message (``tag_probe(remove=True)``), receives a tag's
first message as its header and its second into a staging buffer of the probed length, and
when both are in validates the header against its own cache (``ucxx_wire.parse_header``:
ids in range and distinct, slice inside its heads, ``nb`` equal to what they describe),
asks the worker's ``write_gate`` whether the reservation the notification names owns those
blocks and still waits for them on this rank (a nonce no step named yet waits for that
step, within the write's timeout; any other write is dropped: before, D copied first and
the worker checked the nonce after, so a stray or forged write overwrote whichever request
held the blocks), copies the data into the blocks (``index_copy_``) and only then returns
the notification. So **the notification is delivered after the data, by construction**: D
itself puts the data in place before it hands the notif to the worker. A write whose data
has not come within ``xfer_timeout_s`` of its header, or that was sent more than
``xfer_timeout_s`` ago by the sender's clock (P gave up on it by then; this assumes host
clocks within that of each other, as NTP keeps them), is dropped without a notif, and the
connector's deadlines end the transfer. D's KV memory is written only by D's own step
thread, never by UCX, and never for a write that old, so a stalled message cannot land in
a block after its quarantine ended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvconnector.nixl.ucxx_lib import StagingPool, load_ucxx, np_bytes, req_state, unit_view, wide
from kvconnector.nixl.ucxx_wire import HEADER_MAX, BlockLayout, parse_header

logger = logging.getLogger(__name__)

_PROBES_PER_CALL = 1024  # messages taken from UCX per get_notifs call, at most


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


class UcxxReceiver:
    """Incoming writes on one UCX worker, placed into ``kv_blocks`` (one row per block)."""

    def __init__(
        self,
        worker: Any,
        pool: StagingPool,
        kv_blocks: torch.Tensor,
        layout: BlockLayout,
        xfer_timeout_s: float,
    ) -> None:
        self._ucx, self._Array = load_ucxx()
        self._worker = worker
        self._pool = pool
        self._kv_blocks = kv_blocks
        self.layout = layout
        self.xfer_timeout_s = xfer_timeout_s
        self.rx: dict[int, _Rx] = {}  # incoming writes by tag, oldest first
        self._discards: list[tuple[Any, Any]] = []  # (request, buffer) of refused messages
        self._ready: list[bytes] = []
        # Asked before a write's data goes into the blocks (notification bytes, block
        # ids): True write it, False drop it, None not yet (asked again, within the
        # write's timeout). The worker sets it; None: every valid write is placed.
        self.write_gate: Callable[[bytes, list[int]], bool | None] | None = None
        self.writes_dropped = 0  # incoming writes dropped without a notification

    def receive(self) -> list[bytes]:
        """Notifications of writes whose data is in place, from any peer, oldest first."""
        try:
            self._take_messages()
            self._advance()
        except Exception as exc:  # never raise into the worker's step
            logger.warning("UCXX receive failed: %r", exc)
        out, self._ready = self._ready, []
        return out

    def reap(self) -> None:
        """Drop buffers of refused messages UCX is done with."""
        self._discards = [(r, b) for r, b in self._discards if not r.completed]

    def clear(self) -> None:
        """Forget every incoming write (the transport closes)."""
        self.rx.clear()
        self._discards.clear()
        self._worker = None

    def _take_messages(self) -> None:
        ucx = self._ucx
        any_tag, any_mask = ucx.UCXXTag(0), ucx.UCXXTagMask(0)
        limit = self.layout.num_blocks * self.layout.block_bytes
        for _ in range(_PROBES_PER_CALL):
            probe = self._worker.tag_probe(any_tag, any_mask, remove=True)
            if not probe.matched:
                return
            tag, length = int(probe.sender_tag.value), int(probe.length)
            rx = self.rx.get(tag)
            if rx is None and length <= HEADER_MAX:  # a write's first message: its header
                rx = _Rx(tag, time.monotonic(), np.empty(max(length, 1), np.uint8), length)
                rx.hdr_req = self._worker.tag_recv_with_handle(self._Array(rx.hdr_buf), probe)
                self.rx[tag] = rx
            elif (
                rx is not None and rx.data_req is None and rx.error is None and 0 < length <= limit
            ):  # its second: the data, checked against the header once both are in
                rx.staging = self._pool.get(length)
                rx.data_len = length
                rx.data_req = self._worker.tag_recv_with_handle(
                    self._Array(np_bytes(rx.staging)), probe
                )
            else:
                self._discard(probe, tag, length, rx)

    def _discard(self, probe: Any, tag: int, length: int, rx: _Rx | None) -> None:
        """Consume a message nobody expects (a 1-byte receive: UCX truncates it)."""
        logger.warning("UCXX: dropping an unexpected %d-byte message (tag %x)", length, tag)
        if rx is not None and rx.error is None:
            rx.error = f"unexpected {length}-byte message"
        buf = np.empty(1, np.uint8)
        self._discards.append((self._worker.tag_recv_with_handle(self._Array(buf), probe), buf))

    def _advance(self) -> None:
        now = time.monotonic()
        for tag, rx in list(self.rx.items()):
            if rx.header is None and rx.error is None:
                completed, error = req_state(rx.hdr_req)
                if error is not None:
                    rx.error = f"header: {error}"
                elif completed:
                    raw = rx.hdr_buf[: rx.hdr_len].tobytes()
                    rx.header, rx.error = parse_header(raw, self.layout)
            if rx.error is not None:
                self._drop(tag, rx, rx.error)
                continue
            if rx.header is not None and rx.header["nb"] == 0:
                self._ready.append(rx.header["n"])
                del self.rx[tag]
                continue
            if rx.header is not None and rx.data_req is not None:
                completed, error = req_state(rx.data_req)
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
                    del self.rx[tag]
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
        del self.rx[tag]
        for req, buf in ((rx.hdr_req, rx.hdr_buf), (rx.data_req, rx.staging)):
            if req is not None and not req.completed:  # UCX may still write it: keep it
                self._discards.append((req, buf))
            elif buf is rx.staging and buf is not None:
                self._pool.put(buf)

    def _place(self, rx: _Rx) -> str | None:
        """Copy a write's data from its staging buffer into the blocks it names."""
        header = rx.header
        assert header is not None and rx.staging is not None
        if rx.data_len != header["nb"]:
            return f"{rx.data_len} data bytes received, the header said {header['nb']}"
        age = time.time() - header["ts"]
        if age > self.xfer_timeout_s:  # the sender gave up on it long ago
            return f"sent {age:.1f}s ago, more than the {self.xfer_timeout_s:.1f}s deadline"
        ids = torch.as_tensor(header["ids"], dtype=torch.long, device=self._kv_blocks.device)
        n = len(header["ids"])
        layout = self.layout
        if header["h"] is None:
            wide(self._kv_blocks).index_copy_(0, ids, wide(rx.staging.view(n, layout.block_bytes)))
        else:
            first, count = header["h"]
            blocks = unit_view(
                self._kv_blocks, layout.num_layers, layout.num_heads, layout.head_bytes
            )
            dst = wide(blocks)[:, :, first : first + count]
            units = 2 * (layout.num_layers or 0)
            dst.index_copy_(0, ids, wide(rx.staging.view(n, units, count, layout.head_bytes)))
        if rx.staging.device.type == "cuda":
            torch.cuda.current_stream(rx.staging.device).synchronize()  # before reuse
        return None
