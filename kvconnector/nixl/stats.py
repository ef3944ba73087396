"""What the NIXL connector reports (typed: counters and gauges, see ``engine.stats``)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.stats import Stats, counter, gauge


@dataclass
class NixlSchedulerStats(Stats):
    """The engine process's side: transfers, waits, peers."""

    kv_transfers_in_flight: int = gauge("KV pushes issued and not yet done on every rank")
    kv_transfers_started_total: int = counter("KV pushes started")
    kv_pipelined_transfers_total: int = counter(
        "KV pushes started during the prefill's last step, a layer group at a time"
    )
    kv_transfer_failures_total: int = counter("KV pushes that failed")
    kv_loads_failed_total: int = counter("KV loads that failed (recomputed or failed)")
    kv_loads_waiting: int = gauge("Requests waiting for their KV to land")
    kv_quarantined_requests: int = gauge("Requests whose blocks a late write may still reach")
    kv_held_for_send: int = gauge("Finished prefills holding blocks for a push")
    kv_reservations_waiting: int = gauge("Reservations that arrived before their prefill ended")
    kv_handshakes_total: int = counter("Handshakes with peers")
    kv_prefill_peers_lost_total: int = counter("Prefill peers found restarted or silent")
    kv_decode_peers: int = gauge("Decode peers known")
    kv_handshake_failures_total: int = counter("Handshakes refused or failed")
    kv_checksum_failures_total: int = counter(
        "Transfers whose KV failed its checksum on arrival (--kv-checksum)"
    )
    kv_side_channel_requests_refused_total: int = counter(
        "Side-channel requests refused before they were read: unsigned, forged, replayed or "
        "out-of-window ones (--kv-secret)"
    )
    kv_side_channel_calls_refused_total: int = counter(
        "Side-channel calls to peers not made: the peer's lane full, or too many peers "
        "(the request's transfer ended at once)"
    )


@dataclass
class NixlWorkerStats(Stats):
    """One TP rank's transport counters; the executor adds the ranks up."""

    kv_bytes_sent_total: int = counter("Bytes written by KV pushes, all ranks")
    kv_blocks_sent_total: int = counter("Blocks written by KV pushes, all ranks")
    kv_descriptors_total: int = counter("NIXL descriptors posted, all ranks")
    kv_rank_transfers_started_total: int = counter("Per-rank WRITEs started")
    kv_rank_transfers_done_total: int = counter("Per-rank WRITEs completed")
    kv_rank_transfers_failed_total: int = counter("Per-rank WRITEs failed")
    kv_rank_write_seconds_total: float = counter(
        "Seconds per-rank WRITEs took, posted to completion seen, over completed ones (the "
        "wire time: divide by kv_rank_transfers_done_total for the mean)"
    )
    kv_notifs_received_total: int = counter("KV-landed notifications received, all ranks")
