"""Multiprocess executor: one worker process per TP rank.

Each step's ``SchedulerOutput`` is pickled once and sent to every rank over its task
pipe; a reader thread per rank turns results into futures, and
``KVOutputAggregator.async_aggregate`` combines them (the synchronous path waits on that
same future). A monitor thread watches the processes: when one dies, the executor is
dead, every pending step fails with ``WorkerDiedError``, and the engine turns unhealthy.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from typing import Any

from engine.config import ConfigError, EngineConfig
from engine.core.scheduler_output import (
    DeferredSampling,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerOutput,
)
from engine.executor.aggregator import KVOutputAggregator
from engine.executor.pipe_send import send_within, set_nonblocking
from engine.executor.proc_start import StartTimeout, start_within
from engine.worker.pipe import (
    WAKE,
    WorkerError,
    stop_fork_server,
    worker_context,
    worker_entry,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_GRACE_S = 5.0
# The shutdown message to a worker whose pipe is full (stopped) is not waited for longer.
SHUTDOWN_SEND_S = 1.0


class WorkerDiedError(RuntimeError):
    pass


def rendezvous_socket() -> socket.socket:
    """The TP ranks' rendezvous (torch.distributed's TCP store): a loopback port bound and
    listening from now on, which rank 0's store serves on (``master_listen_fd``). Held from
    the pick on: a port picked, closed and bound again by rank 0 once it has imported torch
    could meanwhile go to another process (EADDRINUSE: the node did not start), or to
    another node's store (whose rendezvous rank 1 would join)."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        s.listen(128)
    except BaseException:
        s.close()
        raise
    return s


def _is_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, SIGTSTP; or traced): Linux's ``/proc``, else
    False."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


class MultiprocExecutor:
    """Starts the workers in two phases: each loads its shard and reports how many KV bytes
    it can hold (``None`` on CPU); ``decide_num_blocks`` turns those reports into the
    number of blocks every rank allocates; then each worker reports ready."""

    def __init__(
        self,
        config: EngineConfig,
        decide_num_blocks: Callable[[list[int | None]], int],
        log_level: str = "INFO",
    ) -> None:
        self.world_size = config.parallel.tp
        self.step_timeout = config.parallel.step_timeout
        self.aggregator = KVOutputAggregator(self.world_size)
        self.dead_reason: str | None = None
        self._shutting_down = False
        self._woken = False
        self._on_wake: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._pending: list[collections.deque[Future[WorkerOutput]]] = [
            collections.deque() for _ in range(self.world_size)
        ]
        ctx = worker_context()
        env = dict(os.environ)
        self._rendezvous: socket.socket | None = (
            rendezvous_socket() if self.world_size > 1 else None
        )
        port = self._rendezvous.getsockname()[1] if self._rendezvous is not None else 0
        self.procs: list[mp.process.BaseProcess] = []
        self._task: list[Connection] = []
        self._result: list[Connection] = []
        # One deadline for the whole start (every rank's process start and two reports,
        # the decision between).
        self._startup_timeout = STARTUP_TIMEOUT_S
        deadline = time.monotonic() + self._startup_timeout
        try:
            for rank in range(self.world_size):
                rendezvous = (port, self._rendezvous if rank == 0 else None)
                head = (env, rank, self.world_size, config, rendezvous)
                self._start_rank(ctx, head, log_level, deadline)
        except BaseException:
            self.shutdown()
            raise
        try:
            kv_bytes = self._wait_for_all("loaded", deadline)
            self.num_blocks = decide_num_blocks(kv_bytes)
            for conn in self._task:
                conn.send(self.num_blocks)
            self.worker_infos = self._wait_for_all("ready", deadline)
        except BaseException:
            self.shutdown()
            raise
        self._close_rendezvous()  # rank 0's store serves on its own copy of the socket
        # From here on every message to a worker has a deadline (``pipe_send``); one lock per
        # pipe keeps a message whole (the shutdown does not write into a step's message).
        for conn in self._task:
            set_nonblocking(conn)
        self._send_locks = [threading.Lock() for _ in range(self.world_size)]
        self._cut: set[int] = set()  # ranks whose pipe holds a message given up half-way
        self._threads = [
            threading.Thread(target=self._reader, args=(r,), daemon=True, name=f"tp{r}-reader")
            for r in range(self.world_size)
        ]
        self._threads.append(threading.Thread(target=self._monitor, daemon=True, name="monitor"))
        for t in self._threads:
            t.start()

    def _start_rank(
        self, ctx: BaseContext, head: tuple[Any, ...], log_level: str, deadline: float
    ) -> None:
        """Start a rank's process by ``deadline`` (``head``: ``worker_entry``'s arguments
        before its pipes, the rank second). Past it, what holds the start is ended
        (``_abandon_start``) and the start fails naming the rank."""
        rank = head[1]
        task_r, task_w = ctx.Pipe(duplex=False)
        res_r, res_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=worker_entry,
            args=(*head, task_r, res_w, log_level),
            name=f"pdserve-tp{rank}",
            daemon=True,
        )
        try:
            start_within(proc, deadline - time.monotonic())
        except StartTimeout as e:
            why = self._abandon_start(ctx, e.thread)
            for conn in (task_r, task_w, res_r, res_w):
                conn.close()
            raise RuntimeError(
                f"TP worker {rank} did not start within {self._startup_timeout:.0f}s "
                f"(its process start was held: {why})"
            ) from None
        except BaseException:
            for conn in (task_r, task_w, res_r, res_w):
                conn.close()
            raise
        task_r.close()
        res_w.close()
        self.procs.append(proc)
        self._task.append(task_w)
        self._result.append(res_r)

    def _abandon_start(self, ctx: BaseContext, thread: threading.Thread) -> str:
        """A process start is past the deadline: kill the ranks started (they wait in the
        rendezvous for this one) and, from the fork server, the server (the held start
        reads its end and fails, so its thread ends; the next start gets a fresh server).
        A spawned child still being written to is not known by pid: it is left, with its
        thread. Returns what was done, for the error."""
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.kill()
        why = "a spawned child did not read its start-up data; left running"
        if ctx.get_start_method() == "forkserver":
            pid = stop_fork_server()
            why = f"the fork server (pid {pid}) did not fork it; killed"
        thread.join(SHUTDOWN_GRACE_S)
        if thread.is_alive():
            logger.error("the held start of a TP worker still runs in %s; leaving it", thread.name)
        return why

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def _wait_for_all(self, expected: str, deadline: float) -> list[Any]:
        """Every rank's start-up report ``expected``, by ``deadline``. Any rank's death ends
        the wait (naming that rank): at TP > 1 the others wait in the rendezvous or a
        collective for a dead one."""
        got: dict[int, Any] = {}
        conns = {conn: rank for rank, conn in enumerate(self._result)}
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs)}
        while len(got) < self.world_size:
            waiting = [conn for conn, rank in conns.items() if rank not in got]
            left = deadline - time.monotonic()
            # Past the deadline nothing is waited for, not even a report that raced in
            # (``wait`` with no time left still returned one: the start's outcome was
            # the race's).
            ready = wait([*waiting, *sentinels], timeout=left) if left > 0 else []
            if not ready:
                raise self._not_ready([r for r in range(self.world_size) if r not in got])
            for obj in ready:
                if obj in sentinels:  # its error report, if it sent one, is read there
                    raise self._died_at_startup(*sentinels[obj])
            for obj in ready:
                rank = conns[obj]
                got[rank] = self._report(rank, expected)
        return [got[rank] for rank in range(self.world_size)]

    def _report(self, rank: int, expected: str) -> Any:
        """``rank``'s report, ready to read: its payload if it is ``expected``."""
        try:
            kind, payload = self._result[rank].recv()
        except EOFError:  # it is exiting: its exit code
            raise self._died_at_startup(rank, self.procs[rank], join_s=1.0) from None
        if kind == expected:
            return payload
        if kind == "config_error":  # e.g. --device cuda where no GPU is visible
            raise ConfigError(f"TP worker {rank}: {payload}")
        raise RuntimeError(f"TP worker {rank} failed to start:\n{payload}")

    def _not_ready(self, ranks: list[int]) -> RuntimeError:
        """The start's deadline passed with ``ranks`` not reported. A stopped one (SIGSTOP)
        is named: the others may only be waiting for it in the rendezvous or a collective."""
        after = f"not ready after {self._startup_timeout:.0f}s"
        for rank in ranks:
            pid = self.procs[rank].pid
            if pid is not None and _is_stopped(pid):
                return RuntimeError(f"TP worker {rank} (pid {pid}) {after}: its process is stopped")
        if len(ranks) == 1:
            return RuntimeError(f"TP worker {ranks[0]} {after}")
        return RuntimeError(f"TP workers {', '.join(map(str, ranks))} {after}")

    def _died_at_startup(
        self, rank: int, proc: mp.process.BaseProcess, join_s: float = 0.1
    ) -> Exception:
        """The error of a rank that ended during start-up: its own report if it sent one
        (a failed load's traceback), else its exit code."""
        proc.join(join_s)
        conn = self._result[rank]
        with contextlib.suppress(EOFError, OSError):
            while conn.poll():  # its earlier reports, then its error if any (EOF ends it)
                kind, payload = conn.recv()
                if kind == "config_error":
                    return ConfigError(f"TP worker {rank}: {payload}")
                if kind == "error":
                    return RuntimeError(f"TP worker {rank} failed to start:\n{payload}")
        return RuntimeError(f"TP worker {rank} died during startup (exit {proc.exitcode})")

    # -- steps -----------------------------------------------------------------------------
    def execute_model(
        self, sched: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        payload = pickle.dumps(sched)
        md = sched.kv_connector_metadata
        if md is not None and (ended := md.ended_transfer_keys()):
            self.aggregator.forget(ended)  # transfers that ended: no count outlives them
        futures: list[Future[WorkerOutput]] = []
        with self._lock:
            if self.dead_reason is not None:
                raise WorkerDiedError(self.dead_reason)
            for rank in range(self.world_size):
                fut: Future[WorkerOutput] = Future()
                self._pending[rank].append(fut)
                futures.append(fut)
        self._send_all(payload)
        result = self.aggregator.async_aggregate(futures)
        if non_block:
            return result
        return self.wait(result)

    def sample_tokens(self, deferred: DeferredSampling) -> None:
        """The masks and bans of a step sent with ``sampling_deferred``: rank 0 (the one
        that samples) waits for them after the step's forward."""
        if self.dead_reason is not None:
            return  # the step fails with the executor
        self._send(0, pickle.dumps(deferred), time.monotonic() + self.step_timeout)

    def _send_all(self, payload: bytes) -> None:
        """A step to every rank, all of it within ``--step-timeout``."""
        deadline = time.monotonic() + self.step_timeout
        for rank in range(self.world_size):
            if not self._send(rank, payload, deadline):
                return

    def _send(self, rank: int, payload: bytes, deadline: float) -> bool:
        """One message to ``rank`` by ``deadline``; past it (the worker does not read: a
        stopped process, a hung device call) or with the pipe gone, the executor is dead."""
        try:
            with self._send_locks[rank]:
                if rank in self._cut or self._shutting_down:
                    return False
                if send_within(self._task[rank], payload, deadline - time.monotonic()):
                    return True
                self._cut.add(rank)
        except OSError as e:
            self._mark_dead(f"lost the pipe to TP worker {rank}: {e}")
            return False
        self._mark_dead(
            f"TP worker {rank} did not take a step within {self.step_timeout:.0f}s "
            "(its task pipe stayed full)"
        )
        return False

    def wait(self, result: Future[ModelRunnerOutput]) -> ModelRunnerOutput:
        """A step's aggregated result; the executor is dead past ``--step-timeout``."""
        try:
            return result.result(timeout=self.step_timeout)
        except FutureTimeoutError:
            self._mark_dead(f"a TP worker did not finish a step within {self.step_timeout:.0f}s")
            raise WorkerDiedError(self.dead_reason) from None

    def set_wake_callback(self, wake: Callable[[], None]) -> None:
        """Called (on a reader thread) when a worker says a transfer completed between
        steps; the engine loop then steps at once."""
        self._on_wake = wake

    def take_wake(self) -> bool:
        """True once after any worker sent a wake since the last call."""
        woken, self._woken = self._woken, False
        return woken

    def _reader(self, rank: int) -> None:
        conn = self._result[rank]
        while True:
            try:
                raw = conn.recv_bytes()
                if raw == WAKE:
                    self._woken = True
                    if self._on_wake is not None:
                        self._on_wake()
                    continue
                out = pickle.loads(raw)
            except (EOFError, OSError):
                if not self._shutting_down:
                    self._mark_dead(f"TP worker {rank} closed its pipe")
                return
            except Exception as e:  # an unreadable result: never leave steps waiting
                logger.exception("TP worker %d sent an unreadable result", rank)
                self._mark_dead(f"TP worker {rank} sent an unreadable result: {e!r}")
                return
            with self._lock:
                fut = self._pending[rank].popleft() if self._pending[rank] else None
            if fut is None or fut.done():
                continue
            if isinstance(out, WorkerError):
                fut.set_exception(out)
            else:
                fut.set_result(out)

    def _monitor(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs)}
        ready = wait(list(sentinels))
        if self._shutting_down:
            return
        rank, proc = sentinels[ready[0]]
        proc.join(0.1)
        self._mark_dead(f"TP worker {rank} (pid {proc.pid}) died with exit code {proc.exitcode}")

    def _mark_dead(self, reason: str) -> None:
        with self._lock:
            if self.dead_reason is None:
                self.dead_reason = reason
                logger.error("executor dead: %s", reason)
            pending = [f for q in self._pending for f in q]
            for q in self._pending:
                q.clear()
        for f in pending:
            if not f.done():
                f.set_exception(WorkerDiedError(reason))

    def _send_shutdown(self, rank: int, conn: Connection) -> None:
        """Ask a worker to exit; not waited for long: one that does not read (stopped, its
        pipe full, or holding a message cut half-way) is killed after the grace."""
        locks = getattr(self, "_send_locks", None)
        with contextlib.suppress(OSError):
            if locks is None:  # still starting: the pipe is blocking, and empty
                conn.send_bytes(b"shutdown")
            elif locks[rank].acquire(timeout=SHUTDOWN_SEND_S):
                try:
                    if rank not in self._cut:
                        send_within(conn, b"shutdown", SHUTDOWN_SEND_S)
                finally:
                    locks[rank].release()

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def _close_rendezvous(self) -> None:
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None

    def shutdown(self) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        self._close_rendezvous()
        for rank, conn in enumerate(self._task):
            self._send_shutdown(rank, conn)
        for rank, proc in enumerate(self.procs):
            proc.join(SHUTDOWN_GRACE_S)
            if proc.is_alive():  # workers ignore SIGTERM (see worker_proc.worker_main): SIGKILL
                proc.kill()
                proc.join(SHUTDOWN_GRACE_S)  # not for good: SIGKILL waits out a D-state sleep
                if proc.is_alive():
                    logger.error(
                        "TP worker %d (pid %s) did not exit %.0fs after SIGKILL (in an "
                        "uninterruptible call: a hung device or file system?); leaving it",
                        rank, proc.pid, SHUTDOWN_GRACE_S,
                    )  # fmt: skip
        for conn in self._task + self._result:
            conn.close()
        if self.dead_reason is None:
            self.dead_reason = "executor shut down"
        self._mark_dead(self.dead_reason)
