"""The multiprocess executor's start: the TP ranks' rendezvous."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig


@pytest.mark.slow
def test_a_tp_start_does_not_depend_on_a_port_staying_free_until_rank_0_binds_it(monkeypatch):
    """The ranks meet over a TCP store (torch.distributed). Its port was picked with
    ``bind(0)``, closed, and bound again by rank 0 once it had imported torch, seconds
    later: meanwhile the kernel could hand it to another process (another node's pick at
    the same start, an outgoing connection), and rank 0 died with EADDRINUSE -- the node
    did not start (a chaos-suite run, 5 nodes starting at once) -- or, had the port gone to
    another node's store, rank 1 would have joined that node's rendezvous. Here the port a
    pick returns is already someone else's listener."""
    from engine.executor import multiproc

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    monkeypatch.setattr(multiproc, "free_port", lambda: taken, raising=False)
    cfg = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(num_blocks=16),
        parallel=ParallelConfig(tp=2, device="cpu", distributed_executor_backend="mp"),
    )
    try:
        ex = multiproc.MultiprocExecutor(cfg, lambda kv_bytes: 16)
        try:
            assert ex.num_blocks == 16 and len(ex.worker_infos) == 2
        finally:
            ex.shutdown()
        assert [p.exitcode for p in ex.procs] == [0, 0]
    finally:
        squatter.close()


class _Unkillable:
    """Fault injection: a worker SIGKILL does not end (a process in uninterruptible sleep:
    a hung GPU driver call, a dead NFS mount). ``join()`` without a timeout never returns."""

    def __init__(self, real) -> None:
        self.real, self.pid, self.sentinel = real, real.pid, real.sentinel
        self.exitcode = None
        self.killed = 0

    def join(self, timeout: float | None = None) -> None:
        import threading

        threading.Event().wait(timeout)  # forever without one

    def is_alive(self) -> bool:
        return True

    def kill(self) -> None:
        self.killed += 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_shutdown_ends_even_when_a_killed_worker_does_not_exit(caplog, monkeypatch):
    """The shutdown waits the grace, SIGKILLs, and then waits a bounded time: a worker that
    even SIGKILL does not end is logged and left (it waited in ``join()`` for good, so a
    node with such a worker never exited on SIGTERM). A 1 s grace here (5 s by default:
    waited out twice)."""
    import threading

    from engine.executor import multiproc

    monkeypatch.setattr(multiproc, "SHUTDOWN_GRACE_S", 1.0)

    cfg = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(num_blocks=16),
        parallel=ParallelConfig(tp=1, device="cpu", distributed_executor_backend="mp"),
    )
    ex = multiproc.MultiprocExecutor(cfg, lambda kv_bytes: 16)
    real = ex.procs[0]
    stuck = _Unkillable(real)
    ex.procs[0] = stuck
    try:
        done = threading.Thread(target=ex.shutdown, daemon=True)
        done.start()
        done.join(120)  # a deadline for the hang, not a measure of speed
        assert not done.is_alive(), "the shutdown waited for good on a worker SIGKILL left"
        assert stuck.killed == 1
        assert f"TP worker 0 (pid {real.pid}) did not exit" in caplog.text
    finally:
        real.kill()
        real.join(30)


def _grandchildren_named(name: str) -> list[int]:
    """Processes called ``name`` whose parent is a child of this process (the workers,
    forked from this process's fork server): never another job's."""
    import os

    def stat(pid: str) -> tuple[str, int] | None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                text = f.read()
        except OSError:
            return None
        comm = text[text.index("(") + 1 : text.rindex(")")]
        return comm, int(text[text.rindex(")") + 2 :].split()[1])

    procs = {pid: s for pid in os.listdir("/proc") if pid.isdigit() and (s := stat(pid))}
    children = {int(pid) for pid, (_, ppid) in procs.items() if ppid == os.getpid()}
    return [int(pid) for pid, (comm, ppid) in procs.items() if comm == name and ppid in children]


@contextlib.contextmanager
def _signal_when_born(name: str, sig: int) -> Iterator[list[int]]:
    """Send ``sig`` to the worker called ``name`` as soon as it exists (a watcher thread
    polling ``_grandchildren_named``); yields the pids signalled."""
    import os
    import threading
    import time

    signalled: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set() and not signalled:
            for pid in _grandchildren_named(name):
                os.kill(pid, sig)
                signalled.append(pid)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield signalled
    finally:
        stop.set()
        watcher.join(10)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rank_that_dies_before_the_rendezvous_fails_the_start_naming_it(monkeypatch):
    """TP 2, rank 1 killed as soon as it exists: rank 0 waits in the rendezvous for it. The
    start waited on rank 0 alone -- until the TCP store's own timeout (minutes), then
    blamed rank 0 -- or ``STARTUP_TIMEOUT_S`` (600 s). Now every rank's death ends the wait
    of any rank's report, naming the rank that died. (Rank 0, in the rendezvous, is killed
    after the shutdown's grace: 1 s here.)"""
    import signal

    from engine.executor import multiproc

    monkeypatch.setattr(multiproc, "SHUTDOWN_GRACE_S", 1.0)

    died = r"TP worker 1 died during startup \(exit -9\)"
    with (
        _signal_when_born("pdserve-tp1", signal.SIGKILL) as killed,
        pytest.raises(RuntimeError, match=died),
    ):
        multiproc.MultiprocExecutor(_tp(2), lambda kv_bytes: 16).shutdown()
    assert killed


def _tp(tp: int) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(num_blocks=16),
        parallel=ParallelConfig(tp=tp, device="cpu", distributed_executor_backend="mp"),
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_start_up_deadline_is_one_for_the_whole_start(monkeypatch):
    """``STARTUP_TIMEOUT_S`` (here 10 s; a tiny model's worker loads in about 1 s) bounds
    the whole start, not each report: the workers load in time, but the start is past its deadline before their ready reports
    (``decide_num_blocks`` took the rest), so it fails. Each report had its own 600 s,
    so a start could take 2 x TP x 600 s."""
    import time

    from engine.executor import multiproc

    monkeypatch.setattr(multiproc, "STARTUP_TIMEOUT_S", 10.0)
    began = time.monotonic()

    def slow_decision(kv_bytes: list) -> int:
        time.sleep(max(0.0, began + 11.0 - time.monotonic()))
        return 16

    with pytest.raises(RuntimeError, match=r"TP worker 0 not ready after 10s"):
        multiproc.MultiprocExecutor(_tp(1), slow_decision).shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stopped_rank_at_start_up_is_the_one_named(monkeypatch):
    """TP 2, rank 1 stopped (SIGSTOP) as soon as it exists: rank 0 waits in the
    rendezvous for it, and the start fails at its deadline naming rank 1 (the wait was
    on rank 0's report, and the error named rank 0)."""
    import os
    import signal

    from engine.executor import multiproc

    monkeypatch.setattr(multiproc, "STARTUP_TIMEOUT_S", 8.0)
    monkeypatch.setattr(multiproc, "SHUTDOWN_GRACE_S", 1.0)  # the ranks are killed after it
    with _signal_when_born("pdserve-tp1", signal.SIGSTOP) as stopped:
        try:
            with pytest.raises(RuntimeError, match=r"TP worker 1 .*not ready after 8s.*stopped"):
                multiproc.MultiprocExecutor(_tp(2), lambda kv_bytes: 16).shutdown()
        finally:
            for pid in stopped:  # killed by the failed start's shutdown; never left stopped
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    assert stopped


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_start_cancelled_while_a_worker_waits_for_its_blocks_ends_it_quietly(monkeypatch, capfd):
    """The engine refuses the workers' reports (``decide_num_blocks`` raises: no room for
    the KV cache) and shuts the start down while the worker waits for its number of
    blocks. The worker unpickled the ``shutdown`` message, logged "worker failed to
    start" with an ``UnpicklingError`` traceback and reported it; now it says the start
    was cancelled and exits (code 0: not killed after the grace). Spawned workers, so
    their log is this test's stderr."""
    from engine.config import ConfigError
    from engine.executor import multiproc

    monkeypatch.setenv("PDSERVE_WORKER_MULTIPROC_METHOD", "spawn")
    procs: list = []
    shutdown = multiproc.MultiprocExecutor.shutdown

    def recorded(self) -> None:
        shutdown(self)
        procs.extend(self.procs)

    monkeypatch.setattr(multiproc.MultiprocExecutor, "shutdown", recorded)

    def refuse(kv_bytes: list) -> int:
        raise ConfigError("no room for the KV cache")

    with pytest.raises(ConfigError, match="no room"):
        multiproc.MultiprocExecutor(_tp(1), refuse)
    err = capfd.readouterr().err
    assert "worker failed to start" not in err, err
    assert "Unpickling" not in err, err
    assert "start-up cancelled" in err, err
    assert [p.exitcode for p in procs] == [0]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_start_held_by_a_stuck_fork_server_ends_at_the_start_up_deadline(monkeypatch):
    """The fork server is stopped (SIGSTOP: a wedged host, a fork server stuck importing
    torch from a hung file system) when rank 0 is started: ``proc.start()`` waits for the
    server to report the pid it forked, and waited for good (no deadline covered it). Now
    the start is under ``STARTUP_TIMEOUT_S`` (here 10 s) too: past it the fork server is
    killed (the stuck start reads its end), the error names the rank, and the next start
    gets a fresh fork server."""
    import os
    import signal
    import threading
    import time
    from multiprocessing import forkserver

    from engine.executor import multiproc
    from engine.worker.pipe import worker_context

    monkeypatch.setenv("PDSERVE_WORKER_MULTIPROC_METHOD", "forkserver")
    monkeypatch.setattr(multiproc, "STARTUP_TIMEOUT_S", 10.0)
    worker_context()  # its preload, as the executor's start sets it
    forkserver.ensure_running()
    server = forkserver._forkserver._forkserver_pid  # CPython's
    os.kill(server, signal.SIGSTOP)
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            multiproc.MultiprocExecutor(_tp(1), lambda kv_bytes: 16).shutdown()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 -- the test's to judge
            outcome.append(e)

    began = time.monotonic()
    t = threading.Thread(target=start, daemon=True)
    t.start()
    try:
        t.join(90)
        assert not t.is_alive(), "the start still waits on the stopped fork server"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGKILL)  # never left stopped (it unsticks a held start)
        t.join(30)  # (not reaped here: the next start's ensure_running() reaps it)
    (err,) = outcome
    assert isinstance(err, RuntimeError), err
    assert "TP worker 0 did not start within 10s" in str(err), err
    assert time.monotonic() - began >= 10.0  # the deadline's, not sooner
    # The next start forks from a fresh server.
    multiproc.MultiprocExecutor(_tp(1), lambda kv_bytes: 16).shutdown()
