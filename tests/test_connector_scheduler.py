"""The scheduler with the real scheduler-side NIXL connector (no workers, no transport):
ordering races between connector events, aborts and landed KV."""

from __future__ import annotations

import time

import pytest
from harness import free_port

import kvconnector.nixl.scheduler as nixl_scheduler
from engine.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput
from engine.kv_cache_layout import KVCacheSpec
from engine.model.loader import load_arch_config
from engine.sampling_params import SamplingParams
from kvconnector.params import KVTransferParams

BLOCKS = 64


def dead_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"  # nothing listens there


@pytest.fixture
def decode():
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=256, dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=BLOCKS),
        kv_transfer=KVTransferConfig(
            kv_connector="nixl", kv_role="consumer", kv_transfer_timeout=30, peer_ping_interval=0
        ),
    )
    spec = KVCacheSpec.for_model(load_arch_config("tiny"), cfg)
    conn = nixl_scheduler.NixlConnectorScheduler(cfg, spec)
    try:
        yield Scheduler(cfg, BLOCKS, 256, conn), conn
    finally:
        conn.shutdown()


def remote(rid: str, address: str, max_tokens: int = 4) -> Request:
    params = KVTransferParams(do_remote_prefill=True, transfer_id=rid, remote_side_channel=address)
    return Request(
        rid, list(range(1, 30)), SamplingParams(max_tokens=max_tokens), kv_transfer_params=params
    )


def step(sch: Scheduler, out: ModelRunnerOutput | None = None):
    return sch.update_from_output(sch.schedule(), out or ModelRunnerOutput())


def test_abort_after_an_unsafe_failure_keeps_blocks_quarantined(decode, monkeypatch):
    """The reserve call times out on a pool thread (P may hold the reservation), then the
    client aborts before the scheduler saw that failure: the blocks must stay held."""
    sch, conn = decode
    monkeypatch.setattr(nixl_scheduler, "RPC_TIMEOUT_S", 0.2)
    sch.add_request(remote("X", dead_address()))
    step(sch)
    reserved = len(sch.kv.block_ids("X"))
    assert reserved > 0 and sch.kv.pool.num_free == BLOCKS - reserved
    deadline = time.monotonic() + 10
    while "X" not in conn.consumer.quarantine:
        assert time.monotonic() < deadline, "the reserve call never failed"
        time.sleep(0.05)
    sch.abort_request("X")
    step(sch)
    assert sch.kv.pool.num_free == BLOCKS - reserved, "quarantined blocks went back to the pool"
    # A new request may not take the id while its old blocks are quarantined.
    with pytest.raises(Exception, match="already in use"):
        sch.add_request(remote("X", dead_address()))


def test_request_that_finishes_as_its_kv_lands_is_not_treated_as_aborted(decode, monkeypatch):
    sch, conn = decode
    monkeypatch.setattr(nixl_scheduler.NixlConnectorScheduler, "_reserve_job", lambda s, r: None)
    sch.add_request(remote("X", "tcp://127.0.0.1:1", max_tokens=1))
    step(sch)
    outs = step(
        sch, ModelRunnerOutput(finished_recving={"X"}, kv_recv_info={"X": {"first_token": 5}})
    )
    assert [(o.request_id, o.finish_reason) for o in outs] == [("X", "length")]
    assert outs[0].new_token_ids == [5]
    assert not sch.held and not conn.consumer.quarantine
    assert conn.consumer.outcome.cancels == []  # no spurious cancel to P
    assert sch.kv.pool.num_free == BLOCKS
