"""``pd-bench transfer``: the connector's P->D KV push next to raw NIXL and a local copy.

For one KV geometry (default Llama-3-8B: 32 layers, 8 KV heads x head_dim 128, bfloat16,
block size 16 -> 128 KiB of KV per token over all ranks) and each TP size and prompt
length asked for, one run measures side by side, on the same processes and memory:

``connector``
    What the NIXL connector's P workers do: each P rank's ``NixlTransport``
    (``kvconnector/nixl/transport.py``) WRITEs the prompt's blocks of its
    ``[block, layer, kv, head, token, dim]`` cache (rank r holds KV heads
    ``r * H/tp .. (r + 1) * H/tp``) into blocks the same-rank D process reserved, with a
    notification. P's blocks are ``0 .. n-1`` (a fresh pool); D's come from a free list
    (``--dst-blocks``: ``shuffled`` by default, so most blocks are their own descriptor).
    Timed from the first rank issuing its WRITE (``make_prepped_xfer`` + ``transfer``)
    to the notification having arrived at every D rank. ``--kv-transport ucxx``: the same
    on ``UcxxTransport`` (``kvconnector/nixl/transport_ucxx.py``) instead.
``raw``
    Plain NIXL moving the same bytes: a second agent per process, registered on the same
    caches, one prepared request per rank whose only descriptor is P's blocks
    ``0 .. n-1`` -> D's blocks ``0 .. n-1`` as one region, re-posted with a fresh
    notification each time. Timed the same way, from ``transfer`` to the last D rank's
    notification (the request is built before the clock starts).
``copy``
    The same bytes copied inside each P process (``Tensor.copy_``: memcpy on CPU,
    device-to-device on CUDA, then a synchronize), all ranks at once. Timed from the first
    rank's start to the last rank's end.

Every P and D rank is its own process (``engine/bench/transfer_ranks.py``), started as the
engine's TP workers are; rank r of P
pushes to rank r of D. The ranks of one side start together: the bench hands them a start
time a few ms ahead on ``time.perf_counter`` (``CLOCK_MONOTONIC``, one clock for all
processes of a host). D polls for notifications every ``--poll-us``.

After the timed rounds, each path is run once more into zeroed memory and checked byte for
byte: D's reserved blocks hold exactly what P's blocks hold (P fills block ``i`` of rank r
with a pattern only ``(seed, r, i)`` produces; D recomputes it per block), and no other D
block was written. ``data`` in the table says whether all three checks passed.

Memory: each side allocates only the largest size asked for, per rank -- P a cache and a
copy target, D a cache -- 3 x tokens x bytes/token in all (3 GiB at 8k tokens, the
default maximum), whatever the TP. On CPU the bench refuses to start when that exceeds
75% of the available memory.

    pd-bench transfer                                  # 128 512 2048 8192 tokens, TP 1 and 2
    pd-bench transfer --tokens 2048 --tp 2 --json t.json --plot t.png
    pd-bench transfer --device cuda                    # VRAM (all ranks on cuda:rank % gpus)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import uuid
from dataclasses import asdict
from typing import Any

from engine.bench.stats import json_safe
from engine.bench.transfer_ranks import DTYPE_BYTES, BenchError, Geometry, RankProcs

PATHS = ("connector", "raw", "copy")
DST_LAYOUTS = ("shuffled", "runs", "contiguous")
RUN_MAX = 16  # longest free-list run of --dst-blocks runs


def num_blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def dst_block_ids(n: int, pool: int, layout: str, seed: int) -> list[int]:
    """The ``n`` block ids a D with ``pool`` free blocks reserves, in prompt order.

    ``contiguous``: ``0 .. n-1`` (a fresh pool). ``runs``: the pool cut into runs of 1 to
    16 consecutive blocks, the runs shuffled (a free list after some churn). ``shuffled``:
    ``n`` distinct blocks in random order (the worst case: nearly every block its own run).
    """
    if not 0 <= n <= pool:
        raise ValueError(f"{n} blocks do not fit a pool of {pool}")
    rng = random.Random(seed)
    if layout == "contiguous":
        return list(range(n))
    if layout == "shuffled":
        return rng.sample(range(pool), n)
    if layout == "runs":
        runs: list[list[int]] = []
        start = 0
        while start < pool:
            length = min(rng.randint(1, RUN_MAX), pool - start)
            runs.append(list(range(start, start + length)))
            start += length
        rng.shuffle(runs)
        return [b for run in runs for b in run][:n]
    raise ValueError(f"--dst-blocks must be one of {DST_LAYOUTS}, got {layout!r}")


def count_runs(dst_ids: list[int]) -> int:
    """Descriptors a WRITE from blocks ``0 .. n-1`` into ``dst_ids`` needs (NIXL merges
    pairs contiguous on both sides)."""
    from kvconnector.nixl.block_runs import block_runs

    return len(block_runs(list(range(len(dst_ids))), dst_ids))


def path_stats(times: list[float], nbytes: int) -> dict[str, Any]:
    med = statistics.median(times)
    return {
        "times_s": times,
        "median_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "gbps": nbytes / med / 1e9,
        "gbps_best": nbytes / min(times) / 1e9,
    }


def bench_tp(
    geo: Geometry,
    tp: int,
    tokens_list: list[int],
    args: argparse.Namespace,
    log: Any = print,
) -> list[dict[str, Any]]:
    """Every size for one TP: processes up once, all three paths per round, then checks."""
    geo.heads_per_rank(tp)
    sizes = [(t, num_blocks_for(t, geo.block_size)) for t in tokens_list]
    pool = max(n for _, n in sizes)
    cfg = {
        "geometry": asdict(geo),
        "tp": tp,
        "pool_blocks": pool,
        "device": args.device,
        "seed": args.seed,
        "timeout": args.timeout,
        "poll_us": args.poll_us,
        "copy_threads": args.copy_threads,
        "kv_transport": args.kv_transport,
        "run_id": uuid.uuid4().hex[:8],
    }
    results = []
    procs = RankProcs(cfg)
    counter = 0
    try:
        for tokens, n in sizes:
            dst = dst_block_ids(n, pool, args.dst_blocks, seed=args.seed * 7919 + tokens)
            procs.call_all("P", {"op": "prepare_raw", "n": n})
            nbytes = n * geo.block_bytes(tp) * tp
            times: dict[str, list[float]] = {p: [] for p in PATHS}
            descs: list[int] = []
            p_done: list[float] = []
            for rnd in range(args.warmup + args.reps):
                order = PATHS[rnd % 3 :] + PATHS[: rnd % 3]  # no path always goes first
                for path in order:
                    counter += 1
                    m = procs.measure(path, n, dst, tag=f"pdbench {path} {counter}")
                    if rnd >= args.warmup:
                        times[path].append(m["seconds"])
                        if path == "connector":
                            descs = m["descriptors"]
                            p_done.append(m["p_done_s"])
            data = verify(procs, n, dst, counter) if args.verify else None
            row = {
                "tp": tp,
                "tokens": tokens,
                "blocks_per_rank": n,
                "bytes_per_rank": n * geo.block_bytes(tp),
                "bytes_total": nbytes,
                "dst_runs": count_runs(dst),
                "descriptors_per_rank": descs,
                "paths": {p: path_stats(times[p], nbytes) for p in PATHS},
                "connector_p_done_median_s": statistics.median(p_done),
                "data": data,
            }
            paths = row["paths"]
            row["ratio_connector_raw"] = paths["connector"]["gbps"] / paths["raw"]["gbps"]
            row["ratio_connector_copy"] = paths["connector"]["gbps"] / paths["copy"]["gbps"]
            row["data_ok"] = None if data is None else all(d["ok"] for d in data.values())
            results.append(row)
            log(format_row_line(row))
    finally:
        procs.close()
    return results


def verify(procs: RankProcs, n: int, dst: list[int], counter: int) -> dict[str, Any]:
    """Each path once more into zeroed memory; the receiving side checks every byte."""
    out: dict[str, Any] = {}
    for path, d_ids in (("connector", dst), ("raw", list(range(n)))):
        procs.call_all("D", {"op": "zero"})
        procs.measure(path, n, dst, tag=f"pdbench check {path} {counter}")
        checks = procs.call_all("D", {"op": "check", "dst": d_ids, "src": list(range(n))})
        out[path] = _merge_checks(checks)
    procs.call_all("P", {"op": "zero"})
    procs.measure("copy", n, dst, tag="copy")
    out["copy"] = _merge_checks(procs.call_all("P", {"op": "check", "n": n}))
    return out


def _merge_checks(checks: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "ok": all(c["ok"] for c in checks),
        "blocks_checked": sum(c["blocks"] for c in checks),
        "wrong_blocks": sum(max(c.get("wrong_blocks", 0), 0) for c in checks),
        "dirty_other_blocks": sum(c.get("dirty_other_blocks", 0) for c in checks),
        "per_rank": checks,
    }


# ---------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------


def format_row_line(row: dict[str, Any]) -> str:
    p = row["paths"]
    return (
        f"tp {row['tp']} {row['tokens']:>6} tokens: connector {p['connector']['gbps']:.2f} "
        f"GB/s, raw {p['raw']['gbps']:.2f}, copy {p['copy']['gbps']:.2f} "
        f"(connector/raw {row['ratio_connector_raw']:.2f}, "
        f"connector/copy {row['ratio_connector_copy']:.2f}), data "
        f"{_data_word(row['data_ok'])}"
    )


def _mib(nbytes: int) -> str:
    mib = nbytes / 2**20
    return f"{mib:,.0f}" if mib >= 10 else f"{mib:.2f}"


def _data_word(ok: bool | None) -> str:
    return "unchecked" if ok is None else ("ok" if ok else "WRONG")


def markdown_table(results: list[dict[str, Any]]) -> str:
    head = (
        "| TP | tokens | MiB | descs/rank | connector ms | connector GB/s | raw ms | raw GB/s "
        "| copy ms | copy GB/s | connector/raw | connector/copy | data |"
    )
    lines = [head, "|" + "---:|" * 12 + "---|"]
    for r in results:
        p = r["paths"]
        descs = r["descriptors_per_rank"]
        lines.append(
            f"| {r['tp']} | {r['tokens']} | {_mib(r['bytes_total'])} "
            f"| {max(descs) if descs else 0} "
            f"| {p['connector']['median_s'] * 1e3:.2f} | {p['connector']['gbps']:.2f} "
            f"| {p['raw']['median_s'] * 1e3:.2f} | {p['raw']['gbps']:.2f} "
            f"| {p['copy']['median_s'] * 1e3:.2f} | {p['copy']['gbps']:.2f} "
            f"| {r['ratio_connector_raw']:.2f} | {r['ratio_connector_copy']:.2f} "
            f"| {_data_word(r['data_ok'])} |"
        )
    return "\n".join(lines)


def plot_transfer(report: dict[str, Any], path: str) -> bool:
    """GB/s (median) against prompt tokens, one line per TP and path: color by path,
    line style by TP. False (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed; not writing {path}")
        return False
    results = report["results"]
    colors = {"connector": "tab:blue", "raw": "tab:orange", "copy": "tab:green"}
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(8, 5))
    for k, tp in enumerate(sorted({r["tp"] for r in results})):
        rows = sorted((r for r in results if r["tp"] == tp), key=lambda r: r["tokens"])
        xs = [r["tokens"] for r in rows]
        for path_name in PATHS:
            ys = [r["paths"][path_name]["gbps"] for r in rows]
            ax.plot(
                xs,
                ys,
                marker="o",
                color=colors[path_name],
                linestyle=styles[k % len(styles)],
                label=f"TP {tp} {path_name}",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r["tokens"] for r in results})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("GB/s (median; GB = 1e9 bytes; log scale)")
    geo = report.get("geometry") or {}
    kib = (report.get("bytes_per_token") or 0) / 1024
    ax.set_title(
        f"pd-bench transfer: {report.get('memory', '?')}, {geo.get('layers')} layers, "
        f"{kib:g} KiB/token, connector on {report.get('kv_transport', 'nixl')}, "
        f"commit {report.get('commit')}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, handlelength=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def memory_needed(geo: Geometry, tokens_list: list[int]) -> int:
    """Bytes all ranks of one TP hold at once: P cache + P copy target + D cache."""
    blocks = max(num_blocks_for(t, geo.block_size) for t in tokens_list)
    return 3 * blocks * geo.block_size * geo.bytes_per_token


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def add_transfer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("geometry (default: Llama-3-8B, 128 KiB of KV per token)")
    g.add_argument("--layers", type=int, default=32, help="layers (default: 32)")
    g.add_argument("--kv-heads", type=int, default=8, help="KV heads, all ranks (default: 8)")
    g.add_argument("--head-dim", type=int, default=128, help="head dim (default: 128)")
    g.add_argument(
        "--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16", help="(default: bfloat16)"
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per block (default: 16)")
    w = p.add_argument_group("what to measure")
    w.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[128, 512, 2048, 8192],
        help="prompt lengths to push (default: 128 512 2048 8192)",
    )
    w.add_argument(
        "--tp",
        type=int,
        nargs="+",
        default=[1, 2],
        help="TP sizes, each rank holding its share of the KV heads (default: 1 2)",
    )
    w.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the caches live: cpu (DRAM) or cuda (VRAM, rank r on cuda:r %% gpus)",
    )
    w.add_argument(
        "--dst-blocks",
        choices=DST_LAYOUTS,
        default="shuffled",
        help="how D's reserved blocks lie: shuffled free list (default), shuffled runs of "
        "1-16 blocks, or contiguous",
    )
    w.add_argument("--reps", type=int, default=5, help="measured rounds (default: 5)")
    w.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default: 1)")
    w.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check D's bytes after each path (default: on)",
    )
    w.add_argument("--seed", type=int, default=0, help="data and block-order seed (default: 0)")
    w.add_argument(
        "--poll-us",
        type=float,
        default=50.0,
        help="sleep between polls for completion/notifications, microseconds (default: 50)",
    )
    w.add_argument(
        "--copy-threads",
        type=int,
        default=1,
        help="torch threads per rank process (the CPU copy path's memcpy; default: 1)",
    )
    w.add_argument(
        "--timeout", type=float, default=60.0, help="per-transfer deadline, s (default: 60)"
    )
    w.add_argument(
        "--kv-transport",
        choices=["nixl", "ucxx"],
        default="nixl",
        help="the connector path's transport, as the nodes' flag (default: nixl; ucxx needs "
        "pip install -e '.[ucxx]'); raw and copy are unchanged",
    )
    w.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    w.add_argument(
        "--plot",
        metavar="PATH.png",
        help="GB/s against tokens, one line per TP and path (matplotlib)",
    )


def validate(args: argparse.Namespace) -> Geometry:
    """The geometry, or ``ValueError`` naming the flag."""
    geo = Geometry(args.layers, args.kv_heads, args.head_dim, args.dtype, args.block_size)
    if any(t < 1 for t in args.tokens):
        raise ValueError("--tokens must all be >= 1")
    for tp in args.tp:
        geo.heads_per_rank(tp)
    if args.reps < 1 or args.warmup < 0:
        raise ValueError("--reps must be >= 1 and --warmup >= 0")
    if args.poll_us < 0 or args.timeout <= 0 or args.copy_threads < 1:
        raise ValueError("--poll-us >= 0, --timeout > 0 and --copy-threads >= 1 required")
    return geo


def run_transfer(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        geo = validate(args)
    except ValueError as e:
        parser.error(str(e))
    tokens = sorted(set(args.tokens))
    need = memory_needed(geo, tokens)
    avail = _mem_available()
    if args.device == "cpu" and avail is not None and need > 0.75 * avail:
        print(
            f"pd-bench transfer: needs {need / 2**30:.1f} GiB of memory, only "
            f"{avail / 2**30:.1f} GiB available; ask for fewer --tokens",
            file=sys.stderr,
        )
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("pd-bench transfer: --device cuda but CUDA is not available", file=sys.stderr)
            return 2
    from kvconnector.nixl.transport import NIXL_AVAILABLE

    if not NIXL_AVAILABLE:
        print("pd-bench transfer: nixl is not installed (pip install nixl)", file=sys.stderr)
        return 2
    if args.kv_transport == "ucxx" and importlib.util.find_spec("ucxx") is None:
        print(
            "pd-bench transfer: ucxx is not installed (pip install -e '.[ucxx]')", file=sys.stderr
        )
        return 2
    memory = "VRAM" if args.device == "cuda" else "DRAM"
    print(
        f"pd-bench transfer: {geo.layers} layers x {geo.kv_heads} KV heads x head_dim "
        f"{geo.head_dim}, {geo.dtype}, block {geo.block_size} -> "
        f"{geo.bytes_per_token / 1024:g} KiB/token; {memory}; D blocks {args.dst_blocks}; "
        f"connector on {args.kv_transport}; "
        f"median of {args.reps} (+{args.warmup} warm-up); peak memory {need / 2**30:.2f} GiB",
        flush=True,
    )
    commit = _git_commit()  # now: other work may commit while a long run goes on
    results: list[dict[str, Any]] = []
    try:
        for tp in sorted(set(args.tp)):
            results += bench_tp(geo, tp, tokens, args, log=lambda s: print(s, flush=True))
    except BenchError as e:
        print(f"pd-bench transfer: {e}", file=sys.stderr)
        return 1
    print()
    print(markdown_table(results))
    report = {
        "command": "transfer",
        "commit": commit,
        "device": args.device,
        "memory": memory,
        "geometry": asdict(geo),
        "bytes_per_token": geo.bytes_per_token,
        "tokens": tokens,
        "tp": sorted(set(args.tp)),
        "dst_blocks": args.dst_blocks,
        "reps": args.reps,
        "warmup": args.warmup,
        "poll_us": args.poll_us,
        "copy_threads": args.copy_threads,
        "kv_transport": args.kv_transport,
        "ucx_env": {
            k: v
            for k, v in os.environ.items()
            # expandable_segments: NIXL registers VRAM, UCX may fall back to TCP (nixl#1754)
            if k.startswith("UCX_") or k == "PYTORCH_CUDA_ALLOC_CONF"
        },
        "gb": "1e9 bytes; GB/s = bytes of all ranks / median seconds",
        "results": results,
        "all_data_ok": all(r["data_ok"] is not False for r in results),
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(json_safe(report), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot and plot_transfer(report, args.plot):
        print(f"wrote {args.plot}")
    return 0 if report["all_data_ok"] else 1
