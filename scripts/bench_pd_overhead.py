#!/usr/bin/env python
"""P/D fixed cost at low load: TTFT and ITL through the proxy (1 P + 1 D) vs straight to a
colocated node, same model, same prompts, one request at a time, in one run; and the
proxy's own overhead (the colocated node straight vs behind a proxy, no P/D).

    python scripts/bench_pd_overhead.py [--lengths 256 1024] [--num-prompts 12] [--json F]

Starts (and stops, by PID) a colocated node, a prefill node, a decode node and a proxy on
free loopback ports, runs ``pd-bench serve`` against the colocated node and the proxy for
each prompt length, and prints TTFT p50/p99 and ITL p50/p99 for both with their ratios,
plus the CPU seconds each node process tree used (the cost of waiting: polling shows up
here even when latency does not). The machine is noisy: read the ratios, rerun to see
the spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.bench.cluster import free_port  # noqa: E402 - re-exported to bench_proxy_ab
from engine.bench.interference import kv_hop_means  # noqa: E402
from engine.bench.serve import run_benchmark  # noqa: E402
from engine.bench.serve_args import add_serve_args  # noqa: E402


def start(module: str, *args: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", module, *args, "--port", str(port)]
    proc = subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its descendants (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                todo.extend(int(c) for c in children)
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return total


COUNTERS = ("kv_transfers_started_total", "kv_pipelined_transfers_total")

HOPS = (
    "kv_prefill_to_push_seconds",
    "kv_transfer_duration_seconds",
    "kv_push_exposed_seconds",
    "kv_load_wait_seconds",
    "kv_notif_to_step_seconds",
)


def hop_means(url: str) -> list[tuple[str, float, float]]:
    """(histogram, mean seconds, count) of the P/D hop histograms a node exports, in
    ``HOPS`` order (read by ``pd-bench interference``'s parser)."""
    means = kv_hop_means(url)
    return [(h, means[h]["mean_ms"] / 1e3, means[h]["count"]) for h in HOPS if h in means]


def counters(url: str) -> list[tuple[str, float]]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = []
    for line in text.splitlines():
        for name in COUNTERS:
            if line.startswith((f"pdserve_engine_{name} ", f"pdserve_engine_{name}{{")):
                out.append((name, float(line.rsplit(" ", 1)[1])))
    return out


def proxy_overhead(direct: str, via: str, n: int) -> dict[str, float]:
    """Short requests (8-token prompt, 1 token out), alternating straight to the node and
    through the proxy, so drift in the box's load hits both alike; p50 of each and of the
    per-pair difference, in ms."""
    import httpx

    body = {"model": "tiny", "max_tokens": 1, "temperature": 0}
    straight, proxied, diffs = [], [], []
    with httpx.Client(timeout=60) as c:
        for i in range(n + 5):
            times = []
            for url in (direct, via):
                prompt = f"overhead {i} {url[-5:]}"  # distinct: no prefix-cache hit
                t0 = time.perf_counter()
                r = c.post(url + "/v1/completions", json={**body, "prompt": prompt})
                r.raise_for_status()
                times.append((time.perf_counter() - t0) * 1000)
            if i >= 5:  # warm-up
                straight.append(times[0])
                proxied.append(times[1])
                diffs.append(times[1] - times[0])
    med = statistics.median
    return {"direct_p50_ms": med(straight), "proxy_p50_ms": med(proxied),
            "overhead_p50_ms": med(diffs)}  # fmt: skip


def bench(url: str, length: int, args: argparse.Namespace, seed: int = 0) -> dict[str, float]:
    """``seed``: other prompts for a second pass on the same node (no prefix-cache hits)."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    ns = parser.parse_args(
        [
            "--base-url", url,
            "--num-prompts", str(args.num_prompts),
            "--max-concurrency", "1",
            "--input-len", str(length),
            "--output-len", str(args.output_len),
            "--num-warmup", "2",
            "--no-progress",
            "--seed", str(seed),
        ]
    )  # fmt: skip
    s, _ = asyncio.run(run_benchmark(ns))
    if s.failed:
        raise RuntimeError(f"{url}: {s.failed} requests failed: {s.errors}")
    return {
        "ttft_p50_ms": s.ttft_ms.median,
        "ttft_p99_ms": s.ttft_ms.p99,
        "itl_p50_ms": s.itl_ms.median,
        "itl_p99_ms": s.itl_ms.p99,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--log-dir", default="/tmp/pd_overhead_logs")
    ap.add_argument("--overhead-requests", type=int, default=100)
    ap.add_argument(
        "--prefill-arg", action="append", default=[], metavar="ARG",
        help="extra flag for the prefill node (repeat), e.g. --prefill-arg=--kv-layer-group-size=1",
    )  # fmt: skip
    args = ap.parse_args()
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    common = ["--model", "tiny", "--num-blocks", "1024", "--log-level", "WARNING"]
    procs: list[subprocess.Popen] = []
    try:
        colo, colo_url = start("decode_node", *common, log=logs / "colocated.log")
        p, p_url = start(
            "prefill_node", *common, "--kv-connector", "nixl", *args.prefill_arg,
            log=logs / "p.log",
        )  # fmt: skip
        d, d_url = start("decode_node", *common, "--kv-connector", "nixl", log=logs / "d.log")
        procs += [colo, p, d]
        for url, proc in ((colo_url, colo), (p_url, p), (d_url, d)):
            wait_healthy(url, proc)
        px, px_url = start(
            "proxy", "serve", "--prefill", p_url, "--decode", d_url, log=logs / "proxy.log"
        )
        procs.append(px)
        # The proxy alone: the same colocated node behind a proxy that sends every
        # request to it as a decode node prefilling by itself (no P/D), vs straight.
        solo, solo_url = start(
            "proxy", "serve", "--prefill", p_url, "--decode", colo_url,
            "--disagg-min-prompt-tokens", "1000000000", log=logs / "proxy_solo.log",
        )  # fmt: skip
        procs.append(solo)
        wait_healthy(px_url, px)
        wait_healthy(solo_url, solo)
        rows: list[dict[str, Any]] = []
        for length in args.lengths:
            c0 = cpu_seconds(colo.pid)
            colo_stats = bench(colo_url, length, args)
            c1 = cpu_seconds(colo.pid)
            pd0 = cpu_seconds(p.pid) + cpu_seconds(d.pid)
            pd_stats = bench(px_url, length, args)
            pd1 = cpu_seconds(p.pid) + cpu_seconds(d.pid)
            solo_stats = bench(solo_url, length, args, seed=1)  # colo has seed 0's cached
            rows.append(
                {
                    "input_len": length,
                    "colocated": colo_stats,
                    "pd": pd_stats,
                    "colocated_via_proxy": solo_stats,
                    "colocated_cpu_s": round(c1 - c0, 2),
                    "pd_nodes_cpu_s": round(pd1 - pd0, 2),
                }
            )
        print(
            "| input | TTFT p50 colo / P/D ms | ratio | ITL p99 colo / P/D ms | ratio | node CPU s colo / P+D |"
        )
        print("|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            c, q = r["colocated"], r["pd"]
            print(
                f"| {r['input_len']} | {c['ttft_p50_ms']:.1f} / {q['ttft_p50_ms']:.1f} | "
                f"{q['ttft_p50_ms'] / c['ttft_p50_ms']:.2f} | {c['itl_p99_ms']:.1f} / "
                f"{q['itl_p99_ms']:.1f} | {q['itl_p99_ms'] / c['itl_p99_ms']:.2f} | "
                f"{r['colocated_cpu_s']} / {r['pd_nodes_cpu_s']} |"
            )
        cpu0 = cpu_seconds(solo.pid)
        over = proxy_overhead(colo_url, solo_url, args.overhead_requests)
        over["proxy_cpu_ms_per_request"] = (
            (cpu_seconds(solo.pid) - cpu0) * 1000 / (args.overhead_requests + 5)
        )
        print()
        print(
            f"proxy overhead (1-token requests, alternating, n={args.overhead_requests}): "
            f"p50 straight {over['direct_p50_ms']:.2f} ms, via the proxy "
            f"{over['proxy_p50_ms']:.2f} ms, per-pair difference p50 "
            f"{over['overhead_p50_ms']:.2f} ms; the proxy's CPU per request "
            f"{over['proxy_cpu_ms_per_request']:.2f} ms (load-independent)"
        )
        print()
        print("| input | TTFT p50 colocated straight / via the proxy ms | proxy overhead ms |")
        print("|---:|---:|---:|")
        for r in rows:
            c, v = r["colocated"], r["colocated_via_proxy"]
            print(
                f"| {r['input_len']} | {c['ttft_p50_ms']:.1f} / {v['ttft_p50_ms']:.1f} | "
                f"{v['ttft_p50_ms'] - c['ttft_p50_ms']:+.1f} |"
            )
        print()
        print("| hop (P/D nodes, all requests of this run) | mean ms | count |")
        print("|---|---:|---:|")
        for url in (p_url, d_url):
            for name, mean, count in hop_means(url):
                print(f"| {name} | {mean * 1000:.2f} | {count:.0f} |")
        print()
        for name, value in counters(p_url):
            print(f"prefill {name}: {value:.0f}")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    finally:
        stop(procs)


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each process group (all at once), SIGKILL one not gone within 30 s."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
