"""AsyncLLMEngine: requests are checked once, by the scheduler, and a refusal comes back
through the refused request's own stream."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.sampling_params import InvalidRequestError, SamplingParams
from kvconnector.params import KVTransferParams

pytestmark = pytest.mark.slow  # the engine runs a worker process

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLMEngine(
        EngineConfig(model=ModelConfig(max_model_len=64), cache=CacheConfig(num_blocks=64)),
        log_level="WARNING",
    )
    try:
        yield eng
    finally:
        eng.shutdown()


async def _collect(engine: AsyncLLMEngine, rid: str, prompt: list[int], **kw) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(rid, prompt, GREEDY, **kw):
        tokens.extend(out.new_token_ids)
    return tokens


def _refusal(engine: AsyncLLMEngine, rid: str, prompt: list[int], **kw) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(_collect(engine, rid, prompt, **kw))
    return info.value


def test_the_scheduler_refuses_bad_prompts(engine):
    err = _refusal(engine, "empty", [])
    assert (str(err), err.param) == ("the prompt is empty", "prompt")
    err = _refusal(engine, "long", [1] * 65)
    assert err.param == "prompt"
    assert str(err) == "the prompt has 65 tokens; this model's maximum context length is 64 tokens"


def test_a_prompt_that_fills_the_context_gets_its_one_token(engine):
    """As vLLM's engine: a prompt as long as the context is taken; its first sampled token
    ends it at the context (what echo with max_tokens 0 needs: that token is left out)."""
    assert len(asyncio.run(_collect(engine, "full", [1] * 64))) == 1


def test_transfer_params_without_a_connector_are_refused(engine):
    params = KVTransferParams(do_remote_decode=True, transfer_id="t")
    err = _refusal(engine, "pd", [1, 2, 3], kv_transfer_params=params)
    assert err.param == "kv_transfer_params" and "--kv-connector nixl" in str(err)


def test_a_duplicate_id_is_refused_and_does_not_take_over_the_first_stream(engine):
    async def run() -> tuple[list[int], BaseException | list[int]]:
        first_out: list[int] = []
        first = engine.generate("dup", [5, 6, 7], GREEDY)
        out = await anext(first)  # "dup" is now running in the scheduler
        first_out.extend(out.new_token_ids)
        try:
            second: BaseException | list[int] = await _collect(engine, "dup", [9])
        except InvalidRequestError as e:
            second = e
        async for out in first:
            first_out.extend(out.new_token_ids)
        return first_out, second

    first, second = asyncio.run(run())
    assert isinstance(second, InvalidRequestError)
    assert (str(second), second.param) == ("request id 'dup' is already in use", "request_id")
    assert len(first) == GREEDY.max_tokens  # the first request kept its whole stream
    # The id is free again once its request finished.
    assert len(asyncio.run(_collect(engine, "dup", [9]))) == GREEDY.max_tokens


@pytest.mark.parametrize("raises", ["exception", "panic"])
def test_an_engine_loop_that_raises_between_steps_ends_its_requests_and_health(raises):
    """Fault injection: what the engine thread does after a step (here its stats snapshot,
    a bug) raises. The thread used to die silently there -- outside the guard that turns a
    failed step into a dead engine -- so every request waited for good and ``/health``
    stayed 200; now the engine is dead: requests end with its error, ``healthy`` is False.
    So with a Rust panic (pyo3's ``PanicException``, a ``BaseException``)."""
    if raises == "panic":
        from test_structured_faults import panic_exception

        bug: BaseException = panic_exception()
        bug.args = ("stats bug",)
    else:
        bug = RuntimeError("stats bug")
    eng = AsyncLLMEngine(
        EngineConfig(model=ModelConfig(max_model_len=64), cache=CacheConfig(num_blocks=64)),
        log_level="WARNING",
    )
    try:
        real_stats = eng.core.stats

        def broken_stats():  # once a request is in: after its first step
            if eng.core.scheduler.requests:
                raise bug
            return real_stats()

        eng.core.stats = broken_stats  # type: ignore[method-assign]

        async def run() -> list:
            outs = []
            async for out in eng.generate("r", [1, 2, 3], GREEDY):
                outs.append(out)
            return outs

        async def bounded() -> list:  # a hang shows as a TimeoutError, never as a pass
            return await asyncio.wait_for(run(), 60)

        outs = asyncio.run(bounded())
        assert outs[-1].finished and "stats bug" in (outs[-1].error or ""), outs[-1]
        assert not eng.healthy and "stats bug" in (eng.dead_reason or "")
        with pytest.raises(RuntimeError, match="engine is dead"):
            asyncio.run(bounded())
    finally:
        eng.shutdown()


def test_a_request_whose_event_loop_closed_does_not_stop_the_engine(engine):
    """A caller's event loop closed with its request still running (an ``asyncio.run`` that
    ended mid-stream, its generator never closed): the engine's next output for it has
    nowhere to go. Delivering it raised in the engine thread, which died silently: every
    later request waited for good. Now it is dropped and the engine serves on."""
    loop = asyncio.new_event_loop()
    gen = engine.generate("orphan", [1, 2, 3], GREEDY)
    loop.run_until_complete(anext(gen))  # running; 23 more tokens to come
    loop.close()

    async def bounded() -> list[int]:  # a hang shows as a TimeoutError, never as a pass
        return await asyncio.wait_for(_collect(engine, "after", [4, 5, 6]), 60)

    assert len(asyncio.run(bounded())) == GREEDY.max_tokens
    assert engine.healthy
    del gen
