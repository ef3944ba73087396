"""In-process executor (vLLM's ``uni`` backend): the one TP rank runs in this process.

TP=1 only. The worker is built and stepped in the calling process, so there is no worker
process, no fork server and no pickling or pipe per step: the offline ``LLM`` (and
``pd-bench offline``) starts without importing torch a second time, and a step costs
what the model runner costs. The engine sees the same interface as ``MultiprocExecutor``:
``execute_model`` (blocking, or a future with ``non_block``), ``wait``, the wake-ups,
``pids``, ``is_dead``, ``shutdown``; outputs go through the same ``KVOutputAggregator``, so
the all-ranks rule is the same code at world size 1.

What differs from a worker process:
- **Async scheduling**: ``execute_model(non_block=True)`` launches the step and returns a
  future that ``wait`` resolves (the sampled ids are read back then, after the next step
  was launched), as a worker holding an output does.
- **Masks and bans made after the forward started** (a step sent with
  ``sampling_deferred``): the step runs on a thread of its own (one, kept), which waits
  for ``sample_tokens`` before it samples, while the engine updates the step before and
  makes them; the next ``execute_model`` (or ``wait`` for that step) joins it.
- **Transfers between steps**: a watcher thread takes the worker loop's part -- while the
  connector is watching a transfer it calls ``progress`` every ``WATCH_INTERVAL_S`` and
  wakes the engine once when one completed. A lock keeps it and the steps apart (the
  connector is driven by one thread at a time, as in a worker process).
- **A failed step** fails that step with ``WorkerError`` (as a worker's does); there is
  no process to die, so nothing else marks the executor dead until ``shutdown``. A step
  sent with ``sampling_deferred`` that the engine then cancels (the step before failed:
  its masks will not come) or that shutdown ends fails too, logged in one line: its
  traceback would only show the wait it was in (the failed step's own is logged).
- The process's torch intra-op threads are set to ``--worker-threads`` on CPU, and
  ``cuda:0`` (of the visible GPUs) is made the current device on CUDA.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.config import ConfigError, EngineConfig
from engine.core.scheduler_output import (
    DeferredSampling,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerOutput,
)
from engine.executor.aggregator import KVOutputAggregator
from engine.executor.multiproc import WorkerDiedError
from engine.worker.pipe import StepCancelled, WorkerError, deferred_for

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.0005  # as a worker process polls its transfers between steps


class UniProcExecutor:
    """One rank, in this process (``--distributed-executor-backend uni``)."""

    def __init__(
        self,
        config: EngineConfig,
        decide_num_blocks: Callable[[list[int | None]], int],
        log_level: str = "INFO",  # the process's own logging applies; kept for the interface
        worker: Any = None,  # tests: a ready-made worker (``Worker``'s interface)
    ) -> None:
        if config.parallel.tp != 1:
            raise ValueError(
                f"--distributed-executor-backend uni runs one rank in this process; "
                f"--tp {config.parallel.tp} needs mp"
            )
        self.world_size = 1
        self.step_timeout = config.parallel.step_timeout
        self._threads = config.parallel.worker_threads if config.parallel.device == "cpu" else 0
        self.aggregator = KVOutputAggregator(1)
        self.dead_reason: str | None = None
        self._on_wake: Callable[[], None] | None = None
        self._woken = False
        # Held while the worker (its connector included) runs a step or a progress call.
        self._step_lock = threading.Lock()
        # Async scheduling: the futures of launched steps whose outputs wait for ``wait``.
        self._deferred: dict[Future[ModelRunnerOutput], tuple[WorkerOutput, float]] = {}
        self._last_done = 0.0  # when the last step's output was aggregated (``_finish``)
        # A step waiting for its masks on the step thread: their queue, the
        # thread's task and the step's future.
        self._split: tuple[queue.SimpleQueue, Future[None], Future[ModelRunnerOutput]] | None
        self._split = None
        self._step_thread: ThreadPoolExecutor | None = None
        self.worker = worker if worker is not None else self._build_worker(config)
        try:
            self.num_blocks = decide_num_blocks([self.worker.profile_kv_bytes()])
            self.worker.init_kv_cache(self.num_blocks)
            self.worker_infos = [self.worker.handshake_info()]
        except BaseException:  # as a worker process would exit: its connector's too
            try:
                self.worker.shutdown()
            finally:
                self._release()
            raise
        self._stop = threading.Event()
        self._stepped = threading.Event()  # a step ended: the connector may be watching
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="tp0-watch")
        self._watcher.start()

    @staticmethod
    def _build_worker(config: EngineConfig) -> Any:
        import torch

        from engine.model.parallel import init_tp
        from engine.worker.worker import Worker

        device = "cpu"
        if config.parallel.device == "cuda":
            if not torch.cuda.is_available():  # as a worker process's placement says it
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
                raise ConfigError(
                    f"--device cuda: torch {torch.__version__} sees no CUDA GPU "
                    f"(CUDA_VISIBLE_DEVICES={visible})"
                )
            device = "cuda:0"
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(config.parallel.worker_threads)
        init_tp(0, 1)
        return Worker(config, 0, 1, device)

    @property
    def pids(self) -> list[int]:
        return []  # no worker process: the rank is this process

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    # -- steps -----------------------------------------------------------------------------
    def execute_model(
        self, sched: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if self.dead_reason is not None:
            raise WorkerDiedError(self.dead_reason)
        self._join_split()  # the step before, waiting for its mask: sampled by now
        md = sched.kv_connector_metadata
        if md is not None and (ended := md.ended_transfer_keys()):
            self.aggregator.forget(ended)  # transfers that ended: no count outlives them
        t0 = time.perf_counter()
        fut: Future[ModelRunnerOutput] = Future()
        if sched.sampling_deferred:  # async scheduling only: ``wait`` comes after the mask
            assert non_block, "a step whose masks come later cannot block"
            masks: queue.SimpleQueue = queue.SimpleQueue()
            if self._step_thread is None:
                self._step_thread = ThreadPoolExecutor(
                    1, "tp0-step", initializer=self._init_step_thread
                )
            source = functools.partial(self._take_deferred, masks)
            task = self._step_thread.submit(self._run, sched, fut, t0, True, source)
            self._split = (masks, task, fut)
            return fut
        self._run(sched, fut, t0, non_block)
        return fut if non_block else self.wait(fut)

    def _run(
        self,
        sched: SchedulerOutput,
        fut: Future[ModelRunnerOutput],
        t0: float,
        non_block: bool,
        deferred_source: Callable[[int], Any] | None = None,
    ) -> None:
        """The step, through the worker; on the step thread (``deferred_source``) the output
        is finished by ``wait``, on the engine's thread."""
        try:
            with self._step_lock:
                if deferred_source is None:
                    out = self.worker.execute_model(sched)  # launched (CUDA), or done
                else:
                    out = self.worker.execute_model(sched, deferred_source)
        except StepCancelled as e:  # the step before failed (its traceback was logged)
            logger.warning("cancelled %s", e)
            fut.set_exception(WorkerError(0, f"cancelled {e}"))
        except Exception:
            logger.exception("step %s failed", sched.step_id)
            fut.set_exception(WorkerError(0, traceback.format_exc()))
        else:
            if non_block and (out.pending_sampled is not None or deferred_source is not None):
                self._deferred[fut] = (out, t0)  # read back in ``wait``
            else:
                self._finish(fut, out, t0)
        self._stepped.set()

    def _init_step_thread(self) -> None:
        """The step thread computes as the engine's thread does (same device, threads)."""
        import torch

        if self._threads:
            torch.set_num_threads(self._threads)
        elif torch.cuda.is_initialized():
            torch.cuda.set_device("cuda:0")

    def _take_deferred(self, masks: queue.SimpleQueue, step_id: int) -> DeferredSampling:
        """On the step thread: what ``sample_tokens`` sends (a deadline: the step's)."""
        try:
            got = masks.get(timeout=self.step_timeout)
        except queue.Empty:
            raise RuntimeError(
                f"step {step_id}: no sampling masks within {self.step_timeout:.0f}s"
            ) from None
        if got is None:
            raise StepCancelled(f"step {step_id}: shut down before its sampling masks came")
        return deferred_for(got, step_id)

    def sample_tokens(self, deferred: DeferredSampling) -> None:
        """The masks and bans of a step sent with ``sampling_deferred``: the step thread
        samples with them."""
        if self._split is not None:
            self._split[0].put(deferred)

    def _join_split(self, result: Future[ModelRunnerOutput] | None = None) -> None:
        """Wait for the step thread's step (only when it is ``result``'s, if given)."""
        split = self._split
        if split is None or (result is not None and split[2] is not result):
            return
        self._split = None
        split[1].result()  # ``_run`` puts a step's error on the step's future

    def _finish(self, fut: Future[ModelRunnerOutput], out: WorkerOutput, t0: float) -> None:
        """The step's sampled ids read back (a late device error fails the step, as a
        worker process sends it), then aggregated like any rank's output."""
        try:
            out.resolve_sampled()
        except Exception:
            logger.exception("reading back the sampled ids of a step failed")
            fut.set_exception(WorkerError(0, traceback.format_exc()))
            return
        # From when the rank could start the step -- launched, and the step before it done
        # (async scheduling launches a step behind the one still on the device) -- as
        # the engine counts the step's round trip, which holds it.
        out.busy_s = time.perf_counter() - max(t0, self._last_done)
        result = self.aggregator.aggregate([out])
        self._last_done = result.done_at
        fut.set_result(result)

    def wait(self, result: Future[ModelRunnerOutput]) -> ModelRunnerOutput:
        self._join_split(result)
        held = self._deferred.pop(result, None)
        if held is not None:
            self._finish(result, *held)
        return result.result()

    # -- between steps ---------------------------------------------------------------------
    def set_wake_callback(self, wake: Callable[[], None]) -> None:
        """Called (on the watcher thread) when a transfer completed between steps."""
        self._on_wake = wake

    def take_wake(self) -> bool:
        """True once after the watcher saw a completion since the last call."""
        woken, self._woken = self._woken, False
        return woken

    def _watch(self) -> None:
        """While the connector watches a transfer: ``progress`` every WATCH_INTERVAL_S, one
        wake per completion until the next step reports it (the worker loop's rule)."""
        connector = self.worker.connector
        try:
            while not self._stop.is_set():
                self._stepped.wait()
                self._stepped.clear()
                while not self._stop.is_set() and not self._stepped.is_set():
                    with self._step_lock:
                        if not connector.watching():
                            break
                        progressed = connector.progress()
                    if progressed:
                        self._wake()
                        break  # the step that reports it sets _stepped again
                    time.sleep(WATCH_INTERVAL_S)
        except Exception as e:  # as a worker process whose loop raised: the executor is dead
            logger.exception("tp0: advancing transfers between steps failed")
            self.dead_reason = f"advancing transfers between steps failed: {e!r}"
            self._wake()  # the engine's next step meets the error

    def _wake(self) -> None:
        self._woken = True
        if self._on_wake is not None:
            self._on_wake()

    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._stepped.set()
        self._watcher.join(timeout=5)
        if self._split is not None:
            self._split[0].put(None)  # its step ends with an error
            self._join_split()
        if self._step_thread is not None:
            self._step_thread.shutdown()
        for fut in list(self._deferred):
            fut.cancel()
        self._deferred.clear()
        try:
            with self._step_lock:
                self.worker.shutdown()
        finally:
            if self.dead_reason is None:
                self.dead_reason = "executor shut down"
            self._release()

    def _release(self) -> None:
        """Drop the rank's model, KV cache and buffers now: a worker process's exit would
        have freed them, and whoever held this engine may still hold it (and run something
        else on the same GPU next)."""
        self.worker = None
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # back to the device, for other processes too
