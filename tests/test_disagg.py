"""Disaggregated P/D engines driven from the test process: P pushes KV over real NIXL (UCX,
DRAM) into blocks D reserved; D decodes."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvconnector.params import KVTransferParams

sys.path.insert(0, str(Path(__file__).parent))
from hf_models import hf_greedy, make_hf_model, random_prompt, save_hf_model  # noqa: E402
from pd_utils import assert_pools_full, disagg_generate, nixl_config  # noqa: E402

pytest.importorskip("nixl._api")
pytestmark = pytest.mark.slow  # engines with worker processes and NIXL agents

BS = 16
LENGTHS = [1, BS - 1, BS, BS + 1, 5 * BS + 3, 300, 990]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, seed=1234)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> dict:
    model = make_hf_model("llama", seed=0)
    path = tmp_path_factory.mktemp("ckpt") / "llama"
    save_hf_model(model, path)
    prompts = [random_prompt(n, 256, seed=n) for n in LENGTHS]
    hf = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    base = EngineConfig(model=ModelConfig(model=str(path)), cache=CacheConfig(num_blocks=256))
    # The reference: a colocated engine scheduling synchronously (P/D runs async, the default).
    sync = base.replace(scheduler=SchedulerConfig(async_scheduling=False))
    with LLM(sync) as llm:
        colocated = llm.generate_token_ids(prompts, GREEDY)
        seeded = llm.generate_token_ids(prompts, SEEDED)
    return {
        "path": str(path),
        "prompts": prompts,
        "hf": hf,
        "colocated": colocated,
        "seeded": seeded,
        "base": base,
    }


@pytest.mark.parametrize(
    ("tp", "backend", "async_scheduling"),
    [(1, "mp", False), (1, "mp", None), (1, "uni", None), (2, "mp", None)],
    ids=["1-mp-sync", "1-mp", "1-uni", "2-mp"],
)
def test_disaggregated_output_matches_colocated_and_transformers(
    checkpoint, tp, backend, async_scheduling
):
    """``uni``: P's and D's ranks run in this process (their transfers advanced between
    steps by the executors' watcher threads). Async scheduling is the default; ``sync``:
    P and D with ``--no-async-scheduling``."""
    base = EngineConfig(
        model=ModelConfig(model=checkpoint["path"]),
        cache=CacheConfig(num_blocks=256),
        parallel=ParallelConfig(tp=tp, distributed_executor_backend=backend),
        scheduler=SchedulerConfig(async_scheduling=async_scheduling),
    )
    p = EngineCore(nixl_config(base, "producer"))
    d = EngineCore(nixl_config(base, "consumer"))
    try:
        prompts = checkpoint["prompts"]
        res = disagg_generate(p, d, prompts, GREEDY)
        assert res["tokens"] == checkpoint["colocated"]
        assert res["tokens"] == checkpoint["hf"]
        assert all(f.finish_reason == "length" and f.error is None for f in res["final"])
        # D never computed the prompts: it only decoded.
        assert d.stats()["prompt_tokens_total"] == 0

        # The bytes NIXL moved are exactly the prompts' KV blocks, on every rank, and
        # each rank used one descriptor per contiguous run (fresh pools: one run each).
        ps = p.stats()
        blocks = sum(-(-len(x) // BS) for x in prompts)
        assert ps["kv_blocks_sent_total"] == blocks * tp
        assert ps["kv_bytes_sent_total"] == blocks * tp * p.block_bytes
        assert ps["kv_descriptors_total"] <= len(prompts) * tp
        hists = p.connector.histograms
        assert hists["kv_transfer_duration_seconds"].count == len(prompts)
        descriptors = hists["kv_transfer_descriptors"].snapshot()
        assert descriptors.cumulative()[0] == (1, len(prompts))
        assert descriptors.sum == len(prompts)

        seeded = disagg_generate(p, d, prompts, SEEDED, tag="s")
        assert seeded["tokens"] == checkpoint["seeded"]
        assert_pools_full(p, d)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("backend", ["mp", "uni"])
def test_async_scheduling_on_both_nodes_matches_colocated(checkpoint, backend, monkeypatch):
    """P and D with --async-scheduling: P never computes past its one token (its blocks
    are the prompt's), D decodes ahead of its outputs; tokens as colocated (greedy and
    seeded), nothing left behind. ``uni``: the ranks in this process, each step's output
    held until the next is launched (as on CUDA)."""
    from engine.worker.model_runner import DEFER_READBACK_ENV

    monkeypatch.setenv(DEFER_READBACK_ENV, "1")
    sched = SchedulerConfig(async_scheduling=True)
    parallel = ParallelConfig(distributed_executor_backend=backend)
    base = dataclasses.replace(checkpoint["base"], scheduler=sched, parallel=parallel)
    p = EngineCore(nixl_config(base, "producer"))
    d = EngineCore(nixl_config(base, "consumer"))
    try:
        prompts = checkpoint["prompts"]
        assert disagg_generate(p, d, prompts, GREEDY)["tokens"] == checkpoint["colocated"]
        assert disagg_generate(p, d, prompts, SEEDED, tag="s")["tokens"] == checkpoint["seeded"]
        assert d.stats()["prompt_tokens_total"] == 0
        for eng in (p, d):
            s = eng.stats()
            assert s["kv_blocks_free"] == s["kv_blocks_total"], s
            assert not eng.scheduler.requests and not eng.connector.has_pending_work()
    finally:
        p.shutdown()
        d.shutdown()


def test_64_concurrent_requests_leave_no_state(checkpoint):
    base = EngineConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=512))
    p = EngineCore(nixl_config(base, "producer"))
    d = EngineCore(nixl_config(base, "consumer"))
    try:
        prompts = [random_prompt(1 + (i * 37) % 150, 256, seed=i) for i in range(64)]
        res = disagg_generate(p, d, prompts, SamplingParams(max_tokens=8, temperature=0))
        assert len(res["tokens"]) == 64
        assert all(len(t) == 8 for t in res["tokens"])
        with LLM(base) as llm:
            assert res["tokens"] == llm.generate_token_ids(
                prompts, SamplingParams(max_tokens=8, temperature=0)
            )
        for eng in (p, d):
            s = eng.stats()
            assert s["kv_blocks_free"] == s["kv_blocks_total"], s
            assert s["kv_transfers_in_flight"] == 0
            assert s["kv_loads_waiting"] == 0 and s["kv_held_for_send"] == 0
            assert not eng.scheduler.requests and not eng.scheduler.held
            assert not eng.connector.has_pending_work()
            assert eng.executor.aggregator.pending_ids == set()
        assert p.stats()["kv_rank_transfers_done_total"] == 64
        # Each WRITE's wire time lies inside the engine's view of its push (TP 1 here).
        engine_view = p.connector.histograms["kv_transfer_duration_seconds"].snapshot().sum
        assert 0 < p.stats()["kv_rank_write_seconds_total"] <= engine_view
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize(
    ("policy", "mismatch"),
    [("recompute", "block_size"), ("fail", "block_size"), ("fail", "model")],
)
def test_incompatible_peer_is_refused(policy, mismatch):
    # P would hold its blocks for 600 s unless D's cancel reaches it.
    p_cfg = nixl_config(
        EngineConfig(cache=CacheConfig(num_blocks=64, block_size=16)),
        "producer",
        kv_transfer_timeout=600.0,
    )
    d_base = EngineConfig(cache=CacheConfig(num_blocks=64, block_size=32))
    if mismatch == "model":  # same geometry, other weights: its KV would be garbage
        d_base = EngineConfig(model=ModelConfig(seed=1), cache=CacheConfig(num_blocks=64))
    d_cfg = nixl_config(d_base, "consumer", kv_failure_policy=policy)
    p, d = EngineCore(p_cfg), EngineCore(d_cfg)
    try:
        prompt = random_prompt(40, 256, seed=3)
        # Returns only once P is idle too: D's cancel made P drop its held blocks.
        res = disagg_generate(p, d, [prompt], GREEDY, timeout=60)
        final = res["final"][0]
        if policy == "recompute":
            assert final.error is None
            with LLM(EngineConfig(cache=CacheConfig(num_blocks=64))) as llm:
                assert res["tokens"][0] == llm.generate_token_ids([prompt], GREEDY)[0]
            assert d.stats()["prompt_tokens_total"] == 40  # computed locally
        else:
            assert final.finish_reason == "error"
            assert f"{mismatch} mismatch" in final.error
        assert d.stats()["kv_handshake_failures_total"] >= 1
        assert p.stats()["kv_handshake_failures_total"] >= 1
        assert_pools_full(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_decode_prefix_cache_hit_shrinks_the_transfer():
    """D already holds the prompt's first blocks: it reserves, and P pushes, only the rest."""
    from pd_utils import run_until

    from engine.core.request import Request

    base = EngineConfig(cache=CacheConfig(num_blocks=128, block_size=BS))
    p = EngineCore(nixl_config(base, "producer"))
    d = EngineCore(nixl_config(base, "consumer"))
    try:
        prompt = random_prompt(5 * BS + 3, 256, seed=11)
        local: list[int] = []
        d.add_request(Request("warm", prompt, GREEDY))
        run_until(
            [d],
            lambda: not d.has_work(),
            lambda e, o: local.extend(o.new_token_ids),
        )
        res = disagg_generate(p, d, [prompt], GREEDY)
        assert res["tokens"][0] == local
        ps = p.stats()
        assert ps["kv_blocks_sent_total"] == 1  # blocks 0-4 came from D's prefix cache
        assert ps["kv_bytes_sent_total"] == p.block_bytes
        assert d.stats()["kv_blocks_free"] == 128
    finally:
        p.shutdown()
        d.shutdown()


def test_a_cache_salt_on_both_legs_keeps_each_tenants_prefix_cache_its_own():
    """Both legs carry the client's ``cache_salt``: D's prefix cache shrinks the push only
    for blocks of the same salt, P hits only its own salt's blocks, and every answer is
    the one D computes alone."""
    from pd_utils import run_until

    from engine.core.request import Request

    base = EngineConfig(cache=CacheConfig(num_blocks=128, block_size=BS))
    p = EngineCore(nixl_config(base, "producer"))
    d = EngineCore(nixl_config(base, "consumer"))

    def p_hits() -> int:
        return p.scheduler.stats().prompt_tokens_by_source_total["local_cache_hit"]

    try:
        prompt = random_prompt(5 * BS + 3, 256, seed=12)
        local: list[int] = []
        d.add_request(Request("warm", prompt, GREEDY, cache_salt="tenant-a"))
        run_until([d], lambda: not d.has_work(), lambda e, o: local.extend(o.new_token_ids))
        res = disagg_generate(p, d, [prompt], GREEDY, tag="b", cache_salt="tenant-b")
        assert res["tokens"][0] == local
        assert p.stats()["kv_blocks_sent_total"] == 6  # tenant-a's blocks are not tenant-b's
        hits = p_hits()
        res = disagg_generate(p, d, [prompt], GREEDY, tag="a", cache_salt="tenant-a")
        assert res["tokens"][0] == local
        assert p.stats()["kv_blocks_sent_total"] == 7  # D held tenant-a's blocks 0-4
        assert p_hits() == hits  # P had computed tenant-b's only
        res = disagg_generate(p, d, [prompt], GREEDY, tag="b2", cache_salt="tenant-b")
        assert res["tokens"][0] == local
        assert p.stats()["kv_blocks_sent_total"] == 8
        assert p_hits() == hits + 5 * BS
        assert_pools_full(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_handshake_wait_does_not_stall_other_requests(monkeypatch):
    """A prefill peer that never answers: the request waiting on it does not hold up the
    engine loop (the other request finishes while it still waits); it fails over
    (recompute) after the handshake deadline, here 6 s (5 s in use) so that the other
    request's run fits in it on a loaded box."""
    import time

    import zmq
    from pd_utils import run_until

    import kvconnector.nixl.prefill_links as prefill_links
    from engine.core.request import Request

    monkeypatch.setattr(prefill_links, "RPC_TIMEOUT_S", 6.0)

    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never replies
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    d = EngineCore(nixl_config(EngineConfig(cache=CacheConfig(num_blocks=64)), "consumer"))
    try:
        prompt = random_prompt(20, 256, seed=5)
        params = {
            "do_remote_prefill": True,
            "transfer_id": "silent-1",
            "remote_side_channel": f"tcp://127.0.0.1:{port}",
        }
        d.add_request(
            Request("waits", prompt, GREEDY, kv_transfer_params=KVTransferParams.from_dict(params))
        )
        d.add_request(Request("local", prompt[:10], GREEDY))
        done: dict[str, float] = {}
        failed_when_done: dict[str, int] = {}
        tokens: dict[str, list[int]] = {"waits": [], "local": []}

        def on_output(_, out):
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = time.monotonic()
                failed_when_done[out.request_id] = d.stats()["kv_loads_failed_total"]

        run_until([d], lambda: len(done) == 2, on_output, timeout=60)
        # The other request finished while the handshake still waited (not after it).
        assert failed_when_done["local"] == 0, "the colocated request waited for the handshake"
        assert done["waits"] > done["local"]
        assert d.stats()["kv_loads_failed_total"] == 1  # then recomputed locally
        with LLM(EngineConfig(cache=CacheConfig(num_blocks=64))) as llm:
            assert tokens["waits"] == llm.generate_token_ids([prompt], GREEDY)[0]
    finally:
        d.shutdown()
        silent.close(linger=0)


def test_unseeded_sampling_agrees_between_prefill_and_a_recomputing_decode():
    """P samples the first token; D, failing over to local recompute, samples it again:
    without a client seed both draw from the transfer id's seed, so they agree."""
    from harness import free_port
    from pd_utils import run_until

    from engine.core.request import Request
    from kvconnector.base import transfer_seed

    sampled = SamplingParams(max_tokens=8, temperature=1.0)  # no seed
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    base = EngineConfig(cache=CacheConfig(num_blocks=64))
    # P computes its leg at once (no decode node will reserve it: D's P is elsewhere).
    p = EngineCore(nixl_config(base, "producer", kv_reserve_first=False))
    d = EngineCore(nixl_config(base, "consumer"))
    try:
        prompt = random_prompt(30, 256, seed=9)
        out: dict[str, list[int]] = {"p": [], "d": []}
        p.add_request(
            Request("p", prompt, dataclasses.replace(sampled, max_tokens=1),
                    kv_transfer_params=KVTransferParams(do_remote_decode=True, transfer_id="tx-9"))
        )  # fmt: skip
        d.add_request(
            Request("d", prompt, sampled, kv_transfer_params=KVTransferParams(
                do_remote_prefill=True, transfer_id="tx-9", remote_side_channel=dead))
        )  # fmt: skip
        done: set[str] = set()

        def on_output(_, o):
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                done.add(o.request_id)

        run_until([p, d], lambda: done == {"p", "d"}, on_output, timeout=60)
        assert d.stats()["kv_loads_failed_total"] == 1  # D recomputed locally
        assert out["d"][0] == out["p"][0]
        with LLM(base) as llm:
            seeded = dataclasses.replace(sampled, seed=transfer_seed("tx-9"))
            assert out["d"] == llm.generate_token_ids([prompt], seeded)[0]
    finally:
        p.shutdown()
        d.shutdown()
