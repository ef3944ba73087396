"""Differential property test (hypothesis) of disaggregated serving: generated workloads run
prefill node -> decode node (two real ``EngineCore``s in this process: worker processes,
NIXL agents over UCX on CPU memory, the real side channel; ``pd_utils``), each request
against itself run alone on a colocated reference engine (``test_property_engine``'s).

The engine pairs are started once per module (a pair costs seconds) and every example is
drawn over them, so their prefix caches stay warm from one example to the next (every
prompt is cut from one fixed base):

* ``pipelined``: block size 16, P pushes a layer at a time while its prefill runs
  (``kv_layer_group_size=1``) with reserve-first, a chunked prefill on P (40 tokens a
  step), prefix caching on both sides, D with async scheduling and a KV cache of a few
  blocks more than one full-context request (its requests preempt each other);
* ``whole``: block size 4, P pushes whole blocks after its prefill, eager (P prefills a
  leg before D reserved it: ``--no-kv-reserve-first``; P has room for every prefill of a
  round, as a full P would wait on a full D -- the cycle reserve-first prevents), async
  scheduling on P, D chunked (16 tokens a step, so recomputes after a preemption are
  chunked too) with prefix caching;
* ``hetero`` (the ``many`` form only): P with TP 2 writes head slices into D's TP 1,
  block size 8, pipelined in two layer groups, checksummed (``kv_checksum=full``), async
  scheduling on both with the sampled ids read back late (CUDA's default).

A workload's requests share prefixes of the base at block boundaries (1, bs - 1, bs,
bs + 1, several blocks) with tails of such lengths, up to the context (320 tokens), or
repeat an earlier prompt (a D-side prefix hit: D reserves only the blocks past it and P
pushes only those); ``n`` children seeded ``seed + j`` each have their own transfer, as
the proxy sends them. Each leg arrives on its own step (P's first or D's first), and
some are aborted a few steps later: the decode leg, the prefill leg, or both (as the
proxy aborts an attempt). Sampling is greedy or seeded (``test_property_engine``'s
parameters: penalties, bias, allowed ids, bad words, ``min_tokens``, stop ids, EOS,
log probabilities), ``max_tokens`` down to 1 (P's token is the whole answer).

Asserted for every request: D's output ids and finish reason equal the reference's (an
aborted decode leg's are a prefix; an aborted prefill leg makes D recompute the same
answer), P's first token and its log probability and prompt log probabilities are the
reference's, and D's log probabilities after it are (the sharp check that the KV D
decodes from is the one P computed). For every example: D computed no prompt token but
those its preemptions and the failed loads of aborted prefill legs explain; without
aborts and preemptions P sent exactly the prompt blocks D did not hold (each layer group
of each, from every rank); no load failed unless a prefill leg was aborted. After each:
no work left on either engine, every KV block free, no request in either scheduler, no
transfer state in either connector (pending, in-flight, early reservations, waits,
quarantine -- quarantined blocks are waited for, as the product frees them) and none in
the executors' all-ranks aggregators; and no round took a transfer deadline
(``KV_TIMEOUT``): every wait in it ended on a message.

Runs are not bit-for-bit repeatable (transfers land on their own time) and each example
starts from the caches the previous ones left, so a failing example is printed as drawn
(no shrinking). ``PDSERVE_DISAGG_EXAMPLES=N`` multiplies the example counts (a hunt).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import test_property_engine
from fakes import example_scale, fixed_examples, hunt_timeout
from hypothesis import Phase, event, given, note, settings
from hypothesis import strategies as st
from pd_utils import nixl_config
from test_property_engine import (
    EOS,
    VOCAB,
    Item,
    Reference,
    Result,
    readback_deferred,
    same_logprob,
    sampling_params,
)

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.core.kv_cache_manager import cdiv
from engine.core.request import Request
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from kvconnector.params import KVTransferParams

nixl_transport = pytest.importorskip("kvconnector.nixl.transport")
if not nixl_transport.NIXL_AVAILABLE:
    pytest.skip("nixl not installed", allow_module_level=True)

pytestmark = pytest.mark.slow  # engines with worker processes and NIXL agents

logger = logging.getLogger(__name__)

SCALE = example_scale("PDSERVE_DISAGG_EXAMPLES")
MAX_MODEL_LEN = 320
BASE = tuple((31 * i + 7) % VOCAB for i in range(MAX_MODEL_LEN))
# Long enough that no transfer times out on a loaded box; a round is asserted to take
# less (nothing may end by a deadline: every wait here ends on a message).
KV_TIMEOUT = 15.0
EXAMPLE_TIMEOUT = 120.0
MAX_LEGS, MAX_N = 8, 3  # a round's legs, a leg's children (``n``)


# -- the engine pairs ----------------------------------------------------------------------


@dataclass(frozen=True)
class PairSpec:
    name: str
    block_size: int
    p_blocks: int
    d_blocks: int  # a few more than one full-context request: D's requests preempt
    p_budget: int = 2048
    d_budget: int = 2048
    p_prefix: bool = True
    d_prefix: bool = True
    p_async: bool = False
    d_async: bool = False
    group: int = 0  # kv_layer_group_size (0: whole blocks after the prefill)
    reserve_first: bool = True
    tp_p: int = 1
    tp_d: int = 1
    defer_readback: bool = False  # PDSERVE_DEFER_READBACK=1 (CUDA's default) at start-up
    checksum: str = "off"  # kv_checksum

    @property
    def pieces(self) -> int:
        """Writes of each block per send and P rank (the tiny model has 4 layers)."""
        return cdiv(4, self.group) if self.group else 1


PIPELINED = PairSpec(
    "pipelined", 16, p_blocks=48, d_blocks=21, p_budget=40, d_async=True, group=1
)  # fmt: skip
# Eager, P prefills legs D has no room for yet and holds their blocks: a P pool full of
# those waits on D's until --kv-transfer-timeout (the cycle reserve-first prevents,
# test_reserve_first.py). Room for every prefill of a round.
WHOLE = PairSpec(
    "whole", 4, p_blocks=MAX_LEGS * MAX_N * cdiv(MAX_MODEL_LEN, 4), d_blocks=82, d_budget=16,
    p_prefix=False, p_async=True, reserve_first=False,
)  # fmt: skip
HETERO = PairSpec(
    "hetero", 8, p_blocks=80, d_blocks=42, p_budget=64, d_prefix=False, group=2, tp_p=2,
    p_async=True, d_async=True, defer_readback=True, checksum="full",
)  # fmt: skip


def _config(spec: PairSpec, side: str) -> EngineConfig:
    p = side == "producer"
    base = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=MAX_MODEL_LEN, dtype="float32"),
        cache=CacheConfig(
            block_size=spec.block_size,
            num_blocks=spec.p_blocks if p else spec.d_blocks,
            enable_prefix_caching=spec.p_prefix if p else spec.d_prefix,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=spec.p_budget if p else spec.d_budget,
            max_num_seqs=8,
            async_scheduling=spec.p_async if p else spec.d_async,
        ),
        parallel=ParallelConfig(device="cpu", tp=spec.tp_p if p else spec.tp_d),
    )
    kv: dict[str, object] = {
        "kv_transfer_timeout": KV_TIMEOUT,
        "kv_reserve_first": spec.reserve_first,
        "kv_checksum": spec.checksum,
    }
    if p:
        kv["kv_layer_group_size"] = spec.group
    return nixl_config(base, side, **kv)


class Pairs:
    """The engine pairs, each started when an example first needs it."""

    def __init__(self) -> None:
        self._pairs: dict[str, tuple[EngineCore, EngineCore]] = {}

    def get(self, spec: PairSpec) -> tuple[EngineCore, EngineCore]:
        if spec.name not in self._pairs:
            logger.info("starting the %s pair", spec.name)
            with readback_deferred(spec.defer_readback):
                p = EngineCore(_config(spec, "producer"))
                try:
                    d = EngineCore(_config(spec, "consumer"))
                except BaseException:
                    p.shutdown()
                    raise
            self._pairs[spec.name] = (p, d)
        return self._pairs[spec.name]

    def close(self) -> None:
        for p, d in self._pairs.values():
            p.shutdown()
            d.shutdown()


@pytest.fixture(scope="module")
def pairs() -> Iterator[Pairs]:
    ps = Pairs()
    try:
        yield ps
    finally:
        ps.close()


# test_property_engine's colocated reference engines, one set for this module too.
reference = test_property_engine.reference


# -- what is generated ---------------------------------------------------------------------


@dataclass(frozen=True)
class Leg:
    """One request of a workload, as the proxy sends it: a prefill leg to P and a decode
    leg to D per child (``n`` > 1: children seeded ``seed + j``, each its own transfer)."""

    prompt: tuple[int, ...]
    params: SamplingParams
    p_at: int  # the prefill leg is added before this step of the example
    d_at: int  # the decode leg
    n: int = 1
    eos: bool = True
    abort: str | None = None  # "d", "p" or "both": aborted ``abort_after`` steps later
    abort_after: int = 0

    def children(self, index: int) -> list[tuple[str, SamplingParams]]:
        return Item(self.prompt, self.params, 0, n=self.n).children(index)


# A workload: its pair, and the rounds of legs run one after the other on it.
Case = tuple[PairSpec, list[list[Leg]]]


@st.composite
def workloads(draw: st.DrawFn, bs: int, big: bool) -> list[Leg]:
    """Prompts cut from ``BASE`` at block boundaries with tails of such lengths, or an
    earlier prompt again."""
    legs: list[Leg] = []
    edges = [1, bs - 1, bs, bs + 1, 2 * bs, 3 * bs + 1]
    for _ in range(draw(st.sampled_from([3, 2, 5, 1, 4, MAX_LEGS] if big else [2, 3, 1]))):
        if legs and draw(st.integers(0, 3)) == 0:
            prompt = draw(st.sampled_from(legs)).prompt
        else:
            shared = draw(st.sampled_from([0, *edges, 100, 200]))
            own = draw(st.sampled_from([0, *edges, 40, 150, MAX_MODEL_LEN]))
            rng = random.Random(draw(st.integers(0, 2**16)))
            prompt = (BASE[:shared] + tuple(rng.randrange(VOCAB) for _ in range(own)))[
                :MAX_MODEL_LEN
            ] or (BASE[0],)
        sp = sampling_params(draw)
        sp = dataclasses.replace(
            sp,
            max_tokens=draw(st.sampled_from([1, 4, 9, 2, 16])),
            # P computes prompt log probabilities without its prefix cache, D then takes
            # the whole prompt: rarely, so that prefix hits stay common.
            prompt_logprobs=sp.prompt_logprobs if draw(st.integers(0, 3)) == 0 else None,
        )
        abort = draw(st.sampled_from([None] * 8 + ["d", "p", "both"]))
        legs.append(
            Leg(
                prompt=prompt,
                params=sp,
                p_at=draw(st.sampled_from([0, 0, 1, 4])),
                d_at=draw(st.sampled_from([0, 0, 2, 6])),
                n=draw(st.sampled_from([1, 1, 1, 2, MAX_N] if big else [1, 1, 2])),
                eos=draw(st.booleans()),
                abort=abort,
                abort_after=draw(st.sampled_from([0, 1, 3, 8, 20])) if abort else 0,
            )
        )
    return legs


@st.composite
def cases(draw: st.DrawFn, specs: tuple[PairSpec, ...], big: bool = False) -> Case:
    spec = draw(st.sampled_from(specs))
    rounds = [draw(workloads(spec.block_size, big)) for _ in range(draw(st.sampled_from([1, 2])))]
    return spec, rounds


# -- running them --------------------------------------------------------------------------


@dataclass
class LegRun:
    """One child's two engine requests and what each answered."""

    leg: Leg
    sp: SamplingParams
    p_req: Request
    d_req: Request
    p: Result = field(default_factory=Result)
    d: Result = field(default_factory=Result)


def _collect(res: Result, out) -> None:  # out: RequestOutput
    assert res.finish_reason is None, f"{out.request_id}: an output after its last"
    res.tokens += out.new_token_ids
    if out.new_logprobs is not None:
        res.logprobs += out.new_logprobs
    if out.prompt_logprobs is not None:
        res.prompt_logprobs = out.prompt_logprobs
    if out.finished:
        res.finish_reason, res.error = out.finish_reason, out.error


def run_round(p: EngineCore, d: EngineCore, legs: list[Leg], tag: str) -> list[LegRun]:
    """Add each leg's requests on their steps, abort the aborted ones on theirs, and step
    both engines until every request has ended and neither has work left (transfers
    done, quarantines released)."""
    runs: list[LegRun] = []
    events: dict[int, list[tuple[str, EngineCore, object]]] = {}
    for i, leg in enumerate(legs):
        for rid, sp in leg.children(i):
            tid = f"{tag}-{rid}-{time.monotonic_ns()}"
            eos = (EOS,) if leg.eos else ()
            p_req = Request(
                f"p-{tid}",
                list(leg.prompt),
                dataclasses.replace(sp, max_tokens=1),
                eos_token_ids=eos,
                kv_transfer_params=KVTransferParams(do_remote_decode=True, transfer_id=tid),
            )
            d_params = KVTransferParams(
                do_remote_prefill=True, transfer_id=tid, remote_side_channel=p.connector.address
            )
            d_req = Request(
                f"d-{tid}", list(leg.prompt), sp, eos_token_ids=eos, kv_transfer_params=d_params
            )
            runs.append(LegRun(leg, sp, p_req, d_req))
            events.setdefault(leg.p_at, []).append(("add", p, p_req))
            events.setdefault(leg.d_at, []).append(("add", d, d_req))
            if leg.abort is not None:
                at = max(leg.p_at, leg.d_at) + leg.abort_after
                if leg.abort in ("p", "both"):
                    events.setdefault(at, []).append(("abort", p, p_req.request_id))
                if leg.abort in ("d", "both"):
                    events.setdefault(at, []).append(("abort", d, d_req.request_id))
    by_id = {r.p_req.request_id: r.p for r in runs} | {r.d_req.request_id: r.d for r in runs}
    last = max(events)
    deadline = time.monotonic() + EXAMPLE_TIMEOUT
    step = 0
    while step <= last or p.has_work() or d.has_work():
        assert time.monotonic() < deadline, (
            "no progress",
            p.scheduler.requests,
            d.scheduler.requests,
            p.connector.producer.num_states(),
            d.connector.consumer.num_states(),
        )
        for what, eng, arg in events.get(step, ()):
            if what == "add":
                eng.add_request(arg)  # type: ignore[arg-type]
            else:
                eng.abort_request(arg)  # type: ignore[arg-type]
        idle = True
        for eng in (p, d):
            if eng.has_work():
                outputs, n = eng.step()
                idle = idle and n == 0
                for out in outputs:
                    _collect(by_id[out.request_id], out)
        if idle:
            time.sleep(0.001)
        step += 1
    return runs


def assert_clean(p: EngineCore, d: EngineCore) -> None:
    """Nothing left on either engine: no work, no request, every block free, no transfer
    state in the connectors or the all-ranks aggregators."""
    for eng in (p, d):
        s = eng.scheduler
        assert not eng.has_work()
        assert not (s.requests or s.running or s.waiting), s.requests
        assert not (s.remote_waiting or s.held or s.quarantine), (s.held, s.quarantine)
        stats = s.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total, stats
        assert not any(s.kv.pool.ref_cnt), "a block is still referenced"
        conn = eng.connector
        prod, cons = conn.producer, conn.consumer
        assert not (prod.pending or prod.in_flight or prod.early), (
            prod.pending,
            prod.in_flight,
            prod.early,
        )
        assert not (cons.recvs or cons.quarantine), (cons.recvs, cons.quarantine)
        assert not conn._p_requests and not conn._gave_up
        assert eng.executor.aggregator.pending_ids == set()


def check_leg(run: LegRun, want: Result) -> None:
    leg, rid = run.leg, run.d_req.request_id
    assert want.finish_reason in ("stop", "length"), (rid, want)
    got = run.d
    assert got.error is None, (rid, got.error)
    if leg.abort in ("d", "both") and got.finish_reason == "abort":
        assert got.tokens == want.tokens[: len(got.tokens)], (rid, got.tokens, want.tokens)
    else:
        assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason), (
            rid,
            leg,
            got.tokens,
            got.finish_reason,
            want.tokens,
            want.finish_reason,
        )
    # D's first log probability is P's (None here: it came with the KV); the rest are D's
    # own, computed from the pushed KV.
    for k, (a, b) in enumerate(zip(got.logprobs, want.logprobs, strict=False)):
        assert (a is None and k == 0) or same_logprob(a, b), (rid, "logprobs", k, a, b)
    ptoken = run.p
    if ptoken.finish_reason in ("stop", "length"):
        assert ptoken.tokens == want.tokens[:1], (run.p_req.request_id, ptoken, want.tokens)
        for a, b in zip(ptoken.logprobs, want.logprobs[:1], strict=True):
            assert same_logprob(a, b), (run.p_req.request_id, "logprobs", a, b)
        if want.prompt_logprobs is not None:
            assert ptoken.prompt_logprobs is not None
            pairs = zip(ptoken.prompt_logprobs, want.prompt_logprobs, strict=True)
            for k, (a, b) in enumerate(pairs):
                assert same_logprob(a, b), (run.p_req.request_id, "prompt logprobs", k, a, b)
    elif leg.abort is None:
        # Not aborted: P's leg may fail only when D gave the transfer up first.
        raise AssertionError((run.p_req.request_id, ptoken))


def check_case(pairs: Pairs, reference: Reference, spec: PairSpec, rounds: list[list[Leg]]):
    p, d = pairs.get(spec)
    bs = spec.block_size
    reached: set[str] = set()
    assert_clean(p, d)  # what the examples before left
    for r, legs in enumerate(rounds):
        p0, d0 = p.stats(), d.stats()
        p_hits = p.scheduler.stats().prompt_tokens_by_source_total["local_cache_hit"]
        started = time.monotonic()
        runs = run_round(p, d, legs, f"r{r}")
        # Every wait ends on a message (a reservation, a landing, a cancel and its reply):
        # a round that took a transfer deadline waited for one that never came.
        assert time.monotonic() - started < KV_TIMEOUT, "a round waited for a deadline"
        for run in runs:
            want = reference.result(
                MAX_MODEL_LEN, Item(run.leg.prompt, run.sp, 0, eos=run.leg.eos), run.sp
            )
            check_leg(run, want)
        assert_clean(p, d)
        p1, d1 = p.stats(), d.stats()
        p_aborted = [run for run in runs if run.leg.abort in ("p", "both")]
        any_abort = any(run.leg.abort for run in runs)
        preempted = sum(run.d_req.num_preemptions for run in runs)
        failed = d1["kv_loads_failed_total"] - d0["kv_loads_failed_total"]
        assert failed <= len(p_aborted), (failed, "loads failed without an aborted prefill leg")
        # D computes prompt tokens only to recompute: after a preemption, or a load that
        # failed (its prefill leg aborted).
        allowed = sum(len(run.leg.prompt) * run.d_req.num_preemptions for run in runs)
        allowed += sum(len(run.leg.prompt) for run in p_aborted) if failed else 0
        computed = d1["prompt_tokens_total"] - d0["prompt_tokens_total"]
        assert computed <= allowed, (computed, allowed, "D computed prompt tokens")
        if not any_abort and not preempted:
            assert computed == 0
            # Each prompt block D did not have cached was sent, each layer group of it,
            # by every P rank writing to D's ranks.
            skipped = [run.d_req.num_cached_prompt_tokens // bs for run in runs]
            blocks = sum(
                cdiv(len(run.leg.prompt), bs) - s for run, s in zip(runs, skipped, strict=True)
            )
            sent = p1["kv_blocks_sent_total"] - p0["kv_blocks_sent_total"]
            assert sent == blocks * spec.pieces * max(spec.tp_p, spec.tp_d), (sent, blocks)
            if any(skipped):
                reached.add("D prefix hit")
        assert p1["kv_transfer_failures_total"] == p0["kv_transfer_failures_total"] or p_aborted
        assert d1["kv_checksum_failures_total"] == d0["kv_checksum_failures_total"]
        reached |= {f"finish {run.d.finish_reason}" for run in runs}
        if preempted:
            reached.add("D preempted")
        if failed:
            reached.add("D recomputed after a failed load")
        if p.scheduler.stats().prompt_tokens_by_source_total["local_cache_hit"] > p_hits:
            reached.add("P prefix hit")
    reached.add(f"pair {spec.name}")
    return sorted(reached)


def _check(pairs: Pairs, reference: Reference, case: Case) -> None:
    spec, rounds = case
    note(f"pair {spec}")
    for r, legs in enumerate(rounds):
        note(f"round {r}: {legs}")
    for what in check_case(pairs, reference, spec, rounds):
        event(what)


def examples(n: int) -> settings:
    """``fixed_examples`` without shrinking: each example reruns transfers on engines
    whose caches earlier examples warmed; a failing one is printed as drawn."""
    return settings(fixed_examples(n * SCALE), phases=(Phase.explicit, Phase.generate))


@hunt_timeout(SCALE)
@examples(12)
@given(case=cases((PIPELINED, WHOLE)))
def test_disaggregated_requests_get_their_colocated_answers(
    pairs: Pairs, reference: Reference, case: Case
) -> None:
    _check(pairs, reference, case)


@hunt_timeout(SCALE, 1200)
@examples(25)
@given(case=cases((PIPELINED, WHOLE, HETERO), big=True))
def test_disaggregated_requests_get_their_colocated_answers_many(
    pairs: Pairs, reference: Reference, case: Case
) -> None:
    _check(pairs, reference, case)
