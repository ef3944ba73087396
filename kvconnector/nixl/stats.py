"""What the NIXL connector reports (typed: counters and gauges, see ``engine.stats``; and
the scheduler side's histograms, ``transfer_histograms``)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.stats import Stats, counter, gauge
from kvconnector.nixl.histogram import Histogram

DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


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


def transfer_histograms() -> dict[str, Histogram]:
    """The scheduler-side connector's histograms by metric name (``/metrics``), empty."""
    return {
        "kv_transfer_duration_seconds": Histogram(
            "KV push duration as the engine sees it: from the step that issues the "
            "WRITEs to all ranks reported done (the posting step and the report included; "
            "the wire time alone is kv_rank_write_seconds_total)",
            DURATION_BUCKETS,
        ),
        # One histogram per hop of a P/D request (docs/performance.md, "P/D hops").
        "kv_prefill_to_push_seconds": Histogram(
            "P: prefill finished -> its WRITEs issued (waiting for D's reservation)",
            DURATION_BUCKETS,
        ),
        "kv_push_exposed_seconds": Histogram(
            "P: prefill finished -> its push done on every rank (the part of the push "
            "not hidden behind the prefill; a pipelined push overlaps it)",
            DURATION_BUCKETS,
        ),
        "kv_load_wait_seconds": Histogram(
            "D: blocks reserved -> the KV landed on every rank (P's queue, prefill and push)",
            DURATION_BUCKETS,
        ),
        "kv_notif_to_step_seconds": Histogram(
            "D: the last rank got its notification -> the engine step that saw it",
            DURATION_BUCKETS,
        ),
        "kv_transfer_descriptors": Histogram(
            "NIXL descriptors per transfer per rank (one per contiguous block run)",
            DESCRIPTOR_BUCKETS,
        ),
    }
