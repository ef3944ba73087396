"""What the scheduler reports (typed: counters and gauges, see ``engine.stats``)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.stats import Stats, counter, gauge


@dataclass
class SchedulerStats(Stats):
    num_running: int = gauge(
        "Requests running", metric="num_requests_running", vllm="num_requests_running"
    )
    num_waiting: int = gauge(
        "Requests waiting to be scheduled",
        metric="num_requests_waiting",
        vllm="num_requests_waiting",
    )
    num_waiting_for_remote_kv: int = gauge("Requests waiting for their KV from a prefill node")
    num_held: int = gauge("Finished requests whose blocks are held for a KV push")
    num_quarantined_blocks: int = gauge("Blocks a late KV write may still reach")
    kv_blocks_total: int = gauge("KV cache blocks per rank")
    kv_blocks_free: int = gauge("KV cache blocks free", metric="kv_blocks_free")
    kv_blocks_used: int = gauge("KV cache blocks in use", metric="kv_blocks_used")
    prompt_tokens_total: int = counter(
        "Prompt tokens computed", metric="prompt_tokens", vllm="prompt_tokens"
    )
    generation_tokens_total: int = counter(
        "Tokens generated", metric="generation_tokens", vllm="generation_tokens"
    )
    num_preemptions_total: int = counter("Requests preempted", vllm="num_preemptions")

    @property
    def kv_cache_usage(self) -> float:
        total = self.kv_blocks_used + self.kv_blocks_free
        return self.kv_blocks_used / total if total else 0.0
