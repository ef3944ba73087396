"""Processes of a benchmark run on one box: nodes and proxies started with ``Popen`` in their
own session, stopped by PID (SIGTERM, then SIGKILL for whatever of their tree is left)."""

from __future__ import annotations

import contextlib
import glob
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class BenchError(RuntimeError):
    """A process did not start, died, or the workload could not run."""


# ---------------------------------------------------------------------------------------
# processes: started with Popen, stopped by PID
# ---------------------------------------------------------------------------------------


_HANDED_OUT: set[int] = set()  # ports this process gave out: never twice
_PORTS_BELOW_EPHEMERAL = 12000  # how many ports under the kernel's ephemeral range to use


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


PORT_RANGE_ENV = "PDSERVE_PORT_RANGE"  # "LOW-HIGH": free_port() picks from [LOW, HIGH) only


def port_range() -> tuple[int, int] | None:
    """Where ``free_port`` picks: ``$PDSERVE_PORT_RANGE`` (several test processes at once,
    each its own slice), else the ports just below the kernel's ephemeral range."""
    text = os.environ.get(PORT_RANGE_ENV, "")
    if text:
        low, _, high = text.partition("-")
        return int(low), int(high)
    low = _ephemeral_low()
    if low > _PORTS_BELOW_EPHEMERAL + 1024:
        return low - _PORTS_BELOW_EPHEMERAL, low
    return None


def free_port() -> int:
    """A loopback TCP port nobody listens on now, for a process started next.

    A process binds its port seconds later (after loading its model), so a port the kernel
    hands out for ``bind(0)`` may meanwhile go to another process's UCX/ZMQ listener or
    outgoing connection, or come back from the next ``free_port()`` call: two nodes on one
    port, the loser exiting after the winner answered its health check (a decode node's
    URL served by the colocated node once made a whole test module fail). So ports come
    from just below the kernel's ephemeral range, where it never hands out ports by
    itself, at random, never twice in this process, and checked free by a bind
    (``port_range``: test processes running side by side take disjoint slices).
    """
    span = port_range()
    if span is not None:
        rng = random.Random(os.getpid() ^ time.monotonic_ns())
        for _ in range(200):
            port = rng.randrange(*span)
            if port in _HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    while True:  # no such range here: the kernel's choice, still never twice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    out: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        for path in glob.glob(f"/proc/{p}/task/*/children"):
            try:
                with open(path) as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out.extend(kids)
            stack.extend(kids)
    return out


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    url: str
    log: Path
    cmd: list[str]

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def terminate(self) -> list[int]:
        """SIGTERM to this PID; returns its descendants (TP workers) as they were."""
        kids = descendants(self.popen.pid)
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
        return kids

    def reap(self, kids: list[int], timeout: float = 30.0) -> None:
        """Waits ``timeout`` for this PID (then SIGKILL), and 10 s more for ``kids``: each
        one still alive is SIGKILLed by its PID."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
        deadline = time.monotonic() + 10
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for k in kids:
            if alive(k):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(k, signal.SIGKILL)


# Keys in the user's environment that would make a private cluster's nodes or proxy
# refuse one another (a node with PDSERVE_API_KEY refuses a proxy not given it) or the
# benchmark's client: not passed on. Keys meant for the run go in its flags.
PRIVATE_ENV_DROPPED = (
    "PDSERVE_API_KEY", "PDPROXY_API_KEY", "PDPROXY_NODE_API_KEY", "PDPROXY_REGISTRATION_KEY",
)  # fmt: skip


class Cluster:
    """The processes of one layout; ``stop_all`` stops each by its PID."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = env
        self.procs: list[Proc] = []

    def start(
        self, name: str, module: str, argv: list[str], env: dict[str, str] | None = None
    ) -> Proc:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", module, *argv, "--port", str(port)]
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as f:
            popen = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=self.child_env(env),
            )
        proc = Proc(name, popen, url, log, cmd)
        self.procs.append(proc)
        return proc

    def child_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """A started process's environment: this one's without ``PRIVATE_ENV_DROPPED``,
        then the cluster's and the process's own variables."""
        inherited = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV_DROPPED}
        return {**inherited, **(self.env or {}), **(env or {})}

    def wait_healthy(self, procs: list[Proc], timeout: float) -> None:
        """Every node's ``/health`` answers 200."""
        import httpx

        pending = list(procs)
        deadline = time.monotonic() + timeout
        while pending:
            for p in list(pending):
                self._check_alive(p)
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(p.url + "/health", timeout=2).status_code == 200:
                        pending.remove(p)
            if pending and time.monotonic() > deadline:
                raise BenchError(
                    f"{pending[0].name} not healthy after {timeout:g}s; its log "
                    f"({pending[0].log}):\n{pending[0].tail()}"
                )
            if pending:
                time.sleep(0.2)

    def wait_proxy(self, proxy: Proc, nodes: list[Proc], timeout: float) -> None:
        """The proxy lists every node of ``nodes`` as healthy in its ``/health`` body (its
        status may be 503 for the colocated layout: no prefill node)."""
        import httpx

        want = {n.url for n in nodes}
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive(proxy)
            with contextlib.suppress(httpx.HTTPError, ValueError):
                body = httpx.get(proxy.url + "/health", timeout=2).json()
                healthy = {
                    n["url"]
                    for role in ("prefill", "decode")
                    for n in body.get(role, [])
                    if n.get("healthy")
                }
                if want <= healthy:
                    return
            if time.monotonic() > deadline:
                raise BenchError(
                    f"proxy did not see every node healthy after {timeout:g}s; its log "
                    f"({proxy.log}):\n{proxy.tail()}"
                )
            time.sleep(0.2)

    def _check_alive(self, p: Proc) -> None:
        if p.popen.poll() is not None:
            raise BenchError(
                f"{p.name} exited with {p.popen.returncode}; its log ({p.log}):\n{p.tail()}"
            )

    def check_all_alive(self) -> None:
        for p in self.procs:
            self._check_alive(p)

    def stop_all(self) -> None:
        """SIGTERM to every process at once (each by its PID), then wait for each."""
        kids = [p.terminate() for p in self.procs]
        for p, k in zip(self.procs, kids, strict=True):
            with contextlib.suppress(Exception):
                p.reap(k)
        self.procs = []
