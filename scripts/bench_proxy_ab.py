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
relaying one event. ``--pd``: the node is a decode node paired with the prefill node, and
the proxies route every request P/D (the difference to straight is then the proxy and
the hand-off; compare the two proxies' lines). Stops everything it started, by PID.
"""

from __future__ import annotations

import argparse
import json
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


WARM = 5  # requests per target before the measured ones


def measure(targets: list[tuple[str, str]], args: argparse.Namespace) -> dict[str, list[float]]:
    """Latency in ms of each request, per target; the targets take turns per request."""
    import httpx

    times: dict[str, list[float]] = {k: [] for k, _ in targets}
    body = {"model": args.model, "max_tokens": args.output_len, "temperature": 0}
    body.update(ignore_eos=True, stream=args.stream)
    with httpx.Client(timeout=60) as client:
        for i in range(args.requests + WARM):
            for name, url in targets:
                t0 = time.perf_counter()
                req = {**body, "prompt": f"{i} {name}"}
                with client.stream("POST", url + "/v1/completions", json=req) as r:
                    r.raise_for_status()
                    for _ in r.iter_bytes():
                        pass
                if i >= WARM:
                    times[name].append((time.perf_counter() - t0) * 1000)
    return times


def report(times: dict[str, list[float]], cpu: dict[str, float], args: argparse.Namespace) -> None:
    """Print each proxy's p50, overhead p50 and CPU per request (ms); write ``--json``."""
    med = statistics.median
    kind = "streamed" if args.stream else "plain"
    print(
        f"n={args.requests} {kind} {'P/D ' if args.pd else ''}requests of "
        f"{args.output_len} token(s); "
        f"straight p50 {med(times['straight']):.2f} ms"
    )
    result: dict[str, object] = {
        "requests": args.requests, "output_len": args.output_len, "stream": args.stream,
        "pd": args.pd,
        "straight_p50_ms": med(times["straight"]), "proxies": {},
    }  # fmt: skip
    for name in times:
        if name == "straight":
            continue
        diff = med(a - b for a, b in zip(times[name], times["straight"], strict=True))
        line = f"{name:8s} via the proxy p50 {med(times[name]):.2f} ms, overhead p50 {diff:.2f} ms"
        entry = {"p50_ms": med(times[name]), "overhead_p50_ms": diff}
        if name in cpu:
            line += f", proxy CPU {cpu[name]:.2f} ms per request"
            entry["cpu_ms_per_request"] = cpu[name]
            if args.stream:
                line += f", {1000 * cpu[name] / args.output_len:.0f} us per token"
        print(line)
        result["proxies"][name] = entry  # type: ignore[index]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-tree", type=Path, help="another checkout")
    ap.add_argument("--node", help="a running node's URL (with --proxy: no processes started)")
    ap.add_argument("--proxy", help="a running proxy's URL in front of --node")
    ap.add_argument("--model", help="the model name in requests (default: the node's first)")
    ap.add_argument("--json", metavar="PATH", help="write the numbers to this JSON file")
    ap.add_argument("-n", "--requests", type=int, default=200)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/proxy_ab_logs"))
    ap.add_argument("--stream", action="store_true", help="streamed requests")
    ap.add_argument("--output-len", type=int, default=1, help="tokens per request")
    ap.add_argument("--pd", action="store_true", help="route through P and D (see above)")
    args = ap.parse_args()
    if args.node and args.proxy:
        if args.model is None:
            import httpx

            args.model = httpx.get(args.node + "/v1/models", timeout=10).json()["data"][0]["id"]
        report(measure([("straight", args.node), ("proxy", args.proxy)], args), {}, args)
        return 0
    if args.baseline_tree is None:
        ap.error("give --baseline-tree, or --node and --proxy")

    args.model = args.model or "tiny"
    args.log_dir.mkdir(parents=True, exist_ok=True)
    common = ["--model", "tiny", "--num-blocks", "1024", "--log-level", "WARNING"]
    procs: list[subprocess.Popen] = []
    try:
        pair = ["--kv-connector", "nixl"] if args.pd else []
        node, node_url = start(ROOT, args.log_dir / "node.log", "decode_node", *common, *pair)
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
                *([] if args.pd else ["--disagg-min-prompt-tokens", "1000000000"]),
            )  # fmt: skip
            procs.append(proxies[name][0])
        for proc, url in proxies.values():
            wait_healthy(url, proc)
        targets = [("straight", node_url)] + [(k, u) for k, (_, u) in proxies.items()]
        cpu0 = {k: cpu_seconds(p.pid) for k, (p, _) in proxies.items()}
        times = measure(targets, args)
        cpu = {
            k: (cpu_seconds(p.pid) - cpu0[k]) * 1000 / (args.requests + WARM)
            for k, (p, _) in proxies.items()
        }
        report(times, cpu, args)
    finally:
        stop(procs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
