"""``X-Request-Id``: one sanitising rule, and the middleware that assigns and echoes it."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_LEN = 128
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9._:\-]")

# (method, path, status, seconds) of every finished HTTP request.
Observer = Callable[[str, str, int, float], None]


def clean_request_id(raw: str | None) -> str:
    """The client's id with characters outside ``[A-Za-z0-9._:-]`` removed, cut to 128
    characters; a fresh random id when nothing is left."""
    given = _NOT_ALLOWED.sub("", raw or "")[:MAX_REQUEST_ID_LEN]
    return given or uuid.uuid4().hex


class RequestIdMiddleware:
    """Puts the request id in ``scope["state"]["request_id"]`` (``request.state.request_id``),
    echoes it on the response and reports each request's status and duration to
    ``observe``. Pure ASGI, so streaming responses pass through untouched."""

    def __init__(self, app: ASGIApp, observe: Observer | None = None) -> None:
        self.app = app
        self.observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = next(
            (v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"x-request-id"),
            None,
        )
        rid = clean_request_id(raw)
        scope.setdefault("state", {})["request_id"] = rid
        status = 500
        start = time.monotonic()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.observe is not None:
                self.observe(scope["method"], scope["path"], status, time.monotonic() - start)
