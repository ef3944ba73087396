"""The app nodes and the proxy serve: Starlette, with the hot POST routes served in front
of it, past its layers.

Starlette, not FastAPI: every handler takes a ``Request`` and returns a ``Response`` (bodies
are parsed and validated by ``engine.server.json_body``, ``protocol`` and
``chat_protocol``), so FastAPI's typed parameters,
dependency injection and OpenAPI pages (off anyway) did nothing here, and its import was
~0.7 s of CPU in every node and proxy process. ``FrontedApp`` keeps FastAPI's way of
registering routes (``get``, ``post``, ``api_route``, ``add_api_route``; a handler may take
no argument; a GET route answers HEAD too, as Starlette's routes do).

A request on ``/v1/completions`` crosses several ASGI layers in Starlette before its
handler runs (server-error and exception middlewares, the router, the route's
request/response wrappers), and each message it sends crosses most of them back, none of
it doing anything for a handler that takes a ``Request`` and returns a ``Response``.

``FrontedApp`` is a Starlette app with a front: every HTTP request first goes through the
stack given to ``set_front`` (the kit's middlewares: request id, API key, drain) around
``DirectRoutes``, which calls the hot handlers itself for ``POST`` on their paths and
hands every other request to the router. The same handlers stay registered as routes, so
other methods on those paths get its 405. Lifespan events go to Starlette directly. An
``APIError`` a hot handler raises becomes its OpenAI-shaped JSON answer, as the
installed exception handler would make it; anything else propagates to uvicorn (500).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.httpkit.errors import json_error
from engine.server.request_fields import APIError

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


Endpoint = Callable[..., Awaitable[Response]]  # (request) or ()


class FrontedApp(Starlette):
    _front: ASGIApp | None = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # No redirect of ``/v1/completions/`` to ``/v1/completions``: Starlette builds its
        # Location from the client's Host header (an open redirect); a 404 instead.
        self.router.redirect_slashes = False

    def add_api_route(self, path: str, endpoint: Endpoint, methods: Sequence[str]) -> None:
        """``endpoint`` answers ``methods`` on ``path`` (FastAPI's name); it takes the
        ``Request`` or nothing."""
        handler = endpoint
        if not inspect.signature(endpoint).parameters:

            async def handler(request: Request) -> Response:
                return await endpoint()

        self.router.add_route(path, handler, methods=list(methods), name=endpoint.__name__)

    def api_route(self, path: str, methods: Sequence[str]) -> Callable[[Endpoint], Endpoint]:
        def register(endpoint: Endpoint) -> Endpoint:
            self.add_api_route(path, endpoint, methods)
            return endpoint

        return register

    def get(self, path: str) -> Callable[[Endpoint], Endpoint]:
        return self.api_route(path, ["GET"])

    def post(self, path: str) -> Callable[[Endpoint], Endpoint]:
        return self.api_route(path, ["POST"])

    def set_front(self, routes: Mapping[str, Handler], wrap: Callable[[ASGIApp], ASGIApp]) -> None:
        """Serve ``routes`` (``POST``) directly; ``wrap`` builds the middlewares around them
        and the router (they see every HTTP request)."""
        for path, handler in routes.items():
            self.post(path)(handler)
        self._front = wrap(DirectRoutes(super().__call__, routes))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._front is not None and scope["type"] == "http":
            scope["app"] = self  # as Starlette sets it: request.app.state works in handlers
            await self._front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)
