"""JSON answers that may be large (log probabilities of long prompts and outputs, for many
choices), rendered in a worker thread and in pieces.

One ``json.dumps`` of a 45 MB answer is one C call that holds the GIL for most of a second:
run on the event loop, or even in a thread, every other client of the server (``/health``,
streams) waits that long. ``render_json`` renders long lists a piece at a time, so the
thread doing it lets the loop run between pieces; ``json_response`` runs it in a thread
(``off_loop``: one at a time, as the node builds each choice's answer).
The bytes are those of Starlette's ``JSONResponse``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import anyio
from starlette.responses import Response

# Items of a long list rendered per ``json.dumps`` call (an item of an answer's long lists
# is one token's entry: ~2 ms a piece).
ITEMS_PER_PIECE = 256

T = TypeVar("T")

# Set while a caller will translate the answer (``/v1/responses``): ``json_response`` then
# hands over the object unrendered (``JSONAnswer.obj``; the caller renders what it makes of
# it) instead of rendering bytes that would be dropped or parsed back (one ``json.loads`` of
# a 3.5 MB answer holds the GIL ~0.4 s, thread or not).
_keep_objects: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "big_json_keep_objects", default=False
)

# One answer built or rendered at a time per event loop: several CPU-bound threads beside
# the loop's would take the GIL from it in turn for far longer than one does.
_limiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)

_dumps = functools.partial(
    json.dumps, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
)
_event_dumps = functools.partial(json.dumps, separators=(",", ":"))  # ``sse_event``'s


def render_json(obj: Any) -> bytes:
    """``obj`` as JSONResponse renders it, with no single ``json.dumps`` over more than
    ``ITEMS_PER_PIECE`` items of a list (dicts and short lists of containers are walked)."""
    out: list[str] = []
    _render(obj, out, _dumps)
    return "".join(out).encode()


def render_event(obj: Any) -> str:
    """``sse_event(obj)``, rendered as ``render_json`` renders (in pieces)."""
    out: list[str] = ["data: "]
    _render(obj, out, _event_dumps)
    out.append("\n\n")
    return "".join(out)


def _render(obj: Any, out: list[str], dumps: Callable[[Any], str]) -> None:
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        out.append("{")
        for i, (key, value) in enumerate(obj.items()):
            out.append(("," if i else "") + dumps(key) + ":")
            _render(value, out, dumps)
        out.append("}")
    elif isinstance(obj, list | tuple) and len(obj) > ITEMS_PER_PIECE:
        pieces = (
            dumps(obj[i : i + ITEMS_PER_PIECE])[1:-1] for i in range(0, len(obj), ITEMS_PER_PIECE)
        )
        out.append("[" + ",".join(pieces) + "]")
    elif isinstance(obj, list | tuple) and any(isinstance(x, dict | list | tuple) for x in obj):
        out.append("[")  # a short list of containers (choices): each may be large
        for i, item in enumerate(obj):
            if i:
                out.append(",")
            _render(item, out, dumps)
        out.append("]")
    else:
        out.append(dumps(obj))


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread, one such call at a time on this event loop."""
    loop = asyncio.get_running_loop()
    limiter = _limiters.get(loop)
    if limiter is None:
        limiter = _limiters[loop] = anyio.CapacityLimiter(1)
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)


# An answer shorter than this is parsed on the loop (~10 ms at most): no thread hop, and no
# await between a node's answer and what it says for the common, small answer.
PARSE_ON_LOOP_BYTES = 1 << 20


async def parse_off_loop(parse: Callable[[bytes], T], raw: bytes) -> T:
    """``parse(raw)``: on the loop when ``raw`` is short, else ``off_loop`` (one
    ``json.loads`` of a 5 MB answer holds the GIL ~0.1 s; several in a row, longer)."""
    if len(raw) < PARSE_ON_LOOP_BYTES:
        return parse(raw)
    return await off_loop(parse, raw)


def may_be_large(req: Any) -> bool:
    """Whether a parsed request's answer may be large: it asked for log probabilities
    (``logprobs``, ``top_logprobs``, ``prompt_logprobs``; ``echo`` with them)."""
    return req.logprobs is not None or req.prompt_logprobs is not None


class JSONAnswer(Response):
    """A JSON answer: rendered, or inside ``keeping_objects`` its object ``obj`` unrendered
    (no body) and whether it may be ``large`` (the caller renders it as ``render_json``
    does, off the loop, when so)."""

    obj: Any = None
    large: bool = False


@contextlib.contextmanager
def keeping_objects(keep: bool = True) -> Iterator[None]:
    """``json_response`` answers carry their object unrendered (``JSONAnswer.obj``);
    ``keep`` False: rendered again (around a read of the client's connection, below)."""
    token = _keep_objects.set(keep)
    try:
        yield
    finally:
        _keep_objects.reset(token)


async def json_response(
    body: Any, status_code: int = 200, headers: dict[str, str] | None = None, large: bool = True
) -> Response:
    """A ``JSONResponse`` of ``body``; ``large``: rendered by ``render_json`` in a worker
    thread (else on the loop, as small answers are: none of them waits behind a large one).
    Inside ``keeping_objects``: not rendered, ``body`` carried as ``obj``."""
    if _keep_objects.get():
        resp = JSONAnswer(b"", status_code, headers, media_type="application/json")
        resp.obj, resp.large = body, large
        return resp
    content = await off_loop(render_json, body) if large else _dumps(body).encode()
    return JSONAnswer(content, status_code, headers, media_type="application/json")
