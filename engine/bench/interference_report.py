"""``pd-bench interference``'s numbers: the ITL window, goodput under an SLO, the ratios
of the two layouts, the markdown table and the CDF plot (pure: no processes)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.bench.stats import RequestResult, ServeSummary, Summary, _json_float, ratio

LAYOUTS = ("pd", "colocated")
LAYOUT_TITLES = {"pd": "P/D (1 P + 1 D)", "colocated": "colocated (2 nodes)"}


# ---------------------------------------------------------------------------------------
# arithmetic (pure): windows, goodput, ratios
# ---------------------------------------------------------------------------------------


def token_times(r: RequestResult) -> list[float]:
    """When each token arrived, seconds from the benchmark start (``r.start`` + TTFT, then
    each gap)."""
    if r.ttft is None:
        return []
    t = r.start + r.ttft
    out = [t]
    for gap in r.itl:
        t += gap
        out.append(t)
    return out


def itl_in_window(results: list[RequestResult], start: float, end: float) -> list[float]:
    """The gaps (s) of successful requests that ended inside ``[start, end]``."""
    out = []
    for r in results:
        if not r.ok:
            continue
        times = token_times(r)
        for gap, t in zip(r.itl, times[1:], strict=True):
            if start <= t <= end:
                out.append(gap)
    return out


def goodput(
    results: list[RequestResult],
    duration_s: float,
    slo_ttft_ms: float | None,
    slo_itl_ms: float | None,
) -> tuple[int, float]:
    """(requests meeting every SLO, those per second of ``duration_s``): TTFT <= the TTFT
    SLO and the request's largest ITL <= the ITL SLO (``stats.meets_slo``)."""
    s = ServeSummary.of(results, duration_s, slo_ttft_ms, slo_itl_ms)
    if s.good_requests is None:  # no SLO: every completed request is good
        return s.completed, s.request_throughput
    return s.good_requests, s.goodput if s.goodput is not None else math.nan


@dataclass
class LayoutRun:
    """What one layout's workload measured (times in s, from the benchmark start)."""

    long: list[RequestResult]
    decode: list[RequestResult]
    window: tuple[float, float]  # first long arrival -> last long completion
    duration_s: float  # start -> last completion of any request
    nodes: list[dict[str, Any]] = field(default_factory=list)  # what was started
    route_modes: dict[str, float] = field(default_factory=dict)  # the proxy's, per mode
    kv_hops: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> hop -> mean


def layout_report(
    run: LayoutRun, slo_ttft_ms: float | None, slo_itl_ms: float | None
) -> dict[str, Any]:
    """The numbers of one layout: headline values, summaries, and the samples plotted."""
    every = run.long + run.decode
    summ = ServeSummary.of(every, run.duration_s, slo_ttft_ms, slo_itl_ms)
    long_s = ServeSummary.of(run.long, run.duration_s, slo_ttft_ms, slo_itl_ms)
    dec_s = ServeSummary.of(run.decode, run.duration_s, slo_ttft_ms, slo_itl_ms)
    win_itl = [x * 1e3 for x in itl_in_window(run.decode, *run.window)]
    win = Summary.of(win_itl)
    good, gput = goodput(every, run.duration_s, slo_ttft_ms, slo_itl_ms)
    headline = {
        "decode_itl_window_p50_ms": win.median,
        "decode_itl_window_p99_ms": win.p99,
        "decode_itl_window_max_ms": win.max,
        "itl_p99_ms": summ.itl_ms.p99,
        "long_ttft_p50_ms": long_s.ttft_ms.median,
        "long_ttft_p99_ms": long_s.ttft_ms.p99,
        "decode_ttft_p99_ms": dec_s.ttft_ms.p99,
        "ttft_p99_ms": summ.ttft_ms.p99,
        "goodput_rps": gput,
        "good_requests": good,
        "completed": summ.completed,
        "failed": summ.failed,
        "output_tok_s": summ.output_throughput,
    }
    return {
        "headline": {k: _json_float(v) for k, v in headline.items()},
        "window_s": list(run.window),
        "duration_s": run.duration_s,
        "decode_itl_window_ms": win.to_dict(),
        "all": summ.to_dict(),
        "long": long_s.to_dict(),
        "decode": dec_s.to_dict(),
        "samples": {
            "decode_itl_window_ms": win_itl,
            "long_ttft_ms": [r.ttft * 1e3 for r in run.long if r.ok and r.ttft is not None],
            "decode_ttft_ms": [r.ttft * 1e3 for r in run.decode if r.ok and r.ttft is not None],
        },
        "nodes": run.nodes,
        "proxy_route_modes": run.route_modes,
        "kv_hops": run.kv_hops,
        "requests": [
            {"kind": kind, **r.to_dict()}
            for kind, rs in (("long", run.long), ("decode", run.decode))
            for r in rs
        ],
    }


# (headline key, row label, format)
ROWS = (
    ("decode_itl_window_p99_ms", "ITL p99, ongoing decodes while long prompts run (ms)", ".1f"),
    ("decode_itl_window_p50_ms", "ITL p50, ongoing decodes while long prompts run (ms)", ".1f"),
    ("decode_itl_window_max_ms", "ITL max, ongoing decodes while long prompts run (ms)", ".1f"),
    ("itl_p99_ms", "ITL p99, all requests (ms)", ".1f"),
    ("long_ttft_p50_ms", "TTFT p50, long prompts (ms)", ".1f"),
    ("long_ttft_p99_ms", "TTFT p99, long prompts (ms)", ".1f"),
    ("decode_ttft_p99_ms", "TTFT p99, ongoing decodes (ms)", ".1f"),
    ("ttft_p99_ms", "TTFT p99, all requests (ms)", ".1f"),
    ("goodput_rps", "goodput (req/s meeting the SLO)", ".3f"),
    ("good_requests", "requests meeting the SLO", "d"),
    ("completed", "completed requests", "d"),
    ("failed", "failed requests", "d"),
    ("output_tok_s", "output tokens/s", ".1f"),
)


def ratios(layouts: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """P/D / colocated of every headline number (None when a side is missing)."""
    if not all(name in layouts for name in LAYOUTS):
        return {}
    pd, colo = layouts["pd"]["headline"], layouts["colocated"]["headline"]
    return {key: ratio(pd.get(key), colo.get(key)) for key, _, _ in ROWS}


def _fmt(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(int(v), fmt) if fmt == "d" else format(v, fmt)


def markdown_table(report: dict[str, Any]) -> str:
    layouts = report["layouts"]
    names = [n for n in LAYOUTS if n in layouts]
    rat = report.get("ratios") or {}
    head = "| metric | " + " | ".join(LAYOUT_TITLES[n] for n in names) + " |"
    if rat:
        head += " P/D ÷ colocated |"
    lines = [head, "|---|" + "---:|" * (len(names) + (1 if rat else 0))]
    slo = report.get("slo") or {}
    for key, label, fmt in ROWS:
        if key in ("goodput_rps", "good_requests"):
            label += f" (TTFT <= {_fmt(slo.get('ttft_ms'), 'g')} ms, max ITL <= "
            label += f"{_fmt(slo.get('itl_ms'), 'g')} ms)"
        cells = [_fmt(layouts[n]["headline"].get(key), fmt) for n in names]
        row = f"| {label} | " + " | ".join(cells) + " |"
        if rat:
            row += f" {_fmt(rat.get(key), '.2f')} |"
        lines.append(row)
    return "\n".join(lines)


def plot_interference(report: dict[str, Any], path: str) -> bool:
    """CDFs of both layouts: ongoing decodes' ITL while long prompts run, TTFT of long
    prompts, TTFT of the decodes. False (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed; not writing {path}")
        return False
    panels = (
        ("decode_itl_window_ms", "ITL of ongoing decodes while long prompts run"),
        ("long_ttft_ms", "TTFT of long prompts"),
        ("decode_ttft_ms", "TTFT of ongoing decodes"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.2))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for name in LAYOUTS:
            lay = report["layouts"].get(name)
            if lay is None:
                continue
            xs = sorted(lay["samples"][key])
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=f"{LAYOUT_TITLES[name]} (n={len(xs)})")
        ax.set_title(title, fontsize=10)
        if ax.get_lines():  # latencies span orders of magnitude (a stall vs a step)
            ax.set_xscale("log")
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"pd-bench interference: {report.get('model')} on {report.get('device')}, "
        f"commit {report.get('commit')}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
