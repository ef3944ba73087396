"""Request state kept on the workers: the scheduler sends a request's block table and
sampling parameters once, then only the blocks appended to the table; each worker keeps
them (``engine/worker/request_states.py``).

The invariant checked through the real scheduler (fake model outputs): after every step,
the table a worker holds for each scheduled request equals the scheduler's, and a sampling
request's parameters are its own -- through prefix-cache hits, preemption and recompute,
aborts and a KV reservation of P/D -- and a worker holds nothing once its requests are
gone. And the point of it: a decode step's message does not grow with the sequences'
length, nor carry their parameters."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from fakes import RemotePrefill

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.worker.request_states import BlockTable, RequestStateError, RequestStates
from kvconnector.noop import NoopConnectorScheduler
from kvconnector.params import KVTransferParams

BLOCK = 4


def _config(max_num_seqs: int = 8) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=2048, dtype="float32"),
        cache=CacheConfig(block_size=BLOCK),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256),
    )


def _scheduler(num_blocks: int, connector: Any = None, max_num_seqs: int = 8) -> Scheduler:
    cfg = _config(max_num_seqs)
    conn = connector or NoopConnectorScheduler(cfg, None)  # type: ignore[arg-type]
    return Scheduler(cfg, num_blocks, 2048, conn)


def _step(s: Scheduler, worker: RequestStates, token: int = 7) -> SchedulerOutput:
    """One step; the worker's tables are checked against the scheduler's."""
    so = pickle.loads(pickle.dumps(s.schedule()))  # what a worker receives
    worker.update(so)
    for seq in so.seqs:
        rid = seq.request_id
        assert worker.block_ids(rid).tolist() == s.kv.block_ids(rid), rid
        if seq.samples:
            assert worker.sampling_params(rid) == s.requests[rid].sampling_params, rid
    sampled = {q.request_id: token for q in so.seqs if q.samples}
    s.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled))
    return so


def _drain(s: Scheduler, worker: RequestStates, steps: int = 500) -> None:
    for _ in range(steps):
        if not s.has_work():
            break
        _step(s, worker)
    assert not s.has_work()
    _step(s, worker)  # the last finished ids reach the workers
    assert len(worker) == 0


def test_worker_tables_follow_the_scheduler_through_prefix_hits_and_preemption():
    # A pool too small for all four: requests are preempted, freed and recomputed (a new
    # table each time), and the repeated prompts hit the prefix cache.
    s = _scheduler(num_blocks=40, max_num_seqs=4)
    worker = RequestStates()
    shared = list(range(100, 140))
    for i in range(4):
        prompt = shared + [i] * (3 + i) if i % 2 else list(range(i * 50, i * 50 + 30))
        s.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=40)))
    _drain(s, worker)
    assert s.num_preemptions_total > 0, "the test should exercise preemption"
    s.add_request(Request("again", shared + [9], SamplingParams(max_tokens=5)))
    so = _step(s, worker)
    assert so.seqs[0].new_table and len(so.seqs[0].new_block_ids) > 1  # prefix hit + new
    _drain(s, worker)


def test_a_preempted_request_leaves_no_state_on_the_workers_while_it_waits():
    # A preempted request gets a new table (and penalty history) when it runs again; the
    # old ones -- on a GPU two [V] rows per request with penalties -- must not stay on
    # the workers for as long as it waits.
    s = _scheduler(num_blocks=40, max_num_seqs=4)
    worker = RequestStates()
    for i in range(4):
        params = SamplingParams(max_tokens=40, repetition_penalty=1.2)
        s.add_request(Request(f"r{i}", list(range(i * 50, i * 50 + 30)), params))
    held_while_waiting = set()
    for _ in range(500):
        if not s.has_work():
            break
        so = pickle.loads(pickle.dumps(s.schedule()))
        worker.update(so)
        running = {r.request_id for r in s.running}
        held_while_waiting |= {rid for rid in s.requests if rid in worker} - running
        sampled = {q.request_id: 7 for q in so.seqs if q.samples}
        s.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled))
    assert s.num_preemptions_total > 0, "the test should exercise preemption"
    assert held_while_waiting == set()
    _drain(s, worker)


def test_an_aborted_request_leaves_no_table_on_the_workers():
    s = _scheduler(num_blocks=64)
    worker = RequestStates()
    s.add_request(Request("a", list(range(20)), SamplingParams(max_tokens=50)))
    s.add_request(Request("b", list(range(30, 50)), SamplingParams(max_tokens=50)))
    for _ in range(5):
        _step(s, worker)
    s.abort_request("a")
    _step(s, worker)
    assert "a" not in worker
    _drain(s, worker)


def test_a_decode_nodes_reserved_blocks_reach_the_workers_with_its_first_step():
    conn = RemotePrefill(_config())
    s = _scheduler(num_blocks=64, connector=conn)
    worker = RequestStates()
    params = KVTransferParams(
        do_remote_prefill=True, transfer_id="t", remote_side_channel="tcp://127.0.0.1:1"
    )
    prompt = list(range(1, 19))  # 18 tokens: 5 blocks reserved
    s.add_request(Request("d", prompt, SamplingParams(max_tokens=12), kv_transfer_params=params))
    assert not _step(s, worker).seqs  # reserved, waiting for the KV
    conn.landed = {"d": {"first_token": 42}}
    _step(s, worker)  # the KV landed; nothing computed yet
    so = _step(s, worker)
    assert so.seqs[0].new_table and worker.block_ids("d").tolist() == s.kv.block_ids("d")
    _drain(s, worker)


@pytest.mark.parametrize("first", [512, 10**12])
def test_a_first_token_outside_the_vocabulary_from_a_peer_is_computed_here(first):
    # A buggy or forged prefill peer's first token must not reach the embedding lookup
    # (an index error on CPU, a device assert on CUDA: the node dies) nor a grammar
    # (OverflowError on the engine thread): the decode node samples its own.
    conn = RemotePrefill(_config())
    cfg = _config()
    s = Scheduler(cfg, 64, 2048, conn, vocab_size=512)
    worker = RequestStates()
    params = KVTransferParams(
        do_remote_prefill=True, transfer_id="t", remote_side_channel="tcp://127.0.0.1:1"
    )
    prompt = list(range(1, 19))
    s.add_request(Request("d", prompt, SamplingParams(max_tokens=4), kv_transfer_params=params))
    _step(s, worker)
    conn.landed = {"d": {"first_token": first}}
    _step(s, worker)
    so = _step(s, worker)
    (seq,) = so.seqs
    assert seq.token_ids == [prompt[-1]] and seq.start_pos == len(prompt) - 1  # recomputed
    assert first not in s.requests["d"].all_token_ids
    _drain(s, worker)


def test_a_decode_steps_message_does_not_grow_with_the_sequences_length():
    def decode_step_bytes(prompt_len: int) -> tuple[int, int]:
        s = _scheduler(num_blocks=4200, max_num_seqs=16)
        worker = RequestStates()
        for i in range(16):
            prompt = [(i * 31 + j) % 200 for j in range(prompt_len)]
            params = SamplingParams(max_tokens=64, temperature=0.5, seed=i)  # each its own
            s.add_request(Request(f"r{i}", prompt, params))
        while any(r.num_computed_tokens < prompt_len for r in s.running) or s.waiting:
            _step(s, worker)
        so = s.schedule()
        assert len(so.seqs) == 16 and all(q.num_tokens == 1 and q.samples for q in so.seqs)
        assert all(q.sampling_params is None for q in so.seqs)  # the workers have them
        return len(pickle.dumps(so)), sum(len(q.new_block_ids) for q in so.seqs)

    short, short_blocks = decode_step_bytes(40)
    long, long_blocks = decode_step_bytes(1000)  # 25x the blocks per sequence
    assert short_blocks <= 16 and long_blocks <= 16  # at most one new block per sequence
    assert long <= short * 1.1, (short, long)


def test_a_worker_refuses_a_change_it_cannot_apply():
    worker = RequestStates()
    worker.update(SchedulerOutput(0, [ScheduledSeq("p", [1], 0, [3])]))
    with pytest.raises(RequestStateError, match="no sampling parameters"):
        worker.sampling_params("p")
    grow = ScheduledSeq("x", [1], 8, [5], num_blocks=3, new_table=False)
    with pytest.raises(RequestStateError, match="unknown"):
        worker.update(SchedulerOutput(1, [grow]))  # a change to a table it never had
    worker.update(SchedulerOutput(1, [ScheduledSeq("x", [1, 2], 0, [1, 2])]))
    worker.update(SchedulerOutput(2, [grow]))
    assert worker.block_ids("x").tolist() == [1, 2, 5]
    # A change lost on the way: the scheduler's table has 5 blocks, this one 4.
    lost = ScheduledSeq("x", [1], 16, [9], num_blocks=5, new_table=False)
    with pytest.raises(RequestStateError, match="out of step"):
        worker.update(SchedulerOutput(3, [lost]))


def test_a_block_table_grows_past_its_buffer_and_keeps_every_id():
    table = BlockTable([7])
    want = [7]
    for step in range(40):
        new = list(range(100 + step * 3, 100 + step * 3 + step % 3))  # 0, 1 or 2 ids
        table.extend(new)
        want += new
        assert table.array().tolist() == want
    assert len(table) == len(want) > 32  # past the first buffers
