"""The chaos suite's cluster: nodes on fixed ports that faults kill and restart (each
start a new incarnation), the proxy in front of them, and probes of their metrics,
health and memory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from chaos_config import MIB, ChaosConfig
from harness import (
    MODEL,
    Proc,
    descendants,
    free_port,
    spawn,
    wait_gone,
    wait_healthy,
    worker_pids,
)
from prometheus_client.parser import text_string_to_metric_families

# -- metrics and memory ---------------------------------------------------------------------


def scrape(url: str, timeout: float = 10) -> dict[str, float]:
    """Every sample of a ``/metrics`` page, summed over labels, by sample name."""
    text = httpx.get(url + "/metrics", timeout=timeout).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def rss_bytes(pid: int) -> int:
    """Resident bytes of one process (/proc/<pid>/status, VmRSS); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(next(x for x in f if x.startswith("VmRSS:")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return 0


def rss_detail(pid: int) -> list[float]:
    """MiB of ``pid`` itself, then of each process under it."""
    return [round(rss_bytes(p) / MIB, 1) for p in [pid, *descendants(pid)]]


def scrape_labelled(url: str, sample: str, timeout: float = 10) -> dict[str, float]:
    """The samples named ``sample`` of a ``/metrics`` page by their labels' values
    ("a/b"); empty when the page cannot be read."""
    try:
        text = httpx.get(url + "/metrics", timeout=timeout).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == sample:
                    out["/".join(s.labels.values())] = s.value
        return out
    except (httpx.HTTPError, ValueError):
        return {}


def safe_scrape(url: str, timeout: float = 10) -> dict[str, float]:
    try:
        return scrape(url, timeout)
    except (httpx.HTTPError, ValueError):
        return {}


def health_code(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=3).status_code
    except httpx.HTTPError:
        return 0


def wait_for(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def rank_pid(node: Node, rank: int) -> int:
    """The pid of TP worker ``rank`` of ``node`` (-1: the last; past the node's TP: the
    last)."""
    pids = worker_pids(node.pid)
    return pids[min(rank, len(pids) - 1)] if rank >= 0 else pids[rank]


# -- the cluster ----------------------------------------------------------------------------


class Node:
    """One node on fixed ports; every start is a new incarnation (``proc``)."""

    def __init__(
        self, name: str, module: str, args: list[str], tmp: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.module, self.args, self.tmp, self.env = name, module, args, tmp, env
        self.port = free_port()
        self.sc_port = free_port() if "--kv-connector" in args else 0
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Proc | None = None
        self.starts = 0
        self.lock = threading.Lock()  # one fault at a time on a node
        self.exits: list[dict[str, Any]] = []

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", self.module, "--host", "127.0.0.1", "--port", str(self.port)]
        if self.sc_port:
            cmd += ["--side-channel-port", str(self.sc_port), "--engine-id", self.name]
        return cmd + self.args

    def spawn(self) -> Proc:
        self.starts += 1
        self.proc = spawn(
            f"{self.name}.{self.starts}", self.command(), self.url, self.tmp, self.env
        )
        return self.proc

    def start(self, timeout: float = 300) -> None:
        self.spawn()
        wait_healthy(self.proc, timeout=timeout)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill9()
        self.exits.append({"incarnation": self.starts, "how": "SIGKILL", "code": -9})

    def sigterm_and_wait(self, timeout: float, signal_sent: bool = False) -> dict[str, Any]:
        """SIGTERM (unless ``signal_sent``); waits up to ``timeout`` for the exit (then
        SIGKILLs the tree); what happened."""
        assert self.proc is not None
        kids = descendants(self.pid)
        start = time.monotonic()
        if not signal_sent:
            self.proc.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.proc.wait(timeout)
            took = time.monotonic() - start
            stuck = wait_gone(kids, 10)  # its workers end after it
        except subprocess.TimeoutExpired:
            code, took, stuck = None, time.monotonic() - start, []
        if code is None or stuck:
            self.proc.kill9()
            for k in stuck:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(k, signal.SIGKILL)
        rec = {
            "incarnation": self.starts,
            "how": "SIGTERM",
            "code": code,
            "took_s": round(took, 1),
            "workers_left_behind": len(stuck),
        }
        self.exits.append(rec)
        return rec

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def logs(self, n: int = 3000) -> str:
        return self.proc.logs(n) if self.proc else ""


class Cluster:
    """2 P + 2 D (NIXL, TP ``cfg.tp``) and a proxy; a colocated node for the references."""

    def __init__(self, cfg: ChaosConfig, tmp: Path) -> None:
        self.cfg, self.tmp = cfg, tmp
        common = [
            "--model",
            MODEL,
            "--num-blocks",
            str(cfg.num_blocks),
            "--shutdown-timeout",
            str(cfg.shutdown_timeout),
            "--max-num-seqs",
            "32",
        ]
        if cfg.tenants:  # usage's cached_tokens, through the proxy P's prefix-cache hit
            common.append("--enable-prompt-tokens-details")
        nixl = [
            "--kv-connector",
            "nixl",
            "--kv-transfer-timeout",
            str(cfg.kv_transfer_timeout),
            "--peer-ping-interval",
            "0.5",
        ]
        # The secret travels in the environment (the flag would show in ps).
        env = {"PDSERVE_KV_SECRET": cfg.kv_secret}
        tp = dict(zip(("p1", "p2", "d1", "d2"), cfg.tp, strict=True))

        def node(name: str, module: str, *extra: str, plain: bool = False) -> Node:
            # A plain reference schedules synchronously (async scheduling is the default).
            own = ("--no-async-scheduling",) if plain else cfg.node_args
            args = [*common, *own, "--tp", str(tp.get(name, tp["d1"])), *extra]
            node_env = {**({} if plain else cfg.node_env), **(env if extra else {})}
            return Node(name, module, args, tmp, node_env or None)

        self.prefill = [node(f"p{i}", "prefill_node", *nixl) for i in (1, 2)]
        self.decode = [node(f"d{i}", "decode_node", *nixl) for i in (1, 2)]
        self.reference = node("colocated", "decode_node", plain=cfg.plain_reference)
        self.proxy: Proc | None = None
        self.retired: list[Proc] = []

    @property
    def nodes(self) -> list[Node]:
        return [*self.prefill, *self.decode]

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def start(self) -> None:
        for n in [*self.nodes, self.reference]:
            n.spawn()
        wait_healthy(*[n.proc for n in [*self.nodes, self.reference]], timeout=400)
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--port",
            str(port),
            "--health-interval",
            "0.5",
            "--max-retries",
            "2",
            "--request-timeout",
            "60",
            "--connect-timeout",
            "3",
            "--prefill",
            *[n.url for n in self.prefill],
            "--decode",
            *[n.url for n in self.decode],
        ]
        if self.cfg.tenants:  # prompt_cache_key's affinity, cache_salt's routing keys
            cmd += ["--routing", "prefix"]
        self.proxy = spawn("proxy", cmd, f"http://127.0.0.1:{port}", self.tmp)
        wait_healthy(self.proxy, timeout=60)

    def stop_reference(self) -> None:
        self.reference.stop()

    def stop_all(self) -> None:
        """Stops every process it started, by PID, all at once (each SIGTERM, then SIGKILL)."""
        errors: list[str] = []
        procs = [self.proxy, *[n.proc for n in self.nodes], self.reference.proc, *self.retired]

        def stop(p: Proc) -> None:
            try:
                for w in worker_pids(p.pid):  # a SIGSTOPped worker would never exit
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(w, signal.SIGCONT)
                p.stop()
            except Exception as e:  # stop the rest, then report
                errors.append(f"{p.name}: {e!r}")

        threads = [threading.Thread(target=stop, args=(p,)) for p in procs if p is not None]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError("could not stop: " + "; ".join(errors))


def live_pids(cluster: Cluster) -> dict[str, int]:
    out = {n.name: n.pid for n in cluster.nodes if n.alive()}
    if cluster.proxy is not None:
        out["proxy"] = cluster.proxy.pid
    return out
