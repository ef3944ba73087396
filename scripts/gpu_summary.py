"""Print the target table of docs/performance.md from the JSON files scripts/gpu_check.sh
wrote: ``python scripts/gpu_summary.py OUT_DIR`` (Markdown on stdout)."""

from __future__ import annotations

import glob
import json
import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any


def _load(out: str, name: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(out, name), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _get(d: dict[str, Any] | None, *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d or d[key] is None:
            return None
        d = d[key]
    return d


Row = tuple[str, str, Any, Callable[[float], bool], str]


def _info(label: str, value: Any, fmt: str) -> Row:
    """A row without a target: shown, never counted as missed."""
    return (label, "(info)", value, lambda v: True, fmt)


def step_split(report: dict[str, Any] | None) -> str | None:
    """``pd-bench offline``'s mean split of a measured step (engine/core/step_stats.py)."""
    d = _get(report, "step_ms")
    if not d:
        return None
    parts = (d["schedule_ms"], d["ipc_ms"], d["worker_ms"], d["update_ms"])
    return " + ".join(f"{v:.3f}" for v in parts)


def _pair(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str | None:
    """Two reports' ms per output token as ``a / b`` (``-`` for a missing one)."""
    va, vb = (_get(r, "result", "ms_per_output_token") for r in (a, b))
    if va is None and vb is None:
        return None
    return " / ".join("-" if v is None else f"{v:.3f}" for v in (va, vb))


def rows(out: str) -> list[Row]:
    thr = _load(out, "offline_throughput.json")
    lat = _load(out, "offline_latency.json")
    eager = _load(out, "offline_latency_eager.json")
    lat_mp = _load(out, "offline_latency_mp.json")
    thr_sync = _load(out, "offline_throughput_sync.json")
    lat_sync = _load(out, "offline_latency_sync.json")
    pre = _load(out, "offline_prefill.json")
    thr_triton_ops = _load(out, "offline_throughput_triton_ops.json")
    lat_triton_ops = _load(out, "offline_latency_triton_ops.json")
    eager_triton_ops = _load(out, "offline_latency_eager_triton_ops.json")
    table: list[Row] = [
        (
            "offline 32x512->128 output tok/s",
            ">= 10,000",
            _get(thr, "result", "output_tokens_per_s"),
            lambda v: v >= 10_000,
            "{:,.0f}",
        ),
        _info(
            "  where a step goes, ms: schedule + executor + worker + update",
            step_split(thr),
            "{}",
        ),
        _info(
            "  same, --no-async-scheduling: output tok/s",
            _get(thr_sync, "result", "output_tokens_per_s"),
            "{:,.0f}",
        ),
        _info(
            "  same, Triton model ops (PDSERVE_MODEL_OPS=triton): output tok/s",
            _get(thr_triton_ops, "result", "output_tokens_per_s"),
            "{:,.0f}",
        ),
        (
            "  vs transformers generate (same run)",
            ">= 20x",
            _get(thr, "hf", "speedup"),
            lambda v: v >= 20,
            "{:.1f}x",
        ),
        (
            "single stream 512->128 ms/token (graphs)",
            "<= 1.5",
            _get(lat, "result", "ms_per_output_token"),
            lambda v: v <= 1.5,
            "{:.3f}",
        ),
        _info(
            "  where a step goes, ms: schedule + executor + worker + update",
            step_split(lat),
            "{}",
        ),
        _info(
            "  same, --no-async-scheduling",
            _get(lat_sync, "result", "ms_per_output_token"),
            "{:.3f}",
        ),
        _info(
            "  same, --enforce-eager",
            _get(eager, "result", "ms_per_output_token"),
            "{:.3f}",
        ),
        _info(
            "  same, Triton model ops / Triton model ops and --enforce-eager",
            _pair(lat_triton_ops, eager_triton_ops),
            "{}",
        ),
        _info(
            "  same, a worker process (--distributed-executor-backend mp)",
            _get(lat_mp, "result", "ms_per_output_token"),
            "{:.3f}",
        ),
    ]
    table += structured_rows(_load(out, "offline_structured.json"))
    table += [
        (
            "prefill 8000 tokens, fraction of bf16 matmul peak",
            ">= 30%",
            _get(pre, "prefill", "fraction_of_peak"),
            lambda v: v >= 0.30,
            "{:.1%}",
        ),
        _info(
            "  prefill TFLOP/s (achieved)",
            _get(pre, "prefill", "achieved_tflops"),
            "{:.1f}",
        ),
    ]
    for name, label in (("serve_colocated.json", "colocated"), ("serve_pd.json", "P/D")):
        s = _get(_load(out, name), "summary")
        table += [
            (
                f"HTTP 64 req/32 conc/1024 in/64 out, {label}: ITL p50 ms",
                "<= 10",
                _get(s, "itl_ms", "median"),
                lambda v: v <= 10,
                "{:.2f}",
            ),
            (
                f"  {label}: ITL p99 ms",
                "<= 25",
                _get(s, "itl_ms", "p99"),
                lambda v: v <= 25,
                "{:.2f}",
            ),
            (
                f"  {label}: TTFT p50 ms",
                "<= 150",
                _get(s, "ttft_ms", "median"),
                lambda v: v <= 150,
                "{:.1f}",
            ),
            (
                f"  {label}: completed / failed",
                "64 / 0",
                None if s is None else f"{s.get('completed')} / {s.get('failed')}",
                lambda v: True,
                "{}",
            ),
        ]
    table += low_load_rows(out)
    overhead = _load(out, "proxy_overhead.json")
    table.append(
        (
            "proxy overhead p50 ms (1-token requests, via the proxy minus straight)",
            "<= 1",
            _get(overhead, "proxies", "proxy", "overhead_p50_ms"),
            lambda v: v <= 1.0,
            "{:.2f}",
        )
    )
    table += transfer_rows(_load(out, "transfer.json"))
    return table


def structured_rows(report: dict[str, Any] | None) -> list[Row]:
    """``pd-bench offline --structured json``: constrained requests (each its own schema)
    on an engine with ``--no-async-scheduling`` and one with async scheduling (the
    default), or why the step skipped."""
    shape = _get(report, "shape")
    size = "" if not shape else " {num_prompts}x{input_len}->{output_len}".format(**shape)
    label = f"structured JSON{size}, a schema each"
    skipped = _get(report, "skipped")
    if skipped:
        return [_info(f"{label}: output tok/s, sync", f"skipped: {skipped}", "{}")]
    s = _get(report, "structured")

    def both(key: str, fmt: str) -> str | None:
        a, b = _get(s, "sync", *key.split(".")), _get(s, "async", *key.split("."))
        return None if a is None or b is None else f"{fmt.format(a)} / {fmt.format(b)}"

    return [
        _info(
            f"{label}: output tok/s, sync",
            _get(s, "sync", "result", "output_tokens_per_s"),
            "{:,.0f}",
        ),
        _info(
            "  same, async scheduling (the default)",
            _get(s, "async", "result", "output_tokens_per_s"),
            "{:,.0f}",
        ),
        _info(
            "  async / sync output tok/s",
            _get(s, "async_over_sync", "output_tokens_per_s"),
            "{:.2f}x",
        ),
        _info(
            "  ms/token (TPOT mean), sync / async",
            both("result.tpot_ms.mean", "{:.3f}"),
            "{}",
        ),
        (
            "  outputs complete and valid, sync / async",
            "all",
            None if s is None else f"{both('valid', '{}')} of {_get(s, 'sync', 'requests')}",
            lambda v: True,
            "{}",
        ),
    ]


def low_load_rows(out: str) -> list[Row]:
    """One request at a time, 1024-token prompts: what P/D adds to TTFT over colocated,
    with and without the pipelined push (target: <= exposed transfer + 5 ms)."""
    ttft = {
        name: _get(_load(out, f"low_{name}.json"), "summary", "ttft_ms", "median")
        for name in ("colocated", "pd", "pd_pipelined")
    }
    colo = ttft["colocated"]
    table: list[Row] = [_info("low load 1x1024->16: TTFT p50 ms, colocated", colo, "{:.1f}")]
    files = {"pd": "prefill_metrics.txt", "pd_pipelined": "prefill_pipelined_metrics.txt"}
    for name, label in (("pd", "P/D"), ("pd_pipelined", "P/D pipelined (4 layers/piece)")):
        extra = None if colo is None or ttft[name] is None else ttft[name] - colo
        exposed = metric_mean(out, files[name], "pdserve_kv_push_exposed_seconds")
        table += [
            (
                f"  {label}: TTFT p50 minus colocated ms",
                "<= exposed push + 5",
                extra,
                lambda v: v <= 5.0,
                "{:+.1f}",
            ),
            _info(
                f"  {label}: exposed push, mean ms (all pushes of the run)",
                None if exposed is None else exposed * 1000,
                "{:.2f}",
            ),
        ]
    return table


def metric_mean(out: str, name: str, histogram: str) -> float | None:
    """Mean of a Prometheus histogram in a saved /metrics text (sum / count)."""
    sums: dict[str, float] = {}
    try:
        with open(os.path.join(out, name), encoding="utf-8") as f:
            for line in f:
                if line.startswith(histogram) and " " in line:
                    key, value = line.rsplit(" ", 1)
                    key = key.split("{", 1)[0]
                    sums[key] = sums.get(key, 0.0) + float(value)
    except (OSError, ValueError):
        return None
    count = sums.get(f"{histogram}_count", 0.0)
    return sums.get(f"{histogram}_sum", 0.0) / count if count else None


def transfer_rows(report: dict[str, Any] | None) -> list[Row]:
    """Issue 10's push targets from ``pd-bench transfer``: its largest size, per TP."""
    rows_by_tp: dict[int, dict[str, Any]] = {}
    for r in (report or {}).get("results", []):
        if r["tokens"] >= rows_by_tp.get(r["tp"], {"tokens": -1})["tokens"]:
            rows_by_tp[r["tp"]] = r
    table: list[Row] = []
    for tp in sorted(rows_by_tp) or [1]:
        r = rows_by_tp.get(tp)
        where = f"KV push TP{tp}" + (f", {r['tokens']} tokens" if r else "")
        table += [
            (
                f"{where}: connector / raw NIXL GB/s",
                ">= 0.90",
                _get(r, "ratio_connector_raw"),
                lambda v: v >= 0.90,
                "{:.2f}",
            ),
            (
                f"  {where}: connector / device copy GB/s",
                ">= 0.50",
                _get(r, "ratio_connector_copy"),
                lambda v: v >= 0.50,
                "{:.2f}",
            ),
            (
                f"  {where}: connector GB/s; data",
                "(info)",
                None
                if r is None
                else f"{r['paths']['connector']['gbps']:.1f}; "
                + ("ok" if r.get("data_ok") else "WRONG"),
                lambda v: True,
                "{}",
            ),
        ]
    return table


def pytest_runs(out: str) -> list[dict[str, Any]]:
    """The pytest steps' results from their junit XML (``pytest_*.xml`` in ``out``): per
    file, the counts and the failed and skipped tests with their messages."""
    runs = []
    for path in sorted(glob.glob(os.path.join(out, "pytest_*.xml"))):
        run: dict[str, Any] = {"name": os.path.basename(path), "failed": [], "skipped": []}
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as e:
            run["error"] = str(e)
            runs.append(run)
            continue
        passed = 0
        for case in root.iter("testcase"):
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            bad = case.find("failure")
            bad = bad if bad is not None else case.find("error")
            skip = case.find("skipped")
            if bad is not None:
                run["failed"].append((test, (bad.get("message") or "").splitlines()[:1]))
            elif skip is not None:
                run["skipped"].append((test, skip.get("message") or ""))
            else:
                passed += 1
        run["passed"] = passed
        runs.append(run)
    return runs


def print_pytest_runs(runs: list[dict[str, Any]]) -> None:
    if not runs:
        return
    print()
    print("Tests (junit XML of the pytest steps):")
    print()
    print("| run | passed | failed | skipped |")
    print("|---|---:|---:|---:|")
    for run in runs:
        if "error" in run:
            print(f"| {run['name']} | unreadable: {run['error']} | | |")
            continue
        print(f"| {run['name']} | {run['passed']} | {len(run['failed'])} | {len(run['skipped'])} |")
    for run in runs:
        for test, message in run["failed"]:
            print(f"- failed: {test}: {' '.join(message)[:200]}")
        for test, reason in run["skipped"]:
            print(f"- skipped: {test}: {reason[:200]}")


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu_check"
    print("| measure | target | measured | met |")
    print("|---|---|---:|---|")
    for name, target, value, ok, fmt in rows(out):
        if value is None:
            shown, met = "missing", "no"
        elif isinstance(value, str):
            shown, met = value, ""
        else:
            shown = fmt.format(value)
            met = "" if target == "(info)" else ("yes" if ok(value) else "no")
        print(f"| {name} | {target} | {shown} | {met} |")
    transfer = _load(out, "transfer.json")
    if transfer:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from engine.bench.transfer import markdown_table

        print()
        print(f"KV transfer ({transfer.get('memory')}, pd-bench transfer):")
        print()
        print(markdown_table(transfer["results"]))
    print_pytest_runs(pytest_runs(out))
    prof = _load(out, "profile.json")
    if prof:
        print()
        print("profile (one rank, in-process):", json.dumps(prof))
    skipped: list[str] = []
    try:
        with open(os.path.join(out, "steps.txt"), encoding="utf-8") as f:
            failed = [line.strip() for line in f if not line.strip().endswith("rc=0")]
        # Skipped on purpose (an optional package missing: its row says why).
        skipped = [line for line in failed if line.endswith("rc=skipped")]
        failed = [line for line in failed if line not in skipped]
    except OSError:
        failed = ["steps.txt missing"]
    print()
    print("steps not ok:", ", ".join(failed) if failed else "none")
    if skipped:
        print("steps skipped:", ", ".join(skipped))


if __name__ == "__main__":
    main()
