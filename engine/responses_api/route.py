"""``POST /v1/responses`` for an app that serves chat completions (a node or the proxy).

``serve_responses`` reads the body (with the app's size cap), translates it into a chat
completions body, hands the app's chat handler a request carrying that body (the
client's connection stays behind it, so a client that leaves is still seen), and
translates what the handler answers: a body into a ``response`` object, a stream into
the Responses API's events, an error into the same error with its ``param`` named as the
Responses API names it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message

from engine.httpkit.big_json import (
    PARSE_ON_LOOP_BYTES,
    JSONAnswer,
    keeping_objects,
    off_loop,
    render_json,
)
from engine.httpkit.body import read_body
from engine.httpkit.disconnect import ClientDisconnected
from engine.httpkit.errors import json_error
from engine.responses_api.output import responses_param
from engine.responses_api.request import ResponseEcho, to_chat
from engine.responses_api.stream import ResponsesStream, response_object, sse
from engine.server.json_body import parse_json_body
from engine.server.request_fields import APIError

logger = logging.getLogger(__name__)

# The app's chat handler: the request carrying the translated body, and the size cap to read
# it with (``--max-request-bytes``, or the translated body's size when that is larger).
ChatHandler = Callable[[Request, int], Awaitable[Response]]
# Bodies up to this size are translated on the event loop (microseconds); larger ones in
# a worker thread, so a huge ``input`` does not stall the other clients' streams.
INLINE_BYTES = 64 * 1024
_DROPPED_HEADERS = ("content-length", "content-type")


def _translate(raw: bytes) -> tuple[bytes, ResponseEcho]:
    chat, echo = to_chat(parse_json_body(raw))
    # Compact and not ASCII-escaped: a "\u00e9" is 6 bytes where the client sent 2.
    return json.dumps(chat, ensure_ascii=False, separators=(",", ":")).encode(), echo


def _with_body(request: Request, raw: bytes) -> Request:
    """``request`` with ``raw`` as its body: once read, its receive is the client's again
    (a disconnect is still seen), read outside ``keeping_objects``: uvicorn resumes
    reading the connection there, and the callbacks that read it -- and start the
    connection's next request -- keep the context they were scheduled from (that next
    request's answers would all carry their objects unrendered: empty bodies)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        with keeping_objects(False):
            return await request.receive()

    headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-length"]
    scope = {**request.scope, "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
    return Request(scope, receive)


async def serve_responses(request: Request, chat: ChatHandler, max_bytes: int) -> Response:
    try:
        raw = await read_body(request, max_bytes)
        if len(raw) <= INLINE_BYTES:
            chat_raw, echo = _translate(raw)
        else:
            chat_raw, echo = await anyio.to_thread.run_sync(_translate, raw)
    except APIError as e:
        return json_error(e)
    except ClientDisconnected:
        return Response(status_code=499)
    if echo.ignored_fields:
        shown = ", ".join(repr(n[:40]) for n in echo.ignored_fields[:20])
        logger.warning("a /v1/responses request has fields that are ignored: %s", shown)
    # The client's body passed the cap; its translation may be longer (each message's
    # wrapping, the stream's options) and is not refused for it.
    with keeping_objects():  # the answer's object, unrendered: rendered once, translated
        resp = await chat(_with_body(request, chat_raw), max(max_bytes, len(chat_raw)))
    if isinstance(resp, JSONAnswer) and resp.obj is not None:
        large = resp.large
    else:  # an answer made elsewhere (a refusal): bytes, parsed back when long
        large = not isinstance(resp, StreamingResponse) and len(resp.body) >= PARSE_ON_LOOP_BYTES
    if large:
        # A large answer (log probabilities of a long output: MBs) is translated and
        # rendered off the event loop, in pieces, as the chat handler would have.
        return await off_loop(answer, resp, echo, True)
    return answer(resp, echo)


def answer(resp: Response, echo: ResponseEcho, large: bool = False) -> Response:
    """The chat handler's answer ``resp`` as the Responses API's (``large``: rendered in
    pieces, ``render_json``: this runs in a worker thread)."""
    headers = {k: v for k, v in resp.headers.items() if k not in _DROPPED_HEADERS}
    if isinstance(resp, StreamingResponse):
        if resp.status_code == 200:
            resp.body_iterator = events(resp.body_iterator, echo)
        return resp
    body = resp.obj if isinstance(resp, JSONAnswer) else None
    try:
        if body is None:
            body = json.loads(resp.body) if resp.body else None
    except ValueError:
        return resp
    if not isinstance(body, dict):  # passed on as it is (rendered, if it was carried)
        if isinstance(resp, JSONAnswer) and resp.obj is not None:
            content = render_json(body)
            return Response(content, resp.status_code, headers, media_type="application/json")
        return resp
    if resp.status_code == 200:
        obj = response_object(echo, body)
        if large:
            return Response(render_json(obj), headers=headers, media_type="application/json")
        return JSONResponse(obj, headers=headers)
    err = body.get("error")
    if isinstance(err, dict) and isinstance(err.get("param"), str):
        chat, named = err["param"], responses_param(err["param"])
        err["param"] = named
        if isinstance(err.get("message"), str) and named != chat:
            err["message"] = err["message"].replace(f"'{chat}'", f"'{named}'")
    return JSONResponse(body, status_code=resp.status_code, headers=headers)


async def events(chunks: AsyncIterator[Any], echo: ResponseEcho) -> AsyncIterator[str]:
    """A chat stream's SSE text as the Responses API's events; closes ``chunks`` when it
    ends or the client leaves."""
    stream = ResponsesStream(echo)
    buf = ""
    try:
        async for piece in chunks:
            buf += piece.decode() if isinstance(piece, bytes) else piece
            *frames, buf = buf.split("\n\n")
            for frame in frames:
                for line in frame.splitlines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        for event in stream.finish():
                            yield sse(event)
                        continue
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        logger.warning("a chat stream event is not JSON: %.80r", data)
                        continue
                    try:
                        made = stream.feed(chunk) if isinstance(chunk, dict) else []
                    except Exception:  # a chunk of a shape never sent: the response fails
                        logger.exception("a chat stream chunk could not be translated")
                        made = stream.fail({"message": "internal error", "code": "server_error"})
                    for event in made:
                        yield sse(event)
        # A chat stream always ends with [DONE]; one cut before it failed.
        for event in stream.fail({"message": "the stream ended early", "code": "server_error"}):
            yield sse(event)
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                await aclose()
