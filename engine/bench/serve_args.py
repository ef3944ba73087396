"""``pd-bench serve``'s flags: its own, ``vllm bench serve``'s spellings of them (mapped
onto pd-bench's), their defaults and checks (``validate``), and the API key (flag,
``$OPENAI_API_KEY``, header; ``interference`` shares it). The run is ``serve.py``'s.

Imports no torch, as ``serve.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

from engine.bench.responses import RESPONSES_ENDPOINT
from engine.bench.sse_idle import DEFAULT_IDLE_TIMEOUT_S
from engine.bench.stats import (
    DEFAULT_METRIC_PERCENTILES,
    DEFAULT_PERCENTILE_METRICS,
    PERCENTILE_METRICS,
    short_number,
)

API_KEY_ENV = "OPENAI_API_KEY"  # what `vllm bench serve` and the OpenAI client read
AUTH_HINT = f"pass the endpoint's key with --api-key KEY or ${API_KEY_ENV}"


def normalize_base_url(url: str) -> str:
    """``http://host:port/v1/`` -> ``http://host:port``: the bench appends ``/v1/...``
    paths itself, so an OpenAI-client style base URL loses its ``/v1`` (and trailing
    slashes)."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url.removesuffix("/v1").rstrip("/")
    return url


def add_api_key_arg(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"sent as 'Authorization: Bearer KEY' on every request (default: ${API_KEY_ENV}; "
        "unset: none); never printed",
    )


def add_idle_timeout_arg(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="seconds a stream may go without an event once its first came (silence or "
        "only SSE comments): then the request fails (default: "
        f"{DEFAULT_IDLE_TIMEOUT_S:g}; 0: no bound but --timeout)",
    )


def check_idle_timeout(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not args.idle_timeout >= 0:  # NaN fails too
        parser.error("--idle-timeout must be >= 0 (0: no bound but --timeout)")


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("endpoint")
    g.add_argument(
        "--base-url",
        type=normalize_base_url,
        default=None,
        help="node or pd-proxy URL; a trailing /v1 (OpenAI-client style) is dropped, the "
        "bench adds /v1/... itself (default: http://127.0.0.1:8000)",
    )
    add_api_key_arg(g)
    g.add_argument(
        "--endpoint",
        default=None,
        help="/v1/completions (default), /v1/chat/completions or /v1/responses",
    )
    g.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    g.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a request may take in all (default: 600)",
    )
    add_idle_timeout_arg(g)
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64)")
    g.add_argument(
        "--max-concurrency", type=int, help="most requests in flight (default: unlimited)"
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrival rate, req/s; inf sends all at once (default: inf)",
    )
    g.add_argument("--seed", type=int, default=0, help="prompt and arrival seed (default: 0)")
    g.add_argument(
        "--num-warmup",
        type=int,
        default=1,
        help="requests sent one at a time before the measurement, not counted (default: 1)",
    )
    g = p.add_argument_group("prompts")
    g.add_argument("--input-len", type=int, default=1024, help="prompt length (default: 1024)")
    g.add_argument("--output-len", type=int, default=64, help="max_tokens (default: 64)")
    g.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="the first N tokens (words) of prompt i are shared prefix i mod --num-prefixes "
        "(prefix-cache hits; default: 0, every prompt differs from its first token on)",
    )
    g.add_argument(
        "--num-prefixes", type=int, default=1, help="shared prefixes to draw from (default: 1)"
    )
    g.add_argument(
        "--prompt-type",
        choices=["ids", "text"],
        default="ids",
        help="ids: random token-id lists of --input-len tokens (exact); text: --input-len "
        "random words (the token count is the server's; chat and responses always use text)",
    )
    g.add_argument(
        "--token-id-range",
        type=int,
        nargs=2,
        default=(3, 256),
        metavar=("LO", "HI"),
        help="token ids are drawn from [LO, HI) (default: 3 256, valid for every model)",
    )
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly --output-len tokens (default: on)",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    g.add_argument(
        "--extra-body", type=json.loads, default=None, help="JSON object merged into each body"
    )
    g = p.add_argument_group("results")
    g.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT SLO, ms")
    g.add_argument("--slo-itl-ms", type=float, help="goodput: SLO on a request's largest ITL, ms")
    g.add_argument(
        "--percentile-metrics",
        type=percentile_metrics_arg,
        default=",".join(DEFAULT_PERCENTILE_METRICS),
        metavar="M,...",
        help="the latencies reported, as vLLM's bench: a comma list of "
        f"{', '.join(PERCENTILE_METRICS)} (default: all; vLLM's: ttft,tpot,itl)",
    )
    g.add_argument(
        "--metric-percentiles",
        type=metric_percentiles_arg,
        default=",".join(map(short_number, DEFAULT_METRIC_PERCENTILES)),
        metavar="P,...",
        help="the percentiles reported of each, in (0, 100], besides mean and median, as "
        "vLLM's bench: a comma list, e.g. 50,99.9 (default: 90,99; vLLM's: 99)",
    )
    g.add_argument("--json", metavar="PATH", help="write the summary and per-request results")
    g.add_argument("--plot", metavar="PATH.png", help="latency CDFs (TTFT, ITL, E2E); matplotlib")
    g.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    add_vllm_bench_args(p)


def _comma_list(flag: str, value: str) -> list[str]:
    items = [x.strip() for x in value.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"{flag}: empty entry in {value!r}")
    return list(dict.fromkeys(items))  # the first of each, in order


def percentile_metrics_arg(value: str) -> list[str]:
    """``--percentile-metrics ttft,itl`` -> ["ttft", "itl"] (vLLM's metric names)."""
    metrics = _comma_list("--percentile-metrics", value)
    for m in metrics:
        if m not in PERCENTILE_METRICS:
            raise argparse.ArgumentTypeError(
                f"unknown metric {m!r}: choose from {', '.join(PERCENTILE_METRICS)}"
            )
    return metrics


def metric_percentiles_arg(value: str) -> list[float]:
    """``--metric-percentiles 50,99.9`` -> [50.0, 99.9]; each in (0, 100]."""
    out = []
    for item in _comma_list("--metric-percentiles", value):
        try:
            p = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a number") from None
        if not 0 < p <= 100:  # NaN fails too
            raise argparse.ArgumentTypeError(f"percentile {item} is not in (0, 100]")
        out.append(p)
    return list(dict.fromkeys(out))


CHAT_ENDPOINT = "/v1/chat/completions"
_BACKEND_ENDPOINTS = {"vllm": "/v1/completions", "openai": "/v1/completions",
                      "openai-chat": CHAT_ENDPOINT,
                      "openai-responses": RESPONSES_ENDPOINT}  # fmt: skip


def add_vllm_bench_args(p: argparse.ArgumentParser) -> None:
    """``vllm bench serve``'s spellings of what pd-bench does (mapped by ``validate``)."""
    g = p.add_argument_group(
        "vLLM's `bench serve` spellings", "taken as pd-bench's own flags (see each)"
    )
    same = {"default": argparse.SUPPRESS}  # the flag it spells has the default
    g.add_argument("--random-input-len", dest="input_len", type=int, help="= --input-len", **same)
    g.add_argument(
        "--random-output-len", dest="output_len", type=int, help="= --output-len", **same
    )
    g.add_argument(
        "--random-prefix-len",
        type=int,
        help="a prefix of N random tokens every prompt shares, before --random-input-len "
        "tokens of its own (= --shared-prefix-len N, --input-len + N)",
    )
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="only 0: every prompt and answer has exactly its length",
    )
    g.add_argument(
        "--dataset-name", choices=["random"], help="only random: pd-bench draws random prompts"
    )
    g.add_argument("--num-warmups", dest="num_warmup", type=int, help="= --num-warmup", **same)
    g.add_argument(
        "--disable-tqdm", dest="no_progress", action="store_true", help="= --no-progress", **same
    )
    g.add_argument(
        "--backend",
        choices=sorted(_BACKEND_ENDPOINTS),
        help="openai-chat: --endpoint /v1/chat/completions; openai-responses (pd-bench's "
        "name; vLLM's bench has none): /v1/responses; vllm, openai: /v1/completions",
    )
    g.add_argument("--host", help="with --port: --base-url http://HOST:PORT")
    g.add_argument("--port", type=int, help="with --host: --base-url http://HOST:PORT")
    g.add_argument(
        "--served-model-name", help="the model name sent (over --model, as vLLM's bench)"
    )
    g.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="only ttft:MS (= --slo-ttft-ms; pd-bench's other SLO is --slo-itl-ms)",
    )
    g.add_argument("--save-result", action="store_true", help="write the --json report")
    g.add_argument("--result-dir", help="with --save-result: its directory (default: .)")
    g.add_argument("--result-filename", help="with --save-result: its file name")


def _apply_vllm_bench_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``vllm bench serve``'s flags as pd-bench's (``add_vllm_bench_args``)."""
    if args.random_range_ratio != 0:
        parser.error("--random-range-ratio: only 0 (pd-bench's prompts have fixed lengths)")
    if args.random_prefix_len is not None:
        if args.shared_prefix_len:
            parser.error("--random-prefix-len: give it or --shared-prefix-len, not both")
        args.shared_prefix_len = args.random_prefix_len
        args.input_len += args.random_prefix_len
    if args.backend is not None:
        endpoint = _BACKEND_ENDPOINTS[args.backend]
        if args.endpoint is None:
            args.endpoint = endpoint
        elif args.endpoint.rstrip("/") != endpoint:
            parser.error(
                f"--backend {args.backend}: its endpoint is {endpoint}, not {args.endpoint}"
            )
    if args.host or args.port:
        if args.base_url is not None:
            parser.error("--host/--port: give them or --base-url, not both")
        args.base_url = f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    if args.served_model_name:
        args.model = args.served_model_name
    for goal in args.goodput or ():
        key, _, value = goal.partition(":")
        try:
            ms = float(value)
        except ValueError:
            parser.error(f"--goodput: {goal!r} is not KEY:MILLISECONDS")
        if key != "ttft":
            parser.error(
                f"--goodput: {key!r} is not supported: only ttft (= --slo-ttft-ms); "
                "pd-bench's other SLO is the largest ITL, --slo-itl-ms"
            )
        args.slo_ttft_ms = ms
    if args.save_result and not args.json:
        name = args.result_filename or time.strftime("pd-bench-serve-%Y%m%d-%H%M%S.json")
        args.json = os.path.join(args.result_dir or ".", name)
        if args.result_dir:  # vLLM's bench makes it too
            try:
                os.makedirs(args.result_dir, exist_ok=True)
            except OSError as e:
                parser.error(f"--result-dir: cannot create {args.result_dir}: {e}")


DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_ENDPOINT = "/v1/completions"


def fill_defaults(args: argparse.Namespace) -> None:
    """--base-url's and --endpoint's defaults (None on the parser: --host/--port and
    --backend may give them)."""
    args.base_url = args.base_url or DEFAULT_BASE_URL
    args.endpoint = args.endpoint or DEFAULT_ENDPOINT


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    _apply_vllm_bench_args(args, parser)
    fill_defaults(args)
    check_idle_timeout(args, parser)
    if args.num_prompts < 1:
        parser.error("--num-prompts must be >= 1")
    if args.num_warmup < 0:
        parser.error("--num-warmup must be >= 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be >= 1")
    if args.request_rate <= 0:
        parser.error("--request-rate must be > 0 (inf: all at once)")
    if args.input_len < 1 or args.output_len < 1:
        parser.error("--input-len and --output-len must be >= 1")
    if not 0 <= args.shared_prefix_len <= args.input_len or args.num_prefixes < 1:
        parser.error("--shared-prefix-len must be in [0, --input-len], --num-prefixes >= 1")
    lo, hi = args.token_id_range
    if not 0 <= lo < hi:
        parser.error("--token-id-range: need 0 <= LO < HI")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        parser.error("--extra-body must be a JSON object")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        # Checked before the run: a bad path would otherwise fail only after it.
        folder = os.path.dirname(path or "") or "."
        if path and not os.path.isdir(folder):
            parser.error(f"{flag} {path}: no such directory {folder}")
