"""The chaos suite's faults: how each one is injected (``FaultActions``) and when, within
a wave (``Injector``)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from chaos_cluster import Node, health_code, rank_pid, safe_scrape, wait_for
from chaos_config import ORPHAN_GRACE_S, log
from chaos_report import COUNTERS
from chaos_side_channel import side_channel_burst
from harness import (
    descendants,
    wait_gone,
)

if TYPE_CHECKING:
    from chaos_run import ChaosRun


# -- faults ---------------------------------------------------------------------------------


class Injector:
    """Runs one wave's faults in order, each once the wave has issued its share of requests.

    Injecting is quick (a signal, a burst); what follows (waiting for the node to notice,
    the drain, the restart) runs in a background thread that holds the victim's lock, so
    the next fault waits only if it has the same victim. The wave keeps issuing requests
    until every fault has been injected, so every fault meets load."""

    def __init__(
        self, run: ChaosRun, wave_faults: list[tuple[int, str]], round_no: int, wave_no: int
    ) -> None:
        self.run, self.faults, self.round_no, self.wave_no = run, wave_faults, round_no, wave_no
        self.cond = threading.Condition()
        self.issued = 0
        self.injected = 0
        self.threads: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._loop, name="chaos-injector", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def issuing(self, i: int) -> None:
        with self.cond:
            self.issued = i
            self.cond.notify_all()

    def all_injected(self) -> bool:
        with self.cond:
            return self.injected == len(self.faults)

    def _loop(self) -> None:
        for at, name in self.faults:
            with self.cond:
                while self.issued < at:
                    self.cond.wait(1.0)
            try:
                t = self.run.actions.inject(name, self.round_no, self.wave_no)
            except Exception as e:  # a failed injection is reported, never silently lost
                self.run.record_fault(
                    name, self.round_no, "", error=f"{e!r}\n{traceback.format_exc()}"
                )
                t = None
            if t is not None:
                self.threads.append(t)
            with self.cond:
                self.injected += 1
                self.cond.notify_all()

    def join(self, timeout: float = 900) -> None:
        self.thread.join(timeout)
        for t in self.threads:
            t.join(timeout)


class FaultActions:
    """Injects one fault on the run's cluster; what follows it (the node noticing, its
    drain, its restart) runs in a background thread holding the victim's lock."""

    def __init__(self, run: ChaosRun) -> None:
        self.run, self.cfg, self.cluster = run, run.cfg, run.cluster

    def _background(self, node: Node, work: Any, name: str) -> threading.Thread:
        """Runs ``work()`` in a thread that releases ``node``'s lock when it ends."""

        def go() -> None:
            try:
                work()
            except Exception as e:
                self.run.record_fault(name, 0, node.name, error=f"{e!r}\n{traceback.format_exc()}")
            finally:
                node.lock.release()

        t = threading.Thread(target=go, name=f"{name}-{node.name}", daemon=True)
        t.start()
        return t

    def _restart(self, node: Node, fault: dict[str, Any]) -> None:
        if node.proc is not None:
            self.cluster.retired.append(node.proc)
        t0 = time.monotonic()
        try:
            node.start(timeout=400)
            fault["restart_s"] = round(time.monotonic() - t0, 1)
            fault["incarnation"] = node.starts
        except Exception as e:
            fault["restart_error"] = f"{e!r}"[:2000]
            log(f"restart of {node.name} FAILED: {e!r}"[:2000])

    @staticmethod
    def _wait_loaded(node: Node, n: int = 1, timeout: float = 30) -> dict[str, Any]:
        """Waits until ``node`` holds at least ``n`` requests (the fault is to meet load):
        how long it waited (None: it never did; the fault goes ahead anyway) and how many
        requests it held at that moment."""
        t0 = time.monotonic()
        seen = [0.0]

        def loaded() -> bool:
            seen[0] = safe_scrape(node.url, 2).get("pdserve_num_requests_admitted", 0.0)
            return seen[0] >= n

        ok = wait_for(loaded, timeout)
        waited = round(time.monotonic() - t0, 1) if ok else None
        return {"waited_for_load_s": waited, "admitted": seen[0]}

    @staticmethod
    def _before_kill(node: Node) -> dict[str, Any]:
        """What a node had done and held just before it is killed (its counters die with it)."""
        m = safe_scrape(node.url, 2)
        return {
            "admitted_at_kill": m.get("pdserve_num_requests_admitted"),
            "counters_before": {v: m[k] for k, v in COUNTERS.items() if k in m},
        }

    def inject(self, name: str, round_no: int, wave_no: int) -> threading.Thread | None:
        c = self.cluster

        def victim() -> Node:
            node = c.node(self.cfg.victim(name, round_no, wave_no))
            # Never both nodes of a role at once: a fault waits while the other is still
            # down from an earlier one (the load goes on meanwhile).
            role = c.prefill if node in c.prefill else c.decode
            others = [n for n in role if n is not node]
            wait_for(lambda: not any(n.lock.locked() for n in others), 600)
            return node

        if name == "kill_prefill":
            node = victim()
            node.lock.acquire()
            loaded = self._wait_loaded(node)
            before = self._before_kill(node)
            node.kill9()
            rec = self.run.record_fault(name, round_no, node.name, **loaded, **before)
            return self._background(node, lambda: self._restart(node, rec), name)
        if name == "kill_decode":
            return self._kill_decode_mid_write(victim(), round_no)
        if name == "kill_worker":
            node = victim()
            node.lock.acquire()
            loaded = self._wait_loaded(node)
            worker = rank_pid(node, self.cfg.kill_worker_rank)
            os.kill(worker, signal.SIGKILL)
            rec = self.run.record_fault(name, round_no, node.name, worker=worker, **loaded)

            def recover() -> None:
                t0 = time.monotonic()
                # The node turns unhealthy once its engine meets the dead worker (the load
                # keeps coming, so it does); then it is stopped and restarted.
                seen = wait_for(lambda: health_code(node.url) != 200, 60)
                rec["unhealthy_after_s"] = round(time.monotonic() - t0, 1) if seen else None
                rec["shutdown"] = node.sigterm_and_wait(60)
                self._restart(node, rec)

            return self._background(node, recover, name)
        if name == "kill_engine":
            node = victim()
            node.lock.acquire()
            loaded = self._wait_loaded(node)
            kids = descendants(node.pid)
            os.kill(node.pid, signal.SIGKILL)  # the engine process only, not its tree
            node.proc.proc.wait(10)  # type: ignore[union-attr]
            node.exits.append({"incarnation": node.starts, "how": "SIGKILL engine", "code": -9})
            rec = self.run.record_fault(
                name, round_no, node.name, processes_under=len(kids), **loaded
            )

            def reap_and_restart() -> None:
                t0 = time.monotonic()
                left = wait_gone(kids, ORPHAN_GRACE_S)
                rec["orphans_gone_after_s"] = round(time.monotonic() - t0, 1)
                rec["orphans_left"] = len(left)
                for k in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(k, signal.SIGKILL)
                self._restart(node, rec)

            return self._background(node, reap_and_restart, name)
        if name == "stop_worker":
            node = victim()
            node.lock.acquire()
            worker = rank_pid(node, self.cfg.stop_worker_rank)
            length = self.cfg.stop_s or self.cfg.kv_transfer_timeout + 2
            os.kill(worker, signal.SIGSTOP)
            rec = self.run.record_fault(name, round_no, node.name, worker=worker, stopped_s=length)

            def resume() -> None:
                try:
                    time.sleep(length)
                finally:
                    os.kill(worker, signal.SIGCONT)
                rec["healthy_after"] = health_code(node.url)

            return self._background(node, resume, name)
        if name == "drain":
            node = victim()
            node.lock.acquire()
            loaded = self._wait_loaded(node, 2)
            node.proc.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            rec = self.run.record_fault(name, round_no, node.name, **loaded)

            def drain_and_restart() -> None:
                rec["shutdown"] = node.sigterm_and_wait(
                    self.cfg.shutdown_timeout + 60, signal_sent=True
                )
                self._restart(node, rec)

            return self._background(node, drain_and_restart, name)
        if name == "side_channel":
            out = side_channel_burst(c, self.run.fault_rng, f"r{round_no}w{wave_no}")
            self.run.record_fault(name, round_no, "all", **out)
            return None
        raise ValueError(f"unknown fault {name!r}")

    def _kill_decode_mid_write(self, node: Node, round_no: int) -> threading.Thread:
        """A burst of long prompts; ``node`` is SIGKILLed as soon as a prefill node reports
        a push in flight (or once the burst's pushes have started, if none is caught)."""
        c = self.cluster
        node.lock.acquire()
        ps = [p for p in c.prefill if p.alive()]
        key = "pdserve_engine_kv_transfers_started_total"
        before = sum(safe_scrape(p.url, 2).get(key, 0) for p in ps)
        for spec in self.run.new_specs(round_no, 8, long_only=True, rng=self.run.fault_rng):
            self.run.submit(spec)  # before the wave ends: the round waits for every request
        seen_in_flight = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = [safe_scrape(p.url, 2) for p in ps]
            if any(v.get("pdserve_engine_kv_transfers_in_flight", 0) > 0 for v in m):
                seen_in_flight = True
                break
            if sum(v.get(key, 0) for v in m) - before >= 4:
                break
            time.sleep(0.01)
        before = self._before_kill(node)
        node.kill9()
        rec = self.run.record_fault(
            "kill_decode", round_no, node.name, push_in_flight_seen=seen_in_flight, **before
        )
        return self._background(node, lambda: self._restart(node, rec), "kill_decode")
