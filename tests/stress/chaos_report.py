"""The chaos suite's report: a round's figures (``RoundReport``), the summary table and
what the suite asserts (``failures``)."""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_workload import Result


@dataclass
class RoundReport:
    round: int
    requests: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    wrong: int = 0
    leaked: int = 0
    leaks: dict[str, dict[str, float]] = field(default_factory=dict)
    rss_mib: dict[str, float] = field(default_factory=dict)
    rss_detail_mib: dict[str, list[float]] = field(default_factory=dict)  # engine, workers...
    pids_at_start: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    idle_after_s: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    counters: dict[str, dict[str, float]] = field(
        default_factory=dict
    )  # per node, this incarnation


COUNTERS = {
    "pdserve_engine_kv_transfers_started_total": "pushes",
    "pdserve_engine_kv_transfer_failures_total": "push_failures",
    "pdserve_engine_kv_loads_failed_total": "loads_failed",
    "pdserve_engine_kv_notifs_received_total": "notifs",
    "pdserve_engine_kv_handshakes_total": "handshakes",
    "pdserve_engine_kv_prefill_peers_lost_total": "peers_lost",
    "pdserve_prompt_tokens_total": "prompt_tokens",
    "pdserve_generation_tokens_total": "generated_tokens",
}


def tracebacks_in(tmp: Path) -> dict[str, int]:
    """Tracebacks in each process's log (expected from the faults; listed, not asserted)."""
    out = {}
    for path in sorted(tmp.glob("*.err")):
        with contextlib.suppress(OSError):
            n = path.read_text(errors="replace").count("Traceback (most recent call last)")
            if n:
                out[path.name] = n
    return out


# The proxy's log line of a request's attempt after its first (proxy/session.py).
_RETRY = re.compile(r"request (\S+): .*\(attempt (?:[2-9]|\d\d+)\b")


def retried_labels(tmp: Path) -> set[str]:
    """The labels (``X-Request-Id``) of the requests the proxy tried more than once, from
    its log (a reused label counts as retried if any of its requests was)."""
    out: set[str] = set()
    for path in sorted(tmp.glob("proxy*.err")):
        with contextlib.suppress(OSError), path.open(errors="replace") as f:
            for line in f:
                m = _RETRY.search(line)
                if m:
                    out.add(m.group(1))
    return out


def blames_client(r: Result) -> bool:
    return r.status is not None and 400 <= r.status < 500 and r.status != 429


def fault_failed(f: dict[str, Any]) -> bool:
    if f.get("error") or f.get("restart_error") or f.get("orphans_left"):
        return True
    sd = f.get("shutdown")
    return bool(sd and (sd.get("code") != 0 or sd.get("workers_left_behind")))


def error_kind(error: str | None) -> str:
    if not error:
        return "?"
    return error.split(":", 1)[0][:60]


# -- the report -----------------------------------------------------------------------------


def format_table(s: dict[str, Any]) -> str:
    lines = [
        f"chaos suite @ {s['commit']}: {s['requests']} requests in {s['duration_s']:.0f}s "
        f"({s['streamed']} streamed, {s['chat']} chat, {s.get('structured', 0)} with a structured "
        f"output, {s.get('responses', 0)} as /v1/responses, {s['client_abort_planned']} "
        f"planned client aborts, {s['reused_ids']} with a reused X-Request-Id)",
        "",
        "| round | requests | completed | errored | aborted | hung | broken | wrong | leaked | seconds |",  # noqa: E501
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s["rounds"]:
        o = r["outcomes"]
        lines.append(
            f"| {r['round']} | {r['requests']} | {o.get('completed', 0)} | {o.get('errored', 0)} | "
            f"{o.get('aborted', 0)} | {o.get('hung', 0)} | {o.get('broken', 0)} | {r['wrong']} | "
            f"{r['leaked']} | {r['seconds']:.0f} |"
        )
    lines.append(
        f"| all | {s['requests']} | {s['completed']} | {s['errored']} | {s['aborted']} | "
        f"{s['hung']} | {s['broken']} | {s['wrong']} | {s['leaked']} | {s['duration_s']:.0f} |"
    )
    names = sorted({n for r in s["rounds"] for n in r["rss_mib"]})
    if names:
        lines += [
            "",
            "| RSS MiB (process tree) | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for r in s["rounds"]:
            cells = [f"{r['rss_mib'][n]:.0f}" if n in r["rss_mib"] else "-" for n in names]
            lines.append(f"| after round {r['round']} | " + " | ".join(cells) + " |")
        if s["rss_growth"]:
            cells = []
            for n in names:
                g = s["rss_growth"].get(n)
                cells.append(
                    f"{g['growth_mib']:+.1f} (≤ {g['allowed_mib']:.0f})" if g else "restarted"
                )
            lines.append("| growth, last two rounds | " + " | ".join(cells) + " |")
    lines += [
        "",
        "faults injected: " + ", ".join(f"{k} × {v}" for k, v in sorted(s["faults"].items())),
    ]
    if s.get("tenants"):
        t, routes = s["tenants"], s["tenants"].get("routes", {})
        lines.append(
            f"tenants: {s['config']['tenants']} ({'unsalted: negative control, ' if s['config'].get('tenant_unsalted') else ''}"
            f"--routing prefix, prompt_cache_key per conversation): {t['checked']} answers' "
            f"cached_tokens checked, {t['hits']} with cached tokens ({t['cached_tokens']} "
            f"tokens), {t['exposed']} exposed to another tenant's cache, "
            f"{len(t['violations'])} isolation violations; route decisions "
            + ", ".join(f"{k} × {v:.0f}" for k, v in sorted(routes.items()))
        )  # noqa: E501
    if s["config"].get("node_args") or s["config"].get("node_env"):
        env = " ".join(f"{k}={v}" for k, v in sorted(s["config"].get("node_env", {}).items()))
        who = "every node but the reference" if s["config"].get("plain_reference") else "every node"
        lines.append(f"{who}: {' '.join(s['config'].get('node_args', ()))} {env}".rstrip())
    if s["errors"]:
        lines.append(
            "errors (clear): " + ", ".join(f"{k} × {v}" for k, v in sorted(s["errors"].items()))
        )
    if s["client_blamed"]:
        lines.append(f"valid requests answered with a 4xx: {len(s['client_blamed'])}")
    if s["fault_failures"]:
        lines.append(f"fault injections that went wrong: {len(s['fault_failures'])}")
    if s["side_channel_unexpected"]:
        lines.append(f"unexpected side-channel answers: {len(s['side_channel_unexpected'])}")
    return "\n".join(lines)


def failures(s: dict[str, Any]) -> list[str]:
    """What the suite asserts, as messages (empty: passed). Every request of the workload
    is valid, so a 4xx other than 429 is a failure too (the drain-deadline 499 the suite
    once found, fixed in d1a1453, was its last known case)."""
    out = []
    if s.get("client_blamed"):
        out.append(
            f"{len(s['client_blamed'])} valid request(s) answered with a 4xx: {s['client_blamed'][:5]}"
        )
    if s["hung"]:
        out.append(f"{s['hung']} hung request(s)")
    if s["broken"]:
        out.append(f"{s['broken']} broken answer(s) (neither completed nor a clear error)")
    if s["wrong"]:
        out.append(f"{s['wrong']} wrong answer(s)")
    tenants = s.get("tenants")
    if tenants and tenants["violations"]:
        out.append(
            f"{len(tenants['violations'])} answer(s) with cached tokens their tenant could not "
            f"have cached (cross-tenant prefix cache): {tenants['violations'][:5]}"
        )
    for r in s["rounds"]:
        if r["leaks"]:
            out.append(f"round {r['round']}: left over after the deadlines: {r['leaks']}")
    for name, g in s["rss_growth"].items():
        if g["growth_mib"] > g["allowed_mib"]:
            out.append(f"{name}: RSS grew {g['growth_mib']} MiB (allowed {g['allowed_mib']})")
    for f in s["fault_failures"]:
        out.append(
            f"fault {f['fault']} on {f['target']}: {json.dumps({k: v for k, v in f.items() if k not in ('fault', 'target')})[:600]}"
        )  # noqa: E501
    for u in s["side_channel_unexpected"]:
        out.append(f"side channel: {u}")
    return out
