"""``pd-bench serve``: load an OpenAI-compatible endpoint and measure it (like ``vllm bench
serve``).

Requests are streamed (``stream: true``, greedy, ``ignore_eos``, ``max_tokens``); every
SSE chunk is timed on arrival. Per request: TTFT (send -> first chunk carrying a token),
ITL (the gaps between successive chunks carrying tokens; pdserve sends one token per
chunk, and a chunk's tokens are counted from its ``token_ids``), TPOT ((E2E - TTFT) /
(tokens - 1)) and E2E. The Responses API (``/v1/responses``) is timed on its text
deltas, its tokens counted from its final usage (``engine/bench/responses.py``).
Arrivals are Poisson at ``--request-rate`` (``inf``: all at once), at most
``--max-concurrency`` in flight. Its flags and their checks: ``serve_args.py``.

This module imports no torch and no engine code that does, so it runs on a machine that
only has the proxy installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from engine.bench.responses import is_responses, read_events, responses_body
from engine.bench.serve_args import AUTH_HINT, auth_headers, fill_defaults, validate
from engine.bench.sse_idle import DEFAULT_IDLE_TIMEOUT_S, idle_bounded
from engine.bench.stats import RequestResult, ServeSummary, TokenClock
from engine.bench.words import WORDS
from engine.httpkit.sse_reader import SSEReader


def takes_text(endpoint: str) -> bool:
    """Whether an endpoint's prompts are text (chat messages, a response's input): never
    token ids."""
    return endpoint.rstrip("/").endswith("chat/completions") or is_responses(endpoint)


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
    client: Any,
    url: str,
    body: dict[str, Any],
    prompt: Prompt,
    timeout: float | None = None,
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT_S,
) -> RequestResult:
    """One streamed request, timed per chunk, ended after ``timeout`` seconds in all, or
    once its stream goes ``idle_timeout`` seconds without an event after its first
    (``engine/bench/sse_idle.py``). Never raises: a failure is in the result's ``error``."""
    r = RequestResult(prompt_tokens=prompt.num_tokens)
    try:
        await asyncio.wait_for(_stream(client, url, body, r, idle_timeout), timeout)
    except TimeoutError:
        r.error = f"timed out after {timeout:g}s"
    except Exception as e:  # a failed request never stops the benchmark
        r.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if r.error is not None:
        r.ok = False
    return r


async def _stream(
    client: Any, url: str, body: dict[str, Any], r: RequestResult, idle_timeout: float | None
) -> None:
    start = time.perf_counter()
    clock = TokenClock(r, start)
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raw = (await resp.aread()).decode("utf-8", "replace")
            r.error = f"HTTP {resp.status_code}: {_error_message(raw)}"
            if resp.status_code == 401:
                r.error += f" ({AUTH_HINT})"
            return
        lines = idle_bounded(resp.aiter_lines(), idle_timeout)
        if is_responses(url):
            await read_events(lines, r, start)
            return
        events = SSEReader(lines)
        async for chunk in events:
            if "error" in chunk:
                r.error = f"stream error: {_error_message(json.dumps(chunk))}"
                return
            n = _chunk_tokens(chunk)
            if n:
                clock.tick()
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

    fill_defaults(args)
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
            r = await send_one(
                client, url, request_body(args, model, p), p, args.timeout, args.idle_timeout
            )
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
                body = request_body(args, model, prompts[i])
                r = await send_one(client, url, body, prompts[i], args.timeout, args.idle_timeout)
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
