"""Typed stats: counters export as Prometheus counters, gauges as gauges, per-rank stats add
up, and vLLM's names are there for dashboards built for vLLM."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.core.scheduler_stats import SchedulerStats
from engine.server.metrics import ServerMetrics
from engine.stats import StatsGroup
from kvconnector.nixl.stats import NixlSchedulerStats, NixlWorkerStats


class _Engine:
    model_name = "m1"
    healthy = True

    def __init__(self, stats: StatsGroup) -> None:
        self._stats = stats

    def stats(self) -> StatsGroup:
        return self._stats


def _families(stats: StatsGroup) -> dict[str, tuple[str, dict]]:
    text = ServerMetrics(_Engine(stats)).render().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out[sample.name] = (fam.type, {**sample.labels, "value": sample.value})
    return out


def test_counters_are_counters_and_gauges_are_gauges():
    sched = SchedulerStats(
        num_running=3, num_waiting=2, kv_blocks_used=30, kv_blocks_free=70,
        prompt_tokens_total=500, generation_tokens_total=40, num_preemptions_total=1,
    )  # fmt: skip
    conn = NixlSchedulerStats(kv_transfers_started_total=7, kv_transfers_in_flight=2)
    fams = _families(StatsGroup(sched, conn, NixlWorkerStats(kv_bytes_sent_total=4096)))
    assert fams["pdserve_prompt_tokens_total"] == ("counter", {"value": 500.0})
    assert fams["pdserve_engine_kv_transfers_started_total"][0] == "counter"
    assert fams["pdserve_engine_kv_bytes_sent_total"] == ("counter", {"value": 4096.0})
    assert fams["pdserve_engine_num_preemptions_total"][0] == "counter"
    assert fams["pdserve_num_requests_running"] == ("gauge", {"value": 3.0})
    assert fams["pdserve_engine_kv_transfers_in_flight"] == ("gauge", {"value": 2.0})
    assert fams["pdserve_kv_cache_usage_ratio"] == ("gauge", {"value": 0.3})


def test_vllm_names_carry_the_model_label():
    fams = _families(StatsGroup(SchedulerStats(num_waiting=5, kv_blocks_used=1, kv_blocks_free=3)))
    assert fams["vllm:num_requests_waiting"] == ("gauge", {"model_name": "m1", "value": 5.0})
    assert fams["vllm:kv_cache_usage_perc"] == ("gauge", {"model_name": "m1", "value": 0.25})
    assert fams["vllm:prompt_tokens_total"][0] == "counter"


def test_the_kv_cache_usage_under_vllms_older_name_too():
    """vLLM's own Grafana dashboard (examples/online_serving/prometheus_grafana) and the
    autoscalers written from it read ``vllm:gpu_cache_usage_perc`` (vLLM <= 0.10's name of
    ``kv_cache_usage_perc``), as its TPOT panel reads ``time_per_output_token_seconds``,
    which the nodes export: its "Cache Utilization" panel stayed empty (a walkthrough)."""
    fams = _families(StatsGroup(SchedulerStats(kv_blocks_used=1, kv_blocks_free=3)))
    assert fams["vllm:gpu_cache_usage_perc"] == ("gauge", {"model_name": "m1", "value": 0.25})


def test_per_rank_stats_add_up_and_a_group_reads_by_name():
    a = NixlWorkerStats(kv_bytes_sent_total=10, kv_rank_transfers_done_total=1)
    b = NixlWorkerStats(kv_bytes_sent_total=5, kv_rank_transfers_done_total=1)
    total = a + b
    assert total.kv_bytes_sent_total == 15 and total.kv_rank_transfers_done_total == 2
    group = StatsGroup(SchedulerStats(kv_blocks_free=9), total)
    assert group["kv_blocks_free"] == 9 and group["kv_bytes_sent_total"] == 15
    assert group.get("missing", -1) == -1 and "kv_blocks_free" in group


def test_only_counters_end_with_total():
    """Prometheus reserves ``_total`` for counters: a gauge named ``..._total``
    (``pdserve_engine_kv_blocks_total``, the pool's size) reads as a counter to an
    operator and to ``rate()`` in a dashboard."""
    from engine.core.scheduler_stats import RequestMetrics

    sched = SchedulerStats(kv_blocks_total=100, kv_blocks_free=70, kv_blocks_used=30,
                           **RequestMetrics(max_model_len=64).stats())  # fmt: skip
    text = ServerMetrics(_Engine(StatsGroup(sched, NixlSchedulerStats(), NixlWorkerStats())))
    for fam in text_string_to_metric_families(text.render().decode()):
        for sample in fam.samples:
            if sample.name.endswith("_total"):
                assert fam.type == "counter", (sample.name, fam.type)
    fams = _families(StatsGroup(sched))
    assert fams["pdserve_kv_blocks_capacity"] == ("gauge", {"value": 100.0})
