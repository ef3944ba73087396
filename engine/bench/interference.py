"""``pd-bench interference``: the DistServe experiment at small scale -- one P + one D
behind ``pd-proxy`` against two colocated nodes behind the same proxy, same hardware,
same workload.

On one box, one layout after the other, the bench starts (and stops, by PID) the nodes of
a layout and a proxy in front of them, drives the same workload through the proxy and
records what every request saw:

``pd``
    ``prefill-node --kv-connector nixl`` + ``decode-node --kv-connector nixl`` behind
    ``pd-proxy serve --prefill P --decode D``: every request is disaggregated (P prefills,
    pushes the KV, D decodes).
``colocated``
    Two ``decode-node`` processes without a connector (each serves whole requests, as in
    ``scripts/bench_pd_overhead.py``) behind ``pd-proxy serve --decode C1 C2
    --disagg-min-prompt-tokens 1000000000 --registration-key <random>``: both are listed
    as decode nodes and every prompt is "short", so the proxy's conditional
    disaggregation serves each request on one node alone (a plain request, no KV
    transfer), picked by the same ``least_load`` rule. The proxy insists on a way to find
    prefill nodes; a registration key nobody is given satisfies that without a fake URL
    (``/health`` then answers 503 "no healthy prefill node", which the bench does not
    wait on: it waits for both nodes to be healthy in the proxy's ``/health`` body).
    Same proxy binary, same hop from the client, only the layout behind it differs.

The workload (``engine/bench/serve.py``'s prompts, request bodies, streaming client and
``stats``): ``--decode-streams`` ongoing decodes -- closed loops, each sending a short
prompt (``--decode-input-len``) with a long output (``--decode-output-len``) and the next
one as soon as it ends -- and, after ``--lead-s`` seconds, long prompts
(``--long-len`` -> ``--long-output-len``) arriving Poisson at ``--long-rate`` for
``--duration-s`` (or ``--num-long`` of them). Once every long request has finished the
streams start nothing new; the run ends when their last requests end.

Reported per layout: the ITL of the ongoing decodes while long prompts run (the gaps that
ended between the first long arrival and the last long completion: the interference),
ITL of every request, TTFT of long prompts, of decodes and of all, and goodput under an
SLO (requests per second that completed with TTFT <= ``--slo-ttft-ms`` and their largest
ITL <= ``--slo-itl-ms``, over the run's duration; ``stats.meets_slo``), plus the ratios
P/D / colocated. On CPU with ``tiny`` every process shares the same few cores, so the
numbers are for the shape of the output only.

    pd-bench interference --smoke --json i.json --plot i.png     # seconds, tiny sizes
    pd-bench interference --long-rate 1 --long-len 1024 --duration-s 30 \\
        --slo-ttft-ms 1000 --slo-itl-ms 100 --json i.json --plot i.png
    pd-bench interference --device cuda --model /data/llama-886m \\
        --node-arg=--gpu-memory-utilization=0.4 --prefill-arg=--kv-layer-group-size=4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.bench.cluster import ROOT, BenchError, Cluster
from engine.bench.interference_report import (
    LAYOUTS,
    LayoutRun,
    layout_report,
    markdown_table,
    plot_interference,
    ratios,
)
from engine.bench.serve_args import add_api_key_arg, add_idle_timeout_arg, auth_headers
from engine.bench.stats import RequestResult, json_safe

NEVER_DISAGGREGATE = 1_000_000_000  # --disagg-min-prompt-tokens: every prompt is "short"

# Workload flags: None on the command line means "this default" (or --smoke's).
DEFAULTS: dict[str, Any] = {
    "long_rate": 1.0,
    "long_len": 1024,
    "long_output_len": 16,
    "duration_s": 20.0,
    "decode_streams": 4,
    "decode_input_len": 32,
    "decode_output_len": 128,
    "lead_s": 2.0,
    "num_blocks": None,
}
WORKLOAD_KEYS = (*DEFAULTS, "num_long", "seed", "smoke")
SMOKE: dict[str, Any] = {
    "long_rate": 10.0,
    "long_len": 96,
    "long_output_len": 4,
    "num_long": 3,
    "decode_streams": 2,
    "decode_input_len": 8,
    "decode_output_len": 12,
    "lead_s": 0.2,
    "num_blocks": 128,
}


# ---------------------------------------------------------------------------------------
# the layouts: which processes, with which flags
# ---------------------------------------------------------------------------------------


def node_argv(args: argparse.Namespace) -> list[str]:
    """Flags every node of both layouts gets."""
    argv = ["--model", args.model, "--device", args.device, "--tp", str(args.tp)]
    argv += ["--log-level", args.node_log_level]
    if args.num_blocks:
        argv += ["--num-blocks", str(args.num_blocks)]
    return argv + list(args.node_arg)


def layout_plan(layout: str, args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(name, module, argv) of each node of ``layout``, in start order (no ports)."""
    common = node_argv(args)
    kv = ["--kv-connector", "nixl"]
    if layout == "pd":
        return [
            ("prefill", "prefill_node", [*common, *kv, *args.prefill_arg]),
            ("decode", "decode_node", [*common, *kv, *args.decode_arg]),
        ]
    return [
        ("colocated0", "decode_node", [*common, *args.colocated_arg]),
        ("colocated1", "decode_node", [*common, *args.colocated_arg]),
    ]


def proxy_argv(layout: str, urls: list[str], args: argparse.Namespace) -> list[str]:
    argv = ["serve", "--health-interval", "0.5", "--log-level", args.node_log_level]
    if layout == "pd":
        argv += ["--prefill", urls[0], "--decode", urls[1]]
    else:
        # Both colocated nodes are decode nodes; every prompt is shorter than the
        # threshold, so each request goes to one node alone (no prefill leg, no KV
        # transfer). The registration key (given to nobody) is what lets the proxy run
        # without a prefill node list.
        argv += ["--decode", *urls]
        argv += ["--disagg-min-prompt-tokens", str(NEVER_DISAGGREGATE)]
        argv += ["--registration-key", secrets.token_hex(16)]
    return argv + list(args.proxy_arg)


def _gpu_env(index: int, args: argparse.Namespace) -> dict[str, str] | None:
    """``--gpu-per-node``: node ``index`` sees GPUs ``index*tp .. (index+1)*tp - 1``."""
    if not args.gpu_per_node:
        return None
    first = index * args.tp
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(first + i) for i in range(args.tp))}


# ---------------------------------------------------------------------------------------
# the workload
# ---------------------------------------------------------------------------------------


def long_arrivals(args: argparse.Namespace) -> list[float]:
    """Send times (s after ``--lead-s``) of the long prompts: ``--num-long`` Poisson
    arrivals, or as many as fall inside ``--duration-s``."""
    from engine.bench.serve import arrival_delays

    if args.num_long is not None:
        return arrival_delays(args.num_long, args.long_rate, args.seed)
    n = max(1, int(args.long_rate * args.duration_s * 3) + 10)
    out = [t for t in arrival_delays(n, args.long_rate, args.seed) if t < args.duration_s]
    return out or [0.0]


def _body_args(output_len: int) -> argparse.Namespace:
    """What ``serve.request_body`` reads, for one request class."""
    return argparse.Namespace(
        output_len=output_len,
        temperature=0.0,
        ignore_eos=True,
        endpoint="/v1/completions",
        extra_body=None,
    )


async def drive(base_url: str, args: argparse.Namespace) -> LayoutRun:
    """The workload against ``base_url`` (the layout's proxy)."""
    import httpx

    from engine.bench.serve import get_model, make_prompts, request_body, send_one

    url = base_url.rstrip("/") + "/v1/completions"
    delays = long_arrivals(args)
    ids = tuple(args.token_id_range)
    long_prompts = make_prompts(len(delays), args.long_len, "ids", ids, args.seed)
    long_body, dec_body = _body_args(args.long_output_len), _body_args(args.decode_output_len)
    conns = args.decode_streams + len(delays) + 4
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    timeout = httpx.Timeout(args.timeout, connect=min(30.0, args.timeout))
    headers = auth_headers(args.api_key)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        try:
            model = await get_model(client, base_url.rstrip("/"))
        except (httpx.HTTPError, RuntimeError) as e:  # a 401 says which flag to pass
            raise BenchError(f"GET /v1/models: {e}") from e
        # warm-up, not counted: one long and one decode request, other prompts
        for body_args, length, seed in (
            (long_body, args.long_len, args.seed + 50_021),
            (dec_body, args.decode_input_len, args.seed + 50_023),
        ):
            p = make_prompts(1, length, "ids", ids, seed)[0]
            r = await send_one(
                client, url, request_body(body_args, model, p), p, args.timeout, args.idle_timeout
            )
            if not r.ok:
                raise BenchError(f"warm-up request failed: {r.error}")
        stop = asyncio.Event()
        t0 = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - t0

        async def stream(k: int) -> list[RequestResult]:
            out: list[RequestResult] = []
            i = 0
            while not stop.is_set():
                seed = args.seed + 1_000 + k * 100_003 + i
                p = make_prompts(1, args.decode_input_len, "ids", ids, seed)[0]
                sent = now()
                r = await send_one(
                    client,
                    url,
                    request_body(dec_body, model, p),
                    p,
                    args.timeout,
                    args.idle_timeout,
                )
                r.start = sent
                out.append(r)
                i += 1
                if not r.ok:  # do not spin on a failing endpoint
                    await asyncio.sleep(0.1)
            return out

        async def long_one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, args.lead_s + delays[i] - now()))
            sent = now()
            p = long_prompts[i]
            r = await send_one(
                client, url, request_body(long_body, model, p), p, args.timeout, args.idle_timeout
            )
            r.start = sent
            return r

        streams = [asyncio.create_task(stream(k)) for k in range(args.decode_streams)]
        try:
            longs = list(await asyncio.gather(*(long_one(i) for i in range(len(delays)))))
        finally:
            window_end = now()
            stop.set()
        decode = [r for rs in await asyncio.gather(*streams) for r in rs]
        duration = now()
    window = (args.lead_s + delays[0], window_end)
    return LayoutRun(long=longs, decode=decode, window=window, duration_s=duration)


def route_modes(proxy_url: str) -> dict[str, float]:
    """The proxy's ``pdproxy_route_mode_total`` per mode (disaggregated, decode_only): which
    path the requests took; {} if it cannot be read."""
    import httpx

    out: dict[str, float] = {}
    try:
        text = httpx.get(proxy_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    prefix = "pdproxy_route_mode_total{"
    for line in text.splitlines():
        if line.startswith(prefix) and 'mode="' in line:
            mode = line.split('mode="', 1)[1].split('"', 1)[0]
            with contextlib.suppress(ValueError):
                out[mode] = float(line.rsplit(" ", 1)[1])
    return out


def kv_hop_means(node_url: str) -> dict[str, Any]:
    """The P/D hop histograms a node exports (``pdserve_kv_*_seconds``, e.g. D's
    ``kv_load_wait_seconds``): mean ms and count of each, over the whole run (warm-up
    included); {} if they cannot be read."""
    import httpx

    try:
        text = httpx.get(node_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        name = name.split("{", 1)[0]
        kv = name.startswith(("pdserve_kv_", "pdserve_engine_kv_"))
        if kv and name.endswith(("_seconds_sum", "_seconds_count")):
            with contextlib.suppress(ValueError):
                sums[name] = sums.get(name, 0.0) + float(value)
    out: dict[str, Any] = {}
    for name, total in sums.items():
        if name.endswith("_sum"):
            hop = name[len("pdserve_") : -len("_sum")].removeprefix("engine_")
            count = sums.get(name[: -len("_sum")] + "_count", 0.0)
            if count:
                out[hop] = {"mean_ms": total / count * 1e3, "count": count}
    return out


# Flags whose values are secrets: never written to the report or printed.
SECRET_FLAGS = ("--registration-key", "--api-key", "--node-api-key", "--kv-secret")


def _hidden_args(argv: list[str]) -> list[str]:
    """``argv`` with the values of ``SECRET_FLAGS`` (``--flag V`` or ``--flag=V``) hidden."""
    out: list[str] = []
    for i, a in enumerate(argv):
        if i > 0 and argv[i - 1] in SECRET_FLAGS:
            out.append("<hidden>")
        elif a.split("=", 1)[0] in SECRET_FLAGS and "=" in a:
            out.append(a.split("=", 1)[0] + "=<hidden>")
        else:
            out.append(a)
    return out


def _shown_cmd(cmd: list[str]) -> list[str]:
    """The command as recorded: the interpreter's base name, secret values hidden."""
    return [os.path.basename(cmd[0]), *_hidden_args(cmd[1:])]


def run_layout(layout: str, args: argparse.Namespace, log_dir: Path, log: Any = print) -> LayoutRun:
    """Start the layout, drive the workload through its proxy, stop it (always)."""
    cluster = Cluster(log_dir)
    t_start = time.perf_counter()
    try:
        nodes = [
            cluster.start(f"{layout}-{name}", module, argv, _gpu_env(i, args))
            for i, (name, module, argv) in enumerate(layout_plan(layout, args))
        ]
        # the proxy starts with them: it routes to a node once its health check passes
        proxy = cluster.start(
            f"{layout}-proxy", "proxy", proxy_argv(layout, [n.url for n in nodes], args)
        )
        cluster.wait_healthy(nodes, args.startup_timeout)
        cluster.wait_proxy(proxy, nodes, args.startup_timeout)
        started = time.perf_counter()
        log(
            f"  {layout}: {len(nodes)} nodes + proxy up in {started - t_start:.1f}s; "
            "driving the workload"
        )
        run = asyncio.run(drive(proxy.url, args))
        cluster.check_all_alive()
        run.route_modes = route_modes(proxy.url)
        if layout == "pd":
            run.kv_hops = {p.name: kv_hop_means(p.url) for p in nodes}
        log(f"  {layout}: workload done in {time.perf_counter() - started:.1f}s")
        run.nodes = [
            {"name": p.name, "cmd": _shown_cmd(p.cmd), "log": str(p.log)} for p in cluster.procs
        ]
        return run
    finally:
        t_stop = time.perf_counter()
        cluster.stop_all()
        log(f"  {layout}: stopped in {time.perf_counter() - t_stop:.1f}s")


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def add_interference_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("nodes (the same for both layouts)")
    g.add_argument("--model", default="tiny", help="every node's --model (default: tiny)")
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(default: cpu)")
    g.add_argument("--tp", type=int, default=1, help="every node's --tp (default: 1)")
    g.add_argument(
        "--num-blocks",
        type=int,
        help="every node's --num-blocks (default: the node's own sizing; --smoke: 128)",
    )
    g.add_argument(
        "--node-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for every node of both layouts (repeat; write --node-arg=--flag=V)",
    )
    g.add_argument(
        "--prefill-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for the P/D layout's prefill node, e.g. "
        "--prefill-arg=--kv-layer-group-size=4 (repeat)",
    )
    g.add_argument(
        "--decode-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for the P/D layout's decode node (repeat)",
    )
    g.add_argument(
        "--colocated-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for the two colocated nodes (repeat)",
    )
    g.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for both layouts' pd-proxy (repeat)",
    )
    add_api_key_arg(g)  # for a proxy given a key (--proxy-arg=--api-key=KEY, $PDPROXY_API_KEY)
    g.add_argument(
        "--gpu-per-node",
        action="store_true",
        help="--device cuda: node i of a layout sees GPUs i*tp..(i+1)*tp-1 only "
        "(CUDA_VISIBLE_DEVICES); default: every node sees every GPU",
    )
    g.add_argument(
        "--layouts",
        nargs="+",
        choices=LAYOUTS,
        default=list(LAYOUTS),
        help="which layouts to run, in this order (default: pd colocated)",
    )
    g.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds a layout may take to become healthy (default: 300)",
    )
    g.add_argument(
        "--node-log-level",
        default="WARNING",
        help="--log-level of nodes and proxy (default: WARNING)",
    )
    g.add_argument("--log-dir", help="where process logs go (default: a new temporary folder)")

    w = p.add_argument_group("workload")
    d = DEFAULTS
    w.add_argument(
        "--long-rate",
        type=float,
        help=f"long prompts per second, Poisson; inf: all at once (default: {d['long_rate']:g})",
    )
    w.add_argument(
        "--long-len", type=int, help=f"long prompt length, tokens (default: {d['long_len']})"
    )
    w.add_argument(
        "--long-output-len",
        type=int,
        help=f"max_tokens of a long prompt (default: {d['long_output_len']})",
    )
    span = w.add_mutually_exclusive_group()
    span.add_argument(
        "--duration-s",
        type=float,
        help=f"long prompts arrive during this many seconds (default: {d['duration_s']:g})",
    )
    span.add_argument("--num-long", type=int, help="send this many long prompts instead")
    w.add_argument(
        "--decode-streams",
        type=int,
        help=f"ongoing decodes: concurrent closed-loop streams (default: {d['decode_streams']})",
    )
    w.add_argument(
        "--decode-input-len",
        type=int,
        help=f"an ongoing decode's prompt length (default: {d['decode_input_len']})",
    )
    w.add_argument(
        "--decode-output-len",
        type=int,
        help=f"an ongoing decode's max_tokens (default: {d['decode_output_len']})",
    )
    w.add_argument(
        "--lead-s",
        type=float,
        help=f"seconds the streams run before the first long prompt (default: {d['lead_s']:g})",
    )
    w.add_argument(
        "--token-id-range",
        type=int,
        nargs=2,
        default=(3, 256),
        metavar=("LO", "HI"),
        help="prompt token ids are drawn from [LO, HI) (default: 3 256)",
    )
    w.add_argument("--seed", type=int, default=0, help="prompt and arrival seed (default: 0)")
    w.add_argument(
        "--timeout", type=float, default=600.0, help="seconds one request may take (default: 600)"
    )
    add_idle_timeout_arg(w)
    w.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, seconds per layout (3 long prompts of 96 tokens, 2 streams of "
        "8 -> 12 tokens, --num-blocks 128); flags given explicitly still win",
    )

    r = p.add_argument_group("results")
    r.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=1000.0,
        help="goodput: TTFT SLO, ms (default: 1000)",
    )
    r.add_argument(
        "--slo-itl-ms",
        type=float,
        default=100.0,
        help="goodput: SLO on a request's largest ITL, ms (default: 100)",
    )
    r.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    r.add_argument(
        "--plot",
        metavar="PATH.png",
        help="ITL and TTFT CDFs of both layouts (matplotlib)",
    )


def resolve(args: argparse.Namespace) -> None:
    """Fill the workload flags left unset: ``--smoke``'s values, else the defaults."""
    base = {**DEFAULTS, **(SMOKE if args.smoke else {})}
    for key, value in base.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.num_long is not None:
        args.duration_s = None


def validate(args: argparse.Namespace) -> None:
    """Raises ``ValueError`` naming the flag."""
    if args.tp < 1:
        raise ValueError("--tp must be >= 1")
    if args.num_blocks is not None and args.num_blocks < 1:
        raise ValueError("--num-blocks must be >= 1")
    if not args.long_rate > 0:
        raise ValueError("--long-rate must be > 0 (inf: all at once)")
    for flag in ("long_len", "long_output_len", "decode_input_len", "decode_output_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.decode_streams < 0:
        raise ValueError("--decode-streams must be >= 0")
    if args.num_long is not None and args.num_long < 1:
        raise ValueError("--num-long must be >= 1")
    if args.duration_s is not None and not args.duration_s > 0:
        raise ValueError("--duration-s must be > 0")
    if math.isinf(args.long_rate) and args.num_long is None:
        raise ValueError("--long-rate inf (all at once) needs --num-long")
    if args.lead_s < 0 or args.timeout <= 0 or args.startup_timeout <= 0:
        raise ValueError("--lead-s >= 0, --timeout > 0 and --startup-timeout > 0 required")
    if not args.idle_timeout >= 0:  # NaN fails too
        raise ValueError("--idle-timeout must be >= 0 (0: no bound but --timeout)")
    for name in ("slo_ttft_ms", "slo_itl_ms"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    lo, hi = args.token_id_range
    if not 0 <= lo < hi:
        raise ValueError("--token-id-range: need 0 <= LO < HI")
    if args.gpu_per_node and args.device != "cuda":
        raise ValueError("--gpu-per-node needs --device cuda")


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=ROOT,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run_interference(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    resolve(args)
    try:
        validate(args)
    except ValueError as e:
        parser.error(str(e))
    if "pd" in args.layouts:
        from kvconnector.nixl.transport import NIXL_AVAILABLE

        if not NIXL_AVAILABLE:
            print(
                "pd-bench interference: nixl is not installed (pip install nixl); "
                "--layouts colocated runs without it",
                file=sys.stderr,
            )
            return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pd-bench-interference-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    span = (
        f"{args.num_long} long prompts"
        if args.num_long is not None
        else f"long prompts for {args.duration_s:g}s"
    )
    rate = "inf" if math.isinf(args.long_rate) else f"{args.long_rate:g}/s"
    print(
        f"pd-bench interference: {args.model} on {args.device}, TP {args.tp}; {span} of "
        f"{args.long_len} -> {args.long_output_len} tokens at {rate} (Poisson) over "
        f"{args.decode_streams} ongoing decodes of {args.decode_input_len} -> "
        f"{args.decode_output_len} tokens; layouts {' then '.join(args.layouts)}; "
        f"logs in {log_dir}",
        flush=True,
    )
    commit = _git_commit()
    layouts: dict[str, dict[str, Any]] = {}
    for layout in args.layouts:
        try:
            run = run_layout(layout, args, log_dir, log=lambda s: print(s, flush=True))
        except BenchError as e:
            print(f"pd-bench interference: {layout}: {e}", file=sys.stderr)
            return 1
        layouts[layout] = layout_report(run, args.slo_ttft_ms, args.slo_itl_ms)
    report: dict[str, Any] = {
        "command": "interference",
        "commit": commit,
        "model": args.model,
        "device": args.device,
        "tp": args.tp,
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms},
        "workload": {k: getattr(args, k) for k in WORKLOAD_KEYS},
        "args": {k: v for k, v in vars(args).items() if k not in ("command",)}
        | {"api_key": "<hidden>" if args.api_key else None}
        | {"proxy_arg": _hidden_args(list(args.proxy_arg))},
        "note": "on CPU every process shares the same cores: numbers are for shape only",
        "layouts": layouts,
    }
    report["ratios"] = ratios(layouts)
    print()
    print(markdown_table(report))
    for name, lay in layouts.items():
        errors = lay["all"].get("errors") or {}
        for msg, n in sorted(errors.items(), key=lambda kv: -kv[1])[:3]:
            print(f"{name}: error x{n}: {msg}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(json_safe(report), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot and plot_interference(report, args.plot):
        print(f"wrote {args.plot}")
    ok = all(lay["headline"]["completed"] for lay in layouts.values())
    return 0 if ok else 1
