"""A stream whose decode node fails after sending tokens moves to another pair
(``--migration-limit``): the new pair replays the answer, the proxy checks the replayed
tokens against those the client has and drops them, and the stream goes on; a replay that
differs ends the stream with an error event. Stand-in nodes (``tests/standin_http.py``)
through a real ``Session``; the real-process form is in ``tests/test_proxy_failover.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from harness import sse_chunk_events

from kvconnector.base import transfer_seed
from proxy.client_stream import ClientStream, Skipper
from tests.standin_http import SeenRequest, answer, chunked
from tests.test_proxy_waits import (
    PREFILL_ANSWER,
    STREAM_HEAD,
    _chunk,
    _p_and_ds,
    _p_and_two_d,
    _session,
    _sse,
    _stream_through_session,
    _token,
)


async def _prefill(req: SeenRequest) -> bytes:
    choice = {**PREFILL_ANSWER["choices"][0], "text": "t7"}  # D's text of token 7, as a node
    return answer(200, {**PREFILL_ANSWER, "choices": [choice], "model": "tiny"})


def _text(events: list[dict[str, Any]]) -> str:
    return "".join(c.get("text") or "" for e in events for c in e.get("choices", []))


def _breaks_after(*tokens: dict[str, Any]) -> bytes:
    """A stream of ``tokens`` (no [DONE]); then the connection closes (a dead D)."""
    return STREAM_HEAD + b"".join(_chunk(e) for e in _sse(*tokens)[:-1])


D1_BODIES: list[dict[str, Any]] = []


async def _d1_breaks_after_three(req: SeenRequest) -> Any:
    """P's first token (7) repeated, then 8 and 9; then the connection closes (a dead D)."""
    D1_BODIES.append(req.json())
    return _breaks_after(_token(7), _token(8), _token(9)), True


def _d2_streams(*ids: int) -> Any:
    seen: list[dict[str, Any]] = []

    async def decode(req: SeenRequest) -> bytes:
        seen.append(req.json())
        *most, last = ids
        return chunked(200, _sse(*(_token(i) for i in most), _token(last, "length")))

    decode.seen = seen  # type: ignore[attr-defined]
    return decode


def _run(
    d2: Any, d1: Any = _d1_breaks_after_three, fields: dict[str, Any] | None = None, **cfg: Any
) -> tuple[list[int], list, Any]:
    fields = {"max_tokens": 5, "temperature": 0.8, **(fields or {})}

    async def main() -> tuple[list[int], list[dict[str, Any]], Any]:
        async with _p_and_two_d(_prefill, d1, d2, **cfg) as (c, pool, _):
            ids, events = await _stream_through_session(c, pool, **fields)
            return ids, events, pool

    return asyncio.run(main())


def test_a_stream_whose_decode_node_dies_mid_answer_goes_on_on_another_pair() -> None:
    d2 = _d2_streams(7, 8, 9, 10, 11)
    D1_BODIES.clear()
    ids, events, pool = _run(d2, migration_limit=1)
    assert ids == [7, 8, 9, 10, 11], events  # each token once, in order
    assert _text(events) == "t7t8t9t10t11", events
    assert not any("error" in e for e in events), events
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert [n.healthy for n in pool.nodes("decode")] == [False, True]  # D1 left the rotation
    # The replay samples what the first pair did: the unseeded request got the seed its
    # first transfer drew from (P and D seed an unseeded request by the transfer id).
    (first,) = D1_BODIES
    (body,) = d2.seen
    assert "seed" not in first
    assert body["seed"] == transfer_seed(first["kv_transfer_params"]["transfer_id"])
    assert body["kv_transfer_params"]["transfer_id"] != first["kv_transfer_params"]["transfer_id"]


def test_a_replay_that_differs_from_what_the_client_has_ends_the_stream() -> None:
    ids, events, _ = _run(_d2_streams(7, 8, 5, 10, 11), migration_limit=1)
    assert ids == [7, 8, 9], events  # nothing of the differing replay reached the client
    assert events[-1]["error"]["code"] == "retry_diverged", events[-1]


def test_without_a_migration_limit_a_stream_broken_mid_answer_ends_with_an_error() -> None:
    d2 = _d2_streams(7, 8, 9, 10, 11)
    ids, events, _ = _run(d2)  # --migration-limit 0, the default
    assert ids == [7, 8, 9] and "error" in events[-1], events
    assert d2.seen == []


def test_a_move_that_fails_during_the_replay_counts_as_a_move_and_moves_are_bounded() -> None:
    """D1 and D2 break mid-answer, D2 within the replay of what the client has: that is
    the second move (not a retry before the first token), so with --migration-limit 2 a
    third decode node finishes the stream, and with 1 the stream ends with an error."""
    pools: list[Any] = []

    async def d2_breaks_in_replay(req: SeenRequest) -> Any:
        pools[0].nodes("decode")[2].set_healthy(True)  # D3 joins now: it is the third pair
        return _breaks_after(_token(7), _token(8)), True  # the client has 7, 8, 9

    async def main(limit: int) -> tuple[list[int], list[dict[str, Any]]]:
        d3 = _d2_streams(7, 8, 9, 10, 11)
        legs = (_d1_breaks_after_three, d2_breaks_in_replay, d3)
        async with _p_and_ds(_prefill, *legs, migration_limit=limit, max_retries=0) as (
            cfg, pool, _ds,
        ):  # fmt: skip
            pools[:] = [pool]
            pool.nodes("decode")[2].set_healthy(False)  # D1, then D2, then D3
            return await _stream_through_session(cfg, pool, max_tokens=5)

    ids, events = asyncio.run(main(2))
    assert ids == [7, 8, 9, 10, 11] and _text(events) == "t7t8t9t10t11", events
    ids, events = asyncio.run(main(1))
    assert ids == [7, 8, 9] and "error" in events[-1], events
    assert "request failed on" not in events[-1]["error"]["message"]  # not --max-retries


def test_a_stream_broken_after_its_last_token_is_not_replayed() -> None:
    """D sent the answer's end (finish_reason) and broke before [DONE]: a replay would
    send the end again; the stream ends with the error event as without migration."""

    async def d1_ends_then_breaks(req: SeenRequest) -> Any:
        return _breaks_after(_token(7), _token(8), _token(9, "length")), True

    d2 = _d2_streams(7, 8, 9)
    ids, events, _ = _run(d2, d1=d1_ends_then_breaks, migration_limit=1)
    assert ids == [7, 8, 9] and "error" in events[-1], events
    finishes = [c for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert len(finishes) == 1 and d2.seen == []


def test_a_replay_shorter_than_what_the_client_has_ends_the_stream() -> None:
    ids, events, _ = _run(_d2_streams(7, 8), migration_limit=1)
    assert ids == [7, 8, 9] and events[-1]["error"]["code"] == "retry_diverged", events


def test_the_replay_check_drops_across_chunks_and_text() -> None:
    skip = Skipper(4, "t7t8t9t10", expect=[7, 8, 9, 10])
    assert skip.apply([7, 8], "t7t8") == ([], "")
    assert skip.apply([9, 10, 11], "t9t10t11") == ([11], "t11")
    assert skip.apply([12], "t12") == ([12], "t12")


# -- streams that are D's whole answer (not pre-streamed: stop strings, D alone, ...) -----

NO_PRESTREAM = {"stop": ["@@"]}  # a stop string: D's stream is the whole answer


def test_a_stream_that_is_the_decode_nodes_whole_answer_moves_with_its_transfers_seed() -> None:
    """Not pre-streamed (a stop string): D1's stream carries every token, 7 included, and
    breaks after 9; the stream moves, D2 replays 7-9 (dropped) and goes on. The unseeded
    request reruns with the seed D1 drew from (its transfer id's)."""
    d2 = _d2_streams(7, 8, 9, 10, 11)
    D1_BODIES.clear()
    ids, events, _ = _run(d2, fields=NO_PRESTREAM, migration_limit=1)
    assert ids == [7, 8, 9, 10, 11] and _text(events) == "t7t8t9t10t11", events
    assert not any("error" in e for e in events), events
    (first,) = D1_BODIES
    (body,) = d2.seen
    assert "seed" not in first
    assert body["seed"] == transfer_seed(first["kv_transfer_params"]["transfer_id"])


def test_a_whole_decode_stream_broken_before_any_token_is_rerun_without_a_migration() -> None:
    """D1's stream breaks before any token reached the client: nothing to replay, the
    request reruns on another pair (``--max-retries``, the default), moves or not."""

    async def d1_breaks_at_once(req: SeenRequest) -> Any:
        return STREAM_HEAD, True

    d2 = _d2_streams(7, 8, 9)
    ids, events, _ = _run(d2, d1=d1_breaks_at_once, fields=NO_PRESTREAM)
    assert ids == [7, 8, 9] and not any("error" in e for e in events), events


def test_an_echoed_stream_broken_mid_answer_is_not_moved() -> None:
    """With ``echo`` the stream starts with the prompt: it is not replayed (an error event
    ends it, as without --migration-limit)."""
    d2 = _d2_streams(7, 8, 9, 10, 11)
    ids, events, _ = _run(d2, fields={"echo": True}, migration_limit=1)
    assert ids == [7, 8, 9] and "error" in events[-1], events
    assert d2.seen == []


def _migrations(text: str) -> dict[str, float]:
    """``pdproxy_stream_migrations_total`` by outcome, from a scrape's ``text``."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.labels["outcome"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "pdproxy_stream_migrations_total"
    }


@pytest.mark.parametrize("end", ["decode-error-event", "proxy-fault"])
def test_a_moved_stream_that_ends_in_an_error_counts_as_a_failed_migration(
    end: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream moved to D2, whose replay went on past what the client had (token 10),
    then D2's own error event (and [DONE]) ended it, or the proxy's own fault did: the
    client's stream ends with the error, the session's outcome is "error" (D2's [DONE]
    after its error event does not make it "ok"), and the move counts as ``failed``.
    It counted in no outcome of ``pdproxy_stream_migrations_total`` (found by a review:
    resumed + diverged + failed fell short of the streams that moved)."""
    error = {"error": {"message": "engine died", "type": "server_error"}}

    async def d2(req: SeenRequest) -> bytes:
        return chunked(200, _sse(*(_token(i) for i in (7, 8, 9, 10)), error, _token(11)))

    if end == "proxy-fault":
        rewrite = ClientStream.rewrite

        def faulty(self: ClientStream, obj: dict[str, Any]) -> Any:
            if obj.get("choices") and obj["choices"][0].get("token_ids") == [11]:
                raise RuntimeError("a fault of the proxy's own")
            return rewrite(self, obj)

        monkeypatch.setattr(ClientStream, "rewrite", faulty)
        error = {"error": {"message": "x", "type": "server_error"}}  # the proxy's, not D2's

        async def d2(req: SeenRequest) -> bytes:  # noqa: F811 - the tokens only
            return chunked(200, _sse(*(_token(i) for i in (7, 8, 9, 10, 11))))

    async def check(cfg: Any, pool: Any) -> None:
        async with _session(cfg, pool, stream=True, max_tokens=5, temperature=0.8) as s:
            await asyncio.wait_for(s.start_stream(), 20)
            events = sse_chunk_events([c async for c in s.events()])
            assert s.migrations == 1 and s.outcome == "error", (s.outcome, events)
            ids = [t for e in events for c in e.get("choices", []) for t in c["token_ids"]]
            assert ids == [7, 8, 9, 10] and "error" in events[-1], events
            counts = _migrations(s.metrics.render().decode())
            assert counts == {"resumed": 0, "diverged": 0, "failed": 1}, counts

    async def main() -> None:
        async with _p_and_two_d(_prefill, _d1_breaks_after_three, d2, migration_limit=1) as (
            cfg, pool, _,
        ):  # fmt: skip
            await check(cfg, pool)

    asyncio.run(main())


# -- D's own error event mid-answer: a failure moves like a broken connection --------------

SERVER_ERROR = {"error": {"message": "engine died", "type": "server_error", "code": None}}
MID_ANSWER_EVENTS = {
    "server_error": SERVER_ERROR,
    "vllm-500": {"error": {"message": "boom", "type": "InternalServerError", "code": 500}},
    "unknown-type": {"error": {"message": "weird", "type": "WeirdError"}},  # 500
    "text": {"error": "it broke"},  # no type to tell by: 500
    "load": {"error": {"message": "busy", "type": "rate_limit_error", "code": "overloaded"}},
}


def _d1_errs_after_three(event: dict[str, Any]) -> Any:
    """P's first token (7) repeated, then 8 and 9; then ``event`` (and [DONE])."""

    async def decode(req: SeenRequest) -> bytes:
        return chunked(200, _sse(_token(7), _token(8), _token(9), event))

    return decode


@pytest.mark.parametrize("event", list(MID_ANSWER_EVENTS))
def test_a_decode_error_event_mid_answer_moves_the_stream_like_a_broken_connection(
    event: str,
) -> None:
    """D1 streams tokens, then its own error event that is not the client's (a 5xx by its
    ``code``, an unknown ``type`` or none: 500; load): with --migration-limit the stream
    moves on as when D1's connection breaks there -- D2 replays, the client gets every
    token once and no error. A failed D1 leaves the rotation (load: it stays); the
    router's load for the request moved from D1 to D2. It used to end the stream with
    D1's event, D2 never asked."""
    loads: list[list[int]] = []
    pools: list[Any] = []
    d2 = _d2_streams(7, 8, 9, 10, 11)

    async def d2_counting(req: SeenRequest) -> bytes:
        loads.append([n.outstanding for n in pools[0].nodes("decode")])
        return await d2(req)

    async def main() -> tuple[list[int], list[dict[str, Any]], Any]:
        d1 = _d1_errs_after_three(MID_ANSWER_EVENTS[event])
        async with _p_and_two_d(_prefill, d1, d2_counting, migration_limit=1) as (c, pool, _):
            pools.append(pool)
            ids, events = await _stream_through_session(c, pool, max_tokens=5)
            return ids, events, pool

    ids, events, pool = asyncio.run(main())
    assert ids == [7, 8, 9, 10, 11] and _text(events) == "t7t8t9t10t11", events
    assert not any("error" in e for e in events), events
    assert loads == [[0, 1]], loads  # D1's load released when the stream moved to D2
    assert [n.outstanding for n in pool.all()] == [0, 0, 0]
    assert [n.healthy for n in pool.nodes("decode")] == [event == "load", True]


@pytest.mark.parametrize("event", ["server_error", "load"])
def test_a_decode_error_event_mid_answer_with_no_move_left_ends_as_a_broken_stream(
    event: str,
) -> None:
    """No --migration-limit: D1's server error event after its tokens ends the stream as
    its connection breaking there does -- the proxy's ``upstream_error`` event naming
    D1's error, then [DONE] -- and D1 leaves the rotation (a failure of the node,
    wherever in the answer; it stayed in rotation with its event passed on as sent).
    Load stays load: the stream ends with D1's load event, and D1 stays in rotation."""
    d2 = _d2_streams(7, 8, 9, 10, 11)
    ids, events, pool = _run(d2, d1=_d1_errs_after_three(MID_ANSWER_EVENTS[event]))
    assert ids == [7, 8, 9] and len([e for e in events if "error" in e]) == 1, events
    if event == "load":
        assert events[-1] == MID_ANSWER_EVENTS["load"], events
    else:
        assert events[-1]["error"]["code"] == "upstream_error", events
        assert "engine died" in events[-1]["error"]["message"], events
    assert d2.seen == [] and [n.healthy for n in pool.nodes("decode")] == [event == "load", True]


def test_the_clients_error_event_mid_answer_is_not_moved() -> None:
    """D1 refuses the request itself after its tokens (a 4xx event: another node would
    too): the stream ends with D1's event as D1 sent it, no other node is asked, and D1
    stays in rotation, --migration-limit or not."""
    client = {"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}}
    d2 = _d2_streams(7, 8, 9, 10, 11)
    ids, events, pool = _run(d2, d1=_d1_errs_after_three(client), migration_limit=1)
    assert ids == [7, 8, 9] and events[-1] == client, events
    assert d2.seen == [] and all(n.healthy for n in pool.all())


def test_a_server_error_event_in_a_moved_streams_replay_is_another_move() -> None:
    """D1 breaks mid-answer; D2, replaying what the client has, sends a server error event
    after its first new token: that is the second move (as D2's connection breaking
    there), D3 finishes the stream. It ended with D2's event (a moved stream's D never
    moved again on one)."""

    pools: list[Any] = []

    async def d2_errs_in_replay(req: SeenRequest) -> bytes:
        pools[0].nodes("decode")[2].set_healthy(True)  # D3 joins now: it is the third pair
        return chunked(200, _sse(*(_token(i) for i in (7, 8, 9, 10)), SERVER_ERROR))

    async def main() -> tuple[list[int], list[dict[str, Any]], list[bool]]:
        legs = (_d1_breaks_after_three, d2_errs_in_replay, _d2_streams(7, 8, 9, 10, 11))
        async with _p_and_ds(_prefill, *legs, migration_limit=2, max_retries=0) as (
            cfg, pool, _ds,
        ):  # fmt: skip
            pools[:] = [pool]
            pool.nodes("decode")[2].set_healthy(False)  # D1, then D2, then D3
            ids, events = await _stream_through_session(cfg, pool, max_tokens=5)
            return ids, events, [n.healthy for n in pool.nodes("decode")]

    ids, events, healthy = asyncio.run(main())
    assert ids == [7, 8, 9, 10, 11] and _text(events) == "t7t8t9t10t11", events
    assert not any("error" in e for e in events), events
    assert healthy == [False, False, True]


def test_a_load_event_mid_answer_with_no_decode_node_left_is_no_move() -> None:
    """D1, the only decode node, answers with load after its tokens (--migration-limit
    1): no other decode node to move to, so the stream ends with D1's load event -- and
    it did not move: no migration is counted (``failed`` counted one, with no retry of
    the decode role counted; found by tests/test_property_proxy_faults.py)."""
    load = MID_ANSWER_EVENTS["load"]

    async def check(cfg: Any, pool: Any) -> None:
        async with _session(cfg, pool, stream=True, max_tokens=5) as s:
            await asyncio.wait_for(s.start_stream(), 20)
            events = sse_chunk_events([c async for c in s.events()])
            assert events[-1] == load and s.migrations == 0, (s.migrations, events)
            counts = _migrations(s.metrics.render().decode())
            assert counts == {"resumed": 0, "diverged": 0, "failed": 0}, counts

    async def main() -> None:
        async with _p_and_ds(_prefill, _d1_errs_after_three(load), migration_limit=1) as (
            cfg, pool, _ds,
        ):  # fmt: skip
            await check(cfg, pool)

    asyncio.run(main())
