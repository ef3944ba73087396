"""vLLM's ``bad_words``: words the answer must not contain. Each word becomes token id
sequences (the word, and the word after a space when that is a new token of the same
length, vLLM's rule); a sequence's last id is banned in a step whose output so far ends
with the rest of it (a one-token word: always). The output only, not the prompt (vLLM's).

The rule through the real scheduler and the paged toy model (sync and async scheduling:
a request with multi-token bad words is scheduled ahead of its token in flight, and the
ban, which needs it, goes to the workers after that token's update); parsing and tokenizing; live node and P/D through the proxy in
``tests/test_choices.py``."""

from __future__ import annotations

from typing import Any

import pytest
from fakes import PagedToyModel

from engine.bad_words import banned_by_bad_words, tokenize_bad_words
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.server.protocol import parse_completion_request
from engine.server.request_fields import APIError
from engine.tokenizer import load_tokenizer
from kvconnector.noop import NoopConnectorScheduler

BLOCK = 4
VOCAB = 40


def _run(
    async_scheduling: bool,
    params: SamplingParams,
    prompt: list[int],
    overlapped: list | None = None,
) -> list[int]:
    """The answer; ``overlapped`` gets, per step sent, whether one was in flight."""
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=512, dtype="float32"),
        cache=CacheConfig(block_size=BLOCK),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, async_scheduling=async_scheduling),
    )
    s = Scheduler(cfg, 200, 512, NoopConnectorScheduler(cfg, None))  # type: ignore[arg-type]
    model = PagedToyModel(BLOCK, VOCAB)
    s.add_request(Request("r", prompt, params))
    out: list[int] = []
    in_flight: tuple[SchedulerOutput, Any] | None = None
    for _ in range(1000):
        if not (s.has_work() or in_flight):
            return out
        so = s.schedule()
        if overlapped is not None and so.seqs:
            overlapped.append(in_flight is not None)
        if async_scheduling:  # as the engine: the step goes, then the one before updates
            if in_flight is not None:
                out += [t for o in s.update_from_output(*in_flight) for t in o.new_token_ids]
            deferred = s.deferred_sampling(so) if so.sampling_deferred else None
            result = model.execute(so, deferred)
            in_flight = (so, result) if so.seqs or so.finished_request_ids else None
            if in_flight is not None:
                continue
        else:
            result = model.execute(so)
        out += [t for o in s.update_from_output(so, result) for t in o.new_token_ids]
    raise AssertionError("no progress")


def _bigrams(ids: list[int]) -> list[tuple[int, int]]:
    return list(zip(ids, ids[1:], strict=False))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_banned_pair_never_follows_and_the_answer_is_the_same_up_to_it(async_scheduling):
    prompt = [3, 14, 15, 9, 26, 5]
    free = _run(async_scheduling, SamplingParams(max_tokens=60, temperature=0), prompt)
    pair = _bigrams(free)[10]
    where = _bigrams(free).index(pair)
    params = SamplingParams(max_tokens=60, temperature=0, bad_words_token_ids=(pair,))
    overlapped: list[bool] = []
    banned = _run(async_scheduling, params, prompt, overlapped)
    assert pair not in _bigrams(banned)
    # Async: every decode step goes while the one before is in flight (the ban follows).
    assert sum(overlapped) == (len(overlapped) - 1 if async_scheduling else 0), overlapped
    assert banned[: where + 1] == free[: where + 1]  # the same until the pair would be
    assert banned[where + 1] != pair[1]
    assert banned == _run(not async_scheduling, params, prompt)


def test_a_one_token_word_is_never_sampled():
    prompt = [3, 14, 15, 9, 26, 5]
    free = _run(False, SamplingParams(max_tokens=40, temperature=0), prompt)
    word = max(set(free), key=free.count)
    params = SamplingParams(max_tokens=40, temperature=0, bad_words_token_ids=((word,),))
    assert word not in _run(False, params, prompt)


def test_the_rule_is_vllms_on_the_output_only():
    words = ((5,), (1, 2), (7, 1, 2))
    assert banned_by_bad_words(words, []) == {5}  # a pair's prefix is not in the output
    assert banned_by_bad_words(words, [9, 1]) == {5, 2}
    assert banned_by_bad_words(words, [7, 1]) == {5, 2}
    assert banned_by_bad_words(words, [3, 7]) == {5}
    assert banned_by_bad_words(words, [1, 7, 1]) == {5, 2}


def test_words_become_their_token_ids_alone_and_after_a_space():
    tok = load_tokenizer("tiny")  # bytes: " ab" is a longer sequence, not a new token
    ids = tokenize_bad_words(tok, ["ab", " c"])
    assert ids == ((97, 98), (99,))


@pytest.mark.parametrize(
    "value",
    [
        "ab",  # a string, not a list
        ["ok", 3],
        [""],
        ["   "],
        ["w"] * 129,
        ["x" * 5000],
    ],
)
def test_bad_words_must_be_a_short_list_of_words(value):
    with pytest.raises(APIError) as e:
        parse_completion_request({"prompt": "x", "bad_words": value})
    assert e.value.param == "bad_words"


def test_bad_words_are_parsed_once():
    req = parse_completion_request({"prompt": "x", "bad_words": ["foo", "bar baz"]})
    assert req.bad_words == ("foo", "bar baz")
    assert parse_completion_request({"prompt": "x", "bad_words": None}).bad_words == ()


def test_sampling_params_refuse_empty_sequences():
    with pytest.raises(InvalidRequestError):
        SamplingParams(bad_words_token_ids=((),))
    with pytest.raises(InvalidRequestError):
        SamplingParams(bad_words_token_ids=((1, -2),))


def test_min_tokens_yields_to_allowed_token_ids_but_bad_words_hold():
    # Allowed {EOS, 9}, min_tokens banning EOS, bad word 9: lifting min_tokens' ban (EOS)
    # keeps the answer clean; lifting both (what one merged ban did) drew 9.
    torch = pytest.importorskip("torch")
    from engine.worker.sampler import Sampler

    eos = 0
    logits = torch.zeros(1, VOCAB)
    logits[0, 9] = 5.0
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[eos, 9])]
    out = Sampler().sample(logits, params, [3], banned=[(eos,)], bad=[(9,)])
    assert out == [eos]
    # Without the bad word, min_tokens' ban holds where it leaves an allowed id.
    assert Sampler().sample(logits, params, [3], banned=[(eos,)]) == [9]


def test_the_output_is_read_from_where_it_starts():
    # The prompt's last ids and the output's first do not make a word (vLLM's rule).
    assert banned_by_bad_words(((1, 2),), [5, 1], start=2) == set()
    assert banned_by_bad_words(((1, 2),), [5, 1], start=1) == {2}


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "defer"), [("uni", "1"), ("mp", "1"), ("mp", "0")])
def test_async_engine_bans_a_pair_every_step_as_the_sync_engine_does(backend, defer, monkeypatch):
    """The real model and executors: under async scheduling the ban that follows the token
    in flight reaches rank 0 after that token's update (the step already computing), and
    the answers are the synchronous engine's."""
    from engine.config import ParallelConfig
    from engine.llm import LLM
    from engine.worker.model_runner import DEFER_READBACK_ENV

    monkeypatch.setenv(DEFER_READBACK_ENV, defer)
    prompt = [3, 14, 15, 9, 26, 5]
    sync_config = EngineConfig(
        cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(async_scheduling=False)
    )
    with LLM(sync_config) as sync:
        (free,) = sync.generate_token_ids([prompt], SamplingParams(max_tokens=40, temperature=0))
        pairs = (_bigrams(free)[5], _bigrams(free)[20])
        params = SamplingParams(max_tokens=40, temperature=0, bad_words_token_ids=pairs)
        (want,) = sync.generate_token_ids([prompt], params)
    assert not set(pairs) & set(_bigrams(want)) and want != free
    cfg = EngineConfig(
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(async_scheduling=True),
        parallel=ParallelConfig(distributed_executor_backend=backend),
    )
    with LLM(cfg) as asyn:
        core, overlapped = asyn.core, []
        execute = core.executor.execute_model

        def counting(sched: Any, non_block: bool = False) -> Any:
            overlapped.append(len(core.scheduler.in_flight.scheduled) == 2)  # one in flight
            return execute(sched, non_block)

        core.executor.execute_model = counting  # type: ignore[method-assign]
        (got,) = asyn.generate_token_ids([prompt], params)
    assert got == want
    assert len(overlapped) == 40 and sum(overlapped) == 39, overlapped
