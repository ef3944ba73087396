"""A prefill node computes a prefill leg only once its decode node reserved the blocks
(``--kv-reserve-first``, the default): P never holds KV that no decode node has room for,
so a full decode node and a full prefill node cannot wait on each other.

The cycle it prevents (found by a black-box round through the proxy): request A's prompt
nearly fills both pools; B's decode leg reached D first (D reserved B's blocks), A's
prefill leg reached P first (P prefilled A and held its blocks for the push). D could not
reserve A (B held blocks), P could not prefill B (A held blocks): both waited for
--kv-transfer-timeout (30 s), and every request queued behind them with them."""

from __future__ import annotations

import time
from dataclasses import replace

import httpx
import pytest
import torch
from harness import GREEDY as HTTP_GREEDY
from harness import NIXL, assert_completes_with
from hf_models import random_prompt
from pd_utils import assert_pools_full, nixl_config, run_until

from engine.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvconnector.base import ConnectorEvents
from kvconnector.noop import NoopConnectorScheduler
from kvconnector.params import KVTransferParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


# -- the engine scheduler: a delayed request does not hold the queue -------------------------
class _Delaying(NoopConnectorScheduler):
    """Delays the requests named in ``hold``; fails those in ``give_up`` at the next step."""

    def __init__(self, config) -> None:
        super().__init__(config, None)
        self.hold: set[str] = set()
        self.give_up: dict[str, str] = {}

    def delay_admission(self, request: Request) -> bool:
        return request.request_id in self.hold

    def take_events(self) -> ConnectorEvents:
        out, self.give_up = self.give_up, {}
        return ConnectorEvents(failed_waiting=out)


@pytest.fixture
def delaying():
    cfg = EngineConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=64))
    conn = _Delaying(cfg)
    return Scheduler(cfg, 64, 64, conn), conn


def test_a_delayed_request_lets_the_requests_behind_it_start_and_keeps_its_place(delaying):
    sch, conn = delaying
    for rid in ("a", "b", "c"):
        sch.add_request(Request(rid, [1, 2, 3], GREEDY))
    conn.hold = {"a"}
    out = sch.schedule()
    assert [s.request_id for s in out.seqs] == ["b", "c"]  # it used to hold b and c too
    assert [r.request_id for r in sch.waiting] == ["a"]
    conn.hold = set()
    sch.add_request(Request("d", [1, 2, 3], GREEDY))
    sch.update_from_output(out, _no_output(out))
    out = sch.schedule()
    started = [s.request_id for s in out.seqs if s.request_id in ("a", "d")]
    assert started == ["a", "d"]  # first in line once it may go


def test_a_delayed_request_the_connector_gives_up_on_fails_with_its_reason(delaying):
    sch, conn = delaying
    sch.add_request(Request("a", [1, 2, 3], GREEDY))
    sch.add_request(Request("b", [1, 2, 3], GREEDY))
    conn.hold = {"a", "b"}
    sch.schedule()
    conn.give_up = {"a": "no decode node reserved blocks", "b": None}
    out = sch.schedule()
    assert not out.seqs and not sch.waiting and not sch.requests
    finals = {o.request_id: o for o in sch.take_outputs()}
    assert (
        finals["a"].finish_reason is None or finals["a"].error == "no decode node reserved blocks"
    )
    assert finals["a"].error == "no decode node reserved blocks"
    assert finals["a"].error_code == "kv_transfer_not_reserved"  # a 409, not a 500
    assert finals["b"].finish_reason == "abort" and finals["b"].error is None


def _no_output(out):
    from engine.core.scheduler_output import ModelRunnerOutput

    return ModelRunnerOutput(sampled_token_ids={s.request_id: 7 for s in out.seqs if s.samples})


# -- the NIXL connector's rule -------------------------------------------------------------
def _producer(role: str = "producer", **kv):
    from engine.kv_cache_layout import KVCacheSpec
    from kvconnector.nixl.scheduler import NixlConnectorScheduler

    cfg = EngineConfig(
        model=ModelConfig(model="tiny"),
        kv_transfer=KVTransferConfig(kv_connector="nixl", kv_role=role, **kv),
    )
    spec = KVCacheSpec(num_blocks=8, num_layers=4, num_kv_heads=2, block_size=16, head_dim=32,
                       dtype=torch.float32)  # fmt: skip
    return NixlConnectorScheduler(cfg, spec)


def _leg(rid: str, tid: str | None) -> Request:
    params = KVTransferParams(do_remote_decode=True, transfer_id=tid)
    return Request(rid, [1, 2, 3], replace(GREEDY, max_tokens=1), kv_transfer_params=params)


def test_a_prefill_leg_waits_for_a_confirmed_reservation_then_fails_at_the_deadline():
    from kvconnector.nixl.decode_peers import DecodePeer
    from kvconnector.nixl.producer import Reservation

    conn = _producer(kv_transfer_timeout=5.0)
    try:
        leg, plain = _leg("p", "t1"), Request("c", [1, 2, 3], GREEDY)
        assert conn.delay_admission(leg) and not conn.delay_admission(plain)
        assert not conn.delay_admission(_leg("q", None))  # its answer names the transfer
        assert conn.admission_retry_at() == pytest.approx(leg.arrival_time + 5.0)
        conn.producer.early["t1"] = Reservation("t1", "n", "d", "k", "a", [0], 0, 1e18)
        assert conn.delay_admission(leg)  # its reservation is here, its peer unconfirmed
        conn.service.peers.peers["k"] = DecodePeer("d", "i", "a", [{"num_blocks": 8}], "x",
                                                   verified=True)  # fmt: skip
        assert not conn.delay_admission(leg)  # ... and now confirmed
        del conn.producer.early["t1"]
        assert conn.delay_admission(leg) and not conn.take_events().failed_waiting
        leg.arrival_time -= 5.0  # the deadline passed: it fails rather than prefill blind
        assert conn.delay_admission(leg)
        (why,) = conn.take_events().failed_waiting.values()
        assert "no decode node reserved" in why and "--kv-transfer-timeout" in why
    finally:
        conn.shutdown()


def test_a_decode_node_that_gives_up_first_ends_the_waiting_prefill_leg_at_once():
    """D's handshake was refused (or its request aborted) before it reserved: its cancel
    reaches P while the leg waits -- or before it arrives -- and the leg fails at once
    instead of waiting out --kv-transfer-timeout (a sender P does not pair with may send
    it: knowing the transfer id is the capability, as for a held prefill)."""
    conn = _producer(kv_transfer_timeout=30.0)
    try:
        waiting, later = _leg("p1", "t1"), _leg("p2", "t2")
        assert conn.delay_admission(waiting) and not conn.take_events().failed_waiting
        for tid in ("t1", "t2"):
            assert conn.producer.cancel(tid, "nonce", None).state == "cancelled"
        assert conn.delay_admission(waiting) and conn.delay_admission(later)
        failed = conn.take_events().failed_waiting
        assert set(failed) == {"p1", "p2"} and all("ended before" in w for w in failed.values())
        # Eager mode: a prefill that was running when the cancel came holds nothing.
        conn.producer.cancel("t3", "nonce", None)
        assert not conn.producer.prefill_finished("p3", "t3", [0, 1], 5)
        assert not conn.producer.pending
    finally:
        conn.shutdown()


def test_a_decode_leg_ended_before_decode_admitted_it_cancels_the_transfer_on_prefill():
    """D's leg ends (aborted) while still queued on D: never admitted, so no blocks were
    reserved and no reservation sent -- D cancels the transfer at P all the same, so P's
    leg waiting for the reservation fails at once, and a prefill P computed without one
    (eager) is dropped, instead of either waiting out --kv-transfer-timeout (found by
    test_property_disagg.py: such an example waited the whole timeout)."""
    from engine.core.request import RequestStatus

    p_conn = _producer(kv_transfer_timeout=30.0)
    d_conn = _producer("consumer", kv_transfer_timeout=30.0)
    try:
        waiting = _leg("p1", "t1")
        assert p_conn.delay_admission(waiting) and not p_conn.take_events().failed_waiting
        assert p_conn.producer.prefill_finished("p2", "t2", [0, 1], 5)  # eager: held
        for tid in ("t1", "t2"):
            params = KVTransferParams(
                do_remote_prefill=True, transfer_id=tid, remote_side_channel=p_conn.address
            )
            d_req = Request(f"d-{tid}", [1, 2, 3], GREEDY, kv_transfer_params=params)
            d_req.status = RequestStatus.FINISHED_ABORTED  # as the scheduler ends it
            assert d_conn.request_finished(d_req, []) == (False, None)  # holds nothing
        failed: dict[str, str | None] = {}
        freed: set[str] = set()
        deadline = time.monotonic() + 10
        while (not failed or not freed) and time.monotonic() < deadline:
            time.sleep(0.01)
            p_conn.delay_admission(waiting)
            events = p_conn.take_events()
            failed |= events.failed_waiting
            freed |= events.free_blocks
        assert set(failed) == {"p1"} and "ended before" in str(failed["p1"])
        assert freed == {"p2"} and not p_conn.producer.pending
    finally:
        p_conn.shutdown()
        d_conn.shutdown()


def test_without_reserve_first_a_leg_waits_only_for_a_pipelined_push():
    conn = _producer(kv_reserve_first=False)
    try:
        assert not conn.delay_admission(_leg("p", "t1"))  # no pipelining: at once
    finally:
        conn.shutdown()
    conn = _producer(kv_reserve_first=False, kv_layer_group_size=1, kv_pipeline_wait_ms=50)
    try:
        leg = _leg("p", "t1")
        assert conn.delay_admission(leg)
        leg.arrival_time -= 0.05
        assert not conn.delay_admission(leg) and not conn.take_events().failed_waiting
    finally:
        conn.shutdown()


# -- the cycle, with real engines and NIXL --------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("reserve_first", [True, False], ids=["reserve-first", "eager"])
def test_a_full_prefill_node_and_a_full_decode_node_do_not_wait_on_each_other(reserve_first):
    """16 blocks of 16 tokens on each side. A (230 tokens, 15 blocks) reaches P first, B (20
    tokens, 2 blocks) reaches D first. Reserve-first: P waits for A's reservation, B passes
    it, D finishes B and reserves A, and both land by transfer. Eager (the old order, kept
    as --no-kv-reserve-first): P holds A's 15 blocks, D holds B's 2, and neither moves
    until --kv-transfer-timeout (here 600 s): the state where each waits on the other is
    checked, and that it holds over further steps."""
    nixl = pytest.importorskip("kvconnector.nixl.transport")
    if not nixl.NIXL_AVAILABLE:
        pytest.skip("nixl not installed")
    base = EngineConfig(
        model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=16, block_size=16)
    )
    kv = {"kv_transfer_timeout": 600.0, "kv_reserve_first": reserve_first}
    p = EngineCore(nixl_config(base, "producer", **kv))
    d = EngineCore(nixl_config(base, "consumer", **kv))
    prompts = {"A": random_prompt(230, 256, seed=1), "B": random_prompt(20, 256, seed=2)}
    done: dict[str, list[int]] = {}
    tokens: dict[str, list[int]] = {"A": [], "B": []}

    def p_leg(name: str) -> None:
        params = KVTransferParams(do_remote_decode=True, transfer_id=f"t-{name}")
        p.add_request(Request(f"p-{name}", prompts[name], replace(GREEDY, max_tokens=1),
                              kv_transfer_params=params))  # fmt: skip

    def d_leg(name: str) -> None:
        params = KVTransferParams(do_remote_prefill=True, transfer_id=f"t-{name}",
                                  remote_side_channel=p.connector.address)  # fmt: skip
        d.add_request(Request(name, prompts[name], GREEDY, kv_transfer_params=params))

    def on_output(eng, out) -> None:
        if eng is d:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = tokens[out.request_id]

    try:
        d_leg("B")
        p_leg("A")
        t_end = time.monotonic() + 2.0  # B reserved at D; A prefilled at P unless it waits
        run_until([p, d], lambda: time.monotonic() > t_end, on_output, timeout=10)
        p_leg("B")
        d_leg("A")
        if not reserve_first:
            # Each holds what the other waits for: P A's 15 blocks for a reservation D has
            # no room for (14 free), D B's 2 for a push P has no room to compute (1 free).
            # That state is the deadlock (nothing frees a block before the 600 s timeout);
            # it is waited for (20 s at most), then seen to hold over 20 more steps of D.
            def deadlocked() -> bool:
                ps, ds = p.stats(), d.stats()
                return (
                    (ps["kv_held_for_send"], ps["num_waiting"], ps["kv_blocks_free"]) == (1, 1, 1)
                    and ps["kv_reservations_waiting"] == 1  # B's, from D
                    and (ds["num_waiting_for_remote_kv"], ds["num_waiting"]) == (1, 2)
                    and ds["kv_blocks_free"] == 14
                )

            run_until([p, d], deadlocked, on_output, timeout=20)
            steps = d.stats()["steps_total"]  # P, with nothing it can schedule, is not stepped
            run_until(
                [p, d],
                lambda: bool(done) or d.stats()["steps_total"] >= steps + 20,
                on_output,
                timeout=60,
            )
            assert not done and deadlocked()  # both wait on each other
            assert p.stats()["prompt_tokens_total"] == len(prompts["A"])  # B never computed
            return
        run_until([p, d], lambda: len(done) == 2, on_output, timeout=60)
        with LLM(base) as llm:
            want = llm.generate_token_ids([prompts["A"], prompts["B"]], GREEDY)
        assert [done["A"], done["B"]] == want
        ds = d.stats()
        assert ds["kv_loads_failed_total"] == 0 and ds["prompt_tokens_total"] == 0  # pushed
        assert_pools_full(p, d)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.slow
def test_through_the_proxy_a_pair_that_cannot_pair_still_answers_and_p_stays_in_rotation(procs):
    """P and D disagree on the block size: D's handshake is refused, D gives the transfer
    up and cancels it at P, and P ends its waiting leg with 409 kv_transfer_not_reserved.
    The proxy then serves the request on D alone -- the colocated node's tokens, streamed
    or not -- and does not count P as failed (it used to see a 500 and take P out of
    rotation, and before reserve-first P held the blocks for --kv-transfer-timeout)."""
    common = ("--num-blocks", "128", "--kv-transfer-timeout", "30")
    p = procs.node(*NIXL, *common, "--block-size", "32", module="prefill_node", name="p",
                   wait=False)  # fmt: skip
    d = procs.node(*NIXL, *common, module="decode_node", name="d", wait=False)
    colocated = procs.node(*common, name="colocated")
    proxy = procs.proxy([p.url], [d.url])
    body = {"prompt": random_prompt(40, 256, seed=3), "max_tokens": 6, **HTTP_GREEDY}
    want = httpx.post(colocated.url + "/v1/completions", json=body, timeout=60).json()
    assert_completes_with(proxy.url, body, want["choices"][0]["token_ids"])
    assert proxy.metric("pdproxy_node_requests_total", {"role": "prefill"}) >= 2  # routed there
    assert proxy.metric("pdproxy_node_failures_total", {"role": "prefill"}) == 0
    assert proxy.metric("pdproxy_node_healthy", {"role": "prefill"}) == 1
