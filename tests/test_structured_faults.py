"""One request's grammar never takes down the engine: an llguidance call that raises on the
engine thread -- a Python exception, or a Rust panic (pyo3's ``PanicException``, a
``BaseException``) -- ends that request with an error, as a matcher in its error state
does, and every other request goes on as if it had not been there.

Fault injection: the bad request's matcher is a stand-in whose one method raises from its
``after``-th call on (llguidance computes regex derivatives lazily, so a grammar that
validated may still panic in a mask or a token's consumption).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.structured.compiler import GrammarCompiler
from engine.structured.matcher import GrammarState
from engine.structured.spec import StructuredOutput
from engine.tokenizer import ByteTokenizer

llg = pytest.importorskip("llguidance")

VOCAB = 512
# llguidance 1.9.1 panics in derivre on this regex (validate_grammar raises the panic).
PANICKY_REGEX = r"([éü]|([éü]|é|\{)|([^a])*)"


def panic_exception() -> BaseException:
    """A real ``pyo3_runtime.PanicException`` (its class is not importable by name)."""
    try:
        llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_regex(PANICKY_REGEX))
    except BaseException as e:  # noqa: BLE001 -- the panic is what we want
        assert type(e).__name__ == "PanicException", e
        return e
    pytest.skip("this llguidance no longer panics on the regex")


class Faulty:
    """A matcher whose ``method`` raises ``exc`` from its ``after``-th call on; every other
    method is the real matcher's. ``deep_copy`` (what a request gets) is faulty too."""

    def __init__(self, real: Any, method: str, exc: BaseException, after: int) -> None:
        self._real, self._method, self._exc, self._after = real, method, exc, after
        self.calls = 0

    def deep_copy(self) -> Faulty:
        return Faulty(self._real.deep_copy(), self._method, self._exc, self._after)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name != self._method:
            return attr

        def call(*args: Any) -> Any:
            self.calls += 1
            if self.calls >= self._after:
                raise self._exc
            return attr(*args)

        return call


def _compiler() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer, VOCAB)


# The matcher calls a constrained request makes on the engine thread, each step: the mask
# (schedule), its check (``is_error``), the token's consumption (update).
METHODS = ["unsafe_compute_mask_ptr", "is_error", "is_stopped", "consume_token"]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("raises", ["exception", "panic"])
def test_an_llguidance_call_that_raises_fails_its_request_alone(
    async_scheduling: bool, raises: str
) -> None:
    """Each matcher call of a step raising in turn (a mask, its check, a token's
    consumption): the bad request ends with an error naming llguidance's failure (a
    ``structured_output_stuck``, as a matcher in its error state ends); the requests
    beside it answer token for token what they answer alone; the engine serves on with
    every KV block free. (An exception made the engine dead; a panic, not an
    ``Exception``, ended the engine thread without a word: every request hung.)"""
    from engine.async_engine import AsyncLLMEngine
    from engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from engine.sampling_params import SamplingParams

    regex = "[a-z]{4,12}"
    so = StructuredOutput.regex(regex)
    good = [
        ("free", list(b"hello"), SamplingParams(max_tokens=16, temperature=0.0)),
        ("json", list(b"other"), SamplingParams(max_tokens=16, temperature=1.0, seed=3,
                                                structured_output=so)),
    ]  # fmt: skip
    bad_sp = SamplingParams(max_tokens=16, temperature=1.0, seed=5, structured_output=so)
    compiler = _compiler()
    cfg = EngineConfig(
        cache=CacheConfig(num_blocks=64),
        parallel=ParallelConfig(distributed_executor_backend="uni"),
        scheduler=SchedulerConfig(async_scheduling=async_scheduling),
    )
    eng = AsyncLLMEngine(cfg, log_level="WARNING")

    async def one(rid: str, prompt: list[int], sp: SamplingParams, grammar: Any) -> list[Any]:
        return [out async for out in eng.generate(rid, prompt, sp, grammar=grammar)]

    async def run(tag: str, bad: Any) -> dict[str, list[Any]]:
        reqs = [(f"{rid}-{tag}", p, sp, compiler.compile(so) if sp.structured_output else None)
                for rid, p, sp in good]  # fmt: skip
        if bad is not None:
            reqs.insert(1, (f"bad-{tag}", list(b"hi"), bad_sp, bad))
        outs = await asyncio.wait_for(asyncio.gather(*(one(*r) for r in reqs)), 60)
        return {rid.split("-")[0]: out for (rid, *_), out in zip(reqs, outs, strict=True)}

    def tokens(outs: list[Any]) -> list[int]:
        return [t for o in outs for t in o.new_token_ids]

    exc = RuntimeError("llguidance bug") if raises == "exception" else panic_exception()
    try:
        want = asyncio.run(run("ref", None))
        for method in METHODS:
            tag = f"{method}.{raises}"
            bad = Faulty(compiler.compile(so), method, exc, after=3)
            got = asyncio.run(run(tag, bad))
            assert eng.healthy, (tag, eng.dead_reason)
            last = got["bad"][-1]
            assert last.finished and last.finish_reason == "error", (tag, last)
            assert last.error_code == "structured_output_stuck", (tag, last)
            assert "llguidance failed" in (last.error or ""), (tag, last.error)
            for rid in ("free", "json"):
                assert tokens(got[rid]) == tokens(want[rid]), (tag, rid)
            stats = eng.core.scheduler.stats()
            assert stats.kv_blocks_free == stats.kv_blocks_total, tag
    finally:
        eng.shutdown()


@pytest.mark.parametrize("method", ["validate_tokens", "consume_token"])
@pytest.mark.parametrize("raises", ["exception", "panic"])
def test_a_decode_node_whose_llguidance_fails_on_the_first_token_fails_the_request(
    method: str, raises: str, caplog: pytest.LogCaptureFixture
) -> None:
    """D checks the prefill node's first token (``allows``: ``validate_tokens``) and takes
    it (``consume_token``): either call raising ends the request with llguidance's
    failure, its KV blocks free; the scheduler goes on. (It raised out of the step.)"""
    from fakes import RemotePrefill
    from test_request_metrics import _config

    from engine.core.request import Request
    from engine.core.scheduler import Scheduler
    from engine.core.scheduler_output import ModelRunnerOutput
    from engine.sampling_params import SamplingParams
    from kvconnector.params import KVTransferParams

    exc = RuntimeError("llguidance bug") if raises == "exception" else panic_exception()
    conn = RemotePrefill(_config())
    compiler = _compiler()
    sch = Scheduler(_config(), 64, 256, conn, compiler, VOCAB)
    so = StructuredOutput.regex("[0-9]{2}")
    sp = SamplingParams(max_tokens=8, structured_output=so)
    params = KVTransferParams(
        do_remote_prefill=True, transfer_id="t", remote_side_channel="tcp://127.0.0.1:1"
    )
    req = Request("d", list(range(1, 9)), sp, kv_transfer_params=params)
    req.grammar = GrammarState(Faulty(compiler.compile(so), method, exc, after=1).deep_copy())
    sch.add_request(req)
    sch.update_from_output(sch.schedule(), ModelRunnerOutput())  # waits for its KV
    conn.landed = {"d": {"first_token": ord("4")}}
    outs = sch.update_from_output(sch.schedule(), ModelRunnerOutput())
    for _ in range(3):  # it ends at the landing, or at its next mask
        if outs and outs[-1].finished:
            break
        outs = sch.update_from_output(sch.schedule(), ModelRunnerOutput())
    last = outs[-1]
    assert last.finished and last.finish_reason == "error", last
    assert last.error_code == "structured_output_stuck", last
    assert "llguidance failed" in (last.error or ""), last.error
    assert not sch.has_work() and sch.kv.pool.num_free == sch.kv.num_blocks
    if method == "validate_tokens":  # the log says the check failed, not P's token
        assert "does not follow" not in caplog.text
        assert "checking the prefill node's first token" in caplog.text


class _CopyFails:
    """A compiled matcher whose copy -- what each request gets -- fails."""

    def __init__(self, exc: BaseException) -> None:
        self._exc = exc

    def deep_copy(self) -> Any:
        raise self._exc


@pytest.mark.parametrize("raises", ["exception", "panic"])
def test_a_matcher_whose_copy_fails_refuses_its_request_and_the_scheduler_goes_on(
    raises: str,
) -> None:
    """An offline request's matcher is copied on the engine thread (``add_request``): an
    llguidance failure there is that request's ``InvalidRequestError`` naming its field
    (the engine thread died of it), and the next request is taken."""
    from fakes import RemotePrefill
    from test_request_metrics import _config

    from engine.core.request import Request
    from engine.core.scheduler import Scheduler
    from engine.sampling_params import InvalidRequestError, SamplingParams

    exc = RuntimeError("llguidance bug") if raises == "exception" else panic_exception()
    compiler = _compiler()
    sch = Scheduler(_config(), 64, 256, RemotePrefill(_config()), compiler, VOCAB)
    so = StructuredOutput.regex("[0-9]{2}")
    compiler._cache.put(so.key, _CopyFails(exc))  # the compiled template, as cached
    with pytest.raises(InvalidRequestError) as e:
        sch.add_request(Request("a", [1, 2, 3], SamplingParams(structured_output=so)))
    assert e.value.param == so.param and "llguidance failed" in str(e.value)
    sch.add_request(Request("b", [1, 2, 3], SamplingParams(max_tokens=2)))
    assert sch.has_work()
    with pytest.raises(KeyboardInterrupt):  # not an llguidance failure: raised as it is
        from engine.structured.compiler import copy_matcher

        copy_matcher(_CopyFails(KeyboardInterrupt()), so)
