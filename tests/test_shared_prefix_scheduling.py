"""Requests that arrive together with the same prompt prefix (``n`` > 1 choices, a batch of
prompts behind one system prompt, the prefill legs of several choices on a prefill node)
compute that prefix once: a request whose next full blocks another request computes in a
step not yet finished waits for them (SGLang's in-batch prefix caching) and then starts
from the prefix cache.

Checked with the real scheduler and the paged toy model of ``fakes.py`` (its next token
hashes what its cache holds through the block table, so a hit on KV not written yet
changes the tokens), synchronous and async scheduling."""

from __future__ import annotations

import random

import pytest
from fakes import PagedToyModel

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.request import Request
from engine.core.scheduler import MIN_SHARED_PREFIX_TOKENS, Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kvconnector.noop import NoopConnectorScheduler

BLOCK = 4
VOCAB = 40


def _scheduler(async_scheduling: bool, budget: int, caching: bool = True) -> Scheduler:
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=512, dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=budget, async_scheduling=async_scheduling
        ),
    )
    return Scheduler(cfg, 400, 512, NoopConnectorScheduler(cfg, None))  # type: ignore[arg-type]


def _run(
    s: Scheduler, requests: list[Request], abort: tuple[int, str] | None = None
) -> tuple[dict[str, list[int]], int]:
    """Every request to its end; returns each one's tokens and the prompt tokens computed."""
    model = PagedToyModel(BLOCK, VOCAB)
    for r in requests:
        s.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    computed = 0

    def collect(outputs: list[RequestOutput]) -> None:
        for o in outputs:
            tokens[o.request_id] += o.new_token_ids

    in_flight: tuple[SchedulerOutput, object] | None = None
    for step in range(1, 2000):
        if not (s.has_work() or in_flight):
            break
        if abort is not None and step == abort[0]:
            s.abort_request(abort[1])
        so = s.schedule()
        for q in so.seqs:
            prompt_len = s.requests[q.request_id].num_prompt_tokens
            computed += max(0, min(q.start_pos + q.num_tokens, prompt_len) - q.start_pos)
        result = model.execute(so)
        if not s.async_scheduling:
            collect(s.update_from_output(so, result))
            continue
        if in_flight is not None:
            collect(s.update_from_output(*in_flight))  # type: ignore[arg-type]
        in_flight = (so, result) if so.seqs or so.finished_request_ids else None
        if in_flight is None:
            collect(s.update_from_output(so, result))
    else:
        raise AssertionError("no progress")
    return tokens, computed


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, VOCAB - 1) for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("budget", [512, 48])  # the whole prompt in one step, or chunks
def test_choices_of_one_prompt_compute_it_once_and_get_its_tokens(async_scheduling, budget):
    prompt = _prompt(1, 150)
    alone, _ = _run(
        _scheduler(async_scheduling, budget), [Request("a", prompt, SamplingParams(max_tokens=6))]
    )
    choices = [Request(f"c{j}", prompt, SamplingParams(max_tokens=6)) for j in range(4)]
    tokens, computed = _run(_scheduler(async_scheduling, budget), choices)
    assert all(t == alone["a"] for t in tokens.values()), (tokens, alone)
    # One computes the prompt; each other one at most what is not worth a step's wait
    # (a last chunk's few blocks) and its last, partial block.
    assert computed <= 150 + 3 * (MIN_SHARED_PREFIX_TOKENS + BLOCK), computed


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_shared_system_prompt_is_computed_once_for_requests_arriving_together(
    async_scheduling,
):
    system = _prompt(2, 120)
    requests = [
        Request(f"r{i}", system + _prompt(10 + i, 5 + 7 * i), SamplingParams(max_tokens=4))
        for i in range(5)
    ]
    alone = {}
    for r in requests:
        one = Request(r.request_id, list(r.prompt_token_ids), SamplingParams(max_tokens=4))
        alone.update(_run(_scheduler(async_scheduling, 1024), [one])[0])
    tokens, computed = _run(_scheduler(async_scheduling, 1024), requests)
    assert tokens == alone
    own = sum(r.num_prompt_tokens - 120 for r in requests)
    assert computed <= 120 + own + 4 * (MIN_SHARED_PREFIX_TOKENS + BLOCK), (computed, 120 + own)


def test_a_request_waiting_for_a_prefix_goes_on_when_the_one_computing_it_is_aborted():
    prompt = _prompt(3, 200)
    s = _scheduler(False, 40)  # five steps of chunks for the first
    requests = [Request(f"c{j}", prompt, SamplingParams(max_tokens=5)) for j in range(2)]
    tokens, computed = _run(s, requests, abort=(3, "c0"))
    assert len(tokens["c1"]) == 5 and not s.has_work()
    alone, _ = _run(_scheduler(False, 40), [Request("x", prompt, SamplingParams(max_tokens=5))])
    assert tokens["c1"] == alone["x"]
    assert computed <= 200 + 2 * 40  # c0's chunks before the abort were kept in the cache


def test_without_prefix_caching_requests_with_a_shared_prompt_do_not_wait():
    prompt = _prompt(4, 100)
    s = _scheduler(False, 512, caching=False)
    for j in range(3):
        s.add_request(Request(f"c{j}", prompt, SamplingParams(max_tokens=2)))
    assert len(s.schedule().seqs) == 3
