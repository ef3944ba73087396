"""``FrontedApp``: hot POST routes served past the router, with the kit's middlewares around
every request, as the proxy builds it (in process, Starlette's TestClient)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.testclient import TestClient

from engine.httpkit.auth import OPEN_PATHS, ApiKeyMiddleware
from engine.httpkit.direct import FrontedApp
from engine.httpkit.drain import Drainer, DrainMiddleware
from engine.httpkit.errors import install_error_handlers
from engine.httpkit.request_id import RequestIdMiddleware
from engine.server.request_fields import APIError

KEY = "sekrit"


def make_app(seen: list[str]) -> FrontedApp:
    @asynccontextmanager
    async def lifespan(app: FrontedApp) -> AsyncIterator[None]:
        app.state.started = True
        yield

    app = FrontedApp(lifespan=lifespan)
    app.state.label = "from-state"
    install_error_handlers(app)
    drainer = Drainer(frozenset(["/v1/completions"]), 1.0)
    app.state.drainer = drainer

    async def completions(request: Request) -> Response:
        body = await request.json()
        if body.get("bad"):
            raise APIError("bad is not allowed", param="bad")
        seen.append(request.state.request_id)
        return JSONResponse({"label": request.app.state.label, "echo": body})

    app.set_front(
        {"/v1/completions": completions},
        lambda inner: RequestIdMiddleware(
            ApiKeyMiddleware(DrainMiddleware(inner, drainer), (KEY,), OPEN_PATHS)
        ),
    )

    @app.get("/other")
    async def other() -> JSONResponse:
        return JSONResponse({"ok": True})

    return app


@pytest.fixture
def client_and_seen() -> Iterator[tuple[TestClient, list[str]]]:
    seen: list[str] = []
    with TestClient(make_app(seen)) as c:
        yield c, seen


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_a_hot_route_is_served_with_the_request_id_and_app_state(client_and_seen) -> None:
    c, seen = client_and_seen
    assert c.app.state.started  # lifespan went to Starlette
    r = c.post("/v1/completions", json={"x": 1}, headers={**AUTH, "X-Request-Id": "abc-1"})
    assert r.status_code == 200, r.text
    assert r.json() == {"label": "from-state", "echo": {"x": 1}}
    assert r.headers["x-request-id"] == "abc-1" and seen == ["abc-1"]


def test_every_request_passes_the_api_key_check(client_and_seen) -> None:
    c, seen = client_and_seen
    for method, path in (("POST", "/v1/completions"), ("GET", "/other")):
        r = c.request(method, path, json={})
        assert r.status_code == 401, (path, r.text)
        assert "error" in r.json()
    assert seen == []
    assert c.get("/other", headers=AUTH).json() == {"ok": True}


def test_an_api_error_from_a_hot_handler_is_an_openai_error(client_and_seen) -> None:
    c, _ = client_and_seen
    r = c.post("/v1/completions", json={"bad": True}, headers=AUTH)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "bad is not allowed"
    assert r.json()["error"]["param"] == "bad"
    assert "x-request-id" in r.headers


def test_other_methods_on_a_hot_path_get_the_routers_405(client_and_seen) -> None:
    c, seen = client_and_seen
    r = c.get("/v1/completions", headers=AUTH)
    assert r.status_code == 405 and "error" in r.json()
    assert seen == []


def test_a_draining_server_refuses_hot_routes_with_503(client_and_seen) -> None:
    c, seen = client_and_seen
    c.portal.call(c.app.state.drainer.start, lambda: None)  # on the app's event loop
    r = c.post("/v1/completions", json={}, headers=AUTH)
    assert r.status_code == 503 and r.headers.get("retry-after")
    assert seen == []
