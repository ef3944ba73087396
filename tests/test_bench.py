"""pd-bench: stats helpers, offline runs on 'tiny' and a random checkpoint, serve against a
real node process."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO_ROOT, Proc, Procs, wait_healthy

from engine.bench.stats import (
    RequestResult,
    ServeSummary,
    Summary,
    count_good,
    meets_slo,
    percentile,
)

# ---------------------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------------------


def test_percentile_matches_linear_interpolation():
    xs = [float(x) for x in range(1, 11)]  # 1..10
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 10.0
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile(list(reversed(xs)), 25) == pytest.approx(3.25)  # order does not matter
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_summary_of_known_data_and_scaling():
    s = Summary.of([0.001, 0.002, 0.003, 0.004])
    assert s.n == 4
    assert s.mean == pytest.approx(0.0025)
    assert s.median == pytest.approx(0.0025)
    assert s.min == 0.001 and s.max == 0.004
    ms = s.scaled(1e3)
    assert ms.mean == pytest.approx(2.5) and ms.p99 == pytest.approx(3.97)
    assert ms.n == 4
    empty = Summary.of([])
    assert empty.n == 0 and empty.to_dict()["mean"] is None  # NaN is written as null


def _result(ttft: float, itl: list[float], ok: bool = True, out: int | None = None):
    out = len(itl) + 1 if out is None else out
    e2e = ttft + sum(itl)
    return RequestResult(ok=ok, prompt_tokens=10, output_tokens=out, ttft=ttft, itl=itl, e2e=e2e)


def test_tpot_and_goodput_counting():
    r = _result(0.1, [0.01, 0.03, 0.02])
    assert r.tpot == pytest.approx(0.06 / 3)
    assert r.max_itl == pytest.approx(0.03)
    assert _result(0.1, [], out=1).tpot is None

    results = [
        _result(0.05, [0.01, 0.01]),  # good
        _result(0.20, [0.01, 0.01]),  # TTFT too slow
        _result(0.05, [0.01, 0.09]),  # one gap too slow (the largest ITL counts)
        _result(0.05, [0.01], ok=False),  # failed requests are never good
        _result(0.10, [0.02, 0.02]),  # exactly at both SLOs: good
    ]
    assert count_good(results, 0.1, 0.02) == 2
    assert count_good(results, None, 0.02) == 3
    assert count_good(results, 0.1, None) == 3
    assert count_good(results, None, None) == 4
    assert not meets_slo(RequestResult(ok=True), None, None)  # no token ever came

    summary = ServeSummary.of(results, duration_s=2.0, slo_ttft_ms=100, slo_itl_ms=20)
    assert summary.completed == 4 and summary.failed == 1
    assert summary.good_requests == 2 and summary.goodput == pytest.approx(1.0)
    assert summary.request_throughput == pytest.approx(2.0)
    assert summary.total_output_tokens == 3 + 3 + 3 + 3
    assert summary.output_throughput == pytest.approx(6.0)
    assert summary.total_token_throughput == pytest.approx((40 + 12) / 2)
    assert summary.itl_ms.n == 8
    assert summary.ttft_ms.median == pytest.approx(75.0)  # of 50, 50, 100, 200
    d = summary.to_dict()
    json.dumps(d)
    assert d["ttft_ms"]["p99"] == pytest.approx(summary.ttft_ms.p99)
    assert "Request goodput" in summary.format()
    assert ServeSummary.of(results, 2.0).goodput is None  # no SLO given: no goodput


def _ms_rows(text: str) -> list[str]:
    """The latency rows of a printed report, e.g. 'P99 TTFT', in order."""
    return [line.split(" (ms):")[0] for line in text.splitlines() if " (ms):" in line]


def test_serve_summary_prints_and_writes_the_chosen_metrics_and_percentiles():
    """``--percentile-metrics``/``--metric-percentiles`` as vLLM's bench: the chosen metrics
    (in vLLM's order) with mean, median and each percentile; the JSON keys vLLM writes."""
    results = [_result(0.05, [0.01, 0.02]), _result(0.10, [0.03, 0.01]), _result(0.2, [0.04])]
    s = ServeSummary.of(
        results, 1.0, percentile_metrics=("e2el", "itl"), metric_percentiles=(50, 99.9)
    )
    stats = ("Mean", "Median", "P50", "P99.9")
    assert _ms_rows(s.format()) == [f"{x} {m}" for m in ("ITL", "E2E") for x in stats]
    d = s.to_dict()
    json.dumps(d)
    for m, summ in (("itl", s.itl_ms), ("e2el", s.e2e_ms)):
        assert d[f"mean_{m}_ms"] == pytest.approx(summ.mean)
        assert d[f"median_{m}_ms"] == pytest.approx(summ.median)
        assert d[f"std_{m}_ms"] == pytest.approx(summ.std)
        assert d[f"p50_{m}_ms"] == pytest.approx(summ.median)
        assert d[f"p99.9_{m}_ms"] == pytest.approx(summ.p99, rel=0.01)
    assert not [k for k in d if re.fullmatch(r"(mean|median|std|p[\d.]+)_(ttft|tpot)_ms", k)]
    # The defaults print what pd-bench always printed: every metric, mean/median/p90/p99.
    s = ServeSummary.of(results, 1.0)
    stats = ("Mean", "Median", "P90", "P99")
    metrics = ("TTFT", "TPOT", "ITL", "E2E")
    assert _ms_rows(s.format()) == [f"{x} {m}" for m in metrics for x in stats]
    d = s.to_dict()
    assert d["p90_ttft_ms"] == pytest.approx(s.ttft_ms.p90) and "p99_e2el_ms" in d
    assert d["ttft_ms"]["p99"] == pytest.approx(s.ttft_ms.p99)  # the summaries stay


def test_serve_report_lines_fit_80_columns():
    """The goodput rows fit the table (they ran past it) and a long error message wraps."""
    msg = "HTTP 400: " + " ".join(f"token id {600 + i} is out of range" for i in range(6))
    results = [_result(0.05, [0.01]), RequestResult(ok=False, error=msg)]
    s = ServeSummary.of(results, 1.0, slo_ttft_ms=123456.5, slo_itl_ms=25000.25)
    lines = s.format().splitlines()
    assert max(map(len, lines)) <= 80, lines
    width = len(lines[0])  # the ==== Serving Benchmark Result ==== line
    assert all(len(line) <= width for line in lines if "error" not in line and line[0] != " ")
    text = " ".join(s.format().split())
    assert msg in text and "123456.5" in text and "25000.25" in text
    assert "Request goodput (req/s):" in text


def test_serve_helpers_without_a_server():
    from engine.bench.serve import _chunk_tokens, arrival_delays, make_prompts

    a = make_prompts(3, 16, "ids", (3, 256), seed=1)
    b = make_prompts(3, 16, "ids", (3, 256), seed=1)
    assert [p.prompt for p in a] == [p.prompt for p in b]  # seeded
    assert all(len(p.prompt) == 16 and all(3 <= t < 256 for t in p.prompt) for p in a)
    assert len({p.prompt[0] for p in make_prompts(20, 16, "ids", (3, 256), 2)}) > 1
    text = make_prompts(2, 5, "text", (3, 256), seed=1)
    assert all(isinstance(p.prompt, str) and len(p.prompt.split()) == 5 for p in text)
    shared = make_prompts(6, 16, "ids", (3, 256), 1, prefix_len=10, num_prefixes=2)
    assert all(len(p.prompt) == 16 for p in shared)
    assert [p.prompt[:10] for p in shared[::2]] == [shared[0].prompt[:10]] * 3
    assert shared[0].prompt[:10] != shared[1].prompt[:10] and shared[0] != shared[2]
    words = make_prompts(4, 8, "text", (3, 256), 1, prefix_len=6, num_prefixes=1)
    assert len({" ".join(p.prompt.split()[:6]) for p in words}) == 1
    assert arrival_delays(4, math.inf, 0) == [0.0] * 4
    d = arrival_delays(2000, 100.0, 0)
    assert d == sorted(d) and d[-1] / 2000 == pytest.approx(0.01, rel=0.1)
    assert _chunk_tokens({"choices": [{"text": "ab", "token_ids": [1, 2]}]}) == 2
    assert _chunk_tokens({"choices": [{"text": "", "token_ids": [5]}]}) == 1
    assert _chunk_tokens({"choices": [{"text": "x"}]}) == 1  # servers without token_ids
    assert _chunk_tokens({"choices": [{"delta": {"content": "x"}}]}) == 1
    assert _chunk_tokens({"choices": [], "usage": {"completion_tokens": 3}}) == 0


def _read_responses(events: list[object]) -> RequestResult:
    """``engine.bench.responses.read_events`` on a scripted stream (each event a JSON
    ``data:`` line after its ``event:`` line, as a node sends them)."""
    import asyncio

    from engine.bench.responses import read_events

    async def lines():
        for e in events:
            kind = e.get("type", "x") if isinstance(e, dict) else "x"
            yield f"event: {kind}"
            yield "data: " + json.dumps(e)
            yield ""

    r = RequestResult(prompt_tokens=5)
    asyncio.run(read_events(lines(), r, 0.0))
    return r


def test_serve_times_a_responses_stream_on_its_deltas_and_counts_its_usage():
    def delta(kind: str, text: str) -> dict:
        return {"type": f"response.{kind}.delta", "delta": text}

    usage = {"input_tokens": 11, "output_tokens": 7, "total_tokens": 18,
             "output_tokens_details": {"reasoning_tokens": 2}}  # fmt: skip
    final = {"type": "response.incomplete", "response": {"status": "incomplete", "usage": usage}}
    r = _read_responses([
        {"type": "response.created", "response": {}},
        delta("reasoning_text", "hm"), delta("output_text", "a"), delta("output_text", ""),
        {"type": "response.output_text.done", "text": "ab"}, delta("output_text", "b"),
        delta("function_call_arguments", "{}"), final, delta("output_text", "after the end"),
    ])  # fmt: skip
    assert r.ok and r.error is None
    assert r.ttft is not None and r.ttft > 0 and len(r.itl) == 3  # 4 deltas with text
    assert r.output_tokens == 7 == r.usage_completion_tokens and r.prompt_tokens == 11
    assert r.e2e is not None and r.e2e >= r.ttft and r.tpot is not None
    completed = {**final, "type": "response.completed"}
    assert _read_responses([delta("output_text", "a"), completed]).ok
    # Failures: the server's error, a stream cut before its end, no usage, no text.
    failed = {"type": "response.failed",
              "response": {"error": {"code": "server_error", "message": "boom"}}}  # fmt: skip
    for events, why in [
        ([delta("output_text", "a"), failed], "stream error: boom"),
        ([{"type": "error", "message": "x", "error": {"message": "overloaded"}}],
         "stream error: overloaded"),
        ([{"error": {"message": "bad"}}], "stream error: bad"),  # a chat-style error event
        ([delta("output_text", "a"),  # OpenAI's (pdserve's) error event, then failed
          {"type": "error", "code": "c", "message": "boom", "param": None}, failed],
         "stream error: boom"),
        ([delta("output_text", "a")], "without response.completed"),
        ([delta("output_text", "a"), {"type": "response.completed", "response": {}}],
         "no usage.output_tokens"),
        ([delta("output_text", "a"), {"type": "response.completed", "response": {
            "usage": {"output_tokens": "7"}}}], "no usage.output_tokens"),
        ([delta("output_text", "a"), {"type": "response.completed", "response": "x"}],
         "without response.completed"),
        (["junk", 3, completed], "no text received (7 output tokens)"),
    ]:  # fmt: skip
        r = _read_responses(events)
        assert not r.ok and r.error is not None and why in r.error, (events, r.error)


def test_prefill_flops_formula():
    from engine.bench.offline import prefill_flops
    from engine.model.config import ModelArchConfig

    arch = ModelArchConfig.tiny()
    n = 100
    f = prefill_flops(arch, n)
    h, d, layers = arch.hidden_size, arch.head_dim, arch.num_hidden_layers
    params = layers * (
        h * d * (arch.num_attention_heads + 2 * arch.num_key_value_heads)  # q, k, v
        + arch.num_attention_heads * d * h  # o
        + 3 * h * arch.intermediate_size  # gate, up, down
    )
    assert f["linear"] == 2 * params * n
    assert f["lm_head"] == 2 * h * arch.vocab_size
    assert f["attention"] == pytest.approx(
        2 * 2 * layers * arch.num_attention_heads * d * n * (n + 1) / 2
    )
    assert f["total"] == f["linear"] + f["lm_head"] + f["attention"]


# ---------------------------------------------------------------------------------------
# the command (processes: slow)
# ---------------------------------------------------------------------------------------


def pd_bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
def test_offline_on_tiny_writes_positive_throughput(tmp_path: Path):
    out = tmp_path / "offline.json"
    proc = pd_bench(
        "offline", "--model", "tiny", "--num-prompts", "2", "--input-len", "16",
        "--output-len", "4", "--max-num-seqs", "4", "--json", str(out),
    )  # fmt: skip
    assert "output throughput" in proc.stdout
    report = json.loads(out.read_text())
    res = report["result"]
    assert report["shape"] == {"num_prompts": 2, "input_len": 16, "output_len": 4}
    assert report["config"]["scheduler"]["max_num_seqs"] == 4  # engine flags are honoured
    assert res["output_tokens"] == 2 * 4 and res["prompt_tokens"] == 2 * 16
    assert res["output_tokens_per_s"] > 0
    assert res["total_tokens_per_s"] > res["output_tokens_per_s"]
    assert res["ttft_ms"]["mean"] > 0
    # Where the measured steps' time went: every phase measured, per step.
    split = report["step_ms"]
    # Both prompts prefill in the first step: one worker step per sampled token. With
    # async scheduling (the default) one more engine step collects the last of them.
    assert split["steps"] == 4 and res["steps"] in (4, 5)
    for phase in ("schedule_ms", "update_ms", "ipc_ms", "worker_ms"):
        assert split[phase] > 0, (phase, split)
    assert "per step (mean of" in proc.stdout


@pytest.mark.slow
def test_offline_single_stream_reports_ms_per_token(tmp_path: Path):
    out = tmp_path / "latency.json"
    pd_bench(
        "offline", "--workload", "latency", "--input-len", "32", "--output-len", "5",
        "--num-warmup", "0", "--json", str(out),
    )  # fmt: skip
    report = json.loads(out.read_text())
    res = report["result"]
    assert report["shape"]["num_prompts"] == 1  # from the preset
    assert res["ms_per_output_token"] > 0 and res["single_ttft_ms"] > 0
    assert res["prefill_tokens_per_s"] > 0
    assert report["prefill"]["achieved_tflops"] > 0


@pytest.mark.slow
def test_offline_structured_runs_sync_and_async_and_every_output_follows_its_spec(
    tmp_path: Path,
):
    # The GPU check's structured row at toy size, on a made checkpoint as there.
    pytest.importorskip("llguidance")
    model = tmp_path / "tiny-llama"
    pd_bench("make-model", "--out", str(model), "--preset", "tiny-llama")
    for kind in ("json", "regex"):
        out = tmp_path / f"{kind}.json"
        proc = pd_bench(
            "offline", "--model", str(model), "--structured", kind, "--num-prompts", "4",
            "--input-len", "16", "--num-warmup", "0", "--json", str(out),
        )  # fmt: skip
        for row in ("output tok/s", "ms/token (TPOT mean)", "async/sync", "complete and valid"):
            assert row in proc.stdout, proc.stdout
        report = json.loads(out.read_text())
        assert report["shape"]["output_len"] == 128  # --structured's default
        s = report["structured"]
        assert s["kind"] == kind and len(s["specs"]) == 4
        assert s["async_over_sync"]["output_tokens_per_s"] > 0
        assert s["async_over_sync"]["ms_per_output_token"] > 0
        for mode in ("sync", "async"):
            res = s[mode]["result"]
            assert res["output_tokens_per_s"] > 0 and res["tpot_ms"]["mean"] > 0, mode
            # Every grammar completes within 128 tokens: all end by it, all valid.
            assert s[mode]["requests"] == s[mode]["complete"] == s[mode]["valid"] == 4
            for spec, text in zip(s["specs"], s[mode]["outputs"], strict=True):
                if kind == "regex":
                    assert re.fullmatch(spec, text), (spec, text)
                    continue
                value = json.loads(text)
                assert set(value) == {"id", "kind", "name", "ok"}, text
                assert type(value["id"]) is int and 0 <= value["id"] <= 9999, text
                assert value["kind"] in spec["properties"]["kind"]["enum"], text
                assert isinstance(value["name"], str) and len(value["name"]) <= 16, text
                assert isinstance(value["ok"], bool), text


def test_offline_with_a_tp_the_model_cannot_split_exits_2_without_a_traceback():
    # The engine judges --tp against the model when it starts; its error came out of
    # pd-bench offline as a Python traceback (exit 1) instead of the usage and one line.
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "offline", "--model", "tiny", "--tp", "3",
         "--num-prompts", "1", "--input-len", "8", "--output-len", "2"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "pd-bench offline: error: --tp 3: num_attention_heads=4" in proc.stderr


@pytest.mark.slow
def test_make_model_and_compare_hf_tokens_equal(tmp_path: Path):
    pytest.importorskip("transformers")
    model = tmp_path / "tiny-llama"
    proc = pd_bench("make-model", "--out", str(model), "--preset", "tiny-llama")
    assert "wrote" in proc.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model / name).is_file(), name
    out = tmp_path / "hf.json"
    proc = pd_bench(
        "offline", "--model", str(model), "--dtype", "float32", "--num-prompts", "2",
        "--input-len", "16", "--output-len", "8", "--compare-hf", "--json", str(out),
    )  # fmt: skip
    assert "first prompt tokens equal: True" in proc.stdout, proc.stdout
    report = json.loads(out.read_text())
    assert report["hf"]["first_prompt"] == {"equal": True, "matching_prefix": 8, "length": 8}
    assert report["hf"]["output_tokens_per_s"] > 0 and report["hf"]["speedup"] > 0


@pytest.mark.slow
def test_make_model_writes_a_checkpoint_without_importing_transformers(tmp_path: Path):
    # transformers' import is seconds of CPU; the checkpoint is plain safetensors + JSON
    # (the test above loads one in transformers).
    code = (
        "import sys; sys.modules['transformers'] = None; from engine.bench.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    out = tmp_path / "m"
    proc = subprocess.run(
        [sys.executable, "-c", code, "make-model", "--out", str(out), "--preset", "tiny-qwen2",
         "--tie-word-embeddings", "--dtype", "bfloat16"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        q_bias = f.get_tensor("model.layers.1.self_attn.q_proj.bias")
        norm = f.get_tensor("model.norm.weight")
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied
    assert len(names) == 1 + 2 * 12 + 1  # embeddings, 2 layers of 12 (qwen2: q/k/v biases)
    assert q_bias.shape == (4 * 16,) and q_bias.dtype == torch.bfloat16
    assert torch.all(norm == 20.0)  # tied: the final norm carries the LM-head scale
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"]


@pytest.mark.slow
def test_make_model_refuses_a_non_empty_directory(tmp_path: Path):
    (tmp_path / "x").write_text("keep me")
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "make-model", "--out", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "not empty" in proc.stdout
    assert (tmp_path / "x").read_text() == "keep me"


@pytest.mark.slow
def test_serve_against_a_dead_endpoint_exits_1_without_a_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "serve", "--base-url", "http://127.0.0.1:9",
         "--num-prompts", "2", "--no-progress"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "cannot benchmark" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def bench_nodes(module_procs: Procs) -> dict[str, Proc]:
    """The module's two nodes, started at once (their start-ups overlap): a plain one, and
    one with ``--api-key``."""
    nodes = {
        "tiny": module_procs.node("--model", "tiny", "--max-num-seqs", "8", wait=False),
        "keyed": module_procs.node("--model", "tiny", "--max-num-seqs", "4", "--api-key", _KEY,
                                   name="keyed", wait=False),
    }  # fmt: skip
    wait_healthy(*nodes.values())
    return nodes


@pytest.fixture(scope="module")
def tiny_node(bench_nodes: dict[str, Proc]) -> Proc:
    return bench_nodes["tiny"]


# serve must run where only the proxy is installed: it never imports torch.
_SERVE_IN_PROCESS = """
import sys
from engine.bench.cli import main
rc = main(sys.argv[1:])
assert "torch" not in sys.modules, "pd-bench serve imported torch"
sys.exit(rc)
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["openai", "openai-responses"])
def test_serve_against_a_node(tiny_node, tmp_path: Path, backend: str):
    """Completions (token-id prompts, tokens counted from each chunk's ids) and the
    Responses API (text prompts, timed on its deltas, tokens from its final usage)."""
    out, png = tmp_path / "serve.json", tmp_path / "cdf.png"
    # The random model's tokens past the bytes decode to no text, which the Responses API
    # does not stream: its answers here are letters, one delta a token.
    letters = {"allowed_token_ids": list(range(ord("a"), ord("z") + 1))}
    extra = ["--extra-body", json.dumps(letters)] if backend == "openai-responses" else []
    proc = subprocess.run(
        [sys.executable, "-c", _SERVE_IN_PROCESS, "serve", "--base-url", tiny_node.url,
         "--backend", backend, *extra,
         "--num-prompts", "4", "--max-concurrency", "2", "--input-len", "32",
         "--output-len", "6", "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000",
         "--json", str(out), "--plot", str(png)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr + tiny_node.logs()
    assert "Serving Benchmark Result" in proc.stdout
    assert "4/4 requests" in proc.stderr  # the progress line
    report = json.loads(out.read_text())
    s = report["summary"]
    assert s["completed"] == 4 and s["failed"] == 0
    assert s["good_requests"] == 4 and s["goodput"] > 0
    assert s["total_output_tokens"] == 4 * 6
    if backend == "openai":
        assert s["total_input_tokens"] == 4 * 32
    else:  # 32 words and the chat template, as the node's usage counts them
        assert s["total_input_tokens"] > 4 * 32
    assert s["output_throughput"] > 0 and s["ttft_ms"]["median"] > 0
    # A chunk may carry several tokens when the node merges outputs its reader has not
    # taken yet (a loaded box): at most one gap per token after the first.
    assert 4 <= s["itl_ms"]["n"] <= 4 * 5
    assert report["args"]["model"] == "tiny"  # from GET /v1/models
    assert len(report["requests"]) == 4
    for r in report["requests"]:
        assert r["ok"] and r["error"] is None
        assert r["ttft"] > 0 and r["e2e"] >= r["ttft"]
        assert r["output_tokens"] == 6 and r["usage_completion_tokens"] == 6
        assert 1 <= len(r["itl"]) <= 5 and r["tpot"] > 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in proc.stdout
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_serve_reports_the_chosen_percentiles_as_vllm_names_them(tiny_node, tmp_path: Path):
    out = tmp_path / "pct.json"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "serve", "--base-url", tiny_node.url,
         "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--num-warmup", "0",
         "--no-progress", "--percentile-metrics", "itl,e2el", "--metric-percentiles",
         "50,99.9", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr + tiny_node.logs()
    stats = ("Mean", "Median", "P50", "P99.9")
    assert _ms_rows(proc.stdout) == [f"{x} {m}" for m in ("ITL", "E2E") for x in stats]
    s = json.loads(out.read_text())["summary"]
    for m in ("itl", "e2el"):
        for stat in ("mean", "median", "p50", "p99.9"):
            assert s[f"{stat}_{m}_ms"] > 0, (stat, m, s)
        assert s[f"std_{m}_ms"] >= 0
    assert "p99_ttft_ms" not in s and "mean_tpot_ms" not in s and "p90_itl_ms" not in s


@pytest.mark.slow
def test_serve_counts_failed_requests_and_keeps_going(tiny_node, tmp_path: Path):
    out = tmp_path / "failed.json"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "serve", "--base-url", tiny_node.url,
         "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--num-warmup", "0",
         "--token-id-range", "600", "700", "--no-progress", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr  # nothing completed
    assert "Traceback" not in proc.stderr
    s = json.loads(out.read_text())["summary"]
    assert s["completed"] == 0 and s["failed"] == 3
    assert all("HTTP 400" in msg and "out of range" in msg for msg in s["errors"])
    assert sum(s["errors"].values()) == 3


@pytest.mark.slow  # a node process
def test_serve_stops_when_its_warm_up_fails(tiny_node, tmp_path: Path):
    """Every warm-up request failing means the arguments are wrong (vLLM's bench stops with
    "Initial test run failed"): the run stops there, exit 1 naming the warm-up, instead
    of sending every measured request into the same error."""
    out = tmp_path / "never.json"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "serve", "--base-url", tiny_node.url,
         "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--num-warmup", "1",
         "--token-id-range", "600", "700", "--no-progress", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "warm-up" in proc.stderr, proc.stderr
    assert "out of range" in proc.stderr and not out.exists()


def test_bench_host_step_runs_and_reports_each_part():
    """``scripts/bench_host_step.py`` at toy sizes (no timing asserted)."""
    import importlib.util

    path = REPO_ROOT / "scripts" / "bench_host_step.py"
    spec = importlib.util.spec_from_file_location("bench_host_step", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.measure(seqs=4, context=40, steps=3)
    assert r["seqs"] == 4 and r["message_bytes"] > 0
    parts = ("schedule_ms", "pickle_ms", "worker_prep_ms", "update_ms")
    assert abs(sum(r[k] for k in parts) - r["total_ms"]) < 1e-3


# ---------------------------------------------------------------------------------------
# serve: API keys and base URLs
# ---------------------------------------------------------------------------------------

_KEY = "bench-test-key-5e1f"  # distinctive: a check that it is never printed means something


def test_serve_base_url_accepts_a_trailing_v1():
    from engine.bench.cli import build_parser
    from engine.bench.serve_args import normalize_base_url

    for given in (
        "http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/",
        "http://h:8000//v1//",
    ):  # fmt: skip
        assert normalize_base_url(given) == "http://h:8000", given
    assert normalize_base_url("http://h:8000/api/v1") == "http://h:8000/api"
    assert normalize_base_url("http://h:8000/v10") == "http://h:8000/v10"
    args = build_parser().parse_args(["serve", "--base-url", "http://h:8000/v1"])
    assert args.base_url == "http://h:8000"


def _bench_args(*argv: str):
    """``pd-bench serve ARGV`` parsed and checked as ``run_serve`` checks it."""
    from engine.bench.cli import build_parser
    from engine.bench.serve_args import validate

    args = build_parser().parse_args(["serve", *argv])
    validate(args, args._parser)
    return args


def _prompt(ids: list[int]):
    from engine.bench.serve import Prompt

    return Prompt(ids, len(ids))


def test_serve_takes_vllm_bench_serve_spellings(tmp_path: Path):
    """A `vllm bench serve` command line's flags, mapped to pd-bench's."""
    args = _bench_args(
        "--backend", "openai-chat", "--host", "h", "--port", "9", "--dataset-name", "random",
        "--random-input-len", "100", "--random-output-len", "7", "--random-prefix-len", "20",
        "--random-range-ratio", "0", "--num-warmups", "2", "--disable-tqdm",
        "--model", "org/m", "--served-model-name", "m", "--goodput", "ttft:250",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
    )  # fmt: skip
    assert args.base_url == "http://h:9" and args.endpoint == "/v1/chat/completions"
    # vLLM's prefix comes before --random-input-len's tokens: shared, then random.
    assert (args.input_len, args.shared_prefix_len, args.output_len) == (120, 20, 7)
    assert args.num_warmup == 2 and args.no_progress and args.model == "m"
    assert args.slo_ttft_ms == 250 and args.json == str(tmp_path / "r.json")
    args = _bench_args("--backend", "openai-responses")
    assert args.endpoint == "/v1/responses"
    from engine.bench.serve import request_body

    args.extra_body = {"top_p": 0.5}
    body = request_body(args, "m", _prompt([5, 6]))
    assert body == {"model": "m", "input": "5 6", "max_output_tokens": 64, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "top_p": 0.5}  # fmt: skip
    args = _bench_args("--backend", "vllm", "--save-result", "--result-dir", str(tmp_path))
    assert args.endpoint == "/v1/completions" and args.base_url == "http://127.0.0.1:8000"
    assert args.json.startswith(str(tmp_path)) and args.json.endswith(".json")


def test_serve_takes_vllm_bench_serve_percentile_flags():
    args = _bench_args()  # pd-bench's defaults: what it always printed
    assert args.percentile_metrics == ["ttft", "tpot", "itl", "e2el"]
    assert args.metric_percentiles == [90.0, 99.0]
    args = _bench_args("--percentile-metrics", "e2el, ttft,e2el", "--metric-percentiles",
                       "50,99.9,100")  # fmt: skip
    assert args.percentile_metrics == ["e2el", "ttft"]
    assert args.metric_percentiles == [50.0, 99.9, 100.0]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--dataset-name", "sharegpt"], "--dataset-name"),
        (["--random-range-ratio", "0.5"], "--random-range-ratio"),
        (["--goodput", "tpot:50"], "--goodput"),
        (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--backend"),
        (["--backend", "openai-responses", "--endpoint", "/v1/chat/completions"], "--backend"),
        (["--random-prefix-len", "4", "--shared-prefix-len", "4"], "--random-prefix-len"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--num-prompts", "x"], "--num-prompts"),
        (["--percentile-metrics", "ttft,e2e"], "unknown metric 'e2e'"),
        (["--percentile-metrics", "ttft,,itl"], "--percentile-metrics: empty"),
        (["--metric-percentiles", "0"], "percentile 0 is not in (0, 100]"),
        (["--metric-percentiles", "99,100.5"], "percentile 100.5 is not in (0, 100]"),
        (["--metric-percentiles", "p99"], "'p99' is not a number"),
    ],
)
def test_a_bad_serve_flag_prints_the_serve_usage(argv: list[str], needle: str):
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "serve", *argv],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "usage: pd-bench serve" in proc.stderr and needle in proc.stderr, proc.stderr
    assert "COMMAND ..." not in proc.stderr  # not the top-level usage


@pytest.fixture(scope="module")
def keyed_node(bench_nodes: dict[str, Proc]) -> Proc:
    return bench_nodes["keyed"]


def _serve_keyed(
    node: Proc, tmp_path: Path, *flags: str, env_key: str | None = None
) -> tuple[subprocess.CompletedProcess[str], str]:
    """``pd-bench serve`` (2 prompts, 8 -> 2 tokens) against ``node``; OPENAI_API_KEY is
    ``env_key`` (unset if None). Returns the process and the --json file's text ('')."""
    out = tmp_path / "keyed.json"
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if env_key is not None:
        env["OPENAI_API_KEY"] = env_key
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "serve", "--num-prompts", "2",
         "--input-len", "8", "--output-len", "2", "--num-warmup", "0", "--no-progress",
         "--json", str(out), *flags],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    return proc, out.read_text() if out.exists() else ""


@pytest.mark.slow
def test_serve_sends_the_api_key_from_the_flag_or_the_environment(keyed_node, tmp_path: Path):
    # --api-key, and an OpenAI-style base URL ending in /v1/
    proc, report = _serve_keyed(keyed_node, tmp_path, "--base-url", keyed_node.url + "/v1/",
                                "--api-key", _KEY)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr + keyed_node.logs()
    assert json.loads(report)["summary"]["completed"] == 2
    assert _KEY not in proc.stdout + proc.stderr + report
    # OPENAI_API_KEY, as `vllm bench serve` reads it
    proc, report = _serve_keyed(keyed_node, tmp_path, "--base-url", keyed_node.url,
                                env_key=_KEY)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr + keyed_node.logs()
    assert json.loads(report)["summary"]["completed"] == 2
    assert _KEY not in proc.stdout + proc.stderr + report


@pytest.mark.slow
def test_serve_without_the_api_key_names_the_flag(keyed_node, tmp_path: Path):
    proc, _ = _serve_keyed(keyed_node, tmp_path, "--base-url", keyed_node.url)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "401" in proc.stderr
    assert "--api-key" in proc.stderr and "OPENAI_API_KEY" in proc.stderr
    # a wrong key (--model given: no /v1/models probe) fails every request with the hint
    proc, report = _serve_keyed(keyed_node, tmp_path, "--base-url", keyed_node.url,
                                "--model", "tiny", "--api-key", "wrong")  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = json.loads(report)["summary"]["errors"]
    assert sum(errors.values()) == 2
    assert all("HTTP 401" in e and "--api-key" in e for e in errors), errors


@pytest.mark.slow
def test_interference_workload_sends_the_api_key(keyed_node, monkeypatch):
    """``pd-bench interference`` drives its proxy with serve's client: the same key (here
    straight at the keyed node, at the smallest sizes; no layouts started)."""
    import asyncio

    from engine.bench.cli import build_parser
    from engine.bench.cluster import BenchError
    from engine.bench.interference import drive, resolve

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)

    def args(*flags: str):
        a = build_parser().parse_args(
            ["interference", "--smoke", "--num-long", "1", "--long-len", "8",
             "--long-output-len", "2", "--decode-streams", "1", "--decode-output-len", "2",
             "--lead-s", "0", *flags]
        )  # fmt: skip
        resolve(a)
        return a

    run = asyncio.run(drive(keyed_node.url, args("--api-key", _KEY)))
    assert [r.ok for r in run.long] == [True] and run.decode and all(r.ok for r in run.decode)
    with pytest.raises(BenchError, match="401.*--api-key"):
        asyncio.run(drive(keyed_node.url, args()))


def test_serve_save_result_makes_its_result_dir(tmp_path: Path):
    """vLLM's bench creates --result-dir; pd-bench too, before the run (not a traceback
    after it)."""
    d = tmp_path / "new" / "results"
    args = _bench_args("--save-result", "--result-dir", str(d), "--result-filename", "r.json")
    assert d.is_dir() and args.json == str(d / "r.json")


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_serve_an_output_in_a_missing_directory_is_refused_before_the_run(
    flag: str, tmp_path: Path
):
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "serve", "--base-url", "http://127.0.0.1:9",
         flag, str(tmp_path / "nope" / "out"), "--num-prompts", "1", "--no-progress"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert flag in proc.stderr and "no such directory" in proc.stderr, proc.stderr
    assert "cannot benchmark" not in proc.stderr  # refused before any request


@pytest.mark.slow
def test_serve_ctrl_c_exits_130_without_a_traceback():
    """Ctrl-C mid-run: a one-line message, exit 130, no asyncio traceback."""
    import signal
    import socket

    with socket.socket() as srv:  # accepts (kernel backlog), never answers: requests hang
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        port = srv.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.bench", "serve", "--base-url",
             f"http://127.0.0.1:{port}", "--model", "m", "--num-warmup", "0",
             "--num-prompts", "2", "--no-progress"],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        srv.settimeout(60)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(60)
            assert conn.recv(1)  # a request is out: the run is under way
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err, err
