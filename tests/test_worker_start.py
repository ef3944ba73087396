"""How TP workers start (``engine.worker.pipe``): forked from one fork server that imported
torch once, each with the environment its executor had when it started it (not the
server's), named ``pdserve-tp<rank>``."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

import pytest

from engine.worker.pipe import MULTIPROC_METHOD_ENV, enter_worker, worker_context

pytestmark = pytest.mark.slow

PROBE_ENV = "PDSERVE_TEST_WORKER_ENV_PROBE"


def report(env: dict[str, str], rank: int, conn: Connection) -> None:
    """A worker's start (``enter_worker``), then what it sees."""
    enter_worker(env, rank)
    with open("/proc/self/comm") as f:
        comm = f.read().strip()
    conn.send((os.environ.get(PROBE_ENV), comm, os.getppid()))
    conn.close()


def _start(rank: int) -> tuple[str | None, str, int]:
    ctx = worker_context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=report, args=(dict(os.environ), rank, send), daemon=True)
    proc.start()
    send.close()
    try:
        assert recv.poll(120), "the worker did not report"
        return recv.recv()
    finally:
        proc.join(30)


def test_a_worker_forked_later_has_the_environment_of_its_start_not_the_servers(monkeypatch):
    monkeypatch.delenv(MULTIPROC_METHOD_ENV, raising=False)
    monkeypatch.delenv(PROBE_ENV, raising=False)
    first = _start(0)  # the fork server runs from here on, without the probe
    assert first[0] is None and first[1] == "pdserve-tp0"
    monkeypatch.setenv(PROBE_ENV, "set after the server started")
    value, comm, parent = _start(3)
    assert value == "set after the server started" and comm == "pdserve-tp3"
    assert parent == first[2] != os.getpid()  # both from the one fork server


def test_spawn_is_the_other_way_to_start_and_anything_else_is_refused(monkeypatch):
    monkeypatch.setenv(MULTIPROC_METHOD_ENV, "spawn")
    monkeypatch.setenv(PROBE_ENV, "x")
    assert _start(1) == ("x", "pdserve-tp1", os.getpid())
    monkeypatch.setenv(MULTIPROC_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match=MULTIPROC_METHOD_ENV):
        worker_context()
