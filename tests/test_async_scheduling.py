"""Async scheduling (``--async-scheduling``): step N+1 is scheduled and sent while step N
runs; the tokens step N samples are placeholders the workers fill in.

Checked two ways. Fast: the real scheduler and worker-side request states driving a toy
model with a paged KV cache, whose next token is a hash of every token its cache holds for
the sequence (read through the block table), so a placeholder filled wrongly, a block
reused while a step in flight still writes it, a prefix-cache hit on unwritten KV, or a
stale sample applied to a preempted request all change the tokens -- compared with the
same scheduler run synchronously. Slow: real engines (worker processes, the tiny model),
TP 1 and 2, token-identical to synchronous scheduling.
"""

from __future__ import annotations

import dataclasses
import pickle
import random
from typing import Any

import pytest
from fakes import PagedToyModel

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import DEFER_READBACK_ENV, placeholder_sources
from kvconnector.noop import NoopConnectorScheduler

BLOCK = 4
VOCAB = 40
EOS = 0


def _scheduler_config(async_scheduling: bool, budget: int, max_num_seqs: int = 6) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=128, dtype="float32"),
        cache=CacheConfig(block_size=BLOCK),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            async_scheduling=async_scheduling,
        ),
    )


def _scheduler(async_scheduling: bool, num_blocks: int, budget: int) -> Scheduler:
    cfg = _scheduler_config(async_scheduling, budget)
    return Scheduler(cfg, num_blocks, 256, NoopConnectorScheduler(cfg, None))  # type: ignore[arg-type]


def _requests(seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randint(1, VOCAB - 1) for _ in range(9)]  # prefix-cache hits
    out = []
    for i in range(12):
        n = rng.choice([1, 3, 4, 5, 9, 14, 30])
        prompt = (shared if i % 3 == 0 else []) + [rng.randint(1, VOCAB - 1) for _ in range(n)]
        params = SamplingParams(
            max_tokens=rng.choice([1, 2, 7, 20, 33]),
            min_tokens=rng.choice([0, 0, 3]),
            stop_token_ids=[rng.randint(1, VOCAB - 1)] if i % 4 == 1 else [],
            ignore_eos=i % 5 == 4,
        )
        out.append((f"r{i}", prompt, params))
    return out


def _run(
    async_scheduling: bool,
    seed: int,
    num_blocks: int = 22,
    budget: int = 12,
    abort_at: tuple[int, str] | None = None,
) -> tuple[dict[str, tuple[list[int], str | None]], Scheduler, PagedToyModel]:
    """Requests arrive over the first steps; returns each one's tokens and finish reason."""
    s = _scheduler(async_scheduling, num_blocks, budget)
    model = PagedToyModel(BLOCK, VOCAB)
    pending = _requests(seed)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in pending}
    reasons: dict[str, str | None] = {}

    def collect(outputs: list[RequestOutput]) -> None:
        for o in outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason

    in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    step = 0
    while pending or s.has_work() or in_flight:
        step += 1
        assert step < 2000, "no progress"
        if pending and step % 2:
            rid, prompt, params = pending.pop(0)
            s.add_request(Request(rid, prompt, params, eos_token_ids=[EOS]))
        if abort_at is not None and step == abort_at[0]:
            s.abort_request(abort_at[1])
        so = s.schedule()
        result = model.execute(so)
        if not async_scheduling:
            collect(s.update_from_output(so, result))
            continue
        # The worker ran step N+1 before the engine updates from step N: the order the
        # real engine allows that is hardest on the scheduler.
        if in_flight is not None:
            collect(s.update_from_output(*in_flight))
        in_flight = (so, result) if so.seqs or so.finished_request_ids else None
        if in_flight is None:
            collect(s.update_from_output(so, result))
    return {rid: (tokens[rid], reasons.get(rid)) for rid in tokens}, s, model


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 7, 8])
def test_async_scheduling_gives_the_tokens_of_synchronous_scheduling(seed):
    """Chunked prefills, preemption, prefix-cache hits, EOS / stop ids / min_tokens /
    max_tokens endings: the same tokens and finish reasons."""
    sync, _, _ = _run(False, seed)
    out, s, model = _run(True, seed)
    assert out == sync
    assert all(reason is not None for _, reason in out.values())
    assert model.placeholders > 0, "no step was scheduled ahead"
    assert s.num_preemptions_total > 0, "the test should exercise preemption"
    assert s.kv.pool.num_free == s.kv.num_blocks  # every block back
    assert not s.requests and not s.running
    assert not s.in_flight.scheduled, "a step's record outlived its update"


def test_an_abort_while_a_step_is_in_flight_leaves_the_others_untouched():
    sync, _, _ = _run(False, 3, abort_at=(9, "r3"))
    out, s, _ = _run(True, 3, abort_at=(9, "r3"))
    assert out.pop("r3")[1] == sync.pop("r3")[1] == "abort"
    assert out == sync
    assert s.kv.pool.num_free == s.kv.num_blocks


def test_a_request_that_the_pending_sample_ends_is_not_scheduled_ahead():
    """max_tokens=1 (a prefill node's leg): no step computes past its one token, so its
    blocks are the prompt's alone when it finishes (what a P node sends)."""
    s = _scheduler(True, num_blocks=16, budget=64)
    s.add_request(Request("p", list(range(1, 9)), SamplingParams(max_tokens=1)))  # 2 blocks
    first = s.schedule()
    assert [q.samples for q in first.seqs] == [True]
    ahead = s.schedule()  # step 1 in flight: its sample ends the request
    assert ahead.seqs == []
    assert len(s.kv.block_ids("p")) == 2
    (out,) = s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"p": 5}))
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == [5]


def test_a_sample_for_a_request_preempted_since_is_dropped():
    """The request was preempted (and admitted again) after the step was scheduled: that
    step's sample belongs to the old run, and the new run samples the position again."""
    s = _scheduler(True, num_blocks=16, budget=64)
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=8)))
    step1 = s.schedule()  # a's prefill, samples its first token
    step2 = s.schedule()  # a's first token (a placeholder), in flight behind step 1
    assert step2.seqs[0].token_ids == [PLACEHOLDER_TOKEN_ID]
    req = s.requests["a"]
    s.running.remove(req)
    s._preempt(req)  # what schedule() does when blocks run out
    step3 = s.schedule()  # admitted again: the prompt recomputed, sampling token 1 again
    assert step3.seqs[0].start_pos == 0 and step3.seqs[0].samples
    assert s.update_from_output(step1, ModelRunnerOutput(sampled_token_ids={"a": 11})) == []
    assert s.update_from_output(step2, ModelRunnerOutput(sampled_token_ids={"a": 12})) == []
    (out,) = s.update_from_output(step3, ModelRunnerOutput(sampled_token_ids={"a": 13}))
    assert out.new_token_ids == [13] and req.output_token_ids == [13]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_completed_by_generated_tokens_are_prefix_cache_hits(async_scheduling):
    """A block is registered once its tokens are known, not when a step in flight will
    complete it with a token not sampled yet (its hash would be of the wrong tokens)."""
    s = _scheduler(async_scheduling, num_blocks=16, budget=64)
    model = PagedToyModel(BLOCK, VOCAB)
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True)))
    in_flight, outputs = None, []
    while s.has_work() or in_flight:
        so = s.schedule()
        result = model.execute(so)
        if in_flight is not None:
            outputs += s.update_from_output(*in_flight)
        in_flight = (so, result) if async_scheduling and so.seqs else None
        if in_flight is None:
            outputs += s.update_from_output(so, result)
    generated = [t for o in outputs for t in o.new_token_ids]
    assert len(generated) == 6
    # 3 + 5 tokens computed (the last sample is never fed back): two full blocks.
    again = Request("b", [1, 2, 3, *generated], SamplingParams())
    assert len(s.kv.get_computed_blocks(again)) == 2


def test_a_placeholder_without_a_sample_before_it_is_an_error_not_a_wrong_token():
    s = _scheduler(True, num_blocks=16, budget=64)
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=8)))
    s.schedule()
    ahead = s.schedule()
    with pytest.raises(RuntimeError, match="placeholder"):
        placeholder_sources(ahead.seqs, {})


class _ToyExecutor:
    """The engine core's executor, in process: the paged toy model answers each step when
    it is sent; the order of sends and waits is recorded."""

    num_blocks = 32
    worker_infos: list[Any] = []

    def __init__(self, *_: Any) -> None:
        self.model = PagedToyModel(BLOCK, VOCAB)
        self.log: list[tuple[str, int]] = []

    def execute_model(self, so: SchedulerOutput, non_block: bool = False) -> Any:
        from concurrent.futures import Future

        self.log.append(("send", so.step_id))
        result = self.model.execute(so)
        if not non_block:
            return result
        fut: Future[ModelRunnerOutput] = Future()
        fut.step_id = so.step_id  # type: ignore[attr-defined]
        fut.set_result(result)
        return fut

    def wait(self, fut: Any) -> ModelRunnerOutput:
        self.log.append(("wait", fut.step_id))
        return fut.result()

    def take_wake(self) -> bool:
        return False

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("seed", range(4))
def test_the_engine_core_keeps_a_step_in_flight_with_synchronous_tokens(seed, monkeypatch):
    """``EngineCore.step`` sends step N+1 before it waits for step N, so one step is
    always in flight while requests run, and the tokens are the synchronous engine's."""
    import engine.engine_core as engine_core

    monkeypatch.setattr(engine_core, "make_executor", _ToyExecutor)

    def run(async_scheduling: bool) -> tuple[dict[str, list[int]], list[tuple[str, int]]]:
        core = engine_core.EngineCore(_scheduler_config(async_scheduling, budget=24))
        for rid, prompt, params in _requests(seed):
            core.add_request(Request(rid, prompt, params, eos_token_ids=[EOS]))
        tokens: dict[str, list[int]] = {}
        while core.has_work():
            for out in core.step()[0]:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert core.stats()["kv_blocks_free"] == core.stats()["kv_blocks_total"]
        return tokens, core.executor.log

    sync_tokens, sync_log = run(False)
    async_tokens, log = run(True)
    assert async_tokens == sync_tokens
    assert ("wait", 1) not in sync_log  # the synchronous engine waits inside execute_model
    sends = [step for what, step in log if what == "send"]
    waits = [step for what, step in log if what == "wait"]
    assert waits == sends  # every step waited for, in order
    # Step N is waited for only after step N+1 was sent, while there was a step N+1.
    for n in waits[:-1]:
        if n + 1 in sends:
            assert log.index(("send", n + 1)) < log.index(("wait", n))


def test_an_async_step_that_sent_nothing_but_freed_room_is_followed_at_once(monkeypatch):
    """Both running requests end with the sample in flight (not scheduled ahead) and the
    waiting ones have no room (max_num_seqs): the step sends nothing, but its update of
    the step before ends the running ones. The engine must not then look idle -- the
    loop would sleep up to EMPTY_STEP_WAIT_S with requests it can start waiting."""
    import engine.engine_core as engine_core

    monkeypatch.setattr(engine_core, "make_executor", _ToyExecutor)
    core = engine_core.EngineCore(_scheduler_config(True, budget=64, max_num_seqs=2))
    for i in range(4):
        core.add_request(Request(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=1)))
    _, sent = core.step()  # r0, r1's prefills
    assert sent == 6
    outputs, sent = core.step()  # nothing to send; r0, r1 end in the update
    assert sent == 0 and sorted(o.request_id for o in outputs if o.finished) == ["r0", "r1"]
    assert core.has_running()  # step again now: r2 and r3 can start
    _, sent = core.step()
    assert sent == 6
    # Once everything ended, the engine goes idle within a few steps (no busy loop).
    steps = 0
    while core.has_work() or core.has_running():
        core.step()
        steps += 1
        assert steps < 20
    assert core.stats()["kv_blocks_free"] == core.stats()["kv_blocks_total"]


# -- real engines ---------------------------------------------------------------------------
def _engine_config(async_scheduling: bool, tp: int = 1, backend: str = "auto") -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(num_blocks=24),
        parallel=ParallelConfig(tp=tp, distributed_executor_backend=backend),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(
            max_num_batched_tokens=32, max_num_seqs=8, async_scheduling=async_scheduling
        ),
    )


def _engine_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(1, 255) for _ in range(n)] for n in [1, 15, 16, 17, 40, 90, 33, 100]]


def _generate(cfg: EngineConfig) -> dict[str, Any]:
    from engine.llm import LLM

    prompts = _engine_prompts()
    with LLM(cfg) as llm:
        greedy = llm.generate_token_ids(prompts, SamplingParams(max_tokens=24, temperature=0.0))
        seeded = llm.generate_token_ids(
            prompts,
            [
                SamplingParams(max_tokens=8 + i, temperature=0.8, seed=7 + i, min_tokens=i % 3)
                for i in range(len(prompts))
            ],
        )
        stats = llm.stats()
    return {"greedy": greedy, "seeded": seeded, "stats": stats}


@pytest.fixture(scope="module")
def synchronous() -> dict[str, Any]:
    return _generate(_engine_config(False))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "defer", "backend"),
    [(1, "0", "uni"), (1, "1", "uni"), (1, "1", "mp"), (2, "1", "mp")],
)
def test_async_engine_is_token_identical_to_synchronous(
    synchronous, tp, defer, backend, monkeypatch
):
    """Chunked prefill and preemption (24 blocks), greedy and seeded sampling; at TP 2 the
    other rank gets rank 0's samples for its placeholders. ``defer``: rank 0 holds a
    step's output until the next step is launched (as on CUDA) -- forced on here; in
    process (``uni``) the executor holds it until the engine waits for the step. The
    synchronous engine is the offline default (``uni`` at TP 1)."""
    monkeypatch.setenv(DEFER_READBACK_ENV, defer)  # the workers inherit it
    out = _generate(_engine_config(True, tp, backend))
    assert out["greedy"] == synchronous["greedy"]
    assert out["seeded"] == synchronous["seeded"]
    assert out["stats"]["num_preemptions_total"] > 0
    assert out["stats"]["kv_blocks_free"] == out["stats"]["kv_blocks_total"]


@pytest.mark.slow
def test_an_async_node_over_http_matches_a_synchronous_one(procs):
    """Concurrent completions (greedy, seeded, stop strings) and a streamed request the
    client drops midway: the async node (outputs held until the next step's launch, as
    on CUDA) answers as the synchronous one, and ends with every block free."""
    import asyncio

    import httpx
    from harness import wait_for, wait_healthy

    sync = procs.node("--num-blocks", "256", "--no-async-scheduling", name="sync", wait=False)
    fast = procs.node(
        "--num-blocks", "256", "--async-scheduling", name="async", env={DEFER_READBACK_ENV: "1"}
    )
    wait_healthy(sync)
    rng = random.Random(1)
    bodies = [
        {
            "prompt": [rng.randint(1, 255) for _ in range(rng.randint(1, 120))],
            "max_tokens": rng.randint(1, 24),
            "temperature": 0.0 if i % 2 else 0.9,
            "seed": i,
            **({"stop": ["N", "P", "~", "t"]} if i % 3 == 0 else {}),
        }
        for i in range(16)
    ]

    async def run(url: str) -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            # A streamed request dropped after its first event, among the others.
            async def dropped() -> None:
                body = {"prompt": [5] * 40, "max_tokens": 200, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data:"):
                            return

            results = await asyncio.gather(
                dropped(), *(client.post("/v1/completions", json=b) for b in bodies)
            )
            return [r.json()["choices"][0] for r in results[1:]]

    want = asyncio.run(run(sync.url))
    got = asyncio.run(run(fast.url))
    assert [(c["text"], c["finish_reason"]) for c in got] == [
        (c["text"], c["finish_reason"]) for c in want
    ]
    assert any(c["finish_reason"] == "stop" for c in got)
    wait_for(
        lambda: (
            fast.metric("pdserve_kv_blocks_used") == 0
            and fast.metric("pdserve_kv_blocks_free") == 256
        ),
        30,
        "the async node's blocks all free",
    )


class _Pending:
    """Sampled ids that reach the host after ``ready_after`` checks."""

    def __init__(self, ready_after: int) -> None:
        self.checks = 0
        self.ready_after = ready_after

    def ready(self) -> bool:
        self.checks += 1
        return self.checks > self.ready_after


class _Conn:
    """A task pipe whose next step arrives at the ``arrives_at``-th poll (never: None)."""

    def __init__(self, arrives_at: int | None) -> None:
        self.polls = 0
        self.arrives_at = arrives_at

    def poll(self, timeout: float = 0.0) -> bool:
        self.polls += 1
        return self.arrives_at is not None and self.polls >= self.arrives_at


def test_a_held_output_waits_for_its_ids_or_the_next_step_whichever_comes_first():
    from engine.core.scheduler_output import WorkerOutput
    from engine.worker.worker_proc import next_step_arrives

    def held(ready_after: int) -> WorkerOutput:
        return WorkerOutput(rank=0, pending_sampled=(["a"], _Pending(ready_after)))

    # The next step comes while the ids are still on their way: launch it first.
    out, conn = held(ready_after=10), _Conn(arrives_at=3)
    assert next_step_arrives(out, conn)
    assert out.pending_sampled[1].checks == 3  # stopped waiting when the step came
    # The ids come first and no step is queued: send the held output now.
    out, conn = held(ready_after=4), _Conn(arrives_at=None)
    assert not next_step_arrives(out, conn)
    assert out.pending_sampled[1].checks == 5
    # The ids are there, but so is the next step: still launch it first (outputs in order).
    assert next_step_arrives(held(ready_after=0), _Conn(arrives_at=1))


def test_a_worker_waiting_for_its_sampling_masks_takes_its_own_and_ends_with_the_engine():
    """Rank 0 in a step sent with ``sampling_deferred``: the next message on its task pipe
    is the step's masks; ``shutdown`` (or another step's mask) ends the wait, not a hang."""
    import multiprocessing as mp
    import os

    from engine.core.scheduler_output import DeferredSampling
    from engine.worker.worker_proc import _ShutDown, wait_for_deferred

    recv, send = mp.Pipe(duplex=False)
    try:
        send.send_bytes(pickle.dumps(DeferredSampling(5, [1, 2])))
        assert wait_for_deferred(recv, 5, os.getppid()) == DeferredSampling(5, [1, 2])
        send.send_bytes(pickle.dumps(DeferredSampling(4, None)))
        with pytest.raises(RuntimeError, match="step 6 waited for its sampling masks"):
            wait_for_deferred(recv, 6, os.getppid())
        send.send_bytes(pickle.dumps(DeferredSampling(6, failed="step 5 before it failed")))
        with pytest.raises(RuntimeError, match="step 6: step 5 before it failed"):
            wait_for_deferred(recv, 6, os.getppid())  # none will come: the step fails
        send.send_bytes(b"shutdown")
        with pytest.raises(_ShutDown):
            wait_for_deferred(recv, 7, os.getppid())
        with pytest.raises(_ShutDown):  # nothing comes and the parent is not ours: gone
            wait_for_deferred(recv, 8, os.getppid() + 1)
    finally:
        recv.close()
        send.close()


def test_an_engine_failing_with_a_step_in_flight_ends_every_request_and_frees_its_blocks(
    monkeypatch,
):
    import engine.engine_core as engine_core

    monkeypatch.setattr(engine_core, "make_executor", _ToyExecutor)
    core = engine_core.EngineCore(_scheduler_config(True, budget=64))
    for i in range(3):
        core.add_request(Request(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=9)))
    core.step()
    core.step()  # one step in flight, the requests in it
    outputs = core.fail_all("engine failed: workers died")
    assert sorted(o.request_id for o in outputs if o.finish_reason == "error") == [
        "r0",
        "r1",
        "r2",
    ]
    stats = core.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


class _Broken:
    """Sampled ids whose read-back fails (a device error surfacing late)."""

    def ready(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def result(self) -> list[int]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


class _Sent:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def send_bytes(self, data: bytes) -> None:
        self.items.append(pickle.loads(data))


def test_a_held_output_whose_ids_cannot_be_read_back_is_sent_as_that_steps_error():
    """The worker reports the failure in the step's place (the engine fails that step with
    the real error) instead of dying with it (an exit code, the error only in its log)."""
    from engine.core.scheduler_output import WorkerOutput
    from engine.worker.worker_proc import WorkerError, next_step_arrives, send_output

    held = WorkerOutput(rank=0, pending_sampled=(["a"], _Broken()))
    assert not next_step_arrives(held, _Conn(arrives_at=None))  # send it now: it fails
    conn = _Sent()
    send_output(conn, 0, held, 0.0)  # type: ignore[arg-type]
    (sent,) = conn.items
    assert isinstance(sent, WorkerError) and "illegal memory access" in sent.message
    good = WorkerOutput(rank=0, pending_sampled=(["a"], _Pending(0)))
    good.pending_sampled[1].result = lambda: [7]  # type: ignore[union-attr]
    send_output(conn, 0, good, 0.0)  # type: ignore[arg-type]
    assert conn.items[1].sampled_token_ids == {"a": 7}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prompt_with_prompt_logprobs_is_computed_once(async_scheduling):
    """Prompt logprobs ask for rows up to the prompt's second-to-last token: the prefill
    still computes the whole prompt once, and the next step is a 1-token decode."""
    s = _scheduler(async_scheduling, num_blocks=16, budget=64)
    params = SamplingParams(max_tokens=4, prompt_logprobs=1, ignore_eos=True)
    s.add_request(Request("a", list(range(1, 11)), params))  # 10 prompt tokens
    first = s.schedule()
    assert [q.num_tokens for q in first.seqs] == [10] and first.seqs[0].samples
    assert s.requests["a"].num_computed_tokens == 10
    if not async_scheduling:
        s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"a": 7}))
    second = s.schedule()
    assert [q.num_tokens for q in second.seqs] == [1] and second.seqs[0].start_pos == 10


def test_a_request_its_sample_in_flight_ends_is_waited_for_not_preempted():
    """A needs a block that B holds; B's sample in flight ends it (max_tokens=1, as a
    prefill node's leg, whose blocks may be being sent): A waits a step for B's blocks
    instead of preempting B (a sync step would have finished B first)."""
    s = _scheduler(True, num_blocks=5, budget=64)
    s.add_request(Request("a", list(range(1, 9)), SamplingParams(max_tokens=6, ignore_eos=True)))
    s.add_request(Request("b", list(range(1, 13)), SamplingParams(max_tokens=1)))
    first = s.schedule()  # both prefills: 2 + 3 blocks, all there are
    ahead = s.schedule()  # a's next token needs a third block
    assert ahead.seqs == [] and s.num_preemptions_total == 0
    outs = s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"a": 5, "b": 6}))
    assert [(o.request_id, o.new_token_ids, o.finished) for o in outs] == [
        ("a", [5], False),
        ("b", [6], True),
    ]
    s.update_from_output(ahead, ModelRunnerOutput())
    third = s.schedule()  # b's blocks are back
    assert [(q.request_id, q.start_pos) for q in third.seqs] == [("a", 8)]
    assert s.num_preemptions_total == 0


@pytest.mark.parametrize("ending", ["eos", "abort", "preempt"])
def test_blocks_a_step_in_flight_still_writes_are_freed_at_its_update(ending):
    """The request ends (or is preempted) while the step in flight computes a token for
    it: its blocks stay out of the pool until that step is updated, so none can go to a
    remote load whose WRITE a late local write would overwrite."""
    s = _scheduler(True, num_blocks=16, budget=64)
    s.add_request(
        Request("r", list(range(1, 7)), SamplingParams(max_tokens=8), eos_token_ids=[EOS])
    )
    first = s.schedule()
    ahead = s.schedule()  # computes r's first token (a placeholder)
    assert [q.token_ids for q in ahead.seqs] == [[PLACEHOLDER_TOKEN_ID]]
    held = len(s.kv.block_ids("r"))
    if ending == "eos":
        s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"r": EOS}))
    elif ending == "abort":
        s.abort_request("r")
        s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"r": 3}))
    else:
        req = s.requests["r"]
        s.running.remove(req)
        s._preempt(req)
    assert s.kv.pool.num_free == 16 - held  # step 2 may still write them
    if ending == "preempt":  # the preemption was after step 1's schedule too
        s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"r": 3}))
    s.update_from_output(ahead, ModelRunnerOutput(sampled_token_ids={"r": 4}))
    assert s.kv.pool.num_free == 16


@pytest.mark.parametrize(
    ("backend", "defer"), [("uni", "0"), ("uni", "1"), ("mp", "0"), ("mp", "1")]
)
def test_the_step_split_puts_each_steps_worker_time_inside_its_executor_time(
    backend, defer, monkeypatch
):
    """``pd-bench offline``'s step split (``StepStats``): under async scheduling a step's
    executor round trip is counted from when its workers could start it to when its result
    was there, and the worker's own time inside it -- so the executor's share (the round
    trip less the worker's) is never negative. In process (``uni``, the offline default at
    TP 1) the step ran inside ``execute_model`` (CPU), or was launched behind the step
    before it and read back late (``defer``, as on CUDA); both gave a negative share (the
    window began after the forward, or at the step before's collection)."""
    from engine.llm import LLM

    monkeypatch.setenv(DEFER_READBACK_ENV, defer)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(_engine_config(True, backend=backend)) as llm:
        llm.generate_token_ids(_engine_prompts()[:2], sp)  # warm: first steps are slow
        core, steps = llm.core, []
        step = core.step

        def measured() -> Any:
            before = dataclasses.replace(core.step_stats)
            out = step()
            steps.append(core.step_stats.per_step_ms(before))
            return out

        core.step = measured  # type: ignore[method-assign]
        llm.generate_token_ids(_engine_prompts()[:2], sp)
    split = [s for s in steps if s]  # the steps whose update counted a worker step
    assert len(split) >= 24
    if backend == "uni":  # no pipe between them: each step's own window holds its worker's
        assert all(s["ipc_ms"] >= 0 for s in split), split
    total = sum(s["ipc_ms"] for s in split)
    assert total >= 0, split
