"""One client request answered by several child requests (``n`` > 1, a batch of prompts):
run them together, merge their answers into one body or one stream of choices.

Used by the node (children are engine requests) and the proxy (children are P/D
sessions). A child's failure fails the request: the others are cancelled (and so
aborted), as one failed request would be.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


async def gather_or_cancel(aws: Sequence[Awaitable[T]]) -> list[T]:
    """All results in order; the first exception cancels the rest (awaited, so their
    cleanup ran) and is raised as it is (not in a group)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        await _cancel_and_wait(tasks)


async def _cancel_and_wait(tasks: list[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until each has ended (its cleanup, e.g. an abort, ran),
    also when the caller is being cancelled (anyio's cancellation is re-raised at every
    await of a cancelled scope: without the shield the wait would end at once)."""
    for t in tasks:
        t.cancel()
    with anyio.CancelScope(shield=True):
        await asyncio.gather(*tasks, return_exceptions=True)


_END = object()


class _Failed:
    """A child's exception, as the merge hands it to the reader (an item that is itself
    an exception passes as an item)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """``(child index, item)`` as each child yields it (a child's own order kept); ends when
    all have ended. A child raising ends the merge with that exception. Leaving early
    (break, close, cancel) cancels the children still running."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=max(1, len(streams)))

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            # Closed here when the pump ends, cancelled too: its cleanup runs now, in order.
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    await queue.put((i, item))
        except Exception as e:  # noqa: BLE001 -- handed to the reader
            await queue.put((i, _Failed(e)))
            return
        await queue.put((i, _END))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    running = len(tasks)
    try:
        while running:
            i, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                yield i, item
    finally:
        await _cancel_and_wait(tasks)


async def opened_in_index_order(
    merged: AsyncIterator[tuple[int, T]], urgent: Callable[[T], bool] = lambda _: False
) -> AsyncIterator[tuple[int, T]]:
    """``merged``'s ``(child index, item)`` pairs with child ``i``'s items held back until
    children ``0 .. i-1`` have each passed one, so the children open in index order (each
    one's own order kept): vLLM sends every choice's first chunk in index order, and the
    ``openai`` package's stream helpers file a choice first seen before a lower one in the
    wrong place (or fail). An ``urgent`` item (a failure that ends the stream) passes at
    once; what is still held when ``merged`` ends follows in index order."""
    opened = 0
    held: dict[int, list[T]] = {}
    async for i, item in merged:
        if i < opened or urgent(item):
            yield i, item
            continue
        held.setdefault(i, []).append(item)
        while opened in held:
            for x in held.pop(opened):
                yield opened, x
            opened += 1
    for i in sorted(held):
        for x in held[i]:
            yield i, x


def _reasoning_tokens(usage: dict[str, Any] | None) -> int | None:
    details = (usage or {}).get("completion_tokens_details")
    value = details.get("reasoning_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def cached_tokens(usage: dict[str, Any] | None) -> int:
    """A usage's ``prompt_tokens_details.cached_tokens``; 0 when absent or not a
    non-negative integer."""
    details = (usage or {}).get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else 0  # type: ignore[return-value]


def sum_usage(usages: Sequence[dict[str, Any] | None], n: int) -> dict[str, Any]:
    """The request's usage from its choices' (prompt-major, ``n`` per prompt): each
    prompt's tokens once (vLLM's count), every choice's completion tokens, and their
    reasoning tokens (``completion_tokens_details``) when every choice counted them; each
    prompt's cached tokens once too, its first choice's (``prompt_tokens_details``, absent
    when none: vLLM's ``--enable-prompt-tokens-details``)."""
    prompt = sum(int((u or {}).get("prompt_tokens") or 0) for u in usages[::n])
    completion = sum(int((u or {}).get("completion_tokens") or 0) for u in usages)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}  # fmt: skip
    counted = [r for r in map(_reasoning_tokens, usages) if r is not None]
    if usages and len(counted) == len(usages):
        out["completion_tokens_details"] = {"reasoning_tokens": sum(counted)}
    cached = sum(map(cached_tokens, usages[::n]))
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def merge_bodies(bodies: Sequence[dict[str, Any]], n: int) -> dict[str, Any]:
    """One answer from the children's (each with one choice): the first one's envelope,
    every child's choice with ``index`` its position, the usage summed."""
    body = dict(bodies[0])
    choices = []
    for i, child in enumerate(bodies):
        choice = dict(child["choices"][0])
        choice["index"] = i
        choices.append(choice)
    body["choices"] = choices
    body["usage"] = sum_usage([b.get("usage") for b in bodies], n)
    return body
