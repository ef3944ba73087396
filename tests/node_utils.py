"""Start and stop real node processes in tests (by PID; no psutil, /proc is enough)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

STARTUP_TIMEOUT_S = 180.0
REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
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
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def worker_pids(pid: int) -> list[int]:
    """The TP worker processes (multiprocessing spawn children) under ``pid``."""
    out = []
    for kid in descendants(pid):
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(kid)
        except OSError:
            pass
    return out


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    url: str
    stdout_path: Path
    stderr_path: Path

    def logs(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def metric(self, name: str) -> float:
        return metric(self.url, name)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


def spawn_node(
    tmp: Path,
    *args: str,
    module: str = "decode_node",
    host: str = "127.0.0.1",
    prefix: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Node:
    """Start ``python -m <module> --host H --port <free> *args``; logs go to ``tmp``."""
    port = free_port()
    tag = f"{module}-{port}"
    out, err = tmp / f"{tag}.out", tmp / f"{tag}.err"
    cmd = [*(prefix or []), sys.executable, "-m", module, "--host", host, "--port", str(port)]
    cmd += list(args)
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(
            cmd, stdout=fo, stderr=fe, cwd=REPO_ROOT, env={**os.environ, **(env or {})}
        )
    return Node(proc, f"http://{host}:{port}", out, err)


def wait_healthy(node: Node, timeout: float = STARTUP_TIMEOUT_S) -> Node:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(
                f"node exited with {node.proc.returncode} during startup:\n{node.logs()}"
            )
        try:
            if httpx.get(node.url + "/health", timeout=2).status_code == 200:
                return node
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_node(node)
    raise RuntimeError(f"node not healthy after {timeout}s:\n{node.logs()}")


def start_node(tmp: Path, *args: str, **kw) -> Node:
    return wait_healthy(spawn_node(tmp, *args, **kw))


def stop_node(node: Node) -> None:
    """Stop by PID (SIGTERM, then SIGKILL), and any descendants it left behind."""
    kids = descendants(node.proc.pid)
    if node.proc.poll() is None:
        node.proc.send_signal(signal.SIGTERM)
        try:
            node.proc.wait(30)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait(10)
    for pid in wait_gone(kids, 10):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_for(cond: Any, timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll ``cond()`` until true; returns the seconds it took, raises after ``timeout``."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start


def sse_events(resp: httpx.Response) -> list[Any]:
    """An SSE body as JSON objects; the final [DONE] becomes the string 'DONE'."""
    events: list[Any] = []
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append("DONE" if data == "[DONE]" else json.loads(data))
    return events
