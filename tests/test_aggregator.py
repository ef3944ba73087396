"""All-ranks aggregation: a transfer is finished only in the step in which ALL TP ranks
reported it."""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future

import pytest

from engine.core.scheduler_output import ModelRunnerOutput, WorkerOutput
from engine.executor.aggregator import KVOutputAggregator


def _sync(agg: KVOutputAggregator, outs: list[WorkerOutput]) -> ModelRunnerOutput:
    return agg.aggregate(outs)


def _async(agg: KVOutputAggregator, outs: list[WorkerOutput]) -> ModelRunnerOutput:
    """Resolve each rank's future from its own thread, in a shuffled order."""
    futures: list[Future[WorkerOutput]] = [Future() for _ in outs]
    result = agg.async_aggregate(futures)
    assert not result.done()
    order = list(range(len(outs)))
    random.Random(len(outs)).shuffle(order)
    threads = [threading.Thread(target=futures[i].set_result, args=(outs[i],)) for i in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result.result(timeout=5)


PATHS = pytest.mark.parametrize("collect", [_sync, _async], ids=["sync", "async"])


def wo(rank: int, sent=(), recv=(), sampled=None) -> WorkerOutput:
    return WorkerOutput(
        rank=rank,
        finished_sending=set(sent),
        finished_recving=set(recv),
        sampled_token_ids=sampled or {},
    )


@PATHS
def test_upstream_scenario_world_size_2(collect):
    agg = KVOutputAggregator(2)
    # Step 1: rank 0 reports sent {r1} and received {r2}, rank 1 nothing -> neither.
    out = collect(agg, [wo(0, sent={"r1"}, recv={"r2"}, sampled={"a": 7}), wo(1)])
    assert out.finished_sending == set()
    assert out.finished_recving == set()
    assert out.sampled_token_ids == {"a": 7}  # rank 0's sampled tokens pass through
    # Step 2: rank 1 reports sent {r1} -> r1 finished sending.
    out = collect(agg, [wo(0), wo(1, sent={"r1"})])
    assert out.finished_sending == {"r1"}
    assert out.finished_recving == set()
    # Step 3: rank 1 reports sent {r1} and received {r2} -> r2 finished receiving;
    # r1 is a new count (1 of 2), so not finished.
    out = collect(agg, [wo(0), wo(1, sent={"r1"}, recv={"r2"})])
    assert out.finished_recving == {"r2"}
    assert out.finished_sending == set()
    assert agg.pending_ids == {"r1"}


@PATHS
def test_rank0_partial_sets_never_leak(collect):
    """In a step where nothing completed on all ranks, rank 0's sets must not pass through."""
    agg = KVOutputAggregator(2)
    r0 = wo(0, sent={"x"}, recv={"y"})
    out = collect(agg, [r0, wo(1)])
    assert out.finished_sending == set() and out.finished_recving == set()
    assert out.finished_sending is not r0.finished_sending


@PATHS
def test_world_size_1(collect):
    agg = KVOutputAggregator(1)
    out = collect(agg, [wo(0, sent={"a"}, recv={"b"})])
    assert out.finished_sending == {"a"} and out.finished_recving == {"b"}
    assert agg.pending_ids == set()


@PATHS
def test_world_size_4_out_of_order(collect):
    agg = KVOutputAggregator(4)
    # Ranks report r1 in different steps, in the order 3, 1, 0, 2.
    for step, rank in enumerate([3, 1, 0]):
        outs = [wo(r, sent={"r1"} if r == rank else ()) for r in range(4)]
        out = collect(agg, outs)
        assert out.finished_sending == set(), f"step {step}"
    out = collect(agg, [wo(r, sent={"r1"} if r == 2 else ()) for r in range(4)])
    assert out.finished_sending == {"r1"}
    # All four ranks in one step.
    out = collect(agg, [wo(r, recv={"r9"}) for r in range(4)])
    assert out.finished_recving == {"r9"}


@PATHS
def test_recv_info_survives_until_all_ranks(collect):
    agg = KVOutputAggregator(2)
    first = wo(0, recv={"r"})
    first.kv_recv_info = {"r": {"first_token": 5}}
    out = collect(agg, [first, wo(1)])
    assert out.kv_recv_info == {}
    out = collect(agg, [wo(0), wo(1, recv={"r"})])
    assert out.kv_recv_info == {"r": {"first_token": 5}}


def test_wrong_number_of_outputs_is_an_error():
    with pytest.raises(ValueError):
        KVOutputAggregator(2).aggregate([wo(0)])


def test_async_path_propagates_worker_failure():
    agg = KVOutputAggregator(2)
    futures: list[Future[WorkerOutput]] = [Future(), Future()]
    result = agg.async_aggregate(futures)
    futures[0].set_result(wo(0))
    futures[1].set_exception(RuntimeError("rank 1 died"))
    with pytest.raises(RuntimeError, match="rank 1 died"):
        result.result(timeout=5)


def test_async_path_fails_at_once_when_one_rank_fails():
    """A failed rank must not wait for ranks that may be stuck in a collective with it."""
    agg = KVOutputAggregator(2)
    futures: list[Future[WorkerOutput]] = [Future(), Future()]
    result = agg.async_aggregate(futures)
    futures[1].set_exception(RuntimeError("rank 1 raised"))  # rank 0 never answers
    with pytest.raises(RuntimeError, match="rank 1 raised"):
        result.result(timeout=1)


def test_send_failure_survives_until_all_ranks_finished():
    agg = KVOutputAggregator(2)
    failed = wo(1, sent={"p1"})
    failed.kv_failed = {"p1": "timeout"}
    out = agg.aggregate([wo(0), failed])
    assert out.finished_sending == set() and out.kv_failed == {}
    out = agg.aggregate([wo(0, sent={"p1"}), wo(1)])
    assert out.finished_sending == {"p1"} and out.kv_failed == {"p1": "timeout"}


@PATHS
def test_a_forgotten_transfer_drops_its_partial_count_and_ignores_later_reports(collect):
    """A transfer that ended without every rank reporting it (one rank's WRITE failed):
    its partial count is dropped, and a straggling rank's report starts no new one."""
    agg = KVOutputAggregator(2)
    out = collect(agg, [wo(0, recv={"n1"}, sent={"p1"}), wo(1)])
    assert agg.pending_ids == {"n1", "p1"}
    agg.forget(["n1", "p1"])
    assert agg.pending_ids == set()
    out = collect(agg, [wo(0), wo(1, recv={"n1"}, sent={"p1"})])
    assert out.finished_recving == set() and out.finished_sending == set()
    assert agg.pending_ids == set()
    out = collect(agg, [wo(0, recv={"n2"}), wo(1, recv={"n2"})])  # others are unaffected
    assert out.finished_recving == {"n2"}


@PATHS
@pytest.mark.parametrize("order", ["same_step", "rank1_first", "rank0_first"])
def test_ranks_reporting_different_send_failures_give_the_first_reason(collect, order):
    """Each rank of a failed send may give its own reason. The reason passed on (logged,
    told to D, exported) is the first one reported -- the lowest rank's within a step --
    not whichever rank the loop happened to see last."""
    agg = KVOutputAggregator(2)
    r0 = wo(0, sent={"p1"})
    r0.kv_failed = {"p1": "rank 0: too late"}
    r1 = wo(1, sent={"p1"})
    r1.kv_failed = {"p1": "rank 1: WRITE error"}
    if order == "same_step":
        out = collect(agg, [r0, r1])
        expected = "rank 0: too late"
    elif order == "rank1_first":
        collect(agg, [wo(0), r1])
        out = collect(agg, [r0, wo(1)])
        expected = "rank 1: WRITE error"
    else:
        collect(agg, [r0, wo(1)])
        out = collect(agg, [wo(0), r1])
        expected = "rank 0: too late"
    assert out.finished_sending == {"p1"}
    assert out.kv_failed == {"p1": expected}


@PATHS
def test_ranks_reporting_different_kv_errors_give_the_first_reason(collect):
    """The same for a received transfer whose sums failed on both ranks: rank 0's reason
    (the first in the step) is the one the scheduler logs, not rank 1's."""
    agg = KVOutputAggregator(2)
    r0 = wo(0, recv={"n1"})
    r0.kv_recv_info = {"n1": {"request_id": "X", "kv_error": "rank 0: bad sum"}}
    r1 = wo(1, recv={"n1"})
    r1.kv_recv_info = {"n1": {"request_id": "X", "kv_error": "rank 1: bad sum"}}
    out = collect(agg, [r0, r1])
    assert out.kv_recv_info["n1"]["kv_error"] == "rank 0: bad sum"
