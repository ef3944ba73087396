"""vLLM's request-level metrics on a node: ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds`` (and its older name ``time_per_output_token``),
``vllm:e2e_request_latency_seconds``, the queue/prefill/decode/inference times, the prompt and
generation token histograms and ``vllm:request_success_total{finished_reason}`` -- recorded
by the scheduler, exported as histograms with vLLM's buckets and the ``model_name`` label.

The unit tests drive the real scheduler with fake model outputs (a fake connector for the
decode side of P/D); the live tests read ``GET /metrics`` of a node and of a P/D pair after
requests, so a series that disappears or stops counting fails here.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fakes import RemotePrefill
from harness import GREEDY, MODEL, Proc, Procs, parse_metric
from prometheus_client.parser import text_string_to_metric_families

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput
from engine.core.scheduler_stats import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    SchedulerStats,
    buckets_1_2_5,
)
from engine.sampling_params import SamplingParams
from engine.server.metrics import ServerMetrics
from engine.stats import StatsGroup
from kvconnector.noop import NoopConnectorScheduler
from kvconnector.params import KVTransferParams

MAX_LEN = 256

# Every request-level histogram a vLLM dashboard reads, by its vLLM name.
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
)
PER_REQUEST = tuple(h for h in HISTOGRAMS if "token_latency" not in h and "per_output" not in h)


def _config() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=MAX_LEN, dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=64),
    )


def _run(sch: Scheduler, tokens: dict[str, list[int]]) -> None:
    """Step until every request finished, sampling each request's next token from ``tokens``."""
    for _ in range(100):
        sched = sch.schedule()
        sampled = {s.request_id: tokens[s.request_id].pop(0) for s in sched.seqs if s.samples}
        sch.update_from_output(sched, ModelRunnerOutput(sampled_token_ids=sampled))
        if not sch.requests:
            return
    raise AssertionError("requests did not finish")


class _Engine:
    healthy = True

    def __init__(self, stats: Any, model: str = "m1") -> None:
        self.model_name, self._stats = model, stats

    def stats(self) -> Any:
        return self._stats


def _families(stats: Any, model: str = "m1") -> dict[str, Any]:
    text = ServerMetrics(_Engine(stats, model)).render().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _by_source(fams: dict[str, Any]) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total`` by its ``source`` label."""
    fam = fams["vllm:prompt_tokens_by_source"]
    assert fam.type == "counter"
    return {s.labels["source"]: s.value for s in fam.samples if s.name.endswith("_total")}


def test_scheduler_records_a_request_in_every_histogram() -> None:
    sch = Scheduler(_config(), 64, MAX_LEN, NoopConnectorScheduler(_config(), None))  # type: ignore[arg-type]
    sch.add_request(Request("a", list(range(1, 11)), SamplingParams(max_tokens=4)))
    sch.add_request(Request("b", [5, 6, 7], SamplingParams(max_tokens=8), eos_token_ids=[257]))
    _run(sch, {"a": [1, 2, 3, 4], "b": [9, 257]})  # a: length after 4, b: EOS after 2
    st = sch.stats()
    assert st.request_success_total == {"stop": 1, "length": 1, "abort": 0}
    assert st.time_to_first_token_seconds.count == 2
    assert st.inter_token_latency_seconds.count == (4 - 1) + (2 - 1)
    assert st.time_per_output_token_seconds == st.inter_token_latency_seconds
    for name in (
        "e2e_request_latency_seconds", "request_queue_time_seconds",
        "request_prefill_time_seconds", "request_decode_time_seconds",
        "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
    ):  # fmt: skip
        assert getattr(st, name).count == 2, name
    assert st.request_prompt_tokens.sum == 10 + 3
    assert st.request_generation_tokens.sum == 4 + 2
    assert st.request_prompt_tokens.buckets == buckets_1_2_5(MAX_LEN)
    # e2e covers queue + prefill + decode of the same request.
    assert st.e2e_request_latency_seconds.sum >= st.request_decode_time_seconds.sum


def test_an_abort_counts_and_an_error_does_not() -> None:
    sch = Scheduler(_config(), 64, MAX_LEN, NoopConnectorScheduler(_config(), None))  # type: ignore[arg-type]
    sch.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4)))
    sch.add_request(Request("e", [1, 2, 3], SamplingParams(max_tokens=4)))
    sch.abort_request("a")
    sch.abort_request("e", error="engine failed")
    st = sch.stats()
    assert st.request_success_total == {"stop": 0, "length": 0, "abort": 1}
    assert st.e2e_request_latency_seconds.count == 1
    assert st.time_to_first_token_seconds.count == 0  # no token came


def test_a_request_its_caller_ended_at_a_stop_string_counts_as_stop() -> None:
    """A node (or ``LLM``) ends an answer at a stop string by aborting its engine request:
    that is a "stop" (vLLM's output processor counts it so), not an "abort". A request
    with stop strings that ended by itself is counted once its caller said whether a stop
    string came with its last tokens: "stop" if so (also when the word is the abort of a
    stop string the engine had already ended), the engine's reason if not."""
    sch = Scheduler(_config(), 64, MAX_LEN, NoopConnectorScheduler(_config(), None))  # type: ignore[arg-type]
    for rid in ("cut", "last", "plain", "late"):
        sch.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=2, stop=["x"])))
    sched = sch.schedule()
    sch.update_from_output(
        sched, ModelRunnerOutput(sampled_token_ids={s.request_id: 7 for s in sched.seqs})
    )
    sch.abort_request("cut", reason="stop")  # its stop string, mid-answer
    assert sch.stats().request_success_total == {"stop": 1, "length": 0, "abort": 0}
    _run(sch, {rid: [8] for rid in ("last", "plain", "late")})  # all ended by length
    assert sch.stats().request_success_total == {"stop": 1, "length": 0, "abort": 0}
    sch.settle("last", stop_string=True)  # the stop string came with the last token
    sch.settle("plain", stop_string=False)
    sch.abort_request("late", reason="stop")  # the node's abort came after the end
    sch.settle("late", stop_string=False)  # (counted once)
    st = sch.stats()
    assert st.request_success_total == {"stop": 3, "length": 1, "abort": 0}
    assert st.e2e_request_latency_seconds.count == 4
    assert st.request_generation_tokens.sum == 1 + 2 + 2 + 2


def _decode_node_waiting_for_kv(max_tokens: int) -> tuple[Scheduler, RemotePrefill]:
    """A P/D decode node's scheduler with request ``d`` (an 8-token prompt) reserved and
    waiting for its KV; set ``conn.landed`` to land it."""
    conn = RemotePrefill(_config())
    sch = Scheduler(_config(), 64, MAX_LEN, conn)
    params = KVTransferParams(
        do_remote_prefill=True, transfer_id="t", remote_side_channel="tcp://127.0.0.1:1"
    )
    sch.add_request(
        Request(
            "d", list(range(1, 9)), SamplingParams(max_tokens=max_tokens), kv_transfer_params=params
        )
    )
    sch.update_from_output(sch.schedule(), ModelRunnerOutput())  # reserved, waiting for KV
    return sch, conn


def test_decode_node_ttft_is_the_first_token_arriving_with_the_kv() -> None:
    """On a P/D decode node the first token is the prefill node's, arriving with the KV:
    TTFT ends there (it includes the KV wait, as on a vLLM decode instance), the wait counts
    as prefill time, and inter-token latency starts from it."""
    sch, conn = _decode_node_waiting_for_kv(max_tokens=3)
    assert sch.stats().time_to_first_token_seconds.count == 0
    conn.landed = {"d": {"first_token": 42}}
    sch.update_from_output(sch.schedule(), ModelRunnerOutput())
    st = sch.stats()
    assert st.time_to_first_token_seconds.count == 1
    assert st.inter_token_latency_seconds.count == 0
    _run(sch, {"d": [43, 44]})
    st = sch.stats()
    assert st.inter_token_latency_seconds.count == 2
    assert st.request_generation_tokens.sum == 3  # P's first token counts, as in vLLM
    assert st.request_success_total["length"] == 1
    assert st.request_prefill_time_seconds.count == 1


def _value(fams: dict[str, Any], name: str) -> float:
    (sample,) = [s for s in fams[name].samples if s.name == name + "_total"]
    return sample.value


def test_vllm_prompt_tokens_count_each_prompt_once_prefix_cache_hits_included() -> None:
    """``vllm:prompt_tokens_total`` is vLLM's: every request's whole prompt, once, when its
    first token comes -- prefix-cache hits included; what this node computed is
    ``pdserve_prompt_tokens_total``."""
    sch = Scheduler(_config(), 64, MAX_LEN, NoopConnectorScheduler(_config(), None))  # type: ignore[arg-type]
    prompt = list(range(1, 13))  # 3 blocks of 4
    sch.add_request(Request("a", prompt, SamplingParams(max_tokens=2)))
    _run(sch, {"a": [1, 2]})
    sch.add_request(Request("b", prompt, SamplingParams(max_tokens=2)))  # a prefix-cache hit
    _run(sch, {"b": [1, 2]})
    computed = sch.stats().prompt_tokens_total
    assert computed < 2 * len(prompt)  # b's cached blocks were not computed again
    fams = _families(StatsGroup(sch.stats()))
    assert _value(fams, "vllm:prompt_tokens") == 2 * len(prompt)
    assert fams["vllm:prompt_tokens"].type == "counter"
    assert _value(fams, "pdserve_prompt_tokens") == computed
    # vLLM's breakdown: b's cached blocks are the cache hits, the rest was computed here.
    assert _by_source(fams) == {"local_compute": computed, "local_cache_hit": 2 * len(prompt) - computed,
                                "external_kv_transfer": 0}  # fmt: skip


def test_decode_node_counts_the_prompt_it_received_as_vllm_does() -> None:
    """A P/D decode node computed none of the prompt (``pdserve_prompt_tokens_total`` stays
    0), but counts it in ``vllm:prompt_tokens_total`` as a vLLM decode instance does (its
    prompt tokens by source ``external_kv_transfer``)."""
    sch, conn = _decode_node_waiting_for_kv(max_tokens=2)
    conn.landed = {"d": {"first_token": 42}}
    sch.update_from_output(sch.schedule(), ModelRunnerOutput())
    _run(sch, {"d": [43]})
    fams = _families(StatsGroup(sch.stats()))
    assert _value(fams, "vllm:prompt_tokens") == 8
    assert _value(fams, "pdserve_prompt_tokens") == 0
    assert _value(fams, "vllm:generation_tokens") == 2  # P's first token counts, as in vLLM
    assert _by_source(fams) == {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 8}


def test_decode_node_counts_a_request_waiting_for_its_kv_as_waiting() -> None:
    """A decode node's request waiting for P's KV is in ``vllm:num_requests_waiting`` (as
    on a vLLM decode instance, whose waiting queue holds it): a decode node with requests
    waiting for KV does not read as idle."""
    sch, conn = _decode_node_waiting_for_kv(max_tokens=2)
    st = sch.stats()
    assert st.num_waiting_for_remote_kv == 1
    text = ServerMetrics(_Engine(st)).render().decode()
    assert parse_metric(text, "vllm:num_requests_waiting", {"model_name": "m1"}) == 1
    assert parse_metric(text, "pdserve_num_requests_waiting") == 1
    conn.landed = {"d": {"first_token": 42}}
    sch.update_from_output(sch.schedule(), ModelRunnerOutput())
    st = sch.stats()
    assert (st.num_waiting, st.num_running) == (0, 1)


def test_exported_as_vllm_histograms_with_model_label_and_vllm_buckets() -> None:
    sch = Scheduler(_config(), 64, MAX_LEN, NoopConnectorScheduler(_config(), None))  # type: ignore[arg-type]
    sch.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=3)))
    _run(sch, {"a": [1, 2, 3]})
    fams = _families(StatsGroup(sch.stats()))
    for name in HISTOGRAMS:
        fam = fams[name]
        assert fam.type == "histogram", name
        count = [s for s in fam.samples if s.name == name + "_count"]
        assert count and count[0].labels == {"model_name": "m1"}, name
        assert count[0].value == (2 if name in ITL_NAMES else 1), name
        assert "pdserve_engine_" + name.removeprefix("vllm:") not in fams, name  # vLLM's only
    les = {
        name: [float(s.labels["le"]) for s in fams[name].samples if s.name.endswith("_bucket")]
        for name in HISTOGRAMS
    }
    inf = float("inf")
    assert les["vllm:time_to_first_token_seconds"] == [*TTFT_BUCKETS, inf]
    assert les["vllm:inter_token_latency_seconds"] == [*ITL_BUCKETS, inf]
    assert les["vllm:e2e_request_latency_seconds"] == [*REQUEST_LATENCY_BUCKETS, inf]
    assert les["vllm:request_prompt_tokens"] == [*buckets_1_2_5(MAX_LEN), inf]
    success = {
        s.labels["finished_reason"]: (s.labels["model_name"], s.value)
        for s in fams["vllm:request_success"].samples
    }
    assert fams["vllm:request_success"].type == "counter"
    assert success == {"stop": ("m1", 0.0), "length": ("m1", 1.0), "abort": ("m1", 0.0)}


ITL_NAMES = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")


def test_series_exist_before_any_request() -> None:
    """A fresh node exports every series (zero counts), so dashboards and alerts see them."""
    fams = _families(StatsGroup(SchedulerStats()))
    for name in HISTOGRAMS:
        assert fams[name].type == "histogram", name
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}


def test_histogram_snapshots_add_up() -> None:
    a = SchedulerStats(request_success_total={"stop": 1, "length": 0, "abort": 0})
    b = SchedulerStats(request_success_total={"stop": 2, "length": 1, "abort": 0})
    assert (a + b).request_success_total == {"stop": 3, "length": 1, "abort": 0}
    assert (a + b)["request_success_total"] == 4
    assert (a + b).time_to_first_token_seconds.count == 0


# -- live: a node's /metrics after requests ----------------------------------------------------


VLLM_PROMPT, LABEL = "vllm:prompt_tokens_total", {"model_name": MODEL}


def _counts(proc: Proc) -> dict[str, float]:
    text = httpx.get(proc.url + "/metrics", timeout=10).text
    label = {"model_name": MODEL}
    out = {name: parse_metric(text, name + "_count", label) for name in HISTOGRAMS}
    for reason in ("stop", "length", "abort"):
        out[reason] = parse_metric(
            text, "vllm:request_success_total", {**label, "finished_reason": reason}
        )
    return out


def _complete(url: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "metrics " * 5, "max_tokens": max_tokens, **GREEDY, **extra}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.slow
def test_node_metrics_count_every_request(module_procs: Procs) -> None:
    node = module_procs.node("--model", MODEL, "--num-blocks", "128")
    before = _counts(node)
    for _ in range(2):
        _complete(node.url, 4, ignore_eos=True)
    after = _counts(node)
    for name in PER_REQUEST:
        assert after[name] - before[name] == 2, name
    for name in ITL_NAMES:
        assert after[name] - before[name] == 2 * 3, name
    assert after["length"] - before["length"] == 2
    text = httpx.get(node.url + "/metrics", timeout=10).text
    assert parse_metric(text, "vllm:request_generation_tokens_sum", {"model_name": MODEL}) >= 8


@pytest.mark.slow
def test_pd_decode_and_prefill_nodes_count_requests(pd_pair: Any, module_procs: Procs) -> None:
    """Through a proxy on a P/D pair: P records one request with one token, D a request
    whose first token arrived with the KV and whose later ones it generated."""
    proxy = module_procs.proxy([pd_pair.p.url], [pd_pair.d.url])
    p_before, d_before = _counts(pd_pair.p), _counts(pd_pair.d)
    d_prompt = (
        pd_pair.d.metric(VLLM_PROMPT, LABEL),
        pd_pair.d.metric("pdserve_prompt_tokens_total"),
    )
    usage = _complete(proxy.url, 4, ignore_eos=True)["usage"]
    p_after, d_after = _counts(pd_pair.p), _counts(pd_pair.d)
    # D computed none of the prompt, and counts it under vLLM's name as a vLLM decode does.
    assert pd_pair.d.metric(VLLM_PROMPT, LABEL) - d_prompt[0] == usage["prompt_tokens"]
    assert pd_pair.d.metric("pdserve_prompt_tokens_total") == d_prompt[1]
    for name in PER_REQUEST:
        assert p_after[name] - p_before[name] == 1, ("prefill", name)
        assert d_after[name] - d_before[name] == 1, ("decode", name)
    assert p_after["length"] - p_before["length"] == 1
    assert d_after["length"] - d_before["length"] == 1
    for name in ITL_NAMES:
        assert p_after[name] == p_before[name], name  # P made one token only
        assert d_after[name] - d_before[name] == 3, name
