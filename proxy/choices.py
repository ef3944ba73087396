"""A request with several choices (``n`` > 1, a batch of prompts) through the proxy: each
choice is a ``Session`` of its own (its own P/D pair, transfer and seed: ``seed + j`` for
the ``j``-th choice of a prompt, as on a node), run together; the answers are merged into
one body, or one stream whose chunks name their choice's ``index``.

A choice failing before the answer started fails the request (the node's answer, e.g. a
400 naming the prompt of the batch that was wrong) and the other choices are aborted on
their nodes; one failing mid-stream ends the stream with its error event.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from engine.httpkit.fanout import (
    gather_or_cancel,
    merge_bodies,
    merge_streams,
    opened_in_index_order,
    sum_usage,
)
from engine.httpkit.sse import SSE_DONE, sse_event
from proxy.retries import PassThrough
from proxy.session import Session


async def _each(
    sessions: list[Session], n: int, call: Callable[[Session], Awaitable[Any]]
) -> list[Any]:
    batch = len(sessions) > n  # more than one prompt

    async def one(s: Session) -> Any:
        try:
            return await call(s)
        except PassThrough as e:
            # A node's 400 naming ``prompt`` names the batch's prompt it was: ``prompt[i]``.
            err = e.body.get("error")
            if batch and isinstance(err, dict) and err.get("param") == "prompt":
                where = f"prompt[{(s.index or 0) // n}]"
                err = {**err, "param": where, "message": f"{where}: {err.get('message')}"}
                e.body = {**e.body, "error": err}
            raise

    return await gather_or_cancel([one(s) for s in sessions])


async def complete_all(sessions: list[Session], n: int) -> dict[str, Any]:
    """Every choice's answer, merged (the usage summed, each prompt counted once)."""
    return merge_bodies(await _each(sessions, n, lambda s: s.complete()), n)


async def start_all(sessions: list[Session], n: int) -> None:
    """Every choice's stream started (or the first failure raised, the others aborted)."""
    await _each(sessions, n, lambda s: s.start_stream())


async def _events(session: Session) -> AsyncIterator[tuple[str, bool]]:
    """A choice's events but its [DONE]; each with whether it is the choice's error."""
    async with contextlib.aclosing(session.events()) as events:
        async for event in events:
            if event == SSE_DONE:
                return
            yield event, session.outcome == "error"


async def events_all(sessions: list[Session], n: int) -> AsyncIterator[str]:
    """The merged SSE body; always ends with [DONE]."""
    failed = False
    merged = merge_streams([_events(s) for s in sessions])
    # The choices open in index order, as vLLM's (each choice's leg answers when it does).
    ordered = opened_in_index_order(merged, urgent=lambda item: item[1])
    async with contextlib.aclosing(merged), contextlib.aclosing(ordered):
        async for _, (event, is_error) in ordered:
            yield event
            if is_error:
                failed = True
                break
    first = sessions[0]
    if not failed and first.req.parsed.include_usage:
        body = first.out.envelope([], usage=False)
        body["usage"] = sum_usage([s.usage for s in sessions], n)
        yield sse_event(body)
    yield SSE_DONE
