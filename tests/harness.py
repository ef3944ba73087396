"""The test harness: real node and proxy processes, their metrics and streams, polling.

Every process is started with ``spawn_node``/``spawn_proxy`` (or a ``Procs`` group, which
the fixtures in ``conftest.py`` hand out) and stopped by PID: SIGTERM, then SIGKILL, and
any descendants it left behind (TP workers) are killed too. No psutil: /proc is enough.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.bench.cluster import alive, descendants, free_port  # noqa: F401 - re-exported
from engine.worker.pipe import WORKER_NAME_PREFIX, run_in_environment, worker_context

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
GREEDY = {"temperature": 0, "ignore_eos": True}
STARTUP_TIMEOUT_S = 240.0
NIXL = ("--kv-connector", "nixl")


# -- ports, processes, polling ---------------------------------------------------------------
# free_port, descendants and alive are the benchmarks' (engine/bench/cluster.py): one copy.


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Waits until none of ``pids`` is alive; returns those still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def worker_pids(pid: int) -> list[int]:
    """The TP worker processes under ``pid`` (named ``pdserve-tp<rank>``: under the fork
    server they are its children, not the engine process's), by rank."""
    out = []
    for kid in descendants(pid):
        try:
            with open(f"/proc/{kid}/comm", "rb") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith(WORKER_NAME_PREFIX.encode()):
            out.append((int(name[len(WORKER_NAME_PREFIX) :] or -1), kid))
    return [kid for _, kid in sorted(out)]


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll ``cond()`` until true; returns the seconds it took, raises after ``timeout``."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start


# -- metrics ---------------------------------------------------------------------------------


def parse_metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of the samples of ``name`` (a sample name: ``x_total``, ``x_bucket``...) in
    Prometheus text ``text`` whose labels include ``labels``. A missing metric is an error;
    a labelled series not yet created counts 0."""
    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != name:
                continue
            found = True
            if labels and any(sample.labels.get(k) != v for k, v in labels.items()):
                continue
            total += sample.value
    if not found and not labels:
        raise AssertionError(f"metric {name} not found")
    return total


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """``parse_metric`` of the ``/metrics`` page at ``url``."""
    return parse_metric(httpx.get(url + "/metrics", timeout=10).text, name, labels)


def node_generate_requests(url: str) -> float:
    """Completion/chat requests a node has received (any status)."""
    return sum(
        metric(url, "pdserve_http_requests_total", {"path": p})
        for p in ("/v1/completions", "/v1/chat/completions")
    )


def kv_pool_full(url: str) -> bool:
    """No request left on the node and every KV block free."""
    free = metric(url, "pdserve_kv_blocks_free")
    total = metric(url, "pdserve_kv_blocks_capacity")
    running = metric(url, "pdserve_num_requests_running")
    waiting = metric(url, "pdserve_num_requests_waiting")
    return free == total and running == 0 and waiting == 0


def node_idle(url: str) -> bool:
    return (
        metric(url, "pdserve_num_requests_running") == 0
        and metric(url, "pdserve_num_requests_waiting") == 0
    )


# -- server-sent events ----------------------------------------------------------------------


def sse_data(lines: Iterable[str]) -> list[Any]:
    """SSE lines as JSON objects; the final ``[DONE]`` becomes the string 'DONE'."""
    events: list[Any] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append("DONE" if data == "[DONE]" else json.loads(data))
    return events


def sse_events(resp: httpx.Response) -> list[Any]:
    """A streamed response's SSE body (see ``sse_data``)."""
    return sse_data(resp.iter_lines())


def sse_chunk_events(chunks: Iterable[str]) -> list[Any]:
    """The JSON events of an SSE body that came in ``chunks`` (e.g. a proxy session's
    ``events()``). A chunk may hold several events, or part of one: the chunks are
    buffered and split at blank lines; an event's ``data:`` lines are joined (the SSE
    rule). ``[DONE]``, comments and an event the body never ended are left out."""
    *events, _unended = "".join(chunks).replace("\r\n", "\n").split("\n\n")
    out = []
    for event in events:
        lines = event.split("\n")
        data = "\n".join(x[5:].removeprefix(" ") for x in lines if x.startswith("data:"))
        if data.startswith("{"):
            out.append(json.loads(data))
    return out


def chat_stream_choices(url: str, body: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """``POST /v1/chat/completions`` of ``body`` streamed (the tiny model named): each
    choice's chunks (its ``choices`` entries) in order, by index. The stream must end with
    ``[DONE]`` and carry no error event."""
    body = {"model": MODEL, **body, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        events = sse_events(resp)
    assert events[-1] == "DONE"
    out: dict[int, list[dict[str, Any]]] = {}
    for e in events[:-1]:
        assert isinstance(e, dict) and "error" not in e, e
        for c in e["choices"]:
            out.setdefault(c["index"], []).append(c)
    return dict(sorted(out.items()))


def stream_ids(events: list[Any]) -> list[int]:
    """The token ids of a completion stream's events, in order."""
    return [t for e in events if isinstance(e, dict) for c in e.get("choices", []) for t in c.get("token_ids", [])]  # fmt: skip


def assert_completes_with(url: str, body: dict[str, Any], want_ids: list[int]) -> None:
    """``POST /v1/completions`` of ``body`` at ``url``, not streamed and streamed, answers
    with ``want_ids``."""
    got = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == want_ids
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        assert resp.status_code == 200
        assert stream_ids(sse_events(resp)) == want_ids


# -- child processes ---------------------------------------------------------------------------


def child_process(target: Callable[..., Any], *args: Any, daemon: bool = False) -> Any:
    """A ``multiprocessing.Process`` running ``target(*args)`` (not yet started), forked
    from the fork server the engine's TP workers come from (``worker_context``): torch is
    imported there once, where a ``spawn`` child imports it again (seconds of CPU each, on
    a loaded box). The child takes this process's environment as it is now (a forked one
    would keep the fork server's, from when that started), as a spawned child would.
    Queues and pipes for it come from ``child_context()``."""
    return child_context().Process(
        target=run_in_environment, args=(dict(os.environ), target, *args), daemon=daemon
    )


def child_context() -> Any:
    """The multiprocessing context of ``child_process`` (for its queues and pipes)."""
    return worker_context()


def first_message(conn: Any, proc: Any, timeout: float, what: str) -> Any:
    """The first message ``proc`` (a started ``child_process``) sends on ``conn``: an error
    naming its exit code as soon as it dies without one (the pipe's other end may still be
    open here, so a dead child would otherwise look like a slow one), a TimeoutError after
    ``timeout``."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.1):
        if not proc.is_alive():
            if conn.poll(0):  # it sent, then exited
                break
            raise RuntimeError(f"{what} exited with code {proc.exitcode} before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} was not ready within {timeout:.0f} s")
    return conn.recv()


# -- node and proxy processes ----------------------------------------------------------------


@dataclass
class Proc:
    """A node or proxy process, its URL and its log files."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    stdout_path: Path
    stderr_path: Path
    tmpdir: Path | None = None  # its TMPDIR, removed once it is gone (``stop``/``kill9``)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def logs(self, n: int = 4000) -> str:
        """The last ``n`` characters of what it printed (stdout, then stderr)."""
        text = ""
        for path in (self.stdout_path, self.stderr_path):
            with contextlib.suppress(OSError):
                text += path.read_text(errors="replace")
        return text[-n:]

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return metric(self.url, name, labels)

    def kill9(self) -> None:
        """SIGKILL the process and everything it started (a crashed node)."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        self._remove_tmpdir()

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 30 s), then SIGKILL any descendant still alive after 10 s."""
        kids = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in wait_gone(kids, 10):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._remove_tmpdir()

    def _remove_tmpdir(self) -> None:
        # A SIGKILLed process (or its TP workers) leaves multiprocessing's pymp-* folders.
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


def spawn(
    name: str,
    cmd: list[str],
    url: str,
    tmp: Path,
    env: dict[str, str] | None = None,
) -> Proc:
    """Start ``cmd`` in the repository root; stdout and stderr go to files in ``tmp``.

    The process gets a TMPDIR of its own (short, under the system's: AF_UNIX socket paths
    made there must stay under 108 bytes), removed when it is stopped or killed."""
    stem = f"{name}-{url.rsplit(':', 1)[1]}"
    out, err = tmp / f"{stem}.out", tmp / f"{stem}.err"
    tmpdir = Path(tempfile.mkdtemp(prefix="pdserve-proc-"))
    try:
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(
                cmd,
                stdout=fo,
                stderr=fe,
                cwd=REPO_ROOT,
                env={**os.environ, "TMPDIR": str(tmpdir), **(env or {})},
            )
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return Proc(name, proc, url, out, err, tmpdir)


def spawn_node(
    tmp: Path,
    *args: str,
    module: str = "decode_node",
    name: str | None = None,
    host: str = "127.0.0.1",
    prefix: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Proc:
    """Start ``[prefix] python -m <module> --host H --port <free> *args`` (not yet healthy)."""
    port = free_port()
    cmd = [*(prefix or []), sys.executable, "-m", module, "--host", host, "--port", str(port)]
    return spawn(name or module, [*cmd, *args], f"http://{host}:{port}", tmp, env)


def spawn_proxy(
    tmp: Path, prefill: list[str], decode: list[str], *args: str, name: str | None = None
) -> Proc:
    """Start ``python -m proxy serve`` in front of the given nodes (health checked every
    0.5 s, a check answered within 10 s, unless ``args`` say otherwise: a loaded box's
    node may answer one check later than the default 2 s, which takes it out of rotation
    until the next; tests of hang detection pass ``--health-timeout`` themselves)."""
    port = free_port()
    cmd = [sys.executable, "-m", "proxy", "serve", "--port", str(port), "--health-interval", "0.5"]
    cmd += ["--health-timeout", "10"]
    cmd += ["--prefill", *prefill, "--decode", *decode, *args]
    return spawn(name or "proxy", cmd, f"http://127.0.0.1:{port}", tmp)


def wait_healthy(*procs: Proc, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Waits until every process's ``/health`` answers 200; raises (with the logs) if one
    exits or ``timeout`` passes. Stops nothing: the caller owns the processes."""
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
        if pending:
            time.sleep(0.2)


def stop(*procs: Proc) -> None:
    """Stops each process by PID; a failure to stop one does not keep the others running."""
    errors = []
    for p in procs:
        try:
            p.stop()
        except Exception as e:  # stop the rest, then report
            errors.append(f"{p.name}: {e!r}")
    if errors:
        raise RuntimeError("could not stop: " + "; ".join(errors))


def start_node(tmp: Path, *args: str, **kw: Any) -> Proc:
    """``spawn_node`` and wait until healthy (stopped again if it never gets there)."""
    node = spawn_node(tmp, *args, **kw)
    try:
        wait_healthy(node)
    except BaseException:
        node.stop()
        raise
    return node


@dataclass
class PD:
    """Prefill and decode nodes started together (and a colocated reference node)."""

    prefill: list[Proc]
    decode: list[Proc]
    colocated: Proc | None = None

    @property
    def p(self) -> Proc:
        return self.prefill[0]

    @property
    def d(self) -> Proc:
        return self.decode[0]

    @property
    def nodes(self) -> list[Proc]:
        return [*self.prefill, *self.decode]

    @property
    def all(self) -> list[Proc]:
        """``nodes`` and the colocated node, if any."""
        return [*self.nodes, *([self.colocated] if self.colocated else [])]


@dataclass
class Procs:
    """A group of processes started in ``tmp`` and stopped together (``stop_all``).

    ``node``/``proxy`` spawn and, unless ``wait=False``, wait until healthy; ``pd`` starts
    prefill and decode nodes at once so their start-ups overlap."""

    tmp: Path
    started: list[Proc] = field(default_factory=list)

    def add(self, p: Proc) -> Proc:
        self.started.append(p)
        return p

    def node(self, *args: str, wait: bool = True, **kw: Any) -> Proc:
        p = self.add(spawn_node(self.tmp, *args, **kw))
        if wait:
            wait_healthy(p)
        return p

    def proxy(
        self, prefill: list[str], decode: list[str], *args: str, wait: bool = True, **kw: Any
    ) -> Proc:
        p = self.add(spawn_proxy(self.tmp, prefill, decode, *args, **kw))
        if wait:
            wait_healthy(p, timeout=60)
        return p

    def pd(
        self,
        n_prefill: int = 1,
        n_decode: int = 1,
        *args: str,
        colocated: bool = False,
        wait: bool = True,
    ) -> PD:
        """``n_prefill`` prefill and ``n_decode`` decode nodes with ``--kv-connector nixl``
        and ``args``; with ``colocated``, also a node without a connector (same ``args``).
        With ``wait=False`` returns at once (``wait_healthy(*pd.all)`` before use)."""
        pd = PD(
            [self.node(*NIXL, *args, module="prefill_node", name=f"p{i}", wait=False)
             for i in range(1, n_prefill + 1)],
            [self.node(*NIXL, *args, module="decode_node", name=f"d{i}", wait=False)
             for i in range(1, n_decode + 1)],
        )  # fmt: skip
        if colocated:
            pd.colocated = self.node(*args, name="colocated", wait=False)
        if wait:
            wait_healthy(*pd.all)
        return pd

    def stop_all(self) -> None:
        started, self.started = self.started, []
        stop(*started)


@contextlib.contextmanager
def procs_in(tmp: Path) -> Iterator[Procs]:
    """A ``Procs`` group whose processes are all stopped on exit, also when a test fails."""
    group = Procs(tmp)
    try:
        yield group
    finally:
        group.stop_all()
