"""Process helpers for the proxy tests: real nodes and a real proxy as subprocesses.

Everything started here is stopped by PID (SIGTERM, then SIGKILL, descendants included),
also when a test fails. No tests live in this module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from node_utils import alive, descendants, free_port, sse_events, wait_for  # noqa: F401

MODEL = "tiny"
STARTUP_TIMEOUT_S = 240.0
REPO_ROOT = Path(__file__).resolve().parent.parent
GREEDY = {"temperature": 0, "ignore_eos": True}


_descendants = descendants
_alive = alive


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def logs(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill9(self) -> None:
        """SIGKILL the process and everything it started (a crashed node)."""
        kids = _descendants(self.proc.pid)
        for pid in [self.proc.pid, *kids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        kids = _descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(k) for k in kids):
            time.sleep(0.1)
        for pid in kids:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def spawn(name: str, cmd: list[str], port: int, tmp: Path) -> Proc:
    log = tmp / f"{name}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    return Proc(name, proc, f"http://127.0.0.1:{port}", log)


def spawn_node(name: str, module: str, tmp: Path, *extra: str) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", module, "--model", MODEL, "--port", str(port)]
    cmd += ["--num-blocks", "256", *extra]
    return spawn(name, cmd, port, tmp)


def spawn_proxy(name: str, tmp: Path, prefill: list[str], decode: list[str], *extra: str) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "proxy", "serve", "--port", str(port)]
    cmd += ["--prefill", *prefill, "--decode", *decode, "--health-interval", "0.5", *extra]
    return spawn(name, cmd, port, tmp)


def wait_healthy(procs: Iterable[Proc], timeout: float = STARTUP_TIMEOUT_S) -> None:
    pending = list(procs)
    deadline = time.monotonic() + timeout
    while pending:
        for p in list(pending):
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.logs()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(p.url + "/health", timeout=2).status_code == 200:
                    pending.remove(p)
        if pending and time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise RuntimeError(f"not healthy after {timeout}s: {names}\n{pending[0].logs()}")
        time.sleep(0.2)


def stop_all(procs: Iterable[Proc]) -> None:
    for p in procs:
        with contextlib.suppress(Exception):
            p.stop()


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    text = httpx.get(url + "/metrics", timeout=10).text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric_name, _, label_text = head.partition("{")
        if metric_name != name:
            continue
        if labels and not all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            continue
        total += float(value)
        found = True
    if not found and labels is None:
        raise AssertionError(f"metric {name} not found at {url}")
    return total


def node_generate_requests(url: str) -> float:
    """Completion/chat requests a node has received (any status)."""
    return sum(
        metric(url, "pdserve_http_requests_total", {"path": p})
        for p in ("/v1/completions", "/v1/chat/completions")
    )


def kv_pool_full(url: str) -> bool:
    free = metric(url, "pdserve_kv_blocks_free")
    total = metric(url, "pdserve_engine_kv_blocks_total")
    running = metric(url, "pdserve_num_requests_running")
    waiting = metric(url, "pdserve_num_requests_waiting")
    return free == total and running == 0 and waiting == 0


def stream_ids(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, dict) for c in e.get("choices", []) for t in c.get("token_ids", [])]  # fmt: skip
