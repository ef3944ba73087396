"""Scheduler-side NIXL connector: the engine's hooks, transfer bookkeeping, side channel.

Runs in the engine process. It owns the node's side-channel server (peers reach it for
handshakes, reservations, cancels and failure notices) and one lane (a FIFO queue and a
thread, ``lanes.PeerLanes``) per peer for the calls this node makes, so that no network
wait ever runs on the engine's step loop and a peer that does not answer delays only the
calls to itself. One lock guards all of it. The parts, one role each:

* ``Producer`` / ``Consumer``: the prefill side's held transfers, the decode side's waits;
* ``PrefillService`` (P): what it answers decode peers -- handshakes (confirmed by a
  ping, ``decode_peers``), reservations, cancels;
* ``PrefillLinks`` (D): its calls to prefill nodes -- handshake, reserve, cancel;
* ``PeerChannel``: the side channel -- the server, each request dispatched to the parts
  above, and the calls this node makes on the peers' lanes (the failure notices too);
* this class: the ``KVConnectorScheduler`` hooks that turn them into step metadata and
  read the workers' reports back, liveness, stats.

A node with ``kv_role=both`` runs both sides.

Flow (push, D reserves while P prefills):
  D: request arrives -> blocks reserved -> ``reserve`` to P (handshake first, once per P
     incarnation) -> WAITING_FOR_REMOTE_KV -> all D ranks got their notif -> decode.
  P: request prefills -> first token sampled -> request finished, blocks held ->
     reservation known -> workers WRITE + notif -> all P ranks done -> blocks freed.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.config import ConfigError
from engine.core.request import RequestStatus
from engine.model.config import load_arch_config
from engine.sampling_params import InvalidRequestError
from engine.stats import StatsGroup
from kvconnector.base import ConnectorEvents, KVConnectorScheduler
from kvconnector.nixl.block_runs import block_runs
from kvconnector.nixl.consumer import Consumer, RemoteRecv
from kvconnector.nixl.liveness import PeerLiveness
from kvconnector.nixl.messages import (
    CONNECTOR_VERSION,
    LAYOUT,
    Notif,
    model_fingerprint,
    ranks_digest,
)
from kvconnector.nixl.metadata import STEP_FAILED, TOO_LATE, NixlConnectorMetadata, SendSpec
from kvconnector.nixl.peer_channel import PeerChannel
from kvconnector.nixl.peers import PeerAllowlist, own_address_refused
from kvconnector.nixl.prefill_links import PrefillLinks
from kvconnector.nixl.prefill_service import PrefillService
from kvconnector.nixl.producer import PendingSend, Producer
from kvconnector.nixl.side_channel import SideChannelClient, SideChannelError
from kvconnector.nixl.stats import NixlSchedulerStats, NixlWorkerStats, transfer_histograms
from kvconnector.params import KVTransferParams

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.request import Request
    from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from engine.kv_cache_layout import KVCacheSpec

logger = logging.getLogger(__name__)


class NixlConnectorScheduler(KVConnectorScheduler):
    moves_kv = True

    def __init__(self, config: EngineConfig, kv_spec: KVCacheSpec) -> None:
        super().__init__(config, kv_spec)
        kvc = config.kv_transfer
        self.engine_id = kvc.engine_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.name = f"{self.engine_id}:{self.incarnation}"  # public: logs, pings
        self.timeout = kvc.kv_transfer_timeout
        self.block_size = config.cache.block_size
        arch = load_arch_config(config.model.model)
        max_len = config.model.max_model_len or arch.max_position_embeddings
        tp = config.parallel.tp
        # The model's KV heads (not one rank's): each side maps its ranks onto them.
        self.model_kv_heads = arch.num_key_value_heads
        self.compat = {
            "connector_version": CONNECTOR_VERSION,
            "kv_transport": kvc.kv_transport,  # nixl or ucxx: both sides use the same
            "layout": LAYOUT,
            "model": model_fingerprint(config.model.model, config.model.seed),
            "num_layers": kv_spec.num_layers,
            "num_kv_heads": self.model_kv_heads,
            "head_dim": kv_spec.head_dim,
            "dtype": config.model.dtype,
            "block_size": kv_spec.block_size,
            "tp_size": tp,  # not compared: P and D may differ (tp_map)
            "kv_checksum": kvc.kv_checksum,
        }
        self.producer = Producer(self.timeout)
        # Pipelined push: P request id -> transfer id, for prefills that may pipeline.
        self.pipeline = kvc.kv_layer_group_size > 0 and kvc.kv_role != "consumer"
        self._p_requests: dict[str, str] = {}
        self.pipeline_wait = kvc.kv_pipeline_wait_ms / 1000 if self.pipeline else 0.0
        self._retry_at: float | None = None  # earliest end of a delayed admission
        self.reserve_first = kvc.kv_reserve_first
        self._gave_up: dict[str, str] = {}  # delayed prefill legs that fail now
        self.pipelined_sends = 0
        self.consumer = Consumer(self.timeout)
        self._lock = threading.RLock()
        self._ranks: list[dict[str, Any]] = []
        self._nonces = itertools.count(1)
        self._ended: list[str] = []  # nonces whose counts every rank must drop
        # reservations made since the last step: nonce -> D blocks P may write (workers)
        self._expect: dict[str, list[int]] = {}
        self._told_incarnation = False  # the workers know it (``NixlConnectorMetadata``)
        self._watching = False  # what the workers were last told (metadata ``watch``)
        self.allowed_peers = PeerAllowlist.parse(kvc.kv_allowed_peers)
        secret = kvc.kv_secret.encode() or None
        client = SideChannelClient(secret=secret)
        self._worker_stats = NixlWorkerStats()  # the ranks' transport counters, summed
        self.histograms = transfer_histograms()
        self.failed_transfers = 0
        self.checksum_failures = 0
        sched = config.scheduler
        # P: what it answers its decode peers (handshakes, reservations, cancels).
        self.service = PrefillService(
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            address="",  # set below, once the side-channel server is bound
            role=kvc.kv_role,
            compat=self.compat,
            model_kv_heads=self.model_kv_heads,
            timeout=self.timeout,
            # A reservation names at most one prompt's blocks; so many wait at most.
            max_blocks_per_seq=-(-max_len // self.block_size),
            max_early=2 * (sched.max_num_seqs + sched.max_queued_requests),
            producer=self.producer,
            lock=self._lock,
            client=client,
            allowed_peers=self.allowed_peers,
            transport_info=self.transport_info,
            wake=self.wake,
        )
        # D: its calls to prefill nodes (handshakes, reservations, cancels).
        self.links = PrefillLinks(
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            address="",
            compat=self.compat,
            model_kv_heads=self.model_kv_heads,
            consumer=self.consumer,
            lock=self._lock,
            client=client,
            wake=self.wake,
        )
        try:  # the side channel: served from here on, and the calls this node makes
            self.channel = PeerChannel(
                engine_id=self.engine_id,
                incarnation=self.incarnation,
                role=kvc.kv_role,
                compat=self.compat,
                service=self.service,
                consumer=self.consumer,
                lock=self._lock,
                client=client,
                host=kvc.side_channel_host,
                port=kvc.side_channel_port,
                secret=secret,
                wake=self.wake,
            )
        except SideChannelError as e:  # a port in use, an address not this host's: one line
            flag = "--side-channel-port" if kvc.side_channel_port else "--side-channel-host"
            hint = "; each node on a host needs its own port (0: any free one)"
            raise ConfigError(f"{flag}: {e}{hint if kvc.side_channel_port else ''}") from e
        self.liveness = PeerLiveness(
            kvc.peer_ping_interval, client.request, self.channel.lanes, self._prefill_lost
        )
        if secret is None:
            logger.warning(
                "side channel unsigned: set PDSERVE_KV_SECRET (or --kv-secret) on every node "
                "unless all peers are on one trusted box"
            )
        self.address = self.service.address = self.links.address = self.channel.server.address
        warning = own_address_refused(self.address, self.allowed_peers, kvc.kv_allowed_peers)
        if warning is not None:
            logger.warning("%s", warning)
        logger.info("NIXL connector %s listening on %s", self.name, self.address)

    def set_worker_info(self, infos: list[dict[str, Any]]) -> None:
        self._ranks = self.service.ranks = self.links.ranks = infos
        self.channel.ranks_digest = ranks_digest(infos)  # what this node's pings name
        logger.info("KV transport: %s", self.transport_info())

    def info(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "incarnation": self.incarnation,
            "side_channel": self.address,
            "role": self.config.kv_transfer.kv_role,
            "compat": self.compat,
            "transport": self.transport_info(),
        }

    def transport_info(self) -> dict[str, Any]:
        """Which transport this node uses, so that a silent fallback to TCP is visible."""
        return {
            "library": self.config.kv_transfer.kv_transport,
            "backend": "UCX",
            "mem_type": self._ranks[0].get("mem_type") if self._ranks else None,
            "UCX_TLS": os.environ.get("UCX_TLS", "(UCX default: all available)"),
            "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "(UCX default: all)"),
        }

    # -- decode side ---------------------------------------------------------------------
    def check_transfer_params(self, params: KVTransferParams) -> None:
        role = self.config.kv_transfer.kv_role
        if params.do_remote_prefill and role == "producer":
            raise InvalidRequestError(
                "this is a prefill node: send the decode leg (do_remote_prefill) to a decode node",
                "kv_transfer_params.do_remote_prefill",
            )
        if params.do_remote_decode and role == "consumer":
            raise InvalidRequestError(
                "this is a decode node: send the prefill leg (do_remote_decode) to a prefill node",
                "kv_transfer_params.do_remote_decode",
            )
        address = params.remote_side_channel
        if params.do_remote_prefill and address and not self.allowed_peers.allows(address):
            raise InvalidRequestError(
                f"kv_transfer_params.remote_side_channel {address!r:.80} is not an allowed "
                "prefill peer; start the decode node with --kv-allowed-peers naming it",
                "kv_transfer_params.remote_side_channel",
            )

    def delay_admission(self, request: Request) -> bool:
        """P: hold a new prefill leg until its decode node reserved the blocks -- up to
        --kv-transfer-timeout, then it fails (--kv-reserve-first), or up to
        --kv-pipeline-wait-ms, then it prefills anyway (to pipeline the push)."""
        params = request.kv_transfer_params
        if params is None or not params.do_remote_decode:
            return False
        # Without a transfer id the client learns it from this leg's answer: no
        # reservation can come before it.
        reserve_first = self.reserve_first and params.transfer_id is not None
        wait = self.timeout if reserve_first else self.pipeline_wait
        if wait <= 0:
            return False
        with self._lock:
            res = self.producer.early.get(request.transfer_id)
            if res is not None and self.service.ready(res.peer_key):
                return False  # a new peer: also until its address confirmed it
            tid = request.transfer_id
            if res is None and (
                self.producer.cancelled_legs.pop(tid, None) or tid in self.producer.tombstones
            ):
                # D gave up first (a refused handshake, an abort), or the transfer ended
                # otherwise: no reservation comes. An error, not an empty answer: a
                # proxy that streams P's first token must not take "no token" for one.
                self._gave_up[request.request_id] = (
                    f"transfer {tid!r:.80} ended before a decode node reserved blocks "
                    "for it (the decode node gave up or cancelled it)"
                )
                return True
            until = request.arrival_time + wait
            if time.monotonic() >= until:
                if not reserve_first:
                    return False
                self._gave_up[request.request_id] = (
                    f"no decode node reserved blocks for transfer {request.transfer_id!r:.80} "
                    f"within {self.timeout:g} s (--kv-transfer-timeout)"
                )
            self._retry_at = until if self._retry_at is None else min(self._retry_at, until)
            return True

    def admission_retry_at(self) -> float | None:
        at, self._retry_at = self._retry_at, None
        return at

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.pipeline and params is not None and params.do_remote_decode:
            with self._lock:
                self._p_requests[request.request_id] = request.transfer_id
        if params is None or not params.do_remote_prefill or request.num_output_tokens > 0:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            return
        params = request.kv_transfer_params
        assert params is not None and params.remote_side_channel is not None
        skip = request.num_computed_tokens // self.block_size
        recv = RemoteRecv(
            request_id=request.request_id,
            transfer_id=request.transfer_id,
            p_address=params.remote_side_channel,
            block_ids=list(block_ids[skip:]),
            skip_blocks=skip,
            deadline=time.monotonic() + self.timeout,
            nonce=self._new_nonce(),
        )
        with self._lock:
            self.consumer.expect(recv)
            self._expect[recv.nonce] = list(recv.block_ids)
        proven = self.links.paired(recv.p_address)
        if not self.channel.submit(recv.p_address, self.links.reserve_job, recv, proven=proven):
            # Nothing was sent: P cannot hold this reservation, the blocks are free.
            self.consumer.fail(recv.request_id, "too many calls queued for prefill", safe=True)

    # -- both sides ----------------------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        params = request.kv_transfer_params
        if params is None or not params.disaggregated:
            return False, None
        if params.do_remote_prefill and request.scheduled_time is None:
            # Ended while queued here (never admitted): no reservation went out, so
            # nothing else tells P -- its leg would wait for one, or hold its prefill,
            # until --kv-transfer-timeout. A cancel of a nonce P never held ends those.
            self._cancel_unreserved(request, params)
            return False, None
        with self._lock:
            if params.do_remote_prefill:
                return self.consumer.aborted(request.request_id), None
            self._p_requests.pop(request.request_id, None)
            tid = request.transfer_id
            if request.status not in (
                RequestStatus.FINISHED_STOPPED,
                RequestStatus.FINISHED_LENGTH,
            ):
                # True: a pipelined send still reads the blocks (held until it is done).
                held = self.producer.prefill_failed(tid, f"prefill {request.status.value}")
                return held, None
            first = request.output_token_ids[0] if request.num_output_tokens else None
            if not self.producer.prefill_finished(request.request_id, tid, block_ids, first):
                return False, None
        return True, KVTransferParams(
            transfer_id=tid,
            first_token=first,
            remote_engine_id=self.engine_id,
            remote_side_channel=self.address,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _cancel_unreserved(self, request: Request, params: KVTransferParams) -> None:
        p_addr, tid = params.remote_side_channel, request.transfer_id
        if p_addr is None or tid is None:
            return
        self._send_cancel(p_addr, tid, self._new_nonce(), request.request_id)

    def _new_nonce(self) -> str:
        """A reservation's nonce: unique in this process (incarnation, counter) and
        unguessable (64 bits): only the P that got the reservation can name it."""
        return f"{self.incarnation}.{next(self._nonces)}.{secrets.token_hex(8)}"

    def _send_cancel(self, p_addr: str, tid: str, nonce: str, request_id: str) -> None:
        args = (p_addr, tid, nonce, request_id, time.monotonic())
        self.channel.submit(p_addr, self.links.cancel_job, *args, proven=self.links.paired(p_addr))

    def abort_held(self, request: Request) -> None:
        with self._lock:
            self.producer.abort(request.transfer_id)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_ids: Callable[[str], list[int]]
    ) -> NixlConnectorMetadata:
        md = NixlConnectorMetadata()
        with self._lock:
            md.remove_peers = self.service.take_removed()
            md.ended_keys, self._ended = self._ended, []
            md.expect, self._expect = self._expect, {}
            # Workers watch (progress their transport between steps) while KV is expected
            # and while quarantined blocks may still get a late WRITE: without D's
            # progress a WRITE to it does not complete (UCX on CPU has no progress thread
            # here), so P's push hung to its timeout and the blocks stayed held for 2T.
            watch = bool(self.consumer.recvs or self.consumer.quarantine)
            if watch != self._watching:
                md.watch = self._watching = watch
            if (watch and md.watch) or not self._told_incarnation:
                md.incarnation, self._told_incarnation = self.incarnation, True
            ready = self.service.ready
            for send in self.producer.ready_sends(ready):
                self._add_send(md, send)
            if self.pipeline:
                for seq in scheduler_output.seqs:
                    tid = self._p_requests.get(seq.request_id)
                    if tid is None or not seq.samples:
                        continue  # not a prefill leg, or not its last prefill step
                    blocks = block_ids(seq.request_id)
                    send = self.producer.start_pipelined(seq.request_id, tid, blocks, ready)
                    if send is not None:
                        self.pipelined_sends += 1
                        self._add_send(md, send)
        return md

    def _add_send(self, md: NixlConnectorMetadata, send: PendingSend) -> None:
        res = send.reservation
        assert res is not None
        local = send.block_ids[res.skip_blocks : res.skip_blocks + len(res.block_ids)]
        if len(local) != len(res.block_ids):
            self.channel.notify_failed(res, "block count mismatch", safe=True)
            self.producer.send_finished(send.request_id)
            if not send.pipelined:  # a pipelined one's request still runs: it holds them
                self.producer.outcome.free_blocks.add(send.request_id)
            return
        handle, spec = self.service.worker_peer(res.peer_key)
        if spec is not None:
            md.add_peers[handle] = spec
        self.histograms["kv_transfer_descriptors"].observe(len(block_runs(local, res.block_ids)))
        if not send.pipelined:
            self.histograms["kv_prefill_to_push_seconds"].observe(
                time.monotonic() - send.finished_at
            )
        md.sends.append(
            SendSpec(
                request_id=send.request_id,
                peer_key=handle,
                local_block_ids=local,
                remote_block_ids=res.block_ids,
                notif=Notif(
                    r=res.d_request_id, t=send.transfer_id, k=res.nonce, n=1, ft=send.first_token
                ).pack(),
                pipelined=send.pipelined,
                post_by=res.expires,
            )
        )

    def update_connector_output(self, output: ModelRunnerOutput) -> dict[str, dict[str, Any]]:
        landed: dict[str, dict[str, Any]] = {}
        with self._lock:
            # finished_recving holds nonces: a reservation whose KV every rank has.
            for nonce in output.finished_recving:
                info = output.kv_recv_info.get(nonce, {})
                rid = info.get("request_id")
                if not isinstance(rid, str):
                    continue
                if info.get("kv_error"):
                    # Some KV is wrong. Not safe: a rank may have counted a notification
                    # that came without its WRITE (forged, or P's sums missing) while P's
                    # real WRITE to it is still on its way. Quarantined until P confirms
                    # the cancel (at once for a send that ended) or 2T pass.
                    self.checksum_failures += 1
                    logger.error("request %s: %s; not decoding from it", rid, info["kv_error"])
                    self.consumer.fail(rid, str(info["kv_error"]), safe=False, nonce=nonce)
                else:
                    recv = self.consumer.recvs.get(rid)
                    if self.consumer.landed(rid, nonce):
                        landed[rid] = info
                        self._observe_landed(recv, info)
            for rid in output.finished_sending:
                send = self.producer.send_finished(rid, output.kv_failed.get(rid))
                if send is None or send.started_at is None:
                    continue
                now = time.monotonic()
                self.histograms["kv_transfer_duration_seconds"].observe(now - send.started_at)
                if rid not in output.kv_failed:
                    self.histograms["kv_push_exposed_seconds"].observe(
                        max(0.0, now - send.finished_at)
                    )
                if rid in output.kv_failed and send.reservation is not None:
                    self.failed_transfers += 1
                    r = send.reservation
                    why = output.kv_failed[rid]
                    # Part of an errored WRITE may still land: D quarantines (safe=False).
                    self.channel.notify_failed(r, why, safe=False)
                    if why not in (STEP_FAILED, TOO_LATE):  # P's fault: the peer is fine
                        self.service.evict(r.peer_key, why)
            if isinstance(output.kv_stats, NixlWorkerStats):
                self._worker_stats = output.kv_stats
        return landed

    def _observe_landed(self, recv: RemoteRecv | None, info: dict[str, Any]) -> None:
        if recv is not None:
            self.histograms["kv_load_wait_seconds"].observe(time.monotonic() - recv.created)
        arrived = info.get("arrived")
        if isinstance(arrived, float):  # the workers' wall clock: same host
            self.histograms["kv_notif_to_step_seconds"].observe(max(0.0, time.time() - arrived))

    def _prefill_lost(self, address: str, incarnation: str | None, why: str, safe: bool) -> None:
        """Liveness: the prefill process at ``address`` restarted (``incarnation`` is gone:
        its waits are safe to free) or went silent (every wait there, quarantined)."""
        with self._lock:
            if safe:
                self.links.forget(address, incarnation)  # re-handshake with the new one
            for rid, recv in list(self.consumer.recvs.items()):
                if recv.p_address == address and incarnation in (None, recv.p_incarnation):
                    self.consumer.fail(rid, why, safe=safe)
        self.wake()

    def take_events(self) -> ConnectorEvents:
        with self._lock:
            self.producer.expire()
            self.consumer.expire()
            p, c = self.producer.take_outcome(), self.consumer.take_outcome()
            gave_up, self._gave_up = self._gave_up, {}
            self._ended.extend(c.ended)
            self._ended.extend(p.ended)
            watched = {
                (r.p_address, r.p_incarnation)
                for r in self.consumer.recvs.values()
                if r.reserved and r.p_incarnation is not None
            }
        self.liveness.tick(watched)
        for res, why in p.notify_failed:
            self.channel.notify_failed(res, why, safe=True)
        for res, why in p.notify_unsafe:
            self.channel.notify_failed(res, why, safe=False)
        for p_addr, tid, nonce, rid in c.cancels:
            # Not sent: the quarantine keeps the blocks until its deadline.
            self._send_cancel(p_addr, tid, nonce, rid)
        return ConnectorEvents(
            failed_loads=c.failed_loads,
            free_blocks=p.free_blocks | c.free_blocks,
            failed_waiting=gave_up,
        )

    def has_pending_work(self) -> bool:
        with self._lock:
            return self.producer.num_states() + self.consumer.num_states() > 0

    def needs_worker_poll(self) -> bool:
        with self._lock:
            c = self.consumer
            return bool(self.producer.in_flight or c.recvs or c.quarantine)

    # -- metrics -------------------------------------------------------------------------
    def stats(self) -> StatsGroup:
        with self._lock:
            own = NixlSchedulerStats(
                kv_transfers_in_flight=len(self.producer.in_flight),
                kv_transfers_started_total=self.producer.sends_started,
                kv_pipelined_transfers_total=self.pipelined_sends,
                kv_transfer_failures_total=self.failed_transfers,
                kv_loads_failed_total=self.consumer.loads_failed,
                kv_loads_waiting=len(self.consumer.recvs),
                kv_quarantined_requests=len(self.consumer.quarantine),
                kv_held_for_send=len(self.producer.pending),
                kv_reservations_waiting=len(self.producer.early),
                kv_handshakes_total=self.service.handshakes + self.links.handshakes,
                kv_prefill_peers_lost_total=self.liveness.peers_lost,
                kv_decode_peers=len(self.service.peers),
                kv_handshake_failures_total=(
                    self.service.handshake_failures + self.links.handshake_failures
                ),
                kv_checksum_failures_total=self.checksum_failures,
                kv_side_channel_requests_refused_total=self.channel.server.refused,
                kv_side_channel_calls_refused_total=self.channel.lanes.refused,
            )
            return StatsGroup(own, self._worker_stats)

    def shutdown(self) -> None:
        self.channel.shutdown()
        self.service.shutdown()
