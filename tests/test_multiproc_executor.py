"""The multiprocess executor's start: the TP ranks' rendezvous."""

from __future__ import annotations

import socket

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
def test_a_shutdown_ends_even_when_a_killed_worker_does_not_exit(caplog):
    """The shutdown waits the grace, SIGKILLs, and then waits a bounded time: a worker that
    even SIGKILL does not end is logged and left (it waited in ``join()`` for good, so a
    node with such a worker never exited on SIGTERM)."""
    import threading

    from engine.executor import multiproc

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
