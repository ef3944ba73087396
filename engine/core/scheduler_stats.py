"""What the scheduler reports (typed: counters, gauges and histograms, see ``engine.stats``).

The request-level histograms and ``request_success`` are vLLM's (same names, buckets and
``model_name`` label), recorded by ``RequestMetrics`` from the scheduler's own timestamps:

- arrival: the request reached the engine (``Request.arrival_time``);
- scheduled: it was first admitted (blocks allocated: it runs, or waits for remote KV);
- first token: its first output token is in this engine -- sampled here, or, on a P/D
  decode node, the prefill node's first token arriving with the prompt's KV;
- each later token, and the end.

``time_to_first_token`` = first token - arrival (on a decode node it includes the wait for
the prefill node's KV, as on a vLLM decode instance); ``request_queue_time`` = scheduled -
arrival; ``request_prefill_time`` = first token - scheduled; ``request_decode_time`` = last
token - first token; ``request_inference_time`` = prefill + decode; ``e2e_request_latency``
= end - arrival; ``inter_token_latency`` (and its older name ``time_per_output_token``) is
observed once per token after the first: the time since the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.stats import (
    Histogram,
    HistogramValue,
    Stats,
    counter,
    gauge,
    histogram,
    labeled_counter,
)

if TYPE_CHECKING:
    from engine.core.request import Request

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Finish reasons counted by ``request_success`` (vLLM's; an engine error is not a success).
SUCCESS_REASONS = ("stop", "length", "abort")
# Finished requests waiting for their caller's finish reason (``RequestMetrics.finished``):
# past this many the oldest counts under the engine's reason.
MAX_UNSETTLED = 4096
# vLLM's sources of a prompt's KV (vllm:prompt_tokens_by_source_total{source}).
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


def _latency(doc: str, name: str, buckets: tuple[float, ...] = REQUEST_LATENCY_BUCKETS) -> Any:
    return histogram(doc, buckets, vllm=name, pdserve=False)


@dataclass
class SchedulerStats(Stats):
    num_running: int = gauge(
        "Requests running", metric="num_requests_running", vllm="num_requests_running"
    )
    num_waiting: int = gauge(
        "Requests waiting to be scheduled, or for their KV from a prefill node",
        metric="num_requests_waiting",
        vllm="num_requests_waiting",
    )
    num_waiting_for_remote_kv: int = gauge("Requests waiting for their KV from a prefill node")
    num_held: int = gauge("Finished requests whose blocks are held for a KV push")
    num_quarantined_blocks: int = gauge("Blocks a late KV write may still reach")
    # Not ..._total on the wire: Prometheus keeps that suffix for counters.
    kv_blocks_total: int = gauge("KV cache blocks per rank", metric="kv_blocks_capacity")
    kv_blocks_free: int = gauge("KV cache blocks free", metric="kv_blocks_free")
    kv_blocks_used: int = gauge("KV cache blocks in use", metric="kv_blocks_used")
    prompt_tokens_total: int = counter(
        "Prompt tokens computed by this node (prefix-cache hits and KV received from a "
        "prefill node are not; a prompt recomputed after a preemption is again)",
        metric="prompt_tokens",
    )
    prompt_tokens_processed_total: int = counter(
        "Prompt tokens of the requests that got their first token here, each prompt once: "
        "prefix-cache hits and KV received from a prefill node included (vLLM's count)",
        vllm="prompt_tokens",
        pdserve=False,
    )
    generation_tokens_total: int = counter(
        "Tokens generated", metric="generation_tokens", vllm="generation_tokens"
    )
    num_preemptions_total: int = counter("Requests preempted", vllm="num_preemptions")
    prompt_tokens_by_source_total: dict[str, int] = labeled_counter(
        "Prompt tokens of the requests that got their first token here (vllm:prompt_tokens) "
        "by where their KV came from: computed here, a prefix-cache hit here, or pushed by "
        "a prefill node",
        "source",
        PROMPT_SOURCES,
        vllm="prompt_tokens_by_source",
    )
    # Request-level (vLLM's names only; see the module docstring for what each measures).
    request_success_total: dict[str, int] = labeled_counter(
        "Finished requests by finish reason",
        "finished_reason",
        SUCCESS_REASONS,
        vllm="request_success",
        pdserve=False,
    )
    time_to_first_token_seconds: HistogramValue = _latency(
        "Time from the request's arrival to its first output token in this engine (on a "
        "decode node: the prefill node's first token arriving with the KV)",
        "time_to_first_token_seconds",
        TTFT_BUCKETS,
    )
    inter_token_latency_seconds: HistogramValue = _latency(
        "Time between two output tokens of a request", "inter_token_latency_seconds", ITL_BUCKETS
    )
    time_per_output_token_seconds: HistogramValue = _latency(
        "Time between two output tokens of a request (vLLM's older name of "
        "inter_token_latency_seconds)",
        "time_per_output_token_seconds",
        ITL_BUCKETS,
    )
    e2e_request_latency_seconds: HistogramValue = _latency(
        "Time from the request's arrival to its end", "e2e_request_latency_seconds"
    )
    request_queue_time_seconds: HistogramValue = _latency(
        "Time from the request's arrival until it was first scheduled",
        "request_queue_time_seconds",
    )
    request_inference_time_seconds: HistogramValue = _latency(
        "Time from first scheduled to the last token (prefill + decode)",
        "request_inference_time_seconds",
    )
    request_prefill_time_seconds: HistogramValue = _latency(
        "Time from first scheduled to the first output token (on a decode node: the wait "
        "for the prefill node's KV)",
        "request_prefill_time_seconds",
    )
    request_decode_time_seconds: HistogramValue = _latency(
        "Time from the first output token to the last", "request_decode_time_seconds"
    )
    request_prompt_tokens: HistogramValue = histogram(
        "Prompt tokens per finished request",
        buckets_1_2_5(1),
        vllm="request_prompt_tokens",
        pdserve=False,
    )
    request_generation_tokens: HistogramValue = histogram(
        "Output tokens per finished request",
        buckets_1_2_5(1),
        vllm="request_generation_tokens",
        pdserve=False,
    )

    @property
    def kv_cache_usage(self) -> float:
        total = self.kv_blocks_used + self.kv_blocks_free
        return self.kv_blocks_used / total if total else 0.0


@dataclass
class RequestMetrics:
    """The scheduler's request-level histograms and finish counts (engine thread only)."""

    max_model_len: int
    success: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SUCCESS_REASONS, 0))
    prompt_tokens_processed: int = 0  # whole prompts of the requests that got a token
    by_source: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROMPT_SOURCES, 0))
    # Requests that ended by themselves, waiting for their caller's word on the reason
    # (``finished``): (request, the engine's reason, when), in the order they ended.
    unsettled: dict[str, tuple[Request, str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        tokens = buckets_1_2_5(self.max_model_len)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = Histogram(tokens)
        self.generation_tokens = Histogram(tokens)

    @staticmethod
    def scheduled(req: Request, now: float) -> None:
        if req.scheduled_time is None:
            req.scheduled_time = now

    def token(self, req: Request, now: float) -> None:
        """An output token was appended to ``req`` at ``now``."""
        if req.first_token_time is None:
            req.first_token_time = now
            self.ttft.observe(now - req.arrival_time)
            self.prompt_tokens_processed += req.num_prompt_tokens  # vLLM's: once, whole
            prompt, cached = req.num_prompt_tokens, req.num_cached_prompt_tokens
            external = min(req.num_external_prompt_tokens, prompt - cached)
            self.by_source["local_cache_hit"] += cached
            self.by_source["external_kv_transfer"] += external
            self.by_source["local_compute"] += prompt - cached - external
        elif req.last_token_time is not None:
            self.itl.observe(now - req.last_token_time)
        req.last_token_time = now

    def finished(self, req: Request, reason: str | None, now: float) -> None:
        """``req`` ended by itself (``reason``: the engine's). One whose caller checks stop
        strings on its text (``SamplingParams.stop``: a node's request, the offline
        ``LLM``'s) waits for the caller's word (``settle``): a stop string that came with
        the token that ended it anyway, or while the engine was ending it, makes it a
        "stop" -- as vLLM, whose output processor decides and counts the finish reason."""
        if reason in ("stop", "length") and req.sampling_params.stop:
            self.unsettled[req.request_id] = (req, reason, now)
            if len(self.unsettled) > MAX_UNSETTLED:  # a caller that never settles: the oldest
                self.settle(next(iter(self.unsettled)), stop_string=False)
            return
        self.count(req, reason, now)

    def settle(self, request_id: str, stop_string: bool) -> None:
        """The caller has ``request_id``'s answer: it ended at a stop string, or not (then
        its reason is the engine's). Counts a request ``finished`` left waiting for this
        (else nothing)."""
        entry = self.unsettled.pop(request_id, None)
        if entry is not None:
            req, reason, now = entry
            self.count(req, "stop" if stop_string else reason, now)

    def count(self, req: Request, reason: str | None, now: float) -> None:
        """``req`` finished at ``now`` with ``reason``: its finish count and histograms."""
        if reason not in self.success:
            return  # an engine error: not a success, not a latency sample
        self.success[reason] += 1
        self.e2e.observe(now - req.arrival_time)
        scheduled = req.scheduled_time if req.scheduled_time is not None else now
        first = req.first_token_time if req.first_token_time is not None else now
        last = req.last_token_time if req.last_token_time is not None else now
        self.queue.observe(scheduled - req.arrival_time)
        self.prefill.observe(max(0.0, first - scheduled))
        self.decode.observe(max(0.0, last - first))
        self.inference.observe(max(0.0, last - scheduled))
        self.prompt_tokens.observe(req.num_prompt_tokens)
        self.generation_tokens.observe(req.num_output_tokens)

    def stats(self) -> dict[str, object]:
        """The ``SchedulerStats`` fields this object fills."""
        itl = self.itl.snapshot()
        return {
            "prompt_tokens_processed_total": self.prompt_tokens_processed,
            "prompt_tokens_by_source_total": dict(self.by_source),
            "request_success_total": dict(self.success),
            "time_to_first_token_seconds": self.ttft.snapshot(),
            "inter_token_latency_seconds": itl,
            "time_per_output_token_seconds": itl,
            "e2e_request_latency_seconds": self.e2e.snapshot(),
            "request_queue_time_seconds": self.queue.snapshot(),
            "request_inference_time_seconds": self.inference.snapshot(),
            "request_prefill_time_seconds": self.prefill.snapshot(),
            "request_decode_time_seconds": self.decode.snapshot(),
            "request_prompt_tokens": self.prompt_tokens.snapshot(),
            "request_generation_tokens": self.generation_tokens.snapshot(),
        }
