"""Worker-side NIXL connector: one NIXL agent per TP rank.

P ranks carry out the step's sends: each rank WRITEs its own KV heads of a request's
blocks into the D ranks that own those heads (``tp_map.writes_of``: rank r -> rank r,
whole blocks, when both sides have the same TP; head slices of every (block, layer, kv)
otherwise), each WRITE with a notification that NIXL delivers after the data and that
says how many P ranks write into that D rank. D ranks count notifications per
reservation nonce and report a nonce received once its expected parts are in; the
executor's aggregator reports it to the scheduler only when every D rank has, and the
scheduler-side connector accepts it only for the request's current reservation.

No count outlives its transfer: the nonces of reservations that ended without landing
come in the step metadata (``ended_keys``) and their partial counts are dropped; a nonce
that completed or ended is remembered for 4 x ``kv_transfer_timeout`` so that a late or
replayed notif starts no new count; a partial count no reservation could still complete
(older than that) is dropped on its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from kvconnector.base import KVConnectorWorker
from kvconnector.nixl import checksum, tp_map
from kvconnector.nixl.messages import MessageError, Notif
from kvconnector.nixl.metadata import NixlConnectorMetadata, PeerSpec
from kvconnector.nixl.stats import NixlWorkerStats
from kvconnector.nixl.transport import DONE, ERROR, NixlTransport, TransferHandle

if TYPE_CHECKING:
    import torch

    from engine.config import EngineConfig
    from engine.kv_cache_layout import KVCacheSpec

logger = logging.getLogger(__name__)


class NixlConnectorWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, rank: int, world_size: int) -> None:
        super().__init__(config, rank, world_size)
        self.transport: NixlTransport | None = None
        self._sending: dict[str, list[TransferHandle]] = {}  # P request id -> its WRITEs
        # decode peer key -> (transport peer key, what this rank writes there, notifs the
        # D rank counts), one entry per D rank this rank writes into
        self._targets: dict[str, list[tuple[str, tp_map.HeadWrite, int]]] = {}
        self._finished_sending: set[str] = set()
        self._recving: set[str] = set()  # nonces complete on this rank, not yet reported
        self._watch_notifs = False  # the scheduler expects KV: watch between steps
        self._parts: dict[str, tuple[int, float]] = {}  # nonce -> (notifs seen, first seen)
        self._closed: dict[str, float] = {}  # nonce completed or ended -> forget it then
        self._recv_info: dict[str, dict[str, Any]] = {}
        self._failures: dict[str, str] = {}
        self._notifs = 0
        self._timeout = config.kv_transfer.kv_transfer_timeout
        self._checksum = config.kv_transfer.kv_checksum
        self._kv_cache: torch.Tensor | None = None
        # Test-only fault hook: corrupt checked blocks as they arrive (docs/reliability.md).
        self._corrupt = os.environ.get("PDSERVE_FAULT_CORRUPT_KV") == "1"
        self._kv_errors: dict[str, str] = {}  # nonce -> why its KV is not to be used

    def register_kv_caches(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        self._kv_cache = kv_cache
        name = f"{self.config.kv_transfer.engine_id}-{uuid.uuid4().hex[:8]}-tp{self.rank}"
        make: Any = NixlTransport
        if self.config.kv_transfer.kv_transport == "ucxx":  # --kv-transport: same calls
            from kvconnector.nixl.transport_ucxx import UcxxTransport

            make = UcxxTransport
        self.transport = make(
            name,
            kv_cache,
            spec.block_bytes,
            xfer_timeout_s=self._timeout,
            num_layers=spec.num_layers,
            num_heads=spec.num_kv_heads,
        )

    def handshake_info(self) -> dict[str, Any]:
        assert self.transport is not None
        return self.transport.metadata()

    def wait_for_save(self) -> None:
        md = self.connector_metadata
        if not isinstance(md, NixlConnectorMetadata) or md.is_empty():
            return
        t = self.transport
        assert t is not None
        for key in md.remove_peers:
            for sub, _, _ in self._targets.pop(key, []):
                t.remove_peer(sub)
        for key, spec in md.add_peers.items():
            self._add_peer(key, spec)
        for send in md.sends:
            handles: list[TransferHandle] = []
            try:
                targets = self._targets[send.peer_key]
                for sub, write, senders in targets:
                    notif = self._notif_for(
                        send.notif, write, senders, send.local_block_ids, send.remote_block_ids
                    )
                    handles.append(
                        t.write_blocks(sub, send.local_block_ids, send.remote_block_ids, notif)
                    )
            except Exception as e:  # unknown peer, bad ids: this rank's part failed
                logger.error("tp%d: send of %s failed: %s", self.rank, send.request_id, e)
                self._failures[send.request_id] = str(e)
                for handle in handles:  # the parts already posted still run to their end
                    t.release(handle)
                self._finished_sending.add(send.request_id)
                continue
            # No targets: with replicated heads another replica writes everything.
            self._sending[send.request_id] = handles

    def _add_peer(self, key: str, spec: PeerSpec) -> None:
        t = self.transport
        assert t is not None
        tp_d = len(spec.ranks)
        targets = []
        try:
            for write in tp_map.writes_of(self.rank, self.world_size, tp_d, spec.num_kv_heads):
                sub = f"{key}@{write.d_rank}"
                heads = (
                    None if write.whole_blocks else (write.p_offset, write.d_offset, write.count)
                )
                t.add_peer(sub, spec.ranks[write.d_rank], heads)
                senders = tp_map.senders(write.d_rank, self.world_size, tp_d, spec.num_kv_heads)
                targets.append((sub, write, senders))
        except Exception as e:
            logger.error("tp%d: adding NIXL peer %s failed: %s", self.rank, key, e)
            for sub, _, _ in targets:
                t.remove_peer(sub)
            return
        self._targets[key] = targets

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        now = time.monotonic()
        md = self.connector_metadata
        if isinstance(md, NixlConnectorMetadata):
            if md.watch is not None:
                self._watch_notifs = md.watch
            for nonce in md.ended_keys:
                self._close(nonce, now)
                self._recving.discard(nonce)
        self._poll_transport(now)
        sending, self._finished_sending = self._finished_sending, set()
        recving, self._recving = self._recving, set()
        return sending, recving

    # -- watching between steps (the worker process calls these while it has no task) --
    def watching(self) -> bool:
        """True while something may complete without a step: WRITEs in flight, or (the
        scheduler said so) KV expected."""
        return bool(self._sending) or self._watch_notifs

    def progress(self) -> bool:
        """Poll the transport between steps; True when a completion is waiting for the
        next step (the worker process then wakes the engine)."""
        if self.transport is None or not self.watching():
            return False
        self._poll_transport(time.monotonic())
        return bool(self._finished_sending or self._recving)

    def _poll_transport(self, now: float) -> None:
        t = self.transport
        assert t is not None
        for rid, handles in list(self._sending.items()):
            states = [t.poll(h) for h in handles]
            if any(state not in (DONE, ERROR) for state in states):
                continue
            for handle, state in zip(handles, states, strict=True):
                if state == ERROR:
                    logger.warning("tp%d: WRITE for %s failed: %s", self.rank, rid, handle.error)
                    self._failures[rid] = handle.error or "transfer error"
                t.release(handle)
            del self._sending[rid]
            self._finished_sending.add(rid)
        for raw in t.get_notifs():
            try:
                notif = Notif.unpack(raw)
            except MessageError as e:
                logger.warning("tp%d: ignoring a malformed notification: %s", self.rank, e)
                continue
            self._notifs += 1
            if notif.k in self._closed:
                logger.info("tp%d: notif for an ended transfer %s; ignored", self.rank, notif.t)
                continue
            if notif.c is not None or self._checksum != "off":
                self._check(notif)
            seen, first = self._parts.get(notif.k, (0, now))
            if seen + 1 >= notif.n:
                error = self._kv_errors.get(notif.k)
                self._close(notif.k, now)
                self._recving.add(notif.k)
                self._recv_info[notif.k] = {
                    "request_id": notif.r,
                    "first_token": notif.ft,
                    "arrived": time.time(),
                }
                if error is not None:  # every rank reports; the scheduler fails the load
                    self._recv_info[notif.k]["kv_error"] = error
            else:
                self._parts[notif.k] = (seen + 1, first)
        self._expire(now)

    def _notif_for(
        self,
        raw: bytes,
        write: tp_map.HeadWrite,
        senders: int,
        local: list[int],
        remote: list[int],
    ) -> bytes:
        """P: the send's notification for one D rank: how many P ranks write into it,
        and (``--kv-checksum``) the sums of what this rank writes there."""
        if senders == 1 and self._checksum == "off":
            return raw  # the scheduler built it with n=1
        notif = dataclasses.replace(Notif.unpack(raw), n=senders)
        if self._checksum != "off":
            assert self._kv_cache is not None
            positions = checksum.pick(len(local), self._checksum, notif.k)
            p_heads = None if write.whole_blocks else (write.p_offset, write.count)
            d_heads = None if write.whole_blocks else (write.d_offset, write.count)
            sums = checksum.block_sums(self._kv_cache, [local[i] for i in positions], p_heads)
            pairs = tuple((remote[i], s) for i, s in zip(positions, sums, strict=True))
            notif = dataclasses.replace(notif, c=pairs, hs=d_heads)
        return notif.pack()

    def _check(self, notif: Notif) -> None:
        """D: verify a notification's checksums against the blocks its WRITE filled."""
        assert self._kv_cache is not None
        if notif.c is None:
            error: str | None = "the prefill node sent no checksums (--kv-checksum differs)"
        else:
            if self._corrupt:
                checksum.corrupt_first(self._kv_cache, notif.c, notif.hs)
            error = checksum.verify(self._kv_cache, notif.c, notif.hs)
        if error is not None:
            logger.error("tp%d: transfer %s: %s", self.rank, notif.t, error)
            self._kv_errors[notif.k] = f"rank {self.rank}: {error}"

    def _close(self, nonce: str, now: float) -> None:
        self._parts.pop(nonce, None)
        self._kv_errors.pop(nonce, None)
        self._closed[nonce] = now + 4 * self._timeout

    def _expire(self, now: float) -> None:
        # A reservation lives at most T waiting plus 2T quarantined on D: a count older
        # than 4T belongs to none that could still complete.
        for nonce, (_, first) in list(self._parts.items()):
            if now - first >= 4 * self._timeout:
                self._close(nonce, now)
        for nonce, until in list(self._closed.items()):
            if now >= until:
                del self._closed[nonce]

    @property
    def num_partial_counts(self) -> int:
        return len(self._parts)

    def take_recv_info(self) -> dict[str, dict[str, Any]]:
        info, self._recv_info = self._recv_info, {}
        return info

    def take_failures(self) -> dict[str, str]:
        failures, self._failures = self._failures, {}
        return failures

    def stats(self) -> NixlWorkerStats | None:
        if self.transport is None:
            return None
        s = self.transport.stats
        return NixlWorkerStats(
            kv_bytes_sent_total=s.bytes_written,
            kv_blocks_sent_total=s.blocks_written,
            kv_descriptors_total=s.descriptors_total,
            kv_rank_transfers_started_total=s.transfers_started,
            kv_rank_transfers_done_total=s.transfers_done,
            kv_rank_transfers_failed_total=s.transfers_failed,
            kv_notifs_received_total=self._notifs,
        )

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
