"""Percentiles, per-request results and benchmark summaries (pure Python, no torch)."""

from __future__ import annotations

import math
import textwrap
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default ``linear`` method). NaN for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """Distribution of one metric. Times are in whatever unit the values were given in."""

    n: int
    mean: float
    std: float
    min: float
    median: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Summary:
        xs = [float(v) for v in values]
        if not xs:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, nan, nan)
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
        return cls(
            n=len(xs),
            mean=mean,
            std=std,
            min=min(xs),
            median=percentile(xs, 50),
            p90=percentile(xs, 90),
            p99=percentile(xs, 99),
            max=max(xs),
        )

    def scaled(self, factor: float) -> Summary:
        """The same distribution with every value multiplied by ``factor`` (e.g. s -> ms)."""
        return Summary(
            self.n,
            *(v * factor for v in (self.mean, self.std, self.min, self.median)),
            *(v * factor for v in (self.p90, self.p99, self.max)),
        )

    def to_dict(self) -> dict[str, float]:
        return {k: _json_float(v) for k, v in asdict(self).items()}


def _json_float(v: float) -> float | None:
    """NaN/inf are not JSON; write them as null."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def json_safe(obj: Any) -> Any:
    """``obj`` as ``json.dump`` writes it to a strict reader: NaN/inf as null, at any depth
    (tuples as lists, keys as strings)."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float):
        return _json_float(obj)
    return obj


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or not finite, or b is 0."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return None
    return a / b


@dataclass
class RequestResult:
    """What one benchmark request measured. Times in seconds (``perf_counter`` based)."""

    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0  # as sent, or as the server's usage reported
    output_tokens: int = 0  # tokens received (the chunks' token_ids; /v1/responses: its usage)
    ttft: float | None = None  # send -> first chunk with a token
    itl: list[float] = field(default_factory=list)  # gaps between successive token chunks
    e2e: float | None = None  # send -> end of stream
    start: float = 0.0  # send time, relative to the benchmark start
    usage_completion_tokens: int | None = None  # the server's usage, when it sent one

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def max_itl(self) -> float:
        return max(self.itl, default=0.0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


class TokenClock:
    """Times a stream's token arrivals into ``r``: TTFT at the first (from ``start``, the
    send time, ``perf_counter``), inter-token latencies between the next ones."""

    def __init__(self, r: RequestResult, start: float) -> None:
        self.r, self.start = r, start
        self.last: float | None = None

    def tick(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.r.ttft = now - self.start
        else:
            self.r.itl.append(now - self.last)
        self.last = now


def meets_slo(r: RequestResult, slo_ttft_s: float | None, slo_itl_s: float | None) -> bool:
    """A successful request whose TTFT is within ``slo_ttft_s`` and whose *largest* gap
    between streamed tokens is within ``slo_itl_s`` (an SLO that is None always holds)."""
    if not r.ok or r.ttft is None:
        return False
    if slo_ttft_s is not None and r.ttft > slo_ttft_s:
        return False
    return not (slo_itl_s is not None and r.max_itl > slo_itl_s)


def count_good(
    results: Iterable[RequestResult], slo_ttft_s: float | None, slo_itl_s: float | None
) -> int:
    return sum(meets_slo(r, slo_ttft_s, slo_itl_s) for r in results)


# --percentile-metrics' names (vLLM's) -> (ServeSummary field, row abbreviation, title),
# in the order vLLM prints them whatever order they are given in.
PERCENTILE_METRICS = {
    "ttft": ("ttft_ms", "TTFT", "Time to First Token"),
    "tpot": ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("itl_ms", "ITL", "Inter-token Latency"),
    "e2el": ("e2e_ms", "E2E", "End-to-end Latency"),
}
# pd-bench's defaults: what it always printed (vLLM's are ttft,tpot,itl and 99).
DEFAULT_PERCENTILE_METRICS = tuple(PERCENTILE_METRICS)
DEFAULT_METRIC_PERCENTILES = (90.0, 99.0)


def short_number(v: float) -> str:
    """99.0 -> '99', 99.9 -> '99.9': a percentile as vLLM's keys and rows spell it."""
    return str(int(v)) if math.isfinite(v) and v == int(v) else str(v)


@dataclass
class ServeSummary:
    """Aggregate of one ``pd-bench serve`` run. Latency summaries are in milliseconds."""

    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2e_ms: Summary
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    good_requests: int | None = None
    goodput: float | None = None  # requests meeting every SLO / s
    errors: dict[str, int] = field(default_factory=dict)  # error message -> count
    # The metrics and percentiles reported (--percentile-metrics, --metric-percentiles):
    # metric -> [(percentile, ms)], in PERCENTILE_METRICS' order.
    percentiles_ms: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        results: Sequence[RequestResult],
        duration_s: float,
        slo_ttft_ms: float | None = None,
        slo_itl_ms: float | None = None,
        percentile_metrics: Iterable[str] = DEFAULT_PERCENTILE_METRICS,
        metric_percentiles: Sequence[float] = DEFAULT_METRIC_PERCENTILES,
    ) -> ServeSummary:
        ok = [r for r in results if r.ok]
        samples_ms = {  # keyed as PERCENTILE_METRICS
            "ttft": [r.ttft * 1e3 for r in ok if r.ttft is not None],
            "tpot": [t * 1e3 for r in ok if (t := r.tpot) is not None],
            "itl": [x * 1e3 for r in ok for x in r.itl],
            "e2el": [r.e2e * 1e3 for r in ok if r.e2e is not None],
        }
        chosen = set(percentile_metrics)
        percentiles_ms = {
            m: [(float(p), percentile(xs, p)) for p in metric_percentiles]
            for m, xs in samples_ms.items()
            if m in chosen
        }
        dur = duration_s if duration_s > 0 else math.nan
        tin = sum(r.prompt_tokens for r in ok)
        tout = sum(r.output_tokens for r in ok)
        errors: dict[str, int] = {}
        for r in results:
            if not r.ok:
                key = (r.error or "unknown error")[:200]
                errors[key] = errors.get(key, 0) + 1
        good = goodput = None
        if slo_ttft_ms is not None or slo_itl_ms is not None:
            good = count_good(
                ok,
                None if slo_ttft_ms is None else slo_ttft_ms / 1e3,
                None if slo_itl_ms is None else slo_itl_ms / 1e3,
            )
            goodput = good / dur
        return cls(
            num_prompts=len(results),
            completed=len(ok),
            failed=len(results) - len(ok),
            duration_s=duration_s,
            total_input_tokens=tin,
            total_output_tokens=tout,
            request_throughput=len(ok) / dur,
            output_throughput=tout / dur,
            total_token_throughput=(tin + tout) / dur,
            ttft_ms=Summary.of(samples_ms["ttft"]),
            tpot_ms=Summary.of(samples_ms["tpot"]),
            itl_ms=Summary.of(samples_ms["itl"]),
            e2e_ms=Summary.of(samples_ms["e2el"]),
            slo_ttft_ms=slo_ttft_ms,
            slo_itl_ms=slo_itl_ms,
            good_requests=good,
            goodput=goodput,
            errors=errors,
            percentiles_ms=percentiles_ms,
        )

    def to_dict(self) -> dict[str, Any]:
        """Every field (a latency summary as a dict), and for the chosen metrics the keys of
        vLLM's result JSON: ``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``,
        ``p99_ttft_ms`` (one per chosen percentile)."""
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            if k != "percentiles_ms":
                out[k] = v.to_dict() if isinstance(v, Summary) else _json_float(v)
        for m, pcts in self.percentiles_ms.items():
            s: Summary = getattr(self, PERCENTILE_METRICS[m][0])
            for stat in ("mean", "median", "std"):
                out[f"{stat}_{m}_ms"] = _json_float(getattr(s, stat))
            for p, v in pcts:
                out[f"p{short_number(p)}_{m}_ms"] = _json_float(v)
        return out

    def format(self) -> str:
        """A human-readable table, in the spirit of ``vllm bench serve``."""
        w = 50
        lines = [
            " Serving Benchmark Result ".center(w, "="),
            _row("Successful requests:", self.completed),
            _row("Failed requests:", self.failed),
            _row("Benchmark duration (s):", f"{self.duration_s:.2f}"),
            _row("Total input tokens:", self.total_input_tokens),
            _row("Total generated tokens:", self.total_output_tokens),
            _row("Request throughput (req/s):", f"{self.request_throughput:.2f}"),
            _row("Output token throughput (tok/s):", f"{self.output_throughput:.2f}"),
            _row("Total token throughput (tok/s):", f"{self.total_token_throughput:.2f}"),
        ]
        if self.goodput is not None:
            if self.slo_ttft_ms is not None:
                lines.append(_row("Goodput SLO, TTFT (ms):", short_number(self.slo_ttft_ms)))
            if self.slo_itl_ms is not None:
                lines.append(_row("Goodput SLO, largest ITL (ms):", short_number(self.slo_itl_ms)))
            lines.append(_row("Good requests (met every SLO):", self.good_requests))
            lines.append(_row("Request goodput (req/s):", f"{self.goodput:.2f}"))
        for m, pcts in self.percentiles_ms.items():
            attr, abbrev, title = PERCENTILE_METRICS[m]
            s: Summary = getattr(self, attr)
            lines.append(f" {title} ".center(w, "-"))
            lines.append(_row(f"Mean {abbrev} (ms):", f"{s.mean:.2f}"))
            lines.append(_row(f"Median {abbrev} (ms):", f"{s.median:.2f}"))
            for p, v in pcts:
                lines.append(_row(f"P{short_number(p)} {abbrev} (ms):", f"{v:.2f}"))
        top = sorted(self.errors.items(), key=lambda kv: -kv[1])
        for msg, n in top[:5]:  # wrapped at 80 columns, not cut
            lines += textwrap.wrap(
                f"error x{n}: {msg}", 80, subsequent_indent="  ", break_on_hyphens=False
            )
        if len(top) > 5:
            lines.append(f"... and {len(top) - 5} other error messages (see --json)")
        lines.append("=" * w)
        return "\n".join(lines)


def _row(label: str, value: object) -> str:
    return f"{label:<40}{value!s:>10}"
