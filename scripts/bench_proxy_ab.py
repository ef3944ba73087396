#!/usr/bin/env python
"""The proxy's own overhead, this checkout against another one, in one run.

    git worktree add /tmp/base <commit>
    python scripts/bench_proxy_ab.py --baseline-tree /tmp/base [-n 200]
    python scripts/bench_proxy_ab.py --baseline-tree /tmp/base --stream --output-len 128

Starts one colocated node and one prefill node (from this checkout), and two proxies in
front of them -- one run from ``--baseline-tree``, one from this checkout -- each sending
every request to the colocated node as a decode node prefilling by itself (no P/D), so
the difference to calling the node straight is the proxy alone. One-token requests go
straight / via the baseline proxy / via this proxy in turn, so the box's load drift hits
all three alike. Prints p50 latency of each, the per-request difference to straight, and
each proxy's CPU per request (from /proc). ``--stream --output-len N``: streamed requests
of N tokens (``ignore_eos``), read to their end; the CPU per token is the proxy's cost of
relaying one event. Stops everything it started, by PID.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_pd_overhead import cpu_seconds, free_port, stop, wait_healthy  # noqa: E402


def start(tree: Path, log: Path, *cmd: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", *cmd, "--port", str(port)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=tree, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-tree", type=Path, required=True, help="another checkout")
    ap.add_argument("-n", "--requests", type=int, default=200)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/proxy_ab_logs"))
    ap.add_argument("--stream", action="store_true", help="streamed requests")
    ap.add_argument("--output-len", type=int, default=1, help="tokens per request")
    args = ap.parse_args()
    import httpx

    args.log_dir.mkdir(parents=True, exist_ok=True)
    common = ["--model", "tiny", "--num-blocks", "1024", "--log-level", "WARNING"]
    procs: list[subprocess.Popen] = []
    try:
        node, node_url = start(ROOT, args.log_dir / "node.log", "decode_node", *common)
        pre, pre_url = start(
            ROOT, args.log_dir / "p.log", "prefill_node", *common, "--kv-connector", "nixl"
        )
        procs += [node, pre]
        wait_healthy(node_url, node)
        wait_healthy(pre_url, pre)
        proxies: dict[str, tuple[subprocess.Popen, str]] = {}
        for name, tree in (("baseline", args.baseline_tree.resolve()), ("this", ROOT)):
            proxies[name] = start(
                tree, args.log_dir / f"proxy_{name}.log", "proxy", "serve",
                "--prefill", pre_url, "--decode", node_url,
                "--disagg-min-prompt-tokens", "1000000000",
            )  # fmt: skip
            procs.append(proxies[name][0])
        for proc, url in proxies.values():
            wait_healthy(url, proc)
        targets = [("straight", node_url)] + [(k, u) for k, (_, u) in proxies.items()]
        times: dict[str, list[float]] = {k: [] for k, _ in targets}
        cpu0 = {k: cpu_seconds(p.pid) for k, (p, _) in proxies.items()}
        body = {"model": "tiny", "max_tokens": args.output_len, "temperature": 0}
        body.update(ignore_eos=True, stream=args.stream)
        warm = 5
        with httpx.Client(timeout=60) as client:
            for i in range(args.requests + warm):
                for name, url in targets:
                    t0 = time.perf_counter()
                    req = {**body, "prompt": f"{i} {name}"}
                    with client.stream("POST", url + "/v1/completions", json=req) as r:
                        r.raise_for_status()
                        for _ in r.iter_bytes():
                            pass
                    if i >= warm:
                        times[name].append((time.perf_counter() - t0) * 1000)
        med = statistics.median
        kind = "streamed" if args.stream else "plain"
        print(
            f"n={args.requests} {kind} requests of {args.output_len} token(s); "
            f"straight p50 {med(times['straight']):.2f} ms"
        )
        for name, (proc, _) in proxies.items():
            cpu = (cpu_seconds(proc.pid) - cpu0[name]) * 1000 / (args.requests + warm)
            diff = med(a - b for a, b in zip(times[name], times["straight"], strict=True))
            print(
                f"{name:8s} via the proxy p50 {med(times[name]):.2f} ms, overhead p50 "
                f"{diff:.2f} ms, proxy CPU {cpu:.2f} ms per request"
                + (f", {1000 * cpu / args.output_len:.0f} us per token" if args.stream else "")
            )
    finally:
        stop(procs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
