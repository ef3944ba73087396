"""Differential property test (hypothesis) of the engine's scheduler and KV cache: a
generated workload on an engine with every stressing feature drawn, against each of its
requests run alone on a roomy plain engine.

The engine under test is a real ``EngineCore`` (the tiny model, the uniprocess executor:
the rank runs in this process, so an example costs its forwards and nothing else) with a
drawn block size, KV cache size (from just enough for the largest request, so requests
preempt each other, to roomy), token budget (down to 1 token a step: chunked prefills),
``max_num_seqs``, prefix caching, async scheduling, scheduling policy and context length.
The workload's requests arrive over the first steps, some share prompt prefixes (at the
block boundaries 15/16/17 and past the in-batch sharing threshold) or repeat a prompt,
some are aborted, and each draws its sampling parameters: greedy or seeded sampling
(temperature, top-k, top-p, min-p), presence/frequency/repetition penalties,
``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``min_tokens``, stop token ids,
EOS or ``ignore_eos``, ``max_tokens`` (or none: up to the context), output and prompt
log probabilities, ``n`` (children seeded ``seed + j``, arriving together), a priority.
A second round may follow on the same engine (its prefix cache warm).

Asserted for every request: its output token ids and finish reason equal those of the
same request run alone on the reference engine (block size 16, room for everything, no
chunking, no prefix caching, synchronous, first come first served) -- by the
``(seed, position)`` rule a seeded request's tokens do not depend on what runs with it
-- and so do its log probabilities and prompt log probabilities (to float tolerance: a
batch sums in another order); an aborted request's tokens are a prefix of them. After
each round: the engine has no work, every KV block is free (reference count 0), no
request is left in the scheduler, and once a step has told the worker of the last
endings it keeps no request's state.

The examples are fixed (``derandomize``, no example database), so CI runs the same
inputs, and a failing one is printed as drawn (shrinking reruns the engine for minutes);
the ``slow`` form runs more, larger ones. ``PDSERVE_ENGINE_EXAMPLES=N`` multiplies both counts
(a local hunt: ``PDSERVE_ENGINE_EXAMPLES=20 pytest -m slow tests/test_property_engine.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fakes import example_scale, fixed_examples, hunt_timeout
from hypothesis import Phase, event, example, given, note, settings
from hypothesis import strategies as st

from engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine.core.kv_cache_manager import cdiv
from engine.core.request import Request
from engine.llm import LLM
from engine.outputs import Logprobs, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import DEFER_READBACK_ENV

logger = logging.getLogger(__name__)

SCALE = example_scale("PDSERVE_ENGINE_EXAMPLES")
EOS = 257  # the tiny model's
VOCAB = 512
# Stop ids, bans, biases and allowed ids come from here, so that they take effect: an
# allowed set of a few of them makes stops and bans hit within a few tokens.
ALPHABET = (1, 2, 3, 5, 8, 13, 21, EOS)
REFERENCE_BLOCK_SIZE = 16
# A batch sums in another order than a request alone: log probabilities agree to this.
LOGPROB_TOL = 1e-4
MAX_STEPS = 5000


# -- what is generated ---------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One request of a workload (``n`` > 1: that many children, seeded ``seed + j``)."""

    prompt: tuple[int, ...]
    params: SamplingParams
    arrival: int  # added before this step of its round
    priority: int = 0
    n: int = 1
    eos: bool = True  # EOS ends it (unless ignore_eos)
    abort_after: int | None = None  # aborted this many steps after its arrival

    def children(self, index: int) -> list[tuple[str, SamplingParams]]:
        """The engine requests: (request id, parameters), as ``LLM.generate``'s ``n``."""
        if self.n == 1:
            return [(f"r{index}", self.params)]
        sp = self.params
        return [
            (
                f"{j}_r{index}",
                dataclasses.replace(sp, seed=None if sp.seed is None else sp.seed + j),
            )
            for j in range(self.n)
        ]


@dataclass(frozen=True)
class Setup:
    """The engine under test."""

    max_model_len: int
    block_size: int
    extra_blocks: int  # beyond what the largest request needs
    budget: int  # max_num_batched_tokens
    max_num_seqs: int
    async_scheduling: bool
    prefix_caching: bool
    by_priority: bool
    # Async scheduling: the worker hands a step's sampled ids back after it launched the
    # next step (CUDA's default; ``PDSERVE_DEFER_READBACK=1`` here).
    defer_readback: bool = False


# An engine under test and the rounds of requests it runs, one after the other.
Case = tuple[Setup, list[list[Item]]]


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: Logprobs = field(default_factory=list)
    prompt_logprobs: Logprobs | None = None
    finish_reason: str | None = None
    error: str | None = None


def sampling_params(draw: st.DrawFn) -> SamplingParams:
    greedy = draw(st.booleans())
    alphabet = st.sampled_from(ALPHABET)
    # Each feature is off in most requests: a prefix-cache hit needs a prompt without
    # prompt log probabilities, a stop needs a token not banned.
    kw: dict[str, Any] = {
        "max_tokens": draw(st.one_of(st.integers(1, 24), st.just(None))),
        "min_tokens": draw(st.sampled_from([0, 0, 1, 3, 6])),
        "stop_token_ids": draw(st.one_of(st.just([]), st.lists(alphabet, max_size=2))),
        "ignore_eos": draw(st.booleans()),
        "presence_penalty": draw(st.sampled_from([0.0, 0.0, 1.5, -1.0])),
        "frequency_penalty": draw(st.sampled_from([0.0, 0.0, 0.7, -2.0])),
        "repetition_penalty": draw(st.sampled_from([1.0, 1.0, 1.3, 0.6])),
        "logit_bias": draw(
            st.one_of(
                st.just({}),
                st.dictionaries(alphabet, st.sampled_from([-100.0, 3.0, 100.0]), max_size=2),
            )
        ),
        "allowed_token_ids": draw(
            st.one_of(st.none(), st.none(), st.lists(alphabet, min_size=1, max_size=5, unique=True))
        ),
        "bad_words_token_ids": draw(
            st.one_of(
                st.just(()),
                st.just(()),
                st.lists(st.lists(alphabet, min_size=1, max_size=2).map(tuple), max_size=2).map(
                    tuple
                ),
            )
        ),
        # The sharpest check: a token's log probability moves with any change of
        # the KV it was computed from (the tiny random model's tokens barely do).
        "logprobs": draw(st.sampled_from([1, 0, 3, None])),
        "prompt_logprobs": draw(st.sampled_from([None, None, None, 0, 2])),
    }
    if greedy:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = draw(st.sampled_from([1.0, 0.5, 2.0]))
        kw["seed"] = draw(st.integers(0, 2**31))
        kw["top_k"] = draw(st.sampled_from([-1, 3, 40]))
        kw["top_p"] = draw(st.sampled_from([1.0, 0.8]))
        kw["min_p"] = draw(st.sampled_from([0.0, 0.1]))
    return SamplingParams(**kw)


@st.composite
def workloads(
    draw: st.DrawFn, base: list[int], max_model_len: int, by_priority: bool, big: bool
) -> list[Item]:
    """Requests sharing prefixes of ``base`` (at block boundaries, past the in-batch
    sharing threshold), or repeating an earlier prompt. ``big``: more of them, and more
    children."""
    items: list[Item] = []
    for _ in range(draw(st.sampled_from([5, 3, 8, 1, 2] if big else [3, 2, 4, 1]))):
        if items and draw(st.integers(0, 3)) == 0:
            prompt = draw(st.sampled_from(items)).prompt  # the same prompt again
        else:
            shared = draw(st.sampled_from([15, 16, 33, 17, 0, 15, 32, 1, 40]))
            own = draw(st.sampled_from([0, 1, 2, 5, 15, 16, 17, 30]))
            tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=own, max_size=own))
            prompt = tuple(base[:shared] + tail) or (base[0],)
        prompt = prompt[:max_model_len]
        items.append(
            Item(
                prompt=prompt,
                params=sampling_params(draw),
                arrival=draw(st.sampled_from([0, 0, 1, 3, 8, 20])),
                priority=draw(st.sampled_from([0, 1, -1])) if by_priority else 0,
                n=draw(st.sampled_from([1, 1, 1, 2, 3] if big else [1, 1, 2])),
                eos=draw(st.booleans()),
                abort_after=draw(st.sampled_from([None] * 9 + [0, 2, 8])),
            )
        )
    return items


@st.composite
def cases(draw: st.DrawFn, big: bool = False) -> Case:
    max_model_len = draw(st.sampled_from([64, 48, 160]))
    setup = Setup(
        max_model_len=max_model_len,
        block_size=draw(st.sampled_from([4, 16, 8])),
        extra_blocks=draw(st.sampled_from([0, 1, 2, 4, 64])),
        budget=draw(st.sampled_from([3, 16, 17, 1, 8, 33, 2048])),
        max_num_seqs=draw(st.sampled_from([8, 3, 1, 2])),
        async_scheduling=draw(st.sampled_from([True, False])),
        prefix_caching=draw(st.sampled_from([True, False])),
        by_priority=draw(st.booleans()),
        defer_readback=draw(st.booleans()),
    )
    # One base for the rounds: a second round shares prefixes with the first's, cached.
    base = draw(st.lists(st.integers(0, VOCAB - 1), min_size=64, max_size=64))
    workload = workloads(base, max_model_len, setup.by_priority, big)
    rounds = [draw(workload) for _ in range(draw(st.sampled_from([2, 1])))]
    return setup, rounds


# -- running them --------------------------------------------------------------------------


def blocks_needed(item: Item, max_model_len: int, block_size: int) -> int:
    """The most blocks the item's request can hold (what ``add_request`` checks)."""
    n = len(item.prompt)
    max_tokens = item.params.max_tokens or max(1, max_model_len - n)
    return cdiv(min(n + max_tokens, max_model_len), block_size)


def engine_config(
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    budget: int = 2048,
    max_num_seqs: int = 8,
    async_scheduling: bool = False,
    prefix_caching: bool = False,
    by_priority: bool = False,
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=max_model_len, dtype="float32"),
        cache=CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            async_scheduling=async_scheduling,
            scheduling_policy="priority" if by_priority else "fcfs",
        ),
        parallel=ParallelConfig(device="cpu", distributed_executor_backend="uni"),
    )


def run_round(llm: LLM, items: list[Item], priorities: bool = True) -> dict[str, Result]:
    """Add each item's requests before its arrival step, abort the aborted ones on their
    step, and step until the engine has no work; every request's result."""
    core = llm.core
    results: dict[str, Result] = {}
    arrivals: dict[int, list[Request]] = {}
    aborts: dict[int, list[str]] = {}
    for i, item in enumerate(items):
        for rid, sp in item.children(i):
            req = Request(
                rid,
                list(item.prompt),
                sp,
                eos_token_ids=(EOS,) if item.eos else (),
                priority=item.priority if priorities else 0,
            )
            arrivals.setdefault(item.arrival, []).append(req)
            results[rid] = Result()
            if item.abort_after is not None:
                aborts.setdefault(item.arrival + item.abort_after, []).append(rid)
    last = max([*arrivals, *aborts])
    step = 0
    while step <= last or core.has_work():
        assert step < MAX_STEPS, "the engine makes no progress"
        for req in arrivals.get(step, ()):
            core.add_request(req)
        for rid in aborts.get(step, ()):
            core.abort_request(rid)
        outputs, _ = core.step()
        for out in outputs:
            res = results[out.request_id]
            assert res.finish_reason is None, f"{out.request_id}: an output after its last"
            res.tokens += out.new_token_ids
            if out.new_logprobs is not None:
                res.logprobs += out.new_logprobs
            if out.prompt_logprobs is not None:
                res.prompt_logprobs = out.prompt_logprobs
            if out.finished:
                res.finish_reason, res.error = out.finish_reason, out.error
        step += 1
    assert not core.finish_in_flight(), "outputs after the engine had no work"
    return results


def assert_idle(llm: LLM) -> None:
    """No work, every block free, no request left (scheduler, and the worker once a step
    told it of the last endings)."""
    core = llm.core
    s = core.scheduler
    assert not core.has_work()
    assert not s.requests and not s.running and not s.waiting, s.requests
    stats = s.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, stats
    assert not any(s.kv.pool.ref_cnt), "a block is still referenced"
    core.step()  # carries the last endings to the worker
    assert len(core.executor.worker.model_runner.requests) == 0


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=0.0, abs_tol=LOGPROB_TOL)


def same_logprob(got: TokenLogprob | None, want: TokenLogprob | None) -> bool:
    if got is None or want is None:
        return got is want
    if got.token_id != want.token_id or not close(got.logprob, want.logprob):
        return False
    if len(got.top_ids) != len(want.top_ids):
        return False
    values = want.top_logprobs
    for k, (a, b) in enumerate(zip(got.top_ids, want.top_ids, strict=True)):
        if not close(got.top_logprobs[k], values[k]):
            return False
        # Two ids this close may trade places (and ranks) in another batch.
        tied = any(close(values[k], values[j]) for j in (k - 1, k + 1) if 0 <= j < len(values))
        if a != b and not tied:
            return False
    return True


def assert_same(rid: str, got: Result, want: Result, aborted: bool) -> None:
    assert want.finish_reason in ("stop", "length"), (rid, want)
    assert got.error is None, (rid, got.error)
    if aborted and got.finish_reason == "abort":
        assert got.tokens == want.tokens[: len(got.tokens)], (rid, got.tokens, want.tokens)
        n = len(got.tokens)
        pairs = zip(got.logprobs, want.logprobs[:n], strict=True)
    else:
        assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason), (
            rid,
            got.tokens,
            got.finish_reason,
            want.tokens,
            want.finish_reason,
        )
        pairs = zip(got.logprobs, want.logprobs, strict=True)
    for k, (a, b) in enumerate(pairs):
        assert same_logprob(a, b), (rid, "logprobs", k, a, b)
    if got.tokens and want.prompt_logprobs is not None:
        assert got.prompt_logprobs is not None, rid
        prompt_pairs = zip(got.prompt_logprobs, want.prompt_logprobs, strict=True)
        for k, (a, b) in enumerate(prompt_pairs):
            assert same_logprob(a, b), (rid, "prompt logprobs", k, a, b)


@contextlib.contextmanager
def readback_deferred(on: bool) -> Iterator[None]:
    """``PDSERVE_DEFER_READBACK`` for the engines started inside (read at start-up)."""
    was = os.environ.get(DEFER_READBACK_ENV)
    os.environ[DEFER_READBACK_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if was is None:
            del os.environ[DEFER_READBACK_ENV]
        else:
            os.environ[DEFER_READBACK_ENV] = was


class Reference:
    """Each request alone on a roomy plain engine (one per context length), memoized."""

    def __init__(self) -> None:
        self._engines: dict[int, LLM] = {}
        self._results: dict[tuple, Result] = {}

    def result(self, max_model_len: int, item: Item, sp: SamplingParams) -> Result:
        key = (max_model_len, item.prompt, repr(sp), item.eos)
        if key not in self._results:
            llm = self._engines.get(max_model_len)
            if llm is None:
                blocks = 2 * cdiv(max_model_len, REFERENCE_BLOCK_SIZE)
                logger.info("reference engine: max_model_len %d, %d blocks", max_model_len, blocks)
                llm = LLM(engine_config(max_model_len, REFERENCE_BLOCK_SIZE, blocks))
                self._engines[max_model_len] = llm
            alone = Item(item.prompt, sp, arrival=0, eos=item.eos)
            self._results[key] = run_round(llm, [alone], priorities=False)["r0"]
        return self._results[key]

    def close(self) -> None:
        for llm in self._engines.values():
            llm.shutdown()


@pytest.fixture(scope="module")
def reference() -> Iterator[Reference]:
    ref = Reference()
    try:
        yield ref
    finally:
        ref.close()


def check_case(reference: Reference, setup: Setup, rounds: list[list[Item]]) -> list[str]:
    """Run the rounds on the engine ``setup`` describes; every request's output is the
    reference's, and the engine is idle with every block free after each round. Returns
    what the case reached (for ``--hypothesis-show-statistics``)."""
    m, bs = setup.max_model_len, setup.block_size
    # The cache holds one request of the context length (the engine's rule) and the
    # largest request; past that, ``extra_blocks`` (0: requests preempt each other).
    need = max(cdiv(m, bs), *(blocks_needed(item, m, bs) for items in rounds for item in items))
    cfg = engine_config(
        m,
        bs,
        max(2, need + setup.extra_blocks),
        setup.budget,
        setup.max_num_seqs,
        setup.async_scheduling,
        setup.prefix_caching,
        setup.by_priority,
    )
    reached = set()
    with readback_deferred(setup.defer_readback):
        llm = LLM(cfg)
    with llm:
        for items in rounds:
            got = run_round(llm, items)
            for i, item in enumerate(items):
                for rid, sp in item.children(i):
                    want = reference.result(m, item, sp)
                    assert_same(rid, got[rid], want, item.abort_after is not None)
            assert_idle(llm)
            reached |= {f"finish reason {res.finish_reason}" for res in got.values()}
        stats = llm.core.scheduler.stats()
    longest = max(len(item.prompt) for items in rounds for item in items)
    reached |= {
        f"preempted: {stats.num_preemptions_total > 0}",
        f"prefix-cache hits: {stats.prompt_tokens_by_source_total['local_cache_hit'] > 0}",
        f"chunked prefill: {longest > setup.budget}",
    }
    return sorted(reached)


def _check(reference: Reference, case: Case) -> None:
    setup, rounds = case
    note(f"{setup}")
    for r, items in enumerate(rounds):
        note(f"round {r}: {items}")
    for what in check_case(reference, setup, rounds):
        event(what)


def examples(n: int) -> settings:
    """``fixed_examples``, without shrinking: a failing example is printed as drawn
    (shrinking one reruns the engine for minutes, past the test's timeout)."""
    return settings(fixed_examples(n * SCALE), phases=(Phase.explicit, Phase.generate))


# A warm prefix cache whose blocks end one token before, at and after the next prompts'
# shared prefixes (15/16/17 at block size 4), preempting (no room beyond the context),
# chunked (5 tokens a step), async; then the same prompts with prompt logprobs, n = 2.
_BASE = tuple((7 * i + 3) % VOCAB for i in range(64))
_LP = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
_SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=5, logprobs=2, top_k=40)
_BOUNDARIES = (
    Setup(64, 4, 0, 5, 3, async_scheduling=True, prefix_caching=True, by_priority=False),
    [
        [
            Item(_BASE[:16] + (9, 9, 9), _LP, arrival=0),
            Item(_BASE[:17], _SEEDED, arrival=0, n=2),
            Item(_BASE[:33], _LP, arrival=1),
        ],
        [
            Item(_BASE[:15] + (8, 8, 8, 8), _LP, arrival=0),
            Item(_BASE[:16] + (7, 7), _SEEDED, arrival=0),
            Item(_BASE[:32], dataclasses.replace(_SEEDED, prompt_logprobs=1), arrival=2, n=2),
        ],
    ],
)


# A seeded request whose bad words ban its one allowed id (a row of -inf: token 0) next to
# one sampling with top-k: it drew another id in that batch (the sorted draw's ties).
_EMPTIED_ROW = (
    Setup(64, 16, 4, 2048, 8, async_scheduling=False, prefix_caching=False, by_priority=False),
    [
        [
            Item(
                _BASE[:5],
                SamplingParams(
                    max_tokens=4,
                    temperature=2.0,
                    seed=5,
                    allowed_token_ids=[1],
                    bad_words_token_ids=((1,),),
                    logprobs=0,
                ),
                arrival=0,
            ),
            Item(_BASE[5:9], dataclasses.replace(_SEEDED, top_k=3), arrival=0),
        ]
    ],
)


@hunt_timeout(SCALE)
@examples(12)
@example(case=_BOUNDARIES)
@example(case=_EMPTIED_ROW)
@given(case=cases())
def test_every_request_gets_its_alone_output_under_stress(reference: Reference, case: Case) -> None:
    _check(reference, case)


@pytest.mark.slow
@hunt_timeout(SCALE, 1200)
@examples(20)  # ~20 s on one core: CI runs it; PDSERVE_ENGINE_EXAMPLES=N for a hunt
@given(case=cases(big=True))
def test_every_request_gets_its_alone_output_under_stress_many(
    reference: Reference, case: Case
) -> None:
    _check(reference, case)
