"""``--distributed-executor-backend uni``: the TP-1 rank in the engine's own process."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from engine.config import CacheConfig, ConfigError, EngineConfig, ParallelConfig, SchedulerConfig
from engine.core.scheduler_output import DeferredSampling, SchedulerOutput, WorkerOutput
from engine.executor.uniproc import UniProcExecutor
from engine.sampling_params import SamplingParams
from engine.worker.pipe import WorkerError


class _Connector:
    """Watches a transfer after each step; it completes at the ``complete_after``-th
    ``progress`` call and stays watched (reported by the next step, as a real connector's
    completion is); records whether a progress call ever overlapped a step."""

    def __init__(self, worker: _Worker, complete_after: int) -> None:
        self.worker = worker
        self.complete_after = complete_after
        self.calls = 0
        self.overlapped = False
        self.watching_now = False

    def watching(self) -> bool:
        return self.watching_now

    def progress(self) -> bool:
        self.overlapped = self.overlapped or self.worker.in_step
        self.calls += 1
        return self.calls >= self.complete_after


class _Worker:
    """``Worker``'s interface: each step takes a while and leaves a transfer watched."""

    def __init__(self, complete_after: int = 5, fail_step: int | None = None) -> None:
        self.in_step = False
        self.steps = 0
        self.fail_step = fail_step
        self.connector = _Connector(self, complete_after)
        self.shut = False

    def profile_kv_bytes(self) -> None:
        return None

    def init_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def handshake_info(self) -> dict[str, Any]:
        return {"rank": 0}

    def execute_model(self, sched: SchedulerOutput) -> WorkerOutput:
        self.in_step = True
        try:
            time.sleep(0.02)
            self.steps += 1
            if self.steps == self.fail_step:
                raise IndexError("a step that fails")
            self.connector.calls = 0
            self.connector.watching_now = True
            return WorkerOutput(rank=0, finished_recving={f"t{self.steps}"})
        finally:
            self.in_step = False

    def shutdown(self) -> None:
        self.shut = True


def _executor(worker: _Worker) -> UniProcExecutor:
    return UniProcExecutor(EngineConfig(), lambda kv_bytes: 64, worker=worker)


def _wait(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_a_transfer_completing_between_steps_wakes_the_engine_once_per_step():
    worker = _Worker(complete_after=5)
    ex = _executor(worker)
    wakes = threading.Semaphore(0)
    ex.set_wake_callback(wakes.release)
    try:
        assert ex.num_blocks == 64 and worker.num_blocks == 64
        for step in (1, 2):
            out = ex.execute_model(SchedulerOutput(step_id=step))
            # The all-ranks rule at world size 1: this rank's report is the step's.
            assert out.finished_recving == {f"t{step}"}
            assert wakes.acquire(timeout=10), "no wake for a completion between steps"
            assert ex.take_wake() and not ex.take_wake()  # once
            assert worker.connector.calls == 5
            time.sleep(0.05)  # no second wake before the next step reports the first
            assert not wakes.acquire(timeout=0) and not ex.take_wake()
        assert not worker.connector.overlapped  # never during a step
    finally:
        ex.shutdown()
    assert worker.shut and ex.is_dead and ex.pids == []


def test_progress_never_runs_inside_a_step():
    """Steps back to back while the watcher polls: the lock keeps them apart."""
    worker = _Worker(complete_after=10**9)  # always watching, never completing
    ex = _executor(worker)
    try:
        for step in range(1, 16):
            ex.execute_model(SchedulerOutput(step_id=step))
        _wait(lambda: worker.connector.calls > 3)
        assert not worker.connector.overlapped
    finally:
        ex.shutdown()


def test_a_failed_step_fails_with_the_worker_error_and_the_next_step_runs():
    worker = _Worker(fail_step=2)
    ex = _executor(worker)
    try:
        ex.execute_model(SchedulerOutput(step_id=1))
        with pytest.raises(WorkerError, match="IndexError"):
            ex.execute_model(SchedulerOutput(step_id=2))
        fut = ex.execute_model(SchedulerOutput(step_id=3), non_block=True)
        assert ex.wait(fut).finished_recving == {"t3"}
    finally:
        ex.shutdown()


def test_a_watcher_whose_progress_raises_marks_the_executor_dead():
    worker = _Worker()

    def broken() -> bool:
        raise OSError("the agent went away")

    worker.connector.progress = broken  # type: ignore[method-assign]
    ex = _executor(worker)
    try:
        ex.execute_model(SchedulerOutput(step_id=1))
        _wait(lambda: ex.is_dead)
        assert "the agent went away" in str(ex.dead_reason)
        assert ex.take_wake()  # the engine steps, and meets the error
        from engine.executor.multiproc import WorkerDiedError

        with pytest.raises(WorkerDiedError):
            ex.execute_model(SchedulerOutput(step_id=2))
    finally:
        ex.shutdown()


def test_uni_with_more_than_one_rank_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--distributed-executor-backend: uni .* --tp 2"):
        ParallelConfig(tp=2, distributed_executor_backend="uni")


def test_the_offline_llm_runs_its_one_rank_in_process_with_mp_tokens():
    """The offline default at TP 1 is ``uni`` (vLLM's): no worker process, and the tokens
    (greedy, seeded) of the worker-process executor."""
    from engine.llm import LLM

    prompts = [[5, 6, 7] * n for n in (1, 6, 30)]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=9, temperature=0.9, seed=3),
        SamplingParams(max_tokens=7, temperature=0.7, seed=11, top_k=20),
    ]

    def run(backend: str) -> tuple[str, list[int], list[list[int]]]:
        cfg = EngineConfig(
            cache=CacheConfig(num_blocks=64),
            parallel=ParallelConfig(distributed_executor_backend=backend),  # type: ignore[arg-type]
        )
        with LLM(cfg) as llm:
            return (
                type(llm.core.executor).__name__,
                llm.core.executor.pids,
                llm.generate_token_ids(prompts, params),
            )

    kind, pids, tokens = run("auto")
    assert (kind, pids) == ("UniProcExecutor", [])
    mp_kind, mp_pids, mp_tokens = run("mp")
    assert mp_kind == "MultiprocExecutor" and len(mp_pids) == 1
    assert tokens == mp_tokens


@pytest.mark.slow
def test_a_pd_pair_with_in_process_ranks_answers_as_colocated(procs):
    """P and D nodes with ``--distributed-executor-backend uni`` (the rank in each node's
    process, no worker process), through the proxy: the colocated node's answers, D
    computes no prompt token, nothing left held."""
    import httpx
    from harness import wait_for, worker_pids

    pair = procs.pd(1, 1, "--num-blocks", "256", "--distributed-executor-backend", "uni")
    ref = procs.node("--num-blocks", "256", name="colocated")
    proxy = procs.proxy([pair.p.url], [pair.d.url])
    assert worker_pids(pair.p.proc.pid) == [] and worker_pids(pair.d.proc.pid) == []
    assert len(worker_pids(ref.proc.pid)) == 1
    bodies = [
        {"prompt": [7 + i] * (1 + 37 * i), "max_tokens": 8 + i, "temperature": t, "seed": i}
        for i in range(6)
        for t in (0.0, 0.9)
    ]
    before = pair.d.metric("pdserve_prompt_tokens_total")

    def texts(url: str) -> list[tuple[str, str]]:
        out = []
        for body in bodies:
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            out.append((choice["text"], choice["finish_reason"]))
        return out

    assert texts(proxy.url) == texts(ref.url)
    assert pair.d.metric("pdserve_prompt_tokens_total") == before
    for node in pair.nodes:
        wait_for(lambda n=node: n.metric("pdserve_kv_blocks_used") == 0, 30, f"{node.name} idle")


@pytest.mark.slow
def test_a_uni_node_under_concurrent_streams_and_drops_answers_as_an_mp_node(procs):
    """The rank's forward in the HTTP server's process (it holds the GIL against the
    server): 24 concurrent streamed requests (greedy and seeded) with 6 others dropped by
    their clients mid-stream, while ``/health`` and ``/metrics`` are polled. Every kept
    request streams the mp node's text, the server answers its polls throughout, and the
    node ends with every block free."""
    import asyncio
    import json

    import httpx
    from harness import kv_pool_full, wait_for, wait_healthy, worker_pids

    uni = procs.node("--num-blocks", "192", "--distributed-executor-backend", "uni", name="uni")
    ref = procs.node("--num-blocks", "192", name="mp", wait=False)
    wait_healthy(ref)
    assert worker_pids(uni.proc.pid) == [] and len(worker_pids(ref.proc.pid)) == 1
    bodies = [
        {
            "prompt": [3 + i % 200] * (1 + 23 * i % 150),
            "max_tokens": 12 + i % 9,
            "temperature": 0.0 if i % 2 else 0.8,
            "seed": i,
            "stream": True,
        }
        for i in range(24)
    ]

    async def run(url: str) -> tuple[list[str], list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:

            async def streamed(body: dict[str, Any]) -> str:
                text = []
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            text.append(json.loads(line[6:])["choices"][0]["text"])
                return "".join(text)

            async def dropped(i: int) -> None:
                body = {"prompt": [9 + i] * 60, "max_tokens": 300, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    seen = 0
                    async for line in resp.aiter_lines():
                        seen += line.startswith("data:")
                        if seen > 2 + i:
                            return  # the client goes away mid-stream

            polls: list[int] = []
            done = asyncio.Event()

            async def poll() -> None:
                while not done.is_set():
                    for path in ("/health", "/metrics"):
                        polls.append((await client.get(path, timeout=10)).status_code)
                    await asyncio.sleep(0.05)

            poller = asyncio.create_task(poll())
            try:
                texts = await asyncio.gather(
                    *(streamed(b) for b in bodies), *(dropped(i) for i in range(6))
                )
            finally:
                done.set()
                await poller
            return list(texts[: len(bodies)]), polls

    want, _ = asyncio.run(run(ref.url))
    got, polls = asyncio.run(run(uni.url))
    assert got == want
    assert polls and set(polls) == {200}
    wait_for(lambda: kv_pool_full(uni.url), 30, "the uni node idle with every block free")


def test_shutdown_frees_the_in_process_kv_cache_and_weights_while_the_llm_is_held():
    """``pd-bench offline`` keeps its ``LLM`` referenced after ``shutdown`` (and froze the
    heap: no cyclic GC of what existed then) and runs transformers next, on the same GPU:
    the in-process rank's KV cache and weights must be gone at ``shutdown`` itself."""
    import gc
    import weakref

    from engine.llm import LLM

    cfg = EngineConfig(cache=CacheConfig(num_blocks=64))
    llm = LLM(cfg)
    runner = llm.core.executor.worker.model_runner
    llm.generate_token_ids([[1, 2, 3] * 10], SamplingParams(max_tokens=4))
    kv = weakref.ref(runner.kv_cache)
    weight = weakref.ref(next(runner.model.parameters()))
    del runner
    gc.freeze()
    try:
        llm.shutdown()
        assert kv() is None, "the KV cache outlived shutdown"
        assert weight() is None, "the weights outlived shutdown"
    finally:
        gc.unfreeze()
    llm.shutdown()  # again: a no-op


def test_a_start_that_fails_after_the_worker_was_built_shuts_it_down():
    """A KV size the engine refuses (``decide_num_blocks`` raising) left the in-process
    worker -- its connector's agent and threads -- running in the caller's process."""
    worker = _Worker()

    def refuse(kv_bytes: list[int | None]) -> int:
        raise ValueError("no room")

    with pytest.raises(ValueError, match="no room"):
        UniProcExecutor(EngineConfig(), refuse, worker=worker)
    assert worker.shut


class _SamplingWorker(_Worker):
    """Asks the step's deferred grammar mask, as ``ModelRunner.execute`` does, and returns
    it as the step's one sampled token."""

    def execute_model(self, sched: SchedulerOutput, deferred_source: Any = None) -> WorkerOutput:
        mask = deferred_source(sched.step_id).bitmask if sched.sampling_deferred else None
        return WorkerOutput(rank=0, sampled_token_ids={"r": mask})


def test_a_step_whose_masks_come_later_samples_with_the_ones_sent_for_it() -> None:
    ex = UniProcExecutor(EngineConfig(), lambda kv_bytes: 64, worker=_SamplingWorker())
    try:
        first = ex.execute_model(SchedulerOutput(step_id=1), non_block=True)
        deferred = ex.execute_model(SchedulerOutput(step_id=2, sampling_deferred=True), True)
        assert ex.wait(first).sampled_token_ids == {"r": None}  # no wait for the later mask
        ex.sample_tokens(DeferredSampling(2, 7))
        assert ex.wait(deferred).sampled_token_ids == {"r": 7}
    finally:
        ex.shutdown()


def test_a_step_waiting_for_its_masks_ends_with_an_error_at_shutdown_or_its_deadline() -> None:
    ex = UniProcExecutor(EngineConfig(), lambda kv_bytes: 64, worker=_SamplingWorker())
    fut = ex.execute_model(SchedulerOutput(step_id=1, sampling_deferred=True), non_block=True)
    ex.shutdown()  # no mask ever sent: the step ends, shutdown does not hang
    with pytest.raises(WorkerError, match="shut down before its sampling masks"):
        fut.result(timeout=10)

    cfg = EngineConfig(parallel=ParallelConfig(step_timeout=0.2))
    ex = UniProcExecutor(cfg, lambda kv_bytes: 64, worker=_SamplingWorker())
    try:
        fut = ex.execute_model(SchedulerOutput(step_id=1, sampling_deferred=True), True)
        with pytest.raises(WorkerError, match="no sampling masks within"):
            ex.wait(fut)
        ex.sample_tokens(
            DeferredSampling(1, 3)
        )  # too late: nobody waits for it, and nothing breaks
        fut = ex.execute_model(SchedulerOutput(step_id=2, sampling_deferred=True), True)
        ex.sample_tokens(DeferredSampling(1, 3))  # another step's mask: refused, not sampled with
        with pytest.raises(WorkerError, match="got step 1's"):
            ex.wait(fut)
    finally:
        ex.shutdown()


def test_a_step_that_fails_before_a_deferred_step_leaves_no_wait_behind(monkeypatch) -> None:
    """Async scheduling, the offline LLM in process: step N fails (its forward raises)
    while step N+1, sent with ``sampling_deferred``, waits for masks that the update of
    step N would have made. The failure ends that wait at once (the step N+1 fails too),
    and every request of the call ends: ``generate`` raises, every block is free, and the
    next call answers at once as a fresh engine does. (The step waited out its
    ``--step-timeout``, 600 s by default, inside the next call, which then failed.)"""
    from engine.llm import LLM
    from engine.structured.spec import StructuredOutput
    from engine.worker import model_runner

    pytest.importorskip("llguidance")
    execute, deferred_steps = model_runner.ModelRunner.execute, []

    def failing(runner: Any, sched: SchedulerOutput, *args: Any, **kwargs: Any) -> Any:
        if sched.sampling_deferred:
            deferred_steps.append(sched.step_id)
            if len(deferred_steps) == 3:
                raise RuntimeError("a forward that fails")
        return execute(runner, sched, *args, **kwargs)

    params = SamplingParams(
        max_tokens=20, temperature=0.0, structured_output=StructuredOutput.regex("[a-z]{30}")
    )
    cfg = EngineConfig(
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(async_scheduling=True),
        parallel=ParallelConfig(distributed_executor_backend="uni", step_timeout=30),
    )
    with LLM(cfg) as llm:
        want = llm.generate_token_ids([[5, 6, 7], [8, 9]], params)
        monkeypatch.setattr(model_runner.ModelRunner, "execute", failing)
        with pytest.raises(WorkerError, match="a forward that fails"):
            llm.generate_token_ids([[5, 6, 7], [8, 9]], params)
        monkeypatch.setattr(model_runner.ModelRunner, "execute", execute)
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        t0 = time.monotonic()
        assert llm.generate_token_ids([[5, 6, 7], [8, 9]], params) == want
        assert time.monotonic() - t0 < 10  # no step left waiting for its masks
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tp0")]


class _FailingSamplingWorker(_SamplingWorker):
    """Its first step fails (the forward raises); later ones sample as ``_SamplingWorker``."""

    def execute_model(self, sched: SchedulerOutput, deferred_source: Any = None) -> WorkerOutput:
        if sched.step_id == 1:
            raise IndexError("a forward that fails")
        return super().execute_model(sched, deferred_source)


def test_a_deferred_step_cancelled_after_a_failed_step_logs_one_line_not_a_traceback(
    caplog,
) -> None:
    """Async scheduling: step 1 fails, and step 2, sent with ``sampling_deferred``, is
    cancelled (the engine sends it a ``failed`` DeferredSampling: the masks that follow
    step 1 will not come). Step 1's traceback is logged; step 2's failure is that one's
    consequence: one line naming it, no traceback (a full one was logged for it too)."""
    ex = UniProcExecutor(EngineConfig(), lambda kv_bytes: 64, worker=_FailingSamplingWorker())
    caplog.set_level(logging.INFO, logger="engine.executor.uniproc")
    try:
        first = ex.execute_model(SchedulerOutput(step_id=1), non_block=True)
        second = ex.execute_model(SchedulerOutput(step_id=2, sampling_deferred=True), True)
        with pytest.raises(WorkerError, match="a forward that fails"):
            ex.wait(first)
        why = "no sampling masks: step 1 before it failed (WorkerError('...'))"
        ex.sample_tokens(DeferredSampling(2, failed=why))
        with pytest.raises(WorkerError, match="step 1 before it failed"):
            ex.wait(second)
    finally:
        ex.shutdown()
    records = [r for r in caplog.records if r.name == "engine.executor.uniproc"]
    (failed,) = [r for r in records if "step 1 failed" in r.getMessage()]
    assert failed.exc_info is not None and failed.exc_info[0] is IndexError
    (cancelled,) = [r for r in records if "step 2" in r.getMessage()]
    assert cancelled.exc_info is None and cancelled.stack_info is None, cancelled
    assert "\n" not in cancelled.getMessage() and why in cancelled.getMessage()
    assert len(records) == 2, [r.getMessage() for r in records]
