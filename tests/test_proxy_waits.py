"""The proxy waiting on one leg of a pair while the other has already answered, against
stand-in nodes on loopback: the wait sleeps (it does not spin the event loop at full CPU),
and a leg failing still ends it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from harness import sse_chunk_events

from proxy.config import ProxyConfig
from proxy.legs import Attempt, Legs, UpstreamError
from proxy.node_client import NodeClient
from proxy.nodes import NodePool
from proxy.validation import COMPLETIONS, validate_request
from tests.standin_http import SeenRequest, StandIn, answer, chunked

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _hung_after_half_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode node may be judged hung 0.5 s after its first missed check (5 s in use):
    these tests miss checks on purpose and should not wait."""
    import proxy.legs

    monkeypatch.setattr(proxy.legs, "MIN_HUNG_S", 0.5)


PREFILL_ANSWER = {
    "choices": [{"index": 0, "text": "a", "finish_reason": "length", "token_ids": [7]}],
    "kv_transfer_params": {"first_token": 7},
}
STREAM_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
WAIT_S = 1.0


def _node(leg: Any) -> Any:
    """A stand-in node's handler: ``/v1/abort`` answered 200, every other call by ``leg``."""

    async def handler(req: SeenRequest) -> Any:
        if req.path == "/v1/abort":
            return answer(200, {})
        return await leg(req)

    return handler


def _pair(p: StandIn, d: StandIn) -> tuple[Any, Any, Any]:
    cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,))
    pool = NodePool(cfg.prefill, cfg.decode)
    p_node, d_node = pool.nodes("prefill")[0], pool.nodes("decode")[0]
    p_node.update_info({"side_channel": "tcp://127.0.0.1:1"}, None)
    req = validate_request(COMPLETIONS, b'{"prompt": "x", "max_tokens": 2}', ["m"], None)
    return p_node, d_node, req


@contextlib.asynccontextmanager
async def _attempt(prefill: Any, decode: Any) -> AsyncIterator[tuple[Attempt, Legs]]:
    """One P/D attempt against stand-in nodes answering with ``prefill`` and ``decode``."""
    async with (
        StandIn(_node(prefill)) as p,
        StandIn(_node(decode)) as d,
        NodeClient(timeout=10) as c,
    ):
        p_node, d_node, req = _pair(p, d)
        legs = Legs(c)
        yield Attempt(legs, req, p_node, d_node, "r", skip_first=False), legs


async def _timed(coro: Any) -> tuple[Any, float, float]:
    """(result, wall seconds, the event loop thread's CPU seconds) of awaiting ``coro``
    (the thread's own: a busy thread an earlier test left in this pytest process is not
    counted; the spin these tests catch was on the loop)."""
    wall, cpu = time.monotonic(), time.thread_time()
    out = await coro
    return out, time.monotonic() - wall, time.thread_time() - cpu


def test_waiting_for_the_decode_answer_after_the_prefill_answered_sleeps() -> None:
    """A non-streaming P/D request: P answers at once, D after its whole decode. The wait
    for D must not spin (it did: every loop turn re-awaited the finished prefill leg, a
    core at 100% for the whole decode of every non-streaming request)."""

    async def prefill(req: SeenRequest) -> bytes:
        return answer(200, PREFILL_ANSWER)

    async def decode(req: SeenRequest) -> bytes:
        await asyncio.sleep(WAIT_S)
        return answer(200, {"choices": []})

    async def main() -> None:
        async with _attempt(prefill, decode) as (attempt, legs):
            resp, wall, cpu = await _timed(attempt.wait_decode())
            assert resp.status_code == 200 and wall >= WAIT_S * 0.9
            assert cpu < 0.25 * wall, f"{cpu:.2f} s of CPU in {wall:.2f} s waiting"
            attempt.finished = True
            attempt.release()

    asyncio.run(main())


def test_waiting_for_the_prefill_answer_after_the_decode_stream_opened_sleeps() -> None:
    """A streamed P/D request: D's stream opens at once, P answers after its prefill."""

    async def prefill(req: SeenRequest) -> bytes:
        await asyncio.sleep(WAIT_S)
        return answer(200, PREFILL_ANSWER)

    async def decode_head(req: SeenRequest) -> Any:
        return STREAM_HEAD + b"5\r\ndata:\r\n"  # and nothing more for now

    async def main() -> None:
        async with _attempt(prefill, decode_head) as (attempt, legs):
            first, wall, cpu = await _timed(attempt.wait_prefill())
            assert first["kv_transfer_params"]["first_token"] == 7 and wall >= WAIT_S * 0.9
            assert attempt.d_task.done()  # D's stream was open all along
            assert cpu < 0.25 * wall, f"{cpu:.2f} s of CPU in {wall:.2f} s waiting"
            attempt.release()
            await legs.drain()

    asyncio.run(main())


def test_a_decode_failure_still_ends_the_wait_for_the_prefill_answer() -> None:
    async def prefill(req: SeenRequest) -> bytes:
        await asyncio.sleep(30)
        return answer(200, PREFILL_ANSWER)

    async def decode(req: SeenRequest) -> bytes:
        await asyncio.sleep(0.2)
        return answer(500, {"error": {"message": "boom", "type": "server_error"}})

    async def main() -> None:
        async with _attempt(prefill, decode) as (attempt, legs):
            with pytest.raises(UpstreamError, match="HTTP 500"):
                await asyncio.wait_for(attempt.wait_prefill(), 10)
            attempt.release()
            await legs.drain()

    asyncio.run(main())


def _sse(*events: Any) -> list[bytes]:
    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


def _token(i: int, finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "text": f"t{i}", "token_ids": [i], "finish_reason": finish}
    return {"choices": [choice], "model": "tiny"}


@contextlib.asynccontextmanager
async def _session(
    cfg: ProxyConfig, pool: NodePool, stream: bool, **fields: Any
) -> AsyncIterator[Any]:
    """A Session for one request (``{"prompt": "x", "max_tokens": 3}`` and ``fields``),
    closed after."""
    from proxy.metrics import ProxyMetrics
    from proxy.router import Router
    from proxy.session import Session

    body = {"prompt": "x", "max_tokens": 3, "stream": stream, **fields}
    req = validate_request(COMPLETIONS, json.dumps(body).encode(), ["tiny"], None)
    async with NodeClient(timeout=20) as client:
        legs = Legs(client)
        session = Session(req, "r", cfg, Router(pool), legs, ProxyMetrics(pool))
        try:
            yield session
        finally:
            session.close()
            await legs.drain()


async def _complete_through_session(cfg: ProxyConfig, pool: NodePool, setup: Any = None) -> Any:
    """The answer to one non-streamed request through a Session."""
    async with _session(cfg, pool, stream=False) as session:
        if setup is not None:
            setup()
        return await asyncio.wait_for(session.complete(), 15)


async def _stream_through_session(
    cfg: ProxyConfig, pool: NodePool, setup: Any = None, **fields: Any
) -> Any:
    """The client's token ids and events of one streamed request through a Session."""
    async with _session(cfg, pool, stream=True, **fields) as session:
        if setup is not None:
            setup()
        await asyncio.wait_for(session.start_stream(), 20)
        chunks = [c async for c in session.events()]
    events = sse_chunk_events(chunks)
    ids = [t for e in events for ch in e.get("choices", []) for t in ch.get("token_ids") or []]
    return ids, events


@contextlib.asynccontextmanager
async def _p_and_ds(
    prefill: Any, *decodes: Any, **cfg_kw: Any
) -> AsyncIterator[tuple[ProxyConfig, NodePool, list[StandIn]]]:
    """One P and a D per leg in ``decodes`` (round robin: the first attempt goes to the
    first) answering with the given legs; yields the config, a ready pool and the D's
    stand-ins."""
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(StandIn(_node(prefill)))
        ds = [await stack.enter_async_context(StandIn(_node(d))) for d in decodes]
        cfg = ProxyConfig(
            prefill=(p.url,), decode=tuple(d.url for d in ds), health_interval=0.1,
            routing="round_robin", **cfg_kw,
        )  # fmt: skip
        yield cfg, _ready_pool(cfg), ds


@contextlib.asynccontextmanager
async def _p_and_two_d(
    prefill: Any, d1: Any, d2: Any, **cfg_kw: Any
) -> AsyncIterator[tuple[ProxyConfig, NodePool, StandIn]]:
    """``_p_and_ds`` with two D's; yields D1's stand-in."""
    async with _p_and_ds(prefill, d1, d2, **cfg_kw) as (cfg, pool, ds):
        yield cfg, pool, ds[0]


def _ready_pool(cfg: ProxyConfig) -> NodePool:
    pool = NodePool(cfg.prefill, cfg.decode)
    for node in pool.all():
        node.update_info({"side_channel": "tcp://127.0.0.1:1"}, {"data": [{"id": "tiny"}]})
        node.set_healthy(True)
    return pool


def test_a_decode_stream_whose_first_token_comes_before_the_prefill_answer_is_sent_once() -> None:
    """D's stream carries every token (it did not drop the first) and its first token
    comes before P's answer: D's stream is the answer, each token once, P not waited for."""

    async def prefill(req: SeenRequest) -> bytes:
        await asyncio.sleep(5)
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def decode(req: SeenRequest) -> bytes:
        return chunked(200, _sse(_token(7), _token(8), _token(9, "length")))

    async def main() -> None:
        async with StandIn(_node(prefill)) as p, StandIn(_node(decode)) as d:
            cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,), health_interval=0.1)
            wall = time.monotonic()
            ids, events = await _stream_through_session(cfg, _ready_pool(cfg))
            assert ids == [7, 8, 9], events
            assert time.monotonic() - wall < 4, "waited for P's answer"
            # D finished; P's leg, still running, is aborted (it would wait for a
            # reservation until its own deadline), D's is not.
            assert [r.json() for r in p.seen if r.path == "/v1/abort"] == [
                {"transfer_id": p.seen[0].json()["kv_transfer_params"]["transfer_id"]}
            ]
            assert not [r for r in d.seen if r.path == "/v1/abort"]

    asyncio.run(main())


def test_with_node_skip_first_token_an_unreachable_prefill_node_is_retried() -> None:
    """D leaves the first token out (``--node-skip-first-token``), so only P can give it:
    P1 hangs (its health check gets no answer); the request moves to P2 and gets every token once."""

    async def hung(req: SeenRequest) -> bytes:
        await asyncio.sleep(30)
        return answer(200, PREFILL_ANSWER)

    async def prefill(req: SeenRequest) -> bytes:
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def decode(req: SeenRequest) -> bytes:
        assert req.json()["kv_transfer_params"]["skip_first_token"] is True
        return chunked(200, _sse(_token(8), _token(9, "length")))

    async def main() -> None:
        async with (
            StandIn(_node(hung)) as p1,
            StandIn(_node(prefill)) as p2,
            StandIn(_node(decode)) as d,
        ):
            cfg = ProxyConfig(
                prefill=(p1.url, p2.url), decode=(d.url,), health_interval=0.1,
                node_skip_first_token=True, routing="round_robin",
            )  # fmt: skip
            pool = _ready_pool(cfg)
            hung_node = pool.nodes("prefill")[0]

            def leave_soon() -> None:
                asyncio.get_running_loop().call_later(0.5, hung_node.mark_unreachable, "hung")

            wall = time.monotonic()
            ids, events = await _stream_through_session(cfg, pool, leave_soon)
            assert ids == [7, 8, 9], events
            # Not held until the node client's timeout (10 s) ended P1's leg.
            assert time.monotonic() - wall < 5
            assert len([r for r in p1.seen if r.path == "/v1/completions"]) == 1

    asyncio.run(main())


@pytest.mark.parametrize("skip", [False, True])
def test_a_prefill_node_that_starts_draining_mid_prefill_still_gives_the_first_token(
    skip: bool,
) -> None:
    """P answers its health check 503 (draining) while it computes a prefill: it finishes
    the legs it has, so the stream waits for it. (P out of rotation for any reason
    failed the attempt with --node-skip-first-token: a 503 "no healthy pair" in a rolling
    restart; found by review.)"""

    async def prefill(req: SeenRequest) -> bytes:
        await asyncio.sleep(1.0)
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def decode(req: SeenRequest) -> bytes:
        await asyncio.sleep(1.1)  # D waits for the KV, then streams
        tokens = [_token(8), _token(9, "length")]
        return chunked(200, _sse(*([] if skip else [_token(7)]), *tokens))

    async def main() -> None:
        async with StandIn(_node(prefill)) as p, StandIn(_node(decode)) as d:
            cfg = ProxyConfig(
                prefill=(p.url,), decode=(d.url,), health_interval=0.1,
                node_skip_first_token=skip,
            )  # fmt: skip
            pool = _ready_pool(cfg)
            p_node = pool.nodes("prefill")[0]

            def drain_soon() -> None:
                loop = asyncio.get_running_loop()
                loop.call_later(0.3, p_node.set_healthy, False, "health check answered 503")

            ids, events = await _stream_through_session(cfg, pool, drain_soon)
            assert ids == [7, 8, 9], events

    asyncio.run(main())


def test_a_decode_stream_that_fails_before_any_token_while_p_hangs_is_retried() -> None:
    """P hangs; D1's stream ends with an error event before any token: nothing reached the
    client, so the request moves to another pair (D2's stream is the answer). It used to
    end as a 200 stream holding only the error."""

    async def hung(req: SeenRequest) -> bytes:
        await asyncio.sleep(8)
        return answer(200, PREFILL_ANSWER)

    async def broken(req: SeenRequest) -> bytes:
        return chunked(200, _sse({"error": {"message": "engine died", "type": "server_error"}}))

    async def decode(req: SeenRequest) -> bytes:
        return chunked(200, _sse(_token(7), _token(8), _token(9, "length")))

    async def main() -> None:
        async with _p_and_two_d(hung, broken, decode) as (cfg, pool, d1):
            wall = time.monotonic()
            ids, events = await _stream_through_session(cfg, pool)
            assert ids == [7, 8, 9] and not any("error" in e for e in events), events
            assert time.monotonic() - wall < 6
            assert len([r for r in d1.seen if r.path == "/v1/completions"]) == 1

    asyncio.run(main())


def _key(url: str) -> Any:
    from proxy.node_client import _split

    return _split(url)[0]


def _miss_checks(node: Any, n: int, every_s: float = 0.2) -> None:
    """``n`` health checks of ``node`` in a row get no answer, one every ``every_s``."""
    loop = asyncio.get_running_loop()
    for i in range(n):
        loop.call_later(every_s * (i + 1), node.mark_unreachable, "health check timed out")


def test_a_decode_node_is_given_up_only_after_its_checks_in_a_row_got_no_answer() -> None:
    """One missed health check is not a hung node (a loaded node may answer one late);
    ``unreachable_checks`` in a row are, once ``MIN_HUNG_S`` passed since the first began;
    any answer starts the count again."""
    import proxy.legs

    async def main() -> None:
        async with _attempt(lambda r: answer(200, PREFILL_ANSWER), lambda r: None) as (a, _):
            a.d_checks = 3
            for _ in range(2):
                a.d.mark_unreachable("timed out")
            assert a.d_gone() is None
            a.d.mark_reachable()
            for _ in range(2):
                a.d.mark_unreachable("timed out")
            assert a.d_gone() is None
            a.d.mark_unreachable("timed out")
            assert a.d_gone() is None  # not for MIN_HUNG_S after the first miss began
            a.d.unreachable_since -= proxy.legs.MIN_HUNG_S
            assert "3 health checks in a row" in str(a.d_gone())
            # Bytes of some answer came from D since the first missed check began: alive.
            a.legs.client.heard[_key(a.d.url)] = a.d.unreachable_since + 0.001
            assert a.d_gone() is None
            a.legs.client.heard[_key(a.d.url)] = a.d.unreachable_since - 0.001
            assert a.d_gone() is not None
            a.d_checks = 0  # never
            assert a.d_gone() is None

    asyncio.run(main())


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def test_a_decode_node_that_misses_its_checks_but_still_streams_is_not_cut() -> None:
    """D's health checks time out (a loaded node) while its stream goes on slowly, a
    token every 0.3 s, longer than the proxy's poll: D is alive and the answer whole."""

    async def prefill(req: SeenRequest) -> bytes:
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def decode(req: SeenRequest) -> AsyncIterator[bytes]:
        async def pieces() -> AsyncIterator[bytes]:
            events = _sse(*(_token(i) for i in range(7, 13)), _token(13, "length"))
            yield STREAM_HEAD
            for e in events:
                yield _chunk(e)
                await asyncio.sleep(0.3)
            yield b"0\r\n\r\n"

        return pieces()

    async def main() -> None:
        async with StandIn(_node(prefill)) as p, StandIn(_node(decode)) as d:
            cfg = ProxyConfig(
                prefill=(p.url,), decode=(d.url,), health_interval=0.05, unreachable_checks=3
            )
            pool = _ready_pool(cfg)
            d_node = pool.nodes("decode")[0]
            ids, events = await _stream_through_session(
                cfg, pool, lambda: _miss_checks(d_node, 6, every_s=0.1)
            )
            assert d_node.unreachable_checks == 6  # the rule was in force
            assert ids == list(range(7, 14)), events
            assert not any("error" in e for e in events), events

    asyncio.run(main())


def test_a_decode_stream_that_hangs_mid_answer_ends_once_the_node_misses_its_checks() -> None:
    """D streams two tokens, then hangs with its connection open. The stream used to
    wait for D's next bytes until the request timeout (600 s by default); now it ends
    with an error event once D's health checks got no answer ``unreachable_checks``
    times in a row."""

    async def prefill(req: SeenRequest) -> bytes:
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def decode(req: SeenRequest) -> bytes:
        # No end: the node hangs mid-answer.
        return STREAM_HEAD + b"".join(_chunk(e) for e in _sse(_token(7), _token(8))[:2])

    async def main() -> None:
        async with StandIn(_node(prefill)) as p, StandIn(_node(decode)) as d:
            cfg = ProxyConfig(
                prefill=(p.url,), decode=(d.url,), health_interval=0.1, unreachable_checks=3
            )
            pool = _ready_pool(cfg)
            d_node = pool.nodes("decode")[0]
            ids, events = await _stream_through_session(
                cfg, pool, lambda: _miss_checks(d_node, 3, every_s=0.5)
            )
            assert ids == [7, 8], events
            assert "error" in events[-1], events
            assert "3 health checks in a row" in events[-1]["error"]["message"], events

    asyncio.run(main())


def test_a_non_streamed_request_whose_decode_node_hangs_moves_to_another_pair() -> None:
    """D1 takes the request and never answers (hung, connection open): once D1 missed
    its health checks the request is retried on D2 (it used to wait for the request
    timeout, 600 s by default, before failing over)."""

    async def prefill(req: SeenRequest) -> bytes:
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def hung(req: SeenRequest) -> bytes:
        await asyncio.sleep(30)
        return answer(500, {})

    async def decode(req: SeenRequest) -> bytes:
        return answer(200, {"choices": [{"index": 0, "text": "abc", "token_ids": [7, 8, 9]}]})

    async def main() -> None:
        async with _p_and_two_d(prefill, hung, decode) as (cfg, pool, d1):
            hung_node = pool.nodes("decode")[0]
            out = await _complete_through_session(
                cfg, pool, lambda: _miss_checks(hung_node, cfg.unreachable_checks)
            )
            assert out["choices"][0]["token_ids"] == [7, 8, 9]
            assert len([r for r in d1.seen if r.path == "/v1/completions"]) == 1
            assert "health checks in a row" in (hung_node.last_error or ""), hung_node

    asyncio.run(main())


def test_a_prestreamed_request_whose_decode_node_hangs_before_answering_moves_on() -> None:
    """D1 takes the decode leg and never answers (hung before its headers); P waits for
    D1's reservation, which never comes (it would end the leg at its KV timeout, 30 s by
    default, and the proxy would blame P). Once D1 missed its checks the attempt is given
    up on D1 and the request moves to D2."""
    p_calls = []

    async def prefill(req: SeenRequest) -> bytes:
        p_calls.append(req)
        if len(p_calls) == 1:
            await asyncio.sleep(40)  # no reservation comes from the hung D1
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def hung(req: SeenRequest) -> bytes:
        await asyncio.sleep(40)
        return answer(500, {})

    async def decode(req: SeenRequest) -> bytes:
        return chunked(200, _sse(_token(7), _token(8), _token(9, "length")))

    async def main() -> None:
        async with _p_and_two_d(prefill, hung, decode) as (cfg, pool, _):
            hung_node, p_node = pool.nodes("decode")[0], pool.nodes("prefill")[0]
            ids, events = await _stream_through_session(
                cfg, pool, lambda: _miss_checks(hung_node, cfg.unreachable_checks)
            )
            assert ids == [7, 8, 9] and not any("error" in e for e in events), events
            assert "health checks in a row" in (hung_node.last_error or ""), hung_node
            assert p_node.healthy and p_node.failures_total == 0  # not blamed

    asyncio.run(main())


def test_a_non_streamed_answer_that_stops_midway_moves_to_another_pair() -> None:
    """D1 sends its answer's headers and half its body, then hangs: the read of the
    rest is given up once D1 missed its checks, and D2 answers."""

    async def prefill(req: SeenRequest) -> bytes:
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def half(req: SeenRequest) -> bytes:
        whole = answer(200, {"choices": [{"index": 0, "text": "abc", "token_ids": [1, 2, 3]}]})
        return whole[: len(whole) - 10]  # Content-Length promises 10 bytes more

    async def decode(req: SeenRequest) -> bytes:
        return answer(200, {"choices": [{"index": 0, "text": "abc", "token_ids": [7, 8, 9]}]})

    async def main() -> None:
        async with _p_and_two_d(prefill, half, decode) as (cfg, pool, _):
            hung_node = pool.nodes("decode")[0]
            out = await _complete_through_session(
                cfg, pool, lambda: _miss_checks(hung_node, cfg.unreachable_checks)
            )
            assert out["choices"][0]["token_ids"] == [7, 8, 9]
            assert "health checks in a row" in (hung_node.last_error or ""), hung_node

    asyncio.run(main())


@pytest.mark.parametrize("skip", [False, True])
def test_a_decode_stream_that_breaks_before_its_first_token_after_p_streamed_is_rerun(
    skip: bool,
) -> None:
    """P's first token went to the client; D1's stream then breaks before any of its own
    tokens (its connection closes after the headers). Nothing of D1 reached the client,
    so the request reruns on a pair that agrees on the first token (P again, D2) and the
    client gets every token once. It used to end with an error event after P's token."""
    p_calls = []

    async def prefill(req: SeenRequest) -> bytes:
        p_calls.append(req)
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def broken(req: SeenRequest) -> tuple[bytes, bool]:
        await asyncio.sleep(0.3)  # P's token is streamed first
        return STREAM_HEAD, True  # headers, then the connection closes

    async def decode(req: SeenRequest) -> bytes:
        tokens = [_token(8), _token(9, "length")]
        if not req.json()["kv_transfer_params"].get("skip_first_token"):
            tokens.insert(0, _token(7))
        return chunked(200, _sse(*tokens))

    async def main() -> None:
        async with _p_and_two_d(prefill, broken, decode, node_skip_first_token=skip) as (
            cfg, pool, d1,
        ):  # fmt: skip
            ids, events = await _stream_through_session(cfg, pool)
            assert ids == [7, 8, 9] and not any("error" in e for e in events), events
            assert len(p_calls) == 2  # the rerun asked P again (its first token checked)
            assert len([r for r in d1.seen if r.path == "/v1/completions"]) == 1

    asyncio.run(main())


def test_a_prestreamed_request_whose_only_prefill_node_dies_is_answered_by_the_decode_node() -> (
    None
):
    """P's connection breaks before its first token (SIGKILL) and no other P is ready. D's
    leg is open and D recomputes the prompt when its KV does not come -- as for a P that
    hangs -- so D's stream is the client's whole answer. It used to be a 503 (no other
    pair to retry on), while a hung P's requests were answered."""

    async def dead(req: SeenRequest) -> None:
        await asyncio.sleep(0.2)
        return None  # the connection closes without an answer

    async def decode(req: SeenRequest) -> bytes:
        await asyncio.sleep(0.8)  # D's first token comes once it recomputed the prompt
        return chunked(200, _sse(_token(7), _token(8), _token(9, "length")))

    async def main() -> None:
        async with StandIn(_node(dead)) as p, StandIn(_node(decode)) as d:
            cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,), health_interval=0.1)
            pool = _ready_pool(cfg)
            ids, events = await _stream_through_session(cfg, pool)
            assert ids == [7, 8, 9] and not any("error" in e for e in events), events
            assert not pool.nodes("prefill")[0].healthy  # P is out of rotation all the same

    asyncio.run(main())


def test_with_another_prefill_node_ready_a_dead_one_is_retried_on_a_pair() -> None:
    """With another P ready the request is retried on a pair (D need not prefill)."""

    async def dead(req: SeenRequest) -> None:
        return None

    async def prefill(req: SeenRequest) -> bytes:
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def decode(req: SeenRequest) -> bytes:
        return chunked(200, _sse(_token(7), _token(8), _token(9, "length")))

    async def main() -> None:
        async with (
            StandIn(_node(dead)) as p1,
            StandIn(_node(prefill)) as p2,
            StandIn(_node(decode)) as d,
        ):
            cfg = ProxyConfig(
                prefill=(p1.url, p2.url), decode=(d.url,), health_interval=0.1,
                routing="round_robin",
            )  # fmt: skip
            ids, events = await _stream_through_session(cfg, _ready_pool(cfg))
            assert ids == [7, 8, 9] and not any("error" in e for e in events), events
            assert len([r for r in p2.seen if r.path == "/v1/completions"]) == 1

    asyncio.run(main())


def test_a_non_streamed_request_whose_only_prefill_node_dies_is_answered_by_the_decode_node() -> (
    None
):
    """As for streams: P dead, no other P, D's leg open -- D's answer is the client's."""

    async def dead(req: SeenRequest) -> None:
        await asyncio.sleep(0.2)
        return None

    async def decode(req: SeenRequest) -> bytes:
        await asyncio.sleep(0.8)
        return answer(200, {"choices": [{"index": 0, "text": "abc", "token_ids": [7, 8, 9]}]})

    async def main() -> None:
        async with StandIn(_node(dead)) as p, StandIn(_node(decode)) as d:
            cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,), health_interval=0.1)
            pool = _ready_pool(cfg)
            out = await _complete_through_session(cfg, pool)
            assert out["choices"][0]["token_ids"] == [7, 8, 9]
            assert not pool.nodes("prefill")[0].healthy

    asyncio.run(main())


@pytest.mark.parametrize("fields", [{"stop": ["@@"]}, {"echo": True}], ids=["stop", "echo"])
def test_a_stream_not_prestreamed_whose_only_prefill_node_dies_is_answered_by_the_decode_node(
    fields: dict[str, Any],
) -> None:
    """As for prestreamed and non-streamed requests: P dead, no other P, D's leg open --
    D's stream (the whole answer: a stop string, echo) is the client's. It was a 503
    ``no_healthy_nodes``: the request was retried, and no P was left."""

    async def dead(req: SeenRequest) -> None:
        await asyncio.sleep(0.2)
        return None

    async def decode(req: SeenRequest) -> bytes:
        await asyncio.sleep(0.8)
        return chunked(200, _sse(_token(7), _token(8), _token(9, "length")))

    async def main() -> None:
        async with StandIn(_node(dead)) as p, StandIn(_node(decode)) as d:
            cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,), health_interval=0.1)
            pool = _ready_pool(cfg)
            ids, events = await _stream_through_session(cfg, pool, **fields)
            assert ids == [7, 8, 9] and not any("error" in e for e in events), events
            assert not pool.nodes("prefill")[0].healthy
            assert pool.nodes("decode")[0].healthy

    asyncio.run(main())


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_prefill_node_that_fails_after_the_decode_node_answered_leaves_the_rotation(
    stream: bool,
) -> None:
    """D's answer came first (its first token before P's answer: D recomputed the prompt),
    then P's leg ends with a 500 while D's answer is still being relayed: the client's
    answer is D's, whole, and P leaves the rotation, once, as for a P failing first (it
    stayed in rotation: nobody looked at P's leg again)."""

    async def failing(req: SeenRequest) -> bytes:
        await asyncio.sleep(0.3)
        return answer(500, {"error": {"message": "prefill died", "type": "server_error"}})

    async def decode(req: SeenRequest) -> Any:
        if req.json().get("stream"):
            first, rest = _sse(_token(7)), _sse(_token(8), _token(9, "length"))
            first = first[:-1]  # [DONE] comes with the rest
        else:
            body = json.dumps({"choices": [{"index": 0, "text": "t7t8t9", "token_ids": [7, 8, 9],
                                            "finish_reason": "length"}]}).encode()  # fmt: skip
            first, rest = [body[:10]], [body[10:]]

        async def pieces() -> AsyncIterator[bytes]:
            yield STREAM_HEAD + b"".join(_chunk(x) for x in first)
            await asyncio.sleep(1.0)  # P fails meanwhile
            yield b"".join(_chunk(x) for x in rest) + b"0\r\n\r\n"

        return pieces()

    async def main() -> None:
        async with StandIn(_node(failing)) as p, StandIn(_node(decode)) as d:
            cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,), health_interval=0.1)
            pool = _ready_pool(cfg)
            if stream:
                ids, events = await _stream_through_session(cfg, pool)
                assert ids == [7, 8, 9] and not any("error" in e for e in events), events
            else:
                out = await _complete_through_session(cfg, pool)
                assert out["choices"][0]["token_ids"] == [7, 8, 9], out
            p_node, d_node = pool.nodes("prefill")[0], pool.nodes("decode")[0]
            assert not p_node.healthy and p_node.failures_total == 1, p_node
            assert d_node.healthy and d_node.failures_total == 0, d_node

    asyncio.run(main())


def test_a_decode_leg_that_fails_unlooked_at_still_takes_its_node_out_of_rotation() -> None:
    """D's leg ends with a 500 while the request looks elsewhere, and the attempt is
    dropped before anything reads D's leg again (as when P's leg ended too and was handled
    first: a streamed request's wait for P's first token looks at P first): D leaves the
    rotation, once, as a failing prefill leg does. It stayed in rotation (found by
    tests/test_property_proxy_faults.py: P's 409 ``kv_transfer_not_reserved`` and D's 500
    arriving together; the request moved on, D kept getting requests)."""

    async def prefill(req: SeenRequest) -> bytes:
        await asyncio.sleep(30)  # cancelled by the release
        return answer(200, PREFILL_ANSWER)

    async def decode(req: SeenRequest) -> bytes:
        return answer(500, {"error": {"message": "engine died", "type": "server_error"}})

    async def main() -> None:
        async with _attempt(prefill, decode) as (attempt, legs):
            attempt.p.set_healthy(True)  # type: ignore[union-attr]
            attempt.d.set_healthy(True)
            for _ in range(500):
                if attempt.d_task.done():
                    break
                await asyncio.sleep(0.01)
            attempt.release()
            await legs.drain()
            d, p = attempt.d, attempt.p
            assert not d.healthy and d.failures_total == 1, d
            assert p is not None and p.healthy and p.failures_total == 0, p

    asyncio.run(main())


def test_an_unreachable_prefill_node_ends_the_wait_after_the_decode_stream_opened() -> None:
    """D's stream is open (a rerun after P's token was streamed) and P hangs: the wait for
    P's answer still ends once P is unreachable (a refactor once checked it only while D's
    leg was running: the client waited for --request-timeout)."""

    async def prefill(req: SeenRequest) -> bytes:
        await asyncio.sleep(30)
        return answer(200, PREFILL_ANSWER)

    async def decode(req: SeenRequest) -> Any:
        async def stream() -> AsyncIterator[bytes]:
            yield STREAM_HEAD
            await asyncio.sleep(30)

        return stream()

    async def main() -> None:
        async with _attempt(prefill, decode) as (attempt, legs):
            await asyncio.wait_for(asyncio.shield(attempt.d_task), 10)  # D's head came
            assert attempt.p is not None
            attempt.p.mark_unreachable("no answer", time.monotonic())
            with pytest.raises(UpstreamError, match="unreachable"):
                await asyncio.wait_for(attempt.wait_prefill(poll_s=0.1), 10)
            attempt.release()
            await legs.drain()

    asyncio.run(main())


def test_log_probabilities_are_not_waited_for_from_an_unreachable_prefill_node() -> None:
    """P hangs (unreachable); D's stream is the answer, its first entry's log probability
    null (P's to fill): the stream goes on once P is unreachable, that entry left null
    (it waited 30 s for P's answer before)."""

    async def prefill(req: SeenRequest) -> bytes:
        await asyncio.sleep(40)
        return answer(200, PREFILL_ANSWER)

    def lp_token(i: int, value: float | None, finish: str | None = None) -> dict[str, Any]:
        event = _token(i, finish)
        event["choices"][0]["logprobs"] = {
            "tokens": [f"t{i}"], "token_logprobs": [value], "top_logprobs": [None],
            "text_offset": [0],
        }  # fmt: skip
        return event

    async def decode(req: SeenRequest) -> bytes:
        return chunked(200, _sse(lp_token(7, None), lp_token(8, -0.5), lp_token(9, -1.0, "length")))

    async def main() -> None:
        async with StandIn(_node(prefill)) as p, StandIn(_node(decode)) as d:
            cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,), health_interval=0.1)
            pool = _ready_pool(cfg)
            p_node = pool.nodes("prefill")[0]

            def hung() -> None:  # once the request is on its way
                asyncio.get_running_loop().call_later(
                    0.3, p_node.mark_unreachable, "no answer", time.monotonic()
                )

            ids, events = await asyncio.wait_for(
                _stream_through_session(cfg, pool, hung, logprobs=1), 15
            )
            assert ids == [7, 8, 9], events
            values = [
                v for e in events for c in e.get("choices", [])
                for v in (c.get("logprobs") or {}).get("token_logprobs") or []
            ]  # fmt: skip
            assert values == [None, -0.5, -1.0], events

    asyncio.run(main())


def test_every_pair_failing_because_no_decode_node_reserved_in_time_is_a_503_to_retry():
    """Every prefill node ended its leg with 409 kv_transfer_not_reserved (the decode nodes
    were too full to reserve blocks within --kv-transfer-timeout): that is load, so the
    client gets 503 with Retry-After, not 502 upstream_error (found by a fault round: a
    decode node killed under load, the other full)."""
    from proxy.retries import PassThrough

    async def not_reserved(req: SeenRequest) -> bytes:
        body = {"error": {"message": "no decode node reserved blocks within 4 s",
                          "type": "invalid_request_error", "param": None,
                          "code": "kv_transfer_not_reserved"}}  # fmt: skip
        return answer(409, body)

    async def waiting_decode(req: SeenRequest) -> bytes:
        await asyncio.sleep(30)  # never reserved: its leg waits until it is cancelled
        return answer(200, {})

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            ps = [await stack.enter_async_context(StandIn(_node(not_reserved))) for _ in "ab"]
            d = await stack.enter_async_context(StandIn(_node(waiting_decode)))
            cfg = ProxyConfig(prefill=tuple(p.url for p in ps), decode=(d.url,),
                              routing="round_robin")  # fmt: skip
            pool = _ready_pool(cfg)
            with pytest.raises(PassThrough) as e:
                await _complete_through_session(cfg, pool)
            assert e.value.status == 503, e.value.body
            assert e.value.headers["Retry-After"] and e.value.body["error"]["code"] == "overloaded"
            assert all(n.healthy for n in pool.all())  # no node failed: the pairs were full

    asyncio.run(main())


def test_a_real_failure_before_the_last_pairs_409_is_still_a_502():
    """The 503 is for load alone: when an earlier pair failed for real (a prefill node
    answered 500) and the last one ended with 409 kv_transfer_not_reserved, the client
    gets 502 upstream_error, as for any request that failed on its nodes."""
    from engine.server.request_fields import APIError

    calls = [0]

    async def broken_then_not_reserved(req: SeenRequest) -> bytes:
        calls[0] += 1
        if calls[0] == 1:
            return answer(500, {"error": {"message": "boom", "type": "server_error"}})
        body = {"error": {"message": "no decode node reserved blocks within 4 s",
                          "type": "invalid_request_error", "param": None,
                          "code": "kv_transfer_not_reserved"}}  # fmt: skip
        return answer(409, body)

    async def waiting_decode(req: SeenRequest) -> bytes:
        await asyncio.sleep(30)
        return answer(200, {})

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            ps = [
                await stack.enter_async_context(StandIn(_node(broken_then_not_reserved)))
                for _ in "ab"
            ]
            d = await stack.enter_async_context(StandIn(_node(waiting_decode)))
            cfg = ProxyConfig(prefill=tuple(p.url for p in ps), decode=(d.url,),
                              routing="round_robin")  # fmt: skip
            with pytest.raises(APIError) as e:
                await _complete_through_session(cfg, _ready_pool(cfg))
            assert e.value.status_code == 502 and e.value.code == "upstream_error"

    asyncio.run(main())
