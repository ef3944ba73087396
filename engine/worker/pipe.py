"""What the engine process and its TP workers share over their pipes, free of torch.

The engine process (scheduler, HTTP server) never imports torch: its workers do. So the
pipe's vocabulary (``WAKE``, ``WorkerError``) and the process entry point live here, and
``worker_entry`` imports the worker (and torch) in the child only: the engine process
starts faster (torch's import is seconds on a slow host) and stays smaller.

How workers start (``worker_context``; ``PDSERVE_WORKER_MULTIPROC_METHOD``, as vLLM's
``VLLM_WORKER_MULTIPROC_METHOD``): by default from multiprocessing's fork server, a
process started once per engine process that imports torch once; every worker is forked
from it, so a TP=n node imports torch once instead of n times (and a process starting many
engines -- a test run -- once in all). It never runs CUDA, so no CUDA state is forked.
``spawn`` starts each worker afresh. Either way a worker runs with the environment its
executor had when it started it, and is named ``pdserve-tp<rank>`` (``ps -o comm``).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

from engine.core.scheduler_output import DeferredSampling

MULTIPROC_METHOD_ENV = "PDSERVE_WORKER_MULTIPROC_METHOD"
WORKER_NAME_PREFIX = "pdserve-tp"

# Sent by a worker on its result pipe when a transfer completed between steps: the engine
# runs the step that reports it at once (see ``engine.worker.worker_proc``).
WAKE = b"wake"


def deferred_for(got: object, step_id: int) -> DeferredSampling:
    """What step ``step_id`` (sent with ``sampling_deferred``) waited for, checked: its own
    ``DeferredSampling`` (anything else -- another step's -- raises), not a ``failed``
    one (the step before failed: this one fails with it). Workers and the in-process
    executor take the step's masks through it."""
    if not isinstance(got, DeferredSampling):
        raise RuntimeError(f"step {step_id} waited for its sampling masks, got {got!r:.200}")
    if got.step_id != step_id:
        raise RuntimeError(
            f"step {step_id} waited for its sampling masks, got step {got.step_id}'s"
        )
    if got.failed is not None:
        raise StepCancelled(f"step {step_id}: {got.failed}")
    return got


class StepCancelled(RuntimeError):
    """A step sent with ``sampling_deferred`` ends without sampling: its masks will not
    come (the step before failed, or the executor is shutting down). It fails, but it is
    another failure's consequence, not a fault of its own (no traceback worth logging)."""


class WorkerError(Exception):
    """A worker failed a step; carries the rank and the worker's traceback."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"worker rank {rank}: {message}")
        self.rank = rank
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[int, str]]:  # pickled through the result pipe
        return (WorkerError, (self.rank, self.message))


def worker_context() -> BaseContext:
    """The multiprocessing context TP workers start from (see the module docstring)."""
    method = os.environ.get(MULTIPROC_METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{MULTIPROC_METHOD_ENV} must be 'forkserver' or 'spawn', got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        # torch alone (and the server's signal setup): a module that reads the
        # environment when imported (triton's TRITON_INTERPRET, the engine's own) is
        # imported in the worker, after the environment below is in place.
        ctx.set_forkserver_preload(["engine.worker.fork_server", "torch"])
    return ctx


def stop_fork_server() -> int | None:
    """End this process's fork server, if it started one, at once (SIGKILL: it ignores
    SIGTERM, ``engine.worker.fork_server``): its own exit, the interpreter tearing torch
    down, takes a second of CPU that nothing waits for. Only when no worker is left (they
    are its children). Returns its pid, if there was one."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # CPython's
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return pid


def _set_process_name(name: str) -> None:
    """``/proc/self/comm`` (what ``ps -o comm`` and ``top`` show; Linux, 15 bytes)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def take_environment(env: dict[str, str]) -> None:
    """A child's first act: take ``env`` (its starter's environment when it started the
    child: one forked from the fork server would otherwise keep the server's, from when
    that started)."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)


def run_in_environment(env: dict[str, str], target: Callable[..., Any], *args: Any) -> None:
    """A child process's target: ``take_environment(env)``, then ``target(*args)`` (the
    benchmark's rank processes, the tests' children: forked from ``worker_context()``)."""
    take_environment(env)
    target(*args)


def enter_worker(env: dict[str, str], rank: int) -> None:
    """A worker's first act: ``take_environment(env)`` and its name."""
    take_environment(env)
    _set_process_name(f"{WORKER_NAME_PREFIX}{rank}")


def worker_entry(env: dict[str, str], *args: Any) -> None:
    """A TP worker process's target: ``engine.worker.worker_proc.worker_main(*args)``
    (``args[0]``: the rank), after ``enter_worker``."""
    enter_worker(env, args[0])
    from engine.worker.worker_proc import worker_main

    worker_main(*args)
