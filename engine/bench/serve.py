"""``pd-bench serve``: load an OpenAI-compatible endpoint and measure it (like ``vllm bench
serve``).

Requests are streamed (``stream: true``, greedy, ``ignore_eos``, ``max_tokens``); every
SSE chunk is timed on arrival. Per request: TTFT (send -> first chunk carrying a token),
ITL (the gaps between successive chunks carrying tokens; pdserve sends one token per
chunk, and a chunk's tokens are counted from its ``token_ids``), TPOT ((E2E - TTFT) /
(tokens - 1)) and E2E. The Responses API (``/v1/responses``) is timed on its text
deltas, its tokens counted from its final usage (``engine/bench/responses.py``).
Arrivals are Poisson at ``--request-rate`` (``inf``: all at once), at most
``--max-concurrency`` in flight.

This module imports no torch and no engine code that does, so it runs on a machine that
only has the proxy installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from engine.bench.responses import RESPONSES_ENDPOINT, is_responses, read_events, responses_body
from engine.bench.stats import (
    DEFAULT_METRIC_PERCENTILES,
    DEFAULT_PERCENTILE_METRICS,
    PERCENTILE_METRICS,
    RequestResult,
    ServeSummary,
    short_number,
)
from engine.bench.words import WORDS
from engine.httpkit.sse_reader import SSEReader

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


def takes_text(endpoint: str) -> bool:
    """Whether an endpoint's prompts are text (chat messages, a response's input): never
    token ids."""
    return endpoint.rstrip("/").endswith("chat/completions") or is_responses(endpoint)


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


@dataclass
class Prompt:
    prompt: list[int] | str
    num_tokens: int  # exact for ids; the word count for text (the server reports the truth)


def make_prompts(
    n: int,
    input_len: int,
    kind: str,
    id_range: tuple[int, int],
    seed: int,
    prefix_len: int = 0,
    num_prefixes: int = 1,
) -> list[Prompt]:
    """Random prompts, different from their first token on (no prefix-cache hits), except
    that prompt i starts with shared prefix i mod ``num_prefixes`` of ``prefix_len``."""
    rng = random.Random(seed)
    lo, hi = id_range

    def draw(k: int) -> list[Any]:
        if kind == "ids":
            return [rng.randrange(lo, hi) for _ in range(k)]
        return [rng.choice(WORDS) for _ in range(k)]

    prefixes = [draw(prefix_len) for _ in range(num_prefixes)] if prefix_len else [[]]
    out = []
    for i in range(n):
        toks = prefixes[i % len(prefixes)] + draw(input_len - prefix_len)
        out.append(Prompt(toks if kind == "ids" else " ".join(toks), input_len))
    return out


def arrival_delays(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of ``n`` Poisson arrivals at ``rate`` req/s."""
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _text(prompt: Prompt) -> str:
    return prompt.prompt if isinstance(prompt.prompt, str) else " ".join(map(str, prompt.prompt))


def request_body(args: argparse.Namespace, model: str | None, prompt: Prompt) -> dict[str, Any]:
    if is_responses(args.endpoint):
        body = responses_body(
            _text(prompt), model, args.output_len, args.temperature, args.ignore_eos
        )
        body.update(args.extra_body or {})
        return body
    body: dict[str, Any] = {
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if args.endpoint.rstrip("/").endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": _text(prompt)}]
    else:
        body["prompt"] = prompt.prompt
    if args.extra_body:
        body.update(args.extra_body)
    return body


def _chunk_tokens(chunk: dict[str, Any]) -> int:
    """Tokens a streamed chunk carries: its ``token_ids`` (pdserve), else 1 if it has text."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    c = choices[0]
    ids = c.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    text = c.get("text")
    if text is None:
        text = (c.get("delta") or {}).get("content")
    return 1 if text else 0


async def send_one(
    client: Any, url: str, body: dict[str, Any], prompt: Prompt, timeout: float | None = None
) -> RequestResult:
    """One streamed request, timed per chunk, ended after ``timeout`` seconds in all.
    Never raises: a failure is in the result's ``error``."""
    r = RequestResult(prompt_tokens=prompt.num_tokens)
    try:
        await asyncio.wait_for(_stream(client, url, body, r), timeout)
    except asyncio.TimeoutError:
        r.error = f"timed out after {timeout:g}s"
    except Exception as e:  # a failed request never stops the benchmark
        r.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if r.error is not None:
        r.ok = False
    return r


async def _stream(client: Any, url: str, body: dict[str, Any], r: RequestResult) -> None:
    start = time.perf_counter()
    last: float | None = None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raw = (await resp.aread()).decode("utf-8", "replace")
            r.error = f"HTTP {resp.status_code}: {_error_message(raw)}"
            if resp.status_code == 401:
                r.error += f" ({AUTH_HINT})"
            return
        if is_responses(url):
            await read_events(resp.aiter_lines(), r, start)
            return
        events = SSEReader(resp.aiter_lines())
        async for chunk in events:
            if "error" in chunk:
                r.error = f"stream error: {_error_message(json.dumps(chunk))}"
                return
            n = _chunk_tokens(chunk)
            if n:
                now = time.perf_counter()
                if last is None:
                    r.ttft = now - start
                else:
                    r.itl.append(now - last)
                last = now
                r.output_tokens += n
            usage = chunk.get("usage")
            if usage:
                r.usage_completion_tokens = usage.get("completion_tokens")
                if usage.get("prompt_tokens"):
                    r.prompt_tokens = int(usage["prompt_tokens"])
    r.e2e = time.perf_counter() - start
    if not events.done:
        r.error = "stream ended without [DONE]"
    elif r.output_tokens == 0:
        r.error = "no tokens received"
    else:
        r.ok = True


def _error_message(raw: str) -> str:
    try:
        err = json.loads(raw).get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))[:300]
        return str(err)[:300]
    except (ValueError, AttributeError):
        return raw[:300]


class Progress:
    """A plain-text progress line on stderr (``\\r``-updated on a terminal; otherwise a line
    per 10%)."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = total
        self.enabled = enabled
        self.done = self.failed = 0
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._next_decile = 1

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if not self.enabled:
            return
        frac = self.done / self.total
        width = 30
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        line = (
            f"[{bar}] {self.done}/{self.total} requests, {self.failed} failed, "
            f"{time.perf_counter() - self.t0:.1f}s"
        )
        if self.tty:
            end = "\n" if self.done == self.total else ""
            print("\r" + line, end=end, file=sys.stderr, flush=True)
        elif frac * 10 >= self._next_decile or self.done == self.total:
            self._next_decile = int(frac * 10) + 1
            print(line, file=sys.stderr, flush=True)


async def get_model(client: Any, base_url: str) -> str:
    resp = await client.get(base_url + "/v1/models")
    if resp.status_code == 401:
        sent = "the key sent was refused" if "authorization" in client.headers else "no key sent"
        raise RuntimeError(f"401 Unauthorized from {base_url}/v1/models ({sent}): {AUTH_HINT}")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace) -> tuple[ServeSummary, list[RequestResult]]:
    import httpx

    _fill_defaults(args)
    base = args.base_url.rstrip("/")
    url = base + "/" + args.endpoint.lstrip("/")
    conc = args.max_concurrency or args.num_prompts
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    timeout = httpx.Timeout(args.timeout, connect=min(30.0, args.timeout))
    kind = "text" if takes_text(args.endpoint) else args.prompt_type
    shared = (args.shared_prefix_len, args.num_prefixes)
    prompts = make_prompts(
        args.num_prompts, args.input_len, kind, tuple(args.token_id_range), args.seed, *shared
    )
    delays = arrival_delays(args.num_prompts, args.request_rate, args.seed)
    headers = auth_headers(args.api_key)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        model = args.model or await get_model(client, base)
        args.model = model
        warm = make_prompts(  # other prefixes: the warm-up warms no prefix cache
            args.num_warmup, args.input_len, kind, tuple(args.token_id_range), args.seed + 10_007,
            *shared,
        )  # fmt: skip
        warm_errors = []
        for i, p in enumerate(warm):
            r = await send_one(client, url, request_body(args, model, p), p, args.timeout)
            if not r.ok:
                print(f"warning: warm-up request {i} failed: {r.error}", file=sys.stderr)
                warm_errors.append(r.error)
        if warm and len(warm_errors) == len(warm):  # vLLM's bench stops here too
            raise RuntimeError(
                f"every warm-up request failed ({warm_errors[0]}): check the arguments "
                "(model, prompt lengths and ids, endpoint); --num-warmup 0 skips the warm-up"
            )
        sem = asyncio.Semaphore(conc)
        progress = Progress(args.num_prompts, enabled=not args.no_progress)
        t0 = time.perf_counter()

        async def one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, delays[i] - (time.perf_counter() - t0)))
            async with sem:
                sent = time.perf_counter() - t0
                r = await send_one(
                    client, url, request_body(args, model, prompts[i]), prompts[i], args.timeout
                )
            r.start = sent
            progress.update(r.ok)
            return r

        results = await asyncio.gather(*(one(i) for i in range(args.num_prompts)))
        duration = time.perf_counter() - t0
    summary = ServeSummary.of(
        results, duration, args.slo_ttft_ms, args.slo_itl_ms,
        args.percentile_metrics, args.metric_percentiles,
    )  # fmt: skip
    return summary, list(results)


def plot_cdfs(results: list[RequestResult], path: str) -> bool:
    """TTFT, ITL and E2E latency CDFs to a PNG; False (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed; not writing {path}")
        return False
    ok = [r for r in results if r.ok]
    series = {
        "TTFT": [r.ttft * 1e3 for r in ok if r.ttft is not None],
        "ITL": [x * 1e3 for r in ok for x in r.itl],
        "E2E latency": [r.e2e * 1e3 for r in ok if r.e2e is not None],
    }
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (name, xs) in zip(axes, series.items(), strict=True):
        xs = sorted(xs)
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post")
        ax.set_title(f"{name} CDF (n={len(xs)})")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_ENDPOINT = "/v1/completions"


def _fill_defaults(args: argparse.Namespace) -> None:
    """--base-url's and --endpoint's defaults (None on the parser: --host/--port and
    --backend may give them)."""
    args.base_url = args.base_url or DEFAULT_BASE_URL
    args.endpoint = args.endpoint or DEFAULT_ENDPOINT


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    _apply_vllm_bench_args(args, parser)
    _fill_defaults(args)
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


def _report_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as the --json report records them: inf as null, the API key hidden."""
    out = {
        k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
    }
    out["api_key"] = "<hidden>" if args.api_key else None
    return out


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    validate(args, parser)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s"
    text = args.prompt_type == "text" or takes_text(args.endpoint)
    # Text prompts are --input-len words: their token count is the server's (the summary's
    # "Total input tokens" is from the answers' usage).
    inputs = f"{args.input_len} words" if text else f"{args.input_len} tokens"
    print(
        f"pd-bench serve: {args.num_prompts} requests, {inputs} -> {args.output_len} "
        f"tokens, concurrency {args.max_concurrency or 'unlimited'}, rate {rate}, "
        f"{args.base_url}{args.endpoint}",
        flush=True,
    )
    try:
        summary, results = asyncio.run(run_benchmark(args))
    except Exception as e:  # the endpoint is unreachable or /v1/models is broken
        print(f"pd-bench serve: error: cannot benchmark {args.base_url}: {e}", file=sys.stderr)
        return 1
    print(summary.format())
    if args.json:
        report = {
            "command": "serve",
            "args": _report_args(args),
            "summary": summary.to_dict(),
            "requests": [r.to_dict() for r in results],
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot and plot_cdfs(results, args.plot):
        print(f"wrote {args.plot}")
    return 0 if summary.completed else 1
