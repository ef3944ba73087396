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
