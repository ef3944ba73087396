"""One chaos run: the workload issued in waves with the faults injected, each round's
checks (idle nodes, reference answers, memory) and the summary."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from chaos_cluster import Cluster, live_pids, rss_detail, safe_scrape, scrape_labelled
from chaos_config import (
    IDLE_GAUGES,
    PROXY_IDLE_GAUGES,
    ChaosConfig,
    RefKey,
    git_commit,
    log,
    public_config,
)
from chaos_faults import FaultActions, Injector
from chaos_report import (
    COUNTERS,
    RoundReport,
    blames_client,
    error_kind,
    fault_failed,
    retried_labels,
    tracebacks_in,
)
from chaos_workload import (
    Result,
    Spec,
    TokKey,
    check_answer,
    check_isolation,
    compute_references,
    compute_tokens,
    make_prompts,
    make_specs,
    run_request,
)


class ChaosRun:
    def __init__(self, cfg: ChaosConfig, tmp: Path) -> None:
        self.cfg, self.tmp = cfg, tmp
        self.rng = random.Random(cfg.seed)
        self.cluster = Cluster(cfg, tmp)
        self.prompts = make_prompts(cfg.num_prompts, self.rng, cfg.long_bytes)
        self.refs: dict[RefKey, tuple[list[int], str]] = {}
        self.tokens: dict[TokKey, list[int]] = {}  # --tenants: the prompts' token ids
        self.results: list[Result] = []
        self.faults: list[dict[str, Any]] = []
        self.rounds: list[RoundReport] = []
        self.lock = threading.Lock()
        self.next_index = 0
        self.pool: ThreadPoolExecutor | None = None
        self.sem = threading.Semaphore(cfg.concurrency)
        self.futures: list[Future] = []
        self.fault_rng = random.Random(cfg.seed + 1)
        self.started = time.monotonic()
        self.actions = FaultActions(self)

    # -- bookkeeping --------------------------------------------------------------------------
    def record_fault(self, name: str, round_no: int, target: str, **info: Any) -> dict[str, Any]:
        rec = {
            "fault": name,
            "round": round_no,
            "target": target,
            "t": round(time.monotonic() - self.started, 1),
            **info,
        }
        with self.lock:
            self.faults.append(rec)
        log(f"fault {name} on {target or '-'}: {json.dumps(info)[:300]}")
        return rec

    # -- requests -----------------------------------------------------------------------------
    def submit(self, spec: Spec) -> None:
        self.sem.acquire()
        assert self.pool is not None and self.cluster.proxy is not None
        fut = self.pool.submit(self._one, spec)
        fut.add_done_callback(lambda _f: self.sem.release())
        with self.lock:
            self.futures.append(fut)

    def _one(self, spec: Spec) -> Result:
        assert self.cluster.proxy is not None
        try:
            r = run_request(self.cluster.proxy.url, spec, self.prompts, self.cfg.deadline_s)
        except Exception as e:  # the client itself failed: report it, do not lose the request
            r = Result.of(spec, 0, None, outcome="broken", error=f"client error {e!r}")
        with self.lock:
            self.results.append(r)
        return r

    def new_specs(
        self, round_no: int, n: int, long_only: bool = False, rng: random.Random | None = None
    ) -> list[Spec]:
        with self.lock:
            start, self.next_index = self.next_index, self.next_index + n
        return make_specs(
            self.cfg, rng or self.rng, round_no, start, n, len(self.prompts), long_only
        )

    # -- rounds -------------------------------------------------------------------------------
    def run_wave(self, round_no: int, wave_no: int, n: int, faults: tuple[str, ...]) -> int:
        """Issues at least ``n`` requests with every fault in ``faults`` injected once;
        returns how many it issued."""
        # Spread over 10%..70% of the wave, in an order that alternates the victims.
        order = [
            f
            for f in (
                "side_channel",
                "kill_prefill",
                "kill_decode",
                "stop_worker",
                "side_channel",
                "kill_worker",
                "kill_engine",
                "drain",
            )
            if f in faults
        ]
        points = [int(n * (0.1 + 0.6 * k / max(1, len(order) - 1))) for k in range(len(order))]
        inj = Injector(self, list(zip(points, order, strict=True)), round_no, wave_no)
        inj.start()
        i = 0
        try:
            while i < n or not inj.all_injected():
                (spec,) = self.new_specs(round_no, 1)
                inj.issuing(i)
                self.submit(spec)
                i += 1
        finally:
            inj.issuing(1 << 30)
            inj.join()
        return i

    def run_round(self, round_no: int) -> RoundReport:
        cfg = self.cfg
        faults = cfg.faults_for(round_no)
        log(
            f"round {round_no}: {cfg.requests} requests (waves of {cfg.wave or cfg.requests}), faults {list(faults)}"
        )
        report = RoundReport(round_no, pids_at_start=live_pids(self.cluster))
        t0 = time.monotonic()
        wave_n = cfg.wave or cfg.requests
        issued, wave_no = 0, 0
        faults_before = len(self.faults)
        last_log = time.monotonic()
        while issued < cfg.requests or time.monotonic() - t0 < cfg.min_round_s:
            wave_no += 1
            issued += self.run_wave(round_no, wave_no, wave_n, faults)
            if time.monotonic() - last_log > cfg.log_every_s:
                last_log = time.monotonic()
                self._log_progress(round_no)
        # Every request of the round ends (each has its own deadline on the client side).
        with self.lock:
            futs = list(self.futures)
        for f in futs:
            f.result()
        with self.lock:
            results = [r for r in self.results if r.round == round_no]
        report.requests = len(results)
        report.outcomes = dict(Counter(r.outcome for r in results))
        report.errors = dict(
            Counter(error_kind(r.error) for r in results if r.outcome == "errored")
        )
        report.faults = dict(Counter(f["fault"] for f in self.faults[faults_before:]))
        report.seconds = round(time.monotonic() - t0, 1)
        # Once the deadlines passed: nothing left anywhere.
        t1 = time.monotonic()
        report.leaks = self.wait_idle()
        report.idle_after_s = round(time.monotonic() - t1, 1)
        report.leaked = len(report.leaks)
        report.pids = live_pids(self.cluster)
        for name, pid in report.pids.items():
            detail = rss_detail(pid)
            report.rss_detail_mib[name] = detail
            report.rss_mib[name] = round(sum(detail), 1)
        for n in self.cluster.nodes:
            m = safe_scrape(n.url)
            report.counters[n.name] = {v: m[k] for k, v in COUNTERS.items() if k in m}
        # Then the answers: every one against the colocated node's.
        t2 = time.monotonic()
        keys = {r.ref_key for r in results}
        compute_references(self.cluster.reference.url, keys, self.prompts, self.refs)
        for r in results:
            check_answer(r, self.refs[r.ref_key])
        report.wrong = sum(r.wrong for r in results)
        if cfg.tenants:
            compute_tokens(
                self.cluster.reference.url, {k[:2] for k in keys}, self.prompts, self.tokens
            )
        log(
            f"round {round_no}: {len(keys)} reference answers checked in {time.monotonic() - t2:.0f}s"
        )
        log(f"round {round_no} done: {json.dumps(asdict(report))}")
        return report

    def _log_progress(self, round_no: int) -> None:
        with self.lock:
            c = Counter(r.outcome for r in self.results if r.round == round_no)
        log(f"round {round_no}: {dict(c)} faults={len(self.faults)}")

    def wait_idle(self) -> dict[str, dict[str, float]]:
        """Waits until every live node and the proxy are idle with full pools, for at most
        every deadline of the connector (4 x the transfer timeout: P's tombstones) plus a
        margin; returns what is still left, by process."""
        limit = 4 * self.cfg.kv_transfer_timeout + 60
        deadline = time.monotonic() + limit
        while True:
            left = self.leftovers()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def leftovers(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for n in self.cluster.nodes:
            if not n.alive():
                out[n.name] = {"not_running": 1.0}
                continue
            m = safe_scrape(n.url)
            if not m:
                out[n.name] = {"metrics_unreadable": 1.0}
                continue
            bad = {g: m.get(g, float("nan")) for g in IDLE_GAUGES if m.get(g, float("nan")) != 0}
            free, total = m.get("pdserve_kv_blocks_free"), m.get("pdserve_kv_blocks_capacity")
            if free != total:
                bad["pdserve_kv_blocks_free"] = free if free is not None else float("nan")
            if m.get("pdserve_engine_healthy") != 1:
                bad["pdserve_engine_healthy"] = m.get("pdserve_engine_healthy", float("nan"))
            if bad:
                out[n.name] = bad
        if self.cluster.proxy is not None:
            m = safe_scrape(self.cluster.proxy.url)
            bad = {
                g: m.get(g, float("nan")) for g in PROXY_IDLE_GAUGES if m.get(g, float("nan")) != 0
            }
            if bad:
                out["proxy"] = bad
        return out

    def execute(self) -> dict[str, Any]:
        cfg = self.cfg
        log(
            f"starting 2 prefill + 2 decode nodes (TP p1,p2,d1,d2 = {cfg.tp}), a colocated reference node and a proxy in {self.tmp}"
        )
        t0 = time.monotonic()
        self.cluster.start()
        log(f"cluster up in {time.monotonic() - t0:.0f}s")
        self.pool = ThreadPoolExecutor(cfg.concurrency + 16, thread_name_prefix="chaos-client")
        try:
            for round_no in range(1, cfg.rounds + 1):
                self.rounds.append(self.run_round(round_no))
        finally:
            self.pool.shutdown(wait=True, cancel_futures=False)
        return self.summary()

    # -- the summary ----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        cfg = self.cfg
        totals = Counter(r.outcome for r in self.results)
        tenants = self.tenants() if cfg.tenants else None  # marks results' ``isolation``
        return {
            "commit": git_commit(),
            "config": public_config(cfg),
            "signed_side_channel": bool(cfg.kv_secret),
            "requests": len(self.results),
            "completed": totals.get("completed", 0),
            "errored": totals.get("errored", 0),
            "aborted": totals.get("aborted", 0),
            "hung": totals.get("hung", 0),
            "broken": totals.get("broken", 0),
            "wrong": sum(r.wrong for r in self.results),
            "leaked": sum(rep.leaked for rep in self.rounds),
            "rss_growth": self.rss_check(),
            "faults": dict(Counter(f["fault"] for f in self.faults if not f.get("error"))),
            "fault_failures": [f for f in self.faults if fault_failed(f)],
            "side_channel_unexpected": [u for f in self.faults for u in f.get("unexpected", [])],
            "rounds": [asdict(r) for r in self.rounds],
            "fault_log": self.faults,
            "node_exits": {n.name: n.exits for n in self.cluster.nodes},
            "problems": [
                r.public()
                for r in self.results
                if r.wrong or r.isolation or r.outcome in ("hung", "broken")
            ],
            "errors": dict(
                Counter(error_kind(r.error) for r in self.results if r.outcome == "errored")
            ),
            "duration_s": round(time.monotonic() - self.started, 1),
            "client_abort_planned": sum(r.planned_abort is not None for r in self.results),
            "reused_ids": sum(r.label.startswith("dup-") for r in self.results),
            "streamed": sum(r.stream for r in self.results),
            "chat": sum(r.chat for r in self.results),
            "structured": sum(r.ref_key[3] >= 0 for r in self.results),
            "responses": sum(r.responses for r in self.results),
            # Every request of the workload is valid: a 4xx other than 429 blames the client
            # for something it did not do.
            "client_blamed": [
                f"{r.label} #{r.index}: {r.error}"
                for r in self.results
                if r.outcome == "errored" and blames_client(r)
            ],
            "log_tracebacks": tracebacks_in(self.tmp),
            "tenants": tenants,
        }

    def tenants(self) -> dict[str, Any]:
        """``--tenants``: the isolation check over every round's answers (caches outlive
        rounds) and the proxy's route decisions (``cache_key``: a prompt_cache_key's node)."""
        out = check_isolation(
            self.results, self.tokens, self.cfg.block_size, retried_labels(self.tmp)
        )
        if self.cluster.proxy is not None:
            out["routes"] = scrape_labelled(self.cluster.proxy.url, "pdproxy_route_decisions_total")
        return out

    def rss_check(self) -> dict[str, dict[str, float]]:
        """Resident memory of the survivors: the processes that ran through all of the
        second-to-last round and the last one (same pid at its start and at both ends).
        MiB after each of the two rounds, the growth and what is allowed."""
        if len(self.rounds) < 2:
            return {}
        a, b = self.rounds[-2], self.rounds[-1]
        out = {}
        for name, pid in b.pids.items():
            if not (a.pids_at_start.get(name) == a.pids.get(name) == pid):
                continue
            before, after = a.rss_mib[name], b.rss_mib[name]
            allowed = max(self.cfg.rss_slack_mib, before * self.cfg.rss_slack_ratio)
            out[name] = {
                "before_mib": before,
                "after_mib": after,
                "growth_mib": round(after - before, 1),
                "allowed_mib": round(allowed, 1),
            }
        return out
