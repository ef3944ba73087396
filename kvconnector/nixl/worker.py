"""Worker-side NIXL connector: one NIXL agent per TP rank.

P ranks carry out the step's sends: each rank WRITEs its own KV heads of a request's
blocks into the D ranks that own those heads (``tp_map.writes_of``: rank r -> rank r,
whole blocks, when both sides have the same TP; head slices of every (block, layer, kv)
otherwise), each WRITE with a notification that NIXL delivers after the data and that
says how many P ranks write into that D rank. D ranks count notifications per
reservation nonce and report a nonce received once its expected parts are in; the
executor's aggregator reports it to the scheduler only when every D rank has, and the
scheduler-side connector accepts it only for the request's current reservation.

Pipelined push (``--kv-layer-group-size g``): a send marked ``pipelined`` is for a
prefill whose last step is this one. Its KV is posted in pieces, layers ``[0, g)``,
``[g, 2g)``, ... as the forward writes them (``save_kv_layer``); the last piece goes in
``wait_for_save``, after sampling, and carries the first token (rank 0) and the
checksums. Every piece carries a notification, so D counts senders x pieces per nonce
and nothing else changes: a nonce is received when every piece of every sender landed.
A forward that raises posts no further piece and reports the send failed (D's partial
count never completes; P's scheduler tells D a WRITE may have landed).

No count outlives its transfer: the nonces of reservations that ended without landing
come in the step metadata (``ended_keys``) and their partial counts are dropped; a nonce
that completed or ended is remembered for 4 x ``kv_transfer_timeout`` so that a late or
replayed notif starts no new count; a partial count no reservation could still complete
(older than that) is dropped on its own. A notif whose nonce another D process made (one
at this address before a restart: the metadata names this one's incarnation) counts
nowhere: no reservation here can take it, and the aggregator would wait for it forever.
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
from kvconnector.nixl.metadata import (
    STEP_FAILED,
    TOO_LATE,
    NixlConnectorMetadata,
    PeerSpec,
    SendSpec,
)
from kvconnector.nixl.stats import NixlWorkerStats
from kvconnector.nixl.transport import DONE, ERROR, NixlTransport, TransferHandle

if TYPE_CHECKING:
    import torch

    from engine.config import EngineConfig
    from engine.kv_cache_layout import KVCacheSpec

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Pipeline:
    """A pipelined send of this step: the pieces posted so far."""

    send: SendSpec
    handles: list[TransferHandle] = dataclasses.field(default_factory=list)
    posted: int = 0  # layer groups posted
    error: str | None = None


@dataclasses.dataclass
class _Count:
    """D: the notifications of one reservation seen so far."""

    seen: int
    first_seen: float
    first_token: int | None = None
    checked: list[Notif] = dataclasses.field(default_factory=list)  # notifs with sums


def progress_thread(config: EngineConfig) -> bool:
    """``--kv-progress-thread``: auto is off on CPU, on with CUDA."""
    mode = config.kv_transfer.kv_progress_thread
    return mode == "on" or (mode == "auto" and config.parallel.device == "cuda")


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
        self._parts: dict[str, _Count] = {}  # nonce -> what arrived of it
        self._pipes: dict[str, _Pipeline] = {}  # this step's pipelined sends
        self._groups: list[tuple[int, int]] = []  # layer groups of a pipelined send
        self._peers_of: NixlConnectorMetadata | None = None  # whose peers were applied
        self._closed: dict[str, float] = {}  # nonce completed or ended -> forget it then
        self._recv_info: dict[str, dict[str, Any]] = {}
        self._failures: dict[str, str] = {}
        self._notifs = 0
        self._incarnation: str | None = None  # this D process's (nonces begin with it)
        self._timeout = config.kv_transfer.kv_transfer_timeout
        self._checksum = config.kv_transfer.kv_checksum
        self._kv_cache: torch.Tensor | None = None
        # Test-only fault hook: corrupt checked blocks as they arrive (docs/reliability.md).
        self._corrupt = os.environ.get("PDSERVE_FAULT_CORRUPT_KV") == "1"
        # ... and die after a pipelined send's first piece (a P killed mid-pipeline).
        self._die_mid_pipeline = os.environ.get("PDSERVE_FAULT_DIE_MID_PIPELINE") == "1"
        self._kv_errors: dict[str, str] = {}  # nonce -> why its KV is not to be used
        # nonce -> the blocks its reservation may write (UCXX gates writes by it)
        self._expected: dict[str, frozenset[int]] = {}

    def register_kv_caches(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        self._kv_cache = kv_cache
        name = f"{self.config.kv_transfer.engine_id}-{uuid.uuid4().hex[:8]}-tp{self.rank}"
        make: Any = NixlTransport
        if self.config.kv_transfer.kv_transport == "ucxx":  # --kv-transport: same calls
            from kvconnector.nixl.transport_ucxx import UcxxTransport

            make = UcxxTransport
        group = self.config.kv_transfer.kv_layer_group_size
        extra: dict[str, Any] = {"layer_ranges": True} if group else {}
        if self.config.kv_transfer.kv_transport == "nixl":
            extra["progress_thread"] = progress_thread(self.config)
        self.transport = make(
            name,
            kv_cache,
            spec.block_bytes,
            xfer_timeout_s=self._timeout,
            num_layers=spec.num_layers,
            num_heads=spec.num_kv_heads,
            **extra,
        )
        if self.config.kv_transfer.kv_transport == "ucxx":  # it puts data in place itself
            self.transport.write_gate = self._may_write  # type: ignore[attr-defined]
        if group:
            layers = spec.num_layers
            self._groups = [(i, min(i + group, layers)) for i in range(0, layers, group)]

    def handshake_info(self) -> dict[str, Any]:
        assert self.transport is not None
        return self.transport.metadata()

    def _apply_peers(self) -> NixlConnectorMetadata | None:
        """Add and remove this step's peers, once (before the forward: a pipelined send
        posts its first piece during it)."""
        md = self.connector_metadata
        if not isinstance(md, NixlConnectorMetadata) or md.is_empty():
            return None
        if self._peers_of is not md:
            self._peers_of = md
            t = self.transport
            assert t is not None
            for key in md.remove_peers:
                for sub, _, _ in self._targets.pop(key, []):
                    t.remove_peer(sub)
            for key, spec in md.add_peers.items():
                self._add_peer(key, spec)
            self._pipes = {send.request_id: _Pipeline(send) for send in md.sends if send.pipelined}
        return md

    def start_load_kv(self) -> None:
        self._apply_peers()

    def wants_layer_hook(self) -> bool:
        self._apply_peers()
        return bool(self._pipes) and len(self._groups) > 1

    def needs_sampled_ids(self) -> bool:
        self._apply_peers()
        return bool(self._pipes)  # the last piece carries the first token

    def save_kv_layer(self, layer: int) -> None:
        """Post the pieces whose layers are now all written -- never the last one, which
        waits for the sampled first token (``wait_for_save``)."""
        ready = [
            p for p in self._pipes.values()
            if p.error is None and p.posted < len(self._groups) - 1
            and self._groups[p.posted][1] == layer + 1
        ]  # fmt: skip
        if not ready:
            return
        self._wait_for_kv_writes()
        for pipe in ready:
            self._post_piece(pipe, None)

    def _wait_for_kv_writes(self) -> None:
        """On a GPU the forward's KV writes are only queued when the host gets here: a
        WRITE posted before they ran would send what the blocks held before. Rank 0 waited
        already when it read its sampled tokens; other ranks sample nothing and must wait
        here (their host runs ahead of their GPU). On CPU the writes are done."""
        kv = self._kv_cache
        if kv is not None and kv.is_cuda:
            import torch

            torch.cuda.current_stream(kv.device).synchronize()

    def wait_for_save(self, sampled: dict[str, int] | None = None) -> None:
        md = self._apply_peers()
        if md is None:
            return
        t = self.transport
        assert t is not None
        for send in md.sends:
            if send.pipelined:
                continue
            if time.monotonic() > send.post_by:
                logger.error("tp%d: send of %s not posted: %s", self.rank, send.request_id,
                             TOO_LATE)  # fmt: skip
                self._failures[send.request_id] = TOO_LATE
                self._finished_sending.add(send.request_id)
                continue
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
        pipes, self._pipes = self._pipes, {}
        if sampled is not None and any(p.error is None for p in pipes.values()):
            self._wait_for_kv_writes()  # the last pieces: the last layers' KV
        for rid, pipe in pipes.items():
            if sampled is None and pipe.error is None:
                pipe.error = STEP_FAILED  # the later layers' KV was never computed
            while pipe.error is None and pipe.posted < max(len(self._groups), 1):
                self._post_piece(pipe, sampled)
            if pipe.error is not None:
                logger.error("tp%d: pipelined send of %s failed: %s", self.rank, rid, pipe.error)
                self._failures[rid] = pipe.error
            if pipe.handles:  # what was posted runs to its end before the blocks are freed
                self._sending[rid] = pipe.handles
            else:
                self._finished_sending.add(rid)

    def _post_piece(self, pipe: _Pipeline, sampled: dict[str, int] | None) -> None:
        """Post layer group ``pipe.posted`` of a pipelined send to every target D rank;
        the last group carries the first token (``sampled``, rank 0) and the sums."""
        t = self.transport
        assert t is not None
        send = pipe.send
        groups = self._groups or [(0, 0)]
        index = pipe.posted
        last = index == len(groups) - 1
        layers = groups[index] if self._groups else None
        if time.monotonic() > send.post_by:
            pipe.error = TOO_LATE  # what was posted runs to its end; nothing more goes
            return
        try:
            for sub, write, senders in self._targets[send.peer_key]:
                notif = self._notif_for(
                    send.notif, write, senders, send.local_block_ids, send.remote_block_ids,
                    pieces=len(groups), last=last,
                    first_token=(sampled or {}).get(send.request_id) if last else None,
                )  # fmt: skip
                pipe.handles.append(
                    t.write_blocks(
                        sub, send.local_block_ids, send.remote_block_ids, notif, layers=layers
                    )
                )
        except Exception as e:  # unknown peer, bad ids: this rank's part failed
            pipe.error = str(e)
            return
        pipe.posted += 1
        if self._die_mid_pipeline and not last:
            logger.error("tp%d: PDSERVE_FAULT_DIE_MID_PIPELINE: exiting", self.rank)
            os._exit(17)

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
            if md.incarnation is not None:
                self._incarnation = md.incarnation
            for nonce, blocks in md.expect.items():
                self._expected[nonce] = frozenset(blocks)
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
            if self._incarnation is not None and not notif.k.startswith(f"{self._incarnation}."):
                # Made for another D process (before a restart): no reservation of this
                # one, and a count of it would wait forever in the all-ranks aggregation.
                logger.info(
                    "tp%d: notif for another decode process (%s); ignored", self.rank, notif.t
                )
                continue
            if notif.k in self._closed:
                logger.info("tp%d: notif for an ended transfer %s; ignored", self.rank, notif.t)
                continue
            count = self._parts.setdefault(notif.k, _Count(0, now))
            count.seen += 1
            if notif.ft is not None:
                count.first_token = notif.ft
            if notif.c is not None:
                count.checked.append(notif)
            if count.seen < notif.n:
                continue
            # Every piece of every sender landed: now the sums can be checked.
            if count.checked or self._checksum != "off":
                self._check(notif.k, notif.t, count.checked)
            error = self._kv_errors.get(notif.k)
            self._close(notif.k, now)
            self._recving.add(notif.k)
            info: dict[str, Any] = {"request_id": notif.r, "arrived": time.time()}
            if count.first_token is not None:  # only the rank(s) the token came to say it
                info["first_token"] = count.first_token
            if error is not None:  # every rank reports; the scheduler fails the load
                info["kv_error"] = error
            self._recv_info[notif.k] = info
        self._expire(now)

    def _notif_for(
        self,
        raw: bytes,
        write: tp_map.HeadWrite,
        senders: int,
        local: list[int],
        remote: list[int],
        *,
        pieces: int = 1,
        last: bool = True,
        first_token: int | None = None,
    ) -> bytes:
        """P: the send's notification for one D rank: how many notifications it counts
        (P ranks writing into it x pieces of a pipelined send), and on the last piece the
        first token (pipelined sends: ``first_token``) and (``--kv-checksum``) the sums
        of what this rank writes there."""
        if senders == 1 and pieces == 1 and self._checksum == "off" and first_token is None:
            return raw  # the scheduler built it with n=1
        notif = dataclasses.replace(Notif.unpack(raw), n=senders * pieces)
        if first_token is not None:
            notif = dataclasses.replace(notif, ft=first_token)
        if self._checksum != "off" and last:
            assert self._kv_cache is not None
            positions = checksum.pick(len(local), self._checksum, notif.k)
            p_heads = None if write.whole_blocks else (write.p_offset, write.count)
            d_heads = None if write.whole_blocks else (write.d_offset, write.count)
            sums = checksum.block_sums(self._kv_cache, [local[i] for i in positions], p_heads)
            pairs = tuple((remote[i], s) for i, s in zip(positions, sums, strict=True))
            notif = dataclasses.replace(notif, c=pairs, hs=d_heads)
        return notif.pack()

    def _check(self, nonce: str, transfer_id: str, checked: list[Notif]) -> None:
        """D: once every WRITE of a reservation landed, verify the sums the senders sent
        against the blocks they filled."""
        assert self._kv_cache is not None
        error: str | None = None
        if not checked:
            error = "the prefill node sent no checksums (--kv-checksum differs)"
        for notif in checked:
            assert notif.c is not None
            if self._corrupt:
                checksum.corrupt_first(self._kv_cache, notif.c, notif.hs)
            error = error or checksum.verify(self._kv_cache, notif.c, notif.hs)
        if error is not None:
            logger.error("tp%d: transfer %s: %s", self.rank, transfer_id, error)
            self._kv_errors[nonce] = f"rank {self.rank}: {error}"

    def _may_write(self, raw: bytes, block_ids: list[int]) -> bool | None:
        """D (UCXX, which puts received data in place itself): may a write whose
        notification is ``raw`` go into ``block_ids``? Only into blocks of the reservation
        the notification names, while this rank still waits for it. None: a nonce of this
        process that no step named yet -- the step naming it may still be on its way (the
        reservation goes to P while it is), so the write waits, within its timeout."""
        try:
            nonce = Notif.unpack(raw).k
        except MessageError:
            return False
        if self._incarnation is not None and not nonce.startswith(f"{self._incarnation}."):
            return False
        if nonce in self._closed:
            return False
        blocks = self._expected.get(nonce)
        if blocks is None:
            return None
        return blocks.issuperset(block_ids)

    def _close(self, nonce: str, now: float) -> None:
        self._expected.pop(nonce, None)
        self._parts.pop(nonce, None)
        self._kv_errors.pop(nonce, None)
        self._closed[nonce] = now + 4 * self._timeout

    def _expire(self, now: float) -> None:
        # A reservation lives at most T waiting plus 2T quarantined on D: a count older
        # than 4T belongs to none that could still complete.
        for nonce, count in list(self._parts.items()):
            if now - count.first_seen >= 4 * self._timeout:
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
            kv_rank_write_seconds_total=s.write_seconds,
            kv_notifs_received_total=self._notifs,
        )

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
