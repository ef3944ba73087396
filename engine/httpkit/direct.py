"""The hot POST routes served in front of FastAPI, past its layers.

A request on ``/v1/completions`` crosses about a dozen ASGI layers in FastAPI and
Starlette before its handler runs (FastAPI's native telemetry, server-error, body-limit,
exception and async-exit-stack middlewares, the router, the route's request/response
wrappers), and each message it sends crosses most of them back: ~0.1 ms of CPU per request
(py-spy on the proxy), none of it doing anything for a handler that takes a ``Request``
and returns a ``Response``.

``FrontedApp`` is a FastAPI app with a front: every HTTP request first goes through the
stack given to ``set_front`` (the kit's middlewares: request id, API key, drain) around
``DirectRoutes``, which calls the hot handlers itself for ``POST`` on their paths and
hands every other request to FastAPI. The same handlers stay registered in FastAPI, so
other methods on those paths get its 405. Lifespan events go to FastAPI directly. An
``APIError`` a hot handler raises becomes its OpenAI-shaped JSON answer, as the
installed exception handler would make it; anything else propagates to uvicorn (500).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.httpkit.errors import json_error
from engine.server.protocol import APIError

Handler = Callable[[Request], Awaitable[Response]]


class DirectRoutes:
    """``POST`` on a hot path -> its handler; any other request -> ``app``."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, Handler]) -> None:
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get(scope["path"]) if scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except APIError as e:
            response = json_error(e)
        await response(scope, receive, send)


class FrontedApp(FastAPI):
    _front: ASGIApp | None = None

    def __init__(self, **kwargs: Any) -> None:
        # No redirect of ``/v1/completions/`` to ``/v1/completions``: Starlette builds its
        # Location from the client's Host header (an open redirect); a 404 instead.
        kwargs.setdefault("redirect_slashes", False)
        super().__init__(**kwargs)

    def set_front(self, routes: Mapping[str, Handler], wrap: Callable[[ASGIApp], ASGIApp]) -> None:
        """Serve ``routes`` (``POST``) directly; ``wrap`` builds the middlewares around them
        and FastAPI (they see every HTTP request)."""
        for path, handler in routes.items():
            self.post(path)(handler)
        self._front = wrap(DirectRoutes(super().__call__, routes))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._front is not None and scope["type"] == "http":
            scope["app"] = self  # as Starlette sets it: request.app.state works in handlers
            await self._front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)
