"""``--scheduling-policy priority`` (vLLM's): a request's ``priority`` (lower first; 0 by
default) orders the waiting queue -- ties by arrival -- and, when blocks run out, the
running request with the largest (priority, arrival) is preempted, not the last admitted.
With the default ``fcfs`` a priority other than 0 is refused (vLLM's rule), never
silently ignored.

The real scheduler with fake model outputs; the HTTP field in a live node's test."""

from __future__ import annotations

import pytest
from fakes import PagedToyModel

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.sampling_params import InvalidRequestError, SamplingParams
from kvconnector.noop import NoopConnectorScheduler

BLOCK = 4


def _scheduler(policy: str, num_blocks: int = 200, max_num_seqs: int = 8) -> Scheduler:
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=512, dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=512, scheduling_policy=policy
        ),
    )
    return Scheduler(cfg, num_blocks, 512, NoopConnectorScheduler(cfg, None))  # type: ignore[arg-type]


def _step(s: Scheduler) -> SchedulerOutput:
    so = s.schedule()
    sampled = {q.request_id: 7 for q in so.seqs if q.samples}
    s.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled))
    return so


def _req(rid: str, priority: int, prompt_len: int = 6, max_tokens: int = 3) -> Request:
    prompt = [1 + (hash(rid) + i) % 50 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority)


def test_waiting_requests_start_in_priority_order_then_by_arrival():
    s = _scheduler("priority", max_num_seqs=1)
    for rid, prio in [("late-low", 5), ("b0", 0), ("urgent", -3), ("c0", 0), ("low", 5)]:
        s.add_request(_req(rid, prio))
    started = []
    while s.has_work():
        for q in _step(s).seqs:
            if q.start_pos == 0:
                started.append(q.request_id)
    assert started == ["urgent", "b0", "c0", "late-low", "low"]


def test_fcfs_starts_requests_in_arrival_order():
    s = _scheduler("fcfs", max_num_seqs=1)
    for rid in ["a", "b", "c"]:
        s.add_request(_req(rid, 0))
    started = []
    while s.has_work():
        started += [q.request_id for q in _step(s).seqs if q.start_pos == 0]
    assert started == ["a", "b", "c"]


@pytest.mark.parametrize("policy, victim", [("priority", "background"), ("fcfs", "urgent")])
def test_out_of_blocks_the_policy_picks_whom_to_preempt(policy, victim):
    # "background" (priority 10) runs first; "urgent" (priority 0) joins later. Both grow
    # past what the pool holds: FCFS preempts the last admitted, priority the least urgent.
    s = _scheduler(policy, num_blocks=16)
    prio = 10 if policy == "priority" else 0
    s.add_request(_req("background", prio, prompt_len=8, max_tokens=40))
    _step(s)
    s.add_request(_req("urgent", 0, prompt_len=8, max_tokens=40))
    for _ in range(40):
        _step(s)
        if s.num_preemptions_total:
            break
    assert s.num_preemptions_total == 1
    assert s.requests[victim].status == RequestStatus.PREEMPTED
    other = "urgent" if victim == "background" else "background"
    assert s.requests[other].status == RequestStatus.RUNNING


def test_a_preempted_request_waits_behind_more_urgent_ones_not_before_them():
    s = _scheduler("priority", num_blocks=16, max_num_seqs=2)
    s.add_request(_req("background", 10, prompt_len=8, max_tokens=40))
    _step(s)
    s.add_request(_req("urgent", 0, prompt_len=8, max_tokens=40))
    while not s.num_preemptions_total:
        _step(s)
    s.add_request(_req("next", 1))
    assert [r.request_id for r in s.waiting] == ["next", "background"]


def test_fcfs_refuses_a_priority_it_would_ignore():
    s = _scheduler("fcfs")
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(_req("x", 1))
    assert e.value.param == "priority" and "--scheduling-policy priority" in str(e.value)
    s.add_request(_req("y", 0))  # the default is fine


@pytest.mark.parametrize("num_blocks, urgent_prompt", [(8, 4), (9, 7), (12, 5)])
def test_the_victim_is_never_a_request_already_in_this_step(num_blocks, urgent_prompt):
    # "background" is admitted first, so it is scheduled first in a step; "urgent" then
    # needs a block the pool does not have. The victim (background) must not be one this
    # very step already computes: its blocks would go to urgent while the step still
    # writes them, and the workers would get a seq for a request they were told to drop.
    s = _scheduler("priority", num_blocks=num_blocks)
    model = PagedToyModel(BLOCK, 40)
    s.add_request(_req("background", 10, prompt_len=8, max_tokens=num_blocks * BLOCK - 8))
    for step in range(200):
        if step == 1:
            max_tokens = num_blocks * BLOCK - urgent_prompt
            s.add_request(_req("urgent", 0, prompt_len=urgent_prompt, max_tokens=max_tokens))
        so = s.schedule()
        both = {q.request_id for q in so.seqs} & so.preempted_request_ids
        assert not both, (step, both)
        s.update_from_output(so, model.execute(so))
        if not s.has_work():
            break
    assert s.num_preemptions_total >= 1 and not s.has_work()


def test_async_a_request_preempted_for_a_more_urgent_one_does_not_take_its_room_back():
    # Async scheduling: "background" decodes in the step in flight when "urgent" (ahead of
    # it in the running order) needs the blocks for its next prompt chunk. Preempted in
    # flight, background's blocks come back at that step's update -- and it must not be
    # admitted again in the same step from the few blocks left (its prompt is cached):
    # that starved urgent, and background was preempted again every step (a livelock).
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=512, dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=48,
            async_scheduling=True,
            scheduling_policy="priority",
        ),
    )
    s = Scheduler(cfg, 30, 512, NoopConnectorScheduler(cfg, None))  # type: ignore[arg-type]
    model = PagedToyModel(BLOCK, 40)
    prompts = {
        "background": [1 + i % 37 for i in range(64)],
        "urgent": [2 + i % 31 for i in range(66)],
    }
    max_tokens = {"background": 20, "urgent": 14}
    s.add_request(Request("background", prompts["background"], SamplingParams(max_tokens=20)))
    tokens: dict[str, list[int]] = {"background": [], "urgent": []}
    in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    for step in range(1, 200):
        if step == 4:  # background decodes by now
            s.add_request(
                Request("urgent", prompts["urgent"], SamplingParams(max_tokens=14), priority=-2)
            )
        so = s.schedule()
        idle = not (so.num_scheduled_tokens or so.finished_request_ids or so.preempted_request_ids)
        prev, in_flight = in_flight, (None if idle else (so, model.execute(so)))
        outputs = s.update_from_output(*prev) if prev is not None else []
        if idle:
            outputs += s.update_from_output(so, ModelRunnerOutput())
        for o in outputs:
            tokens[o.request_id] += o.new_token_ids
        if not s.has_work() and in_flight is None:
            break
    else:
        raise AssertionError(f"no progress: {tokens}")
    assert s.num_preemptions_total >= 1
    assert {rid: len(t) for rid, t in tokens.items()} == max_tokens
